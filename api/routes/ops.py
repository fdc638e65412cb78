"""Operations routes: GET /metrics (Prometheus text format: this replica's histograms and
counters, then the fleet's gauges read from Redis now) and GET /get_load (SGLang's, one
entry per live scheduler)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Response

from api import fleet
from api.deps import TokenizerManagerDep
from api.metrics import TEXT_FORMAT
from api.redis_errors import REDIS_ERRORS, REDIS_TIMEOUT_S, unavailable
from api.routes.common import make_router
from api.tokenizer_manager import TokenizerManager

router = make_router("ops")


@router.get("/metrics")
async def metrics(tm: TokenizerManagerDep) -> Response:
    """Scrapable while Redis is away too: the fleet's gauges are then left out and
    `redserve:redis_up` is 0."""
    try:
        view: fleet.FleetView | None = await _read_fleet(tm)
    except REDIS_ERRORS:
        view = None
    return Response(tm.metrics.render(view), media_type=TEXT_FORMAT)


@router.get("/get_load")
async def get_load(tm: TokenizerManagerDep) -> list[dict[str, Any]]:
    view = await read_fleet_or_503(tm)
    return fleet.scheduler_load(view, tm.settings.scheduler.block_size)


async def read_fleet_or_503(tm: TokenizerManager) -> fleet.FleetView:
    try:
        return await _read_fleet(tm)
    except REDIS_ERRORS as e:
        raise unavailable(e, "Redis is unavailable: the fleet cannot be read.") from e


async def _read_fleet(tm: TokenizerManager) -> fleet.FleetView:
    async with asyncio.timeout(REDIS_TIMEOUT_S):
        return await fleet.read_fleet(tm.redis, tm.keys)

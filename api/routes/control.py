"""Fleet control routes: /pause_generation, /continue_generation, /flush_cache. Any api
replica acts on every scheduler: the state goes to Redis (shared.fleet_control) and is
broadcast on `ctl`. While paused, new requests are still accepted, on every replica: they
wait in the request stream until generation continues."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from fastapi import Response
from fastapi.responses import PlainTextResponse

from api.deps import TokenizerManagerDep
from api.redis_errors import REDIS_ERRORS, REDIS_TIMEOUT_S, unavailable
from api.routes.common import make_router
from api.schemas.control import PauseGenerationIn
from shared import fleet_control

logger = logging.getLogger(__name__)

router = make_router("control")


@router.post("/pause_generation")
async def pause_generation(body: PauseGenerationIn, tm: TokenizerManagerDep) -> dict[str, Any]:
    await _control("pause generation", fleet_control.pause(tm.redis, tm.keys, body.mode))
    logger.info("generation paused fleet-wide (mode %s)", body.mode)
    return {"message": f"Generation paused (mode {body.mode}).", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(tm: TokenizerManagerDep) -> dict[str, Any]:
    await _control("continue generation", fleet_control.resume(tm.redis, tm.keys))
    logger.info("generation continues fleet-wide")
    return {"message": "Generation continued.", "status": "ok"}


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(tm: TokenizerManagerDep) -> Response:
    """Every scheduler forgets its cached prefixes (blocks in use stay with their requests,
    so running requests are not disturbed)."""
    await _control("flush the cache", fleet_control.flush_cache(tm.redis, tm.keys))
    return PlainTextResponse("Cache flushed.\n")


async def _control(what: str, call: Awaitable[None]) -> None:
    """A control write, bounded by REDIS_TIMEOUT_S; a failure is a 503 saying what failed."""
    try:
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            await call
    except REDIS_ERRORS as e:
        raise unavailable(e, f"Could not {what}: Redis is unavailable.") from e

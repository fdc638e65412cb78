"""A request by rid, on any replica: GET /v1/requests/{rid} (its durable state and what it
generated so far, readable for the state TTL after it ended) and
GET /v1/requests/{rid}/stream (re-attach to a streaming response: api.reattach)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import msgspec
from fastapi import Header, Request, Response

from api.deps import TokenizerManagerDep
from api.errors import BadRequest, NotFound
from api.reattach import open_stream
from api.redis_errors import REDIS_ERRORS, REDIS_TIMEOUT_S, unavailable
from api.routes.common import make_router
from shared import request_state

router = make_router("requests")

_INTERNAL = ("stream_spec", "attach_id")


@router.get("/v1/requests/{rid}")
async def get_request(rid: str, tm: TokenizerManagerDep) -> dict[str, Any]:
    """A request's state (status, owner, token counts, finish reason) from Redis, with its
    output ids and their text (decoded here) so far; a finished request's result."""
    info = await tm.request_info(rid)
    if not info:
        raise NotFound(
            f"Request {rid} was not found (unknown, or expired).",
            param="rid",
            code="request_not_found",
        )
    fields = {k: v for k, v in msgspec.to_builtins(info).items() if k not in _INTERNAL}
    out: dict[str, Any] = {"id": rid, "object": "request", **fields}
    out["finish_reason"] = info.finish_reason.to_dict() if info.finish_reason else None
    out["running_here"] = rid in tm.rid_to_state
    try:
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            ids = await request_state.output_ids(tm.redis, tm.keys, rid)
    except REDIS_ERRORS as e:
        raise unavailable(e, "Redis is unavailable.") from e
    out["output_ids"] = ids
    out["text"] = (await tm.tok.decode_batch([ids]))[0] if ids else ""
    return out


@router.get("/v1/requests/{rid}/stream", response_model=None)
async def stream_request(
    rid: str,
    request: Request,
    tm: TokenizerManagerDep,
    last_event_id: Annotated[str | None, Header()] = None,
) -> Response:
    """Re-attach to a streaming response (any replica's): its events after the
    `Last-Event-ID` header (all without it), byte for byte, then live to [DONE]."""
    after = -1
    if last_event_id is not None and last_event_id.strip():
        try:
            after = int(last_event_id)
        except ValueError:
            raise BadRequest("Last-Event-ID must be an event id (an integer).",
                             param="Last-Event-ID") from None  # fmt: skip
    return await open_stream(tm, rid, after, request)

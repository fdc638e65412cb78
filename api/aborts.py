"""Aborts from the api (DESIGN §4.5): the durable marker + broadcast are written to Redis
BEFORE local state is dropped, and every aborted request still ends with one terminal output.

- `abort_request`: a client asked (any replica's rid); a Redis failure is the client's 503.
- `abort_and_finish` / `abort_soon`: internal aborts (timeouts, disconnects, shutdown); the
  write is retried, then the local requests end anyway and the write is left to
  `retry_pending` (the maintenance loop), so an outage never leaves a request running.
- `abort_unless_moved`: a stream whose client went away and did not come back within the
  grace: aborted only if this attachment still owns it, else it is handed over quietly."""

from __future__ import annotations

import asyncio
import logging

from api.host import Core
from api.redis_errors import REDIS_ERRORS, REDIS_TIMEOUT_S, unavailable
from api.req_state import ReqState
from shared import protocol, reattach, request_state

logger = logging.getLogger(__name__)

_ATTEMPTS = 3


class Aborts:
    def __init__(self, tm: Core) -> None:
        self.tm = tm
        self.pending: set[str] = set()  # aborted locally, not yet written to Redis

    async def abort_request(
        self, rids: list[str], message: str = "Aborted by request.", status: int | None = None
    ) -> None:
        """Write the abort, THEN end the local requests. Raises ServiceUnavailable, leaving
        local state alone, if Redis is down."""
        await self.write(rids)
        self.finish_locally(rids, message, status)

    async def write(self, rids: list[str]) -> None:
        tm = self.tm
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                async with tm.redis.pipeline(transaction=False) as pipe:
                    request_state.abort(pipe, tm.keys, rids)
                    reattach.drop(pipe, tm.keys, tm.api_id, rids)  # if an outage kept it
                    await pipe.execute()
        except REDIS_ERRORS as e:
            raise unavailable(e, "Could not write the abort: Redis is unavailable.") from e
        self.pending.difference_update(rids)
        for rid in rids:
            logger.info("abort written rid=%s", rid)

    def finish_locally(self, rids: list[str], message: str, status: int | None) -> None:
        reason = protocol.FinishReason(type="abort", message=message, status_code=status)
        for rid in rids:
            state = self.tm.rid_to_state.pop(rid, None)
            if state is not None and not state.finished:
                state.finish(reason)
                self.tm.metrics.finished(state)

    async def abort_and_finish(
        self, rids: list[str], message: str, status: int | None = None, attempts: int = _ATTEMPTS
    ) -> None:
        """Retry the write, then end the local requests even if Redis stayed unreachable
        (the write is then retried in the background until Redis answers)."""
        for attempt in range(attempts):
            try:
                await self.write(rids)
                break
            except Exception:
                logger.warning("abort write failed (attempt %d) rid=%s", attempt + 1, rids[0])
                if attempt + 1 < attempts:
                    await asyncio.sleep(0.2 * 2**attempt)
        else:
            logger.error("abort of %d requests not written yet rid=%s", len(rids), rids[0])
            self.pending.update(rids)
        self.finish_locally(rids, message, status)

    def abort_soon(self, rids: list[str], message: str) -> None:
        """Abort from code that must not await (finally blocks of cancelled generators)."""
        logger.info("aborting %d requests rid=%s: %s", len(rids), rids[0], message)
        if not self.tm.spawn(self.abort_and_finish(rids, message)):
            self.finish_locally(rids, message, None)  # no loop any more: local cleanup only

    async def retry_pending(self) -> None:
        """Write the aborts that an outage kept from Redis (called by the maintenance loop)."""
        if self.pending:
            try:
                await self.write(sorted(self.pending))
            except Exception as e:
                logger.debug("pending aborts still not written: %r", e)

    async def abort_unless_moved(self, states: list[ReqState], message: str) -> None:
        """The grace of a stream whose client went away ran out: abort the requests that this
        attachment still owns; the others were re-attached elsewhere: end them quietly."""
        live = [s for s in states if not s.finished and not s.superseded]
        if not live:
            return
        tm, first = self.tm, live[0]
        guard = None
        if first.stream_rid and first.attach_id:
            guard = (first.stream_rid, first.attach_id)
        rids = [s.rid for s in live]
        aborted: list[str] | None = None
        for attempt in range(_ATTEMPTS):
            try:
                async with asyncio.timeout(REDIS_TIMEOUT_S):
                    aborted = await reattach.abort_if_held(tm.redis, tm.keys, rids, tm.api_id,
                                                           guard)  # fmt: skip
                break
            except REDIS_ERRORS as e:
                logger.warning("grace abort failed (attempt %d) rid=%s: %r", attempt + 1,
                               first.rid, e)  # fmt: skip
                await asyncio.sleep(0.2 * 2**attempt)
        if aborted is None:  # Redis stayed away: abort locally, write it when it is back
            aborted = [s.rid for s in live]
            self.pending.update(aborted)
        for state in live:
            if state.rid not in aborted:
                logger.info("rid=%s was re-attached elsewhere: handing it over", state.rid)
                tm.supersede(state)
        self.finish_locally(aborted, message, None)

"""The api's soft watchdog (the seed's TokenizerManager soft watchdog, per request): on every
upkeep tick, each request here with no output for api.soft_watchdog_s is logged at WARNING,
once per period while it stays silent, with its rid, age, tokens so far and where it waits:

- queued in the request stream (no scheduler took it yet; the fleet may be paused);
- running on scheduler X (its state hash names the worker);
- waiting for the detokenizer (the scheduler generated more ids than reached this replica,
  or it finished and the end has not arrived).

Log only: nothing about the request changes (api.waiting times it out after
request_timeout_s). The state of the silent requests is read in one pipeline, only for them."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from api.host import Core
from api.redis_errors import REDIS_ERRORS, REDIS_TIMEOUT_S
from api.req_state import ReqState
from shared import protocol, request_state

logger = logging.getLogger(__name__)

Where = dict[str, str]  # rid -> where it waits, in words


class SoftWatchdog:
    def __init__(self, tm: Core) -> None:
        self.tm = tm
        self.warned_at: dict[str, float] = {}  # rid -> monotonic time of its last warning

    async def tick(self) -> None:
        """Warn about the requests silent for a period that were not warned about in it."""
        period = self.tm.settings.api.soft_watchdog_s
        if period <= 0:
            return
        now = time.monotonic()
        due = self.due(now, period)
        if not due:
            return
        where = await self.where(due)
        for state in due:
            self.warned_at[state.rid] = now
            logger.warning(
                "soft watchdog: rid=%s no output for %.0fs (age %.0fs, %d tokens so far): %s",
                state.rid,
                now - state.last_time,
                time.time() - state.created_time,
                state.next_seq,
                where[state.rid],
            )

    def due(self, now: float, period: float) -> list[ReqState]:
        """The live requests silent for `period`, not warned about for a period; forgets the
        rids that ended or spoke since."""
        due, warned = [], {}
        for rid, state in self.tm.rid_to_state.items():
            if state.finished or state.released or now - state.last_time < period:
                continue
            last = self.warned_at.get(rid)
            if last is not None and now - last < period:
                warned[rid] = last
                continue
            due.append(state)
        self.warned_at = warned
        return due

    async def where(self, states: list[ReqState]) -> Where:
        """Where each request waits, from its state hash and id log (one pipeline)."""
        tm = self.tm
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                async with tm.redis.pipeline(transaction=False) as pipe:
                    pipe.get(tm.keys.pause)
                    for state in states:
                        pipe.hgetall(tm.keys.state(state.rid))
                        pipe.llen(tm.keys.ids(state.rid))
                    paused, *replies = await pipe.execute()
        except REDIS_ERRORS as e:
            return {state.rid: f"unknown: Redis unreachable ({e!r})" for state in states}
        pause_mode = paused.decode() if paused else ""
        return {
            state.rid: describe(state, _decoded(stored), int(num_ids), pause_mode)
            for state, stored, num_ids in zip(states, replies[::2], replies[1::2], strict=True)
        }


def _decoded(stored: dict[bytes, bytes]) -> protocol.RequestState | None:
    try:
        return request_state.decode({k.decode(): v.decode() for k, v in stored.items()})
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError):
        return None


def describe(
    state: ReqState, stored: protocol.RequestState | None, num_ids: int, pause_mode: str = ""
) -> str:
    """Where a silent request waits, in words. `num_ids`: the length of its id log (what
    the scheduler generated); `state.next_seq`: how much of it reached this replica."""
    paused = f"; the fleet is paused ({pause_mode})" if pause_mode else ""
    if stored is None:
        return "no state in Redis (expired, or never stored)"
    worker = stored.worker or "?"
    if stored.status == "queued":
        return f"queued in the request stream, no scheduler took it yet{paused}"
    if stored.status == "running" and num_ids > state.next_seq:
        return (
            f"waiting for the detokenizer: scheduler {worker} generated {num_ids} ids, "
            f"{state.next_seq} reached this replica"
        )
    if stored.status == "running":
        return f"running on scheduler {worker} (epoch {stored.epoch}), {num_ids} ids{paused}"
    if stored.status in ("finished", "aborted"):
        return f"{stored.status} on scheduler {worker}: waiting for the detokenizer to send it"
    return f"state {stored.status!r}"

"""Refilling what pub/sub lost (DESIGN §4.4): a gap in a request's seqs (Redis cut the
subscription off, a reconnect, a re-attach) first asks the detokenizer to send the text again
from the expected seq (a Reattach on `rs:ctl`); if nothing came after REFILL_IDLE_S, the
missing text is rebuilt from the durable id log `rs:ids:{rid}` (decoded here; logprobs of
those positions are then null), and a request that finished meanwhile is finished from its
state hash. So the final answer never depends on a message that was lost.

The id log holds ids only. A request whose answer needs what only the entries carry (logprobs,
an embedding) is therefore not rebuilt from it while its entries may merely be late: a
detokenizer behind on a busy machine delivers them seconds after the scheduler wrote the ids
and the finish. Only a gap (a later entry came, so one was lost), entries that surely went
elsewhere (a re-attach, a lost subscription) or a finish older than `late_entry_s` (twice the
detokenizer lease: by then a lagging detokenizer delivered, or its shards moved and the entry
is lost for good) is rebuilt for such a request."""

from __future__ import annotations

import asyncio
import logging
import time

from api.host import Core
from api.redis_errors import REDIS_ERRORS, REDIS_TIMEOUT_S
from api.req_state import ReqState
from shared import protocol, reattach, request_state

logger = logging.getLogger(__name__)

REFILL_IDLE_S = 1.0
REFILL_MAX_S = 30.0  # a request with nothing new in its id log is looked at less and less
_TERMINAL = ("finished", "aborted")


class GapFiller:
    def __init__(self, tm: Core) -> None:
        self.tm = tm

    def on_gap(self, state: ReqState) -> None:
        """A held entry waits for a gap: ask for a resend, unless one is pending already."""
        if not state.resend_at:
            self.request([state])

    def request(self, states: list[ReqState], lost: bool = False) -> None:
        """Ask the detokenizer to send these requests' text again from their next seq
        (`lost`: some of it surely went elsewhere, not merely late)."""
        states = [s for s in states if not s.finished]
        if not states:
            return
        now = time.monotonic()
        for state in states:
            state.resend_at, state.refill_every = now, REFILL_IDLE_S
            state.entries_lost = state.entries_lost or lost
        self.tm.spawn(self._announce(states))

    async def _announce(self, states: list[ReqState]) -> None:
        tm = self.tm
        rids, seqs = [s.rid for s in states], [s.next_seq for s in states]
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                async with tm.redis.pipeline(transaction=False) as pipe:
                    reattach.announce(pipe, tm.keys, rids, tm.api_id, seqs)
                    await pipe.execute()
            logger.info("asked for a resend of %d requests rid=%s from seq %d", len(rids),
                        rids[0], seqs[0])  # fmt: skip
        except REDIS_ERRORS as e:
            logger.warning("resend request failed rid=%s: %r", rids[0], e)

    async def check(self, state: ReqState) -> None:
        """Called by the waiter while it waits: refill once a resend is overdue (and again,
        less and less often, while nothing comes: the detokenizer may not have the request)."""
        if state.resend_at and time.monotonic() - state.resend_at >= state.refill_every:
            state.resend_at = time.monotonic()
            found = await self.refill(state)
            state.refill_every = REFILL_IDLE_S if found else min(2 * state.refill_every,
                                                                 REFILL_MAX_S)  # fmt: skip

    def refill_soon(self, state: ReqState) -> None:
        """Refill in the background, now (a request that ended while nobody listened)."""

        async def refill() -> None:
            await self.refill(state)

        self.tm.spawn(refill())

    async def refill(self, state: ReqState) -> bool:
        """Rebuild the missing text from the id log; finish the request if its state hash
        says it ended and every id is covered; give up on a gap the log cannot fill.
        True when it applied something, or waits for a finished request's late entries."""
        tm = self.tm
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                ids = await request_state.output_ids(tm.redis, tm.keys, state.rid)
                info = await request_state.read(tm.redis, tm.keys, state.rid)
        except REDIS_ERRORS as e:
            logger.warning("refill of rid=%s failed: %r", state.rid, e)
            return False
        end = min([len(ids), *(e.seq for e in state.held)])
        terminal = info is not None and info.status in _TERMINAL
        late = not (state.held or state.entries_lost) and needs_entries(state)
        if late and not self._entries_overdue(info):
            return terminal  # its entries may be on their way: look again soon if it ended
        found = end > state.next_seq or (terminal and not state.held)
        if found:
            entry = await self._entry(state, ids, end, info if terminal else None)
            logger.info("rid=%s refilled seq %d..%d from the id log", state.rid,
                        state.next_seq, end)  # fmt: skip
            tm.apply(state, entry)
        if state.held and not state.finished:
            logger.warning("rid=%s: gap at seq %d not refilled; going on without it",
                           state.rid, state.next_seq)  # fmt: skip
            found = True
            if state.release_held():
                tm.apply(state, _nothing(state))
        if state.finished:
            state.resend_at = 0.0
        return found

    def _entries_overdue(self, info: protocol.RequestState | None) -> bool:
        """Whether a request that `info` says finished did so longer than `late_entry_s`
        ago (False while it runs: its entries keep coming, or a gap shows the loss)."""
        if info is None or info.status not in _TERMINAL:
            return False
        late_entry_s = 2 * self.tm.settings.detokenizer.lease_ttl_s
        return time.time() - (info.finished_at or 0.0) >= late_entry_s

    async def _entry(
        self, state: ReqState, ids: list[int], end: int, info: protocol.RequestState | None
    ) -> protocol.TextEntry:
        """The text of ids[next_seq:end] (a running request's trailing partial character is
        left for later), with the finish when it covers a finished request's every id."""
        start = min(state.next_seq, end)
        finish = None
        if info is not None and end >= len(ids):
            finish = info.finish_reason or protocol.FinishReason(type="abort")
        delta = await self._decode(state, ids, start, end)
        while finish is None and end > start and delta.endswith("\ufffd"):
            end -= 1
            delta = await self._decode(state, ids, start, end)
        if finish is not None and finish.type == "stop" and isinstance(finish.matched, str):
            delta = delta.removesuffix(finish.matched)  # as the detokenizer trims it
        done = info.completion_tokens if info is not None and info.completion_tokens else 0
        return protocol.TextEntry(
            rid=state.rid, epoch=state.epoch, seq=start, text=delta, token_ids=ids[start:end],
            prompt_tokens=state.prompt_tokens, completion_tokens=max(end, done), finish=finish,
            cached_tokens=state.cached_tokens,
            weight_version=info.weight_version if finish is not None and info else None,
        )  # fmt: skip

    async def _decode(self, state: ReqState, ids: list[int], start: int, end: int) -> str:
        skip = state.obj.skip_special_tokens
        before, text = await self.tm.tok.decode_batch([ids[:start], ids[:end]], skip)
        return text[len(before) :]


def needs_entries(state: ReqState) -> bool:
    """Whether the answer needs what only the engine's entries carry, not the id log."""
    return state.logprobs is not None or state.obj.embed


def _nothing(state: ReqState) -> protocol.TextEntry:
    """An empty entry at the state's seq: wakes its waiter through the normal path."""
    return protocol.TextEntry(
        rid=state.rid, epoch=state.epoch, seq=state.next_seq, text="", token_ids=[],
        prompt_tokens=state.prompt_tokens, completion_tokens=state.completion_tokens,
        cached_tokens=state.cached_tokens,
    )  # fmt: skip

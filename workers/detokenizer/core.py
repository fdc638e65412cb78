"""Pure core of the detokenizer worker: TokenEntry ids in, TextEntry deltas out (no Redis).

`DetokenizerCore` keeps one DecodeState per rid (bounded, LRU), fences owner epochs, drops
duplicates and routes each TextEntry to the api replica that holds the client. What it cannot
know by itself it asks for and the loop fetches (`needs` -> `Fetched`, like a page fault): the
api_id of a request it holds no state for, and ranges of the request's durable id log. With
them it rebuilds a request another detokenizer served before (an entry at seq > 0) and fills
gaps that pub/sub left (DESIGN §4.2, §4.4), so the text stays exactly what one detokenizer that
saw every message would have sent.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from shared.protocol import (
    DetokParams,
    FinishReason,
    TextEntry,
    TokenBatch,
    TokenEntry,
)
from workers.detokenizer.decode_state import (
    REPLACEMENT,
    DecodeState,
    Tokenizer,
    find_first_stop,
    partial_stop_len,
)
from workers.detokenizer.text_entries import is_stop_token, text_entry

__all__ = [
    "REPLACEMENT",
    "DecodeState",
    "DetokenizerCore",
    "Fetched",
    "IdRange",
    "Needs",
    "Tokenizer",
    "find_first_stop",
    "partial_stop_len",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_STATES = 1 << 16
# A rebuilt request re-emits its last this many ids one TextEntry per id, so that a receiver
# keeps exactly those past what it already has, wherever the old detokenizer stopped (the ids
# before go out as one entry: a receiver that is that far behind lost them anyway).
DEFAULT_REPLAY_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class IdRange:
    """Output ids [start, end) of `rid`, to be read from its id log."""

    rid: str
    start: int
    end: int


@dataclass(slots=True)
class Needs:
    """What `add_batch` wants fetched first: request states (their api_id) and id ranges."""

    states: list[str] = field(default_factory=list)
    ranges: list[IdRange] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.states or self.ranges)


@dataclass(slots=True)
class Fetched:
    """The loop's answers to `Needs`: the api_id in each request state that exists, and the
    ids read per range (fewer than asked when the log is shorter or gone)."""

    api_ids: Mapping[str, str] = field(default_factory=dict)
    ids: Mapping[IdRange, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class _Tombstone:
    """A request whose state is gone: finished (drop its late entries) or aborted."""

    epoch: int
    api_id: str
    is_aborted: bool


Routed = tuple[str, list[TextEntry]]  # api_id, the request's new entries in seq order


class DetokenizerCore:
    """All live DecodeStates of one detokenizer process, driven by TokenBatches."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_states: int = DEFAULT_MAX_STATES,
        replay_tokens: int = DEFAULT_REPLAY_TOKENS,
    ) -> None:
        self._tokenizer = tokenizer
        self.max_states = max(1, max_states)
        self.replay_tokens = max(1, replay_tokens)
        self._states: OrderedDict[str, DecodeState] = OrderedDict()
        self._tombstones: OrderedDict[str, _Tombstone] = OrderedDict()
        self._moved: OrderedDict[str, str] = OrderedDict()  # reattached before any state

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, rid: object) -> bool:
        return rid in self._states

    def get(self, rid: str) -> DecodeState | None:
        return self._states.get(rid)

    def rids(self) -> list[str]:
        return list(self._states)

    def needs(self, batch: TokenBatch) -> Needs:
        """What to fetch before `add_batch(batch)`: for an unknown request, its state (for
        the api_id, unless a first entry brings it) and ids [0, seq); for a gap, the ids
        missing. Only a rid's first entry in the batch is looked at (one per step)."""
        needs, seen = Needs(), set()
        for entry in batch.entries:
            rid = entry.rid
            if rid in seen:
                continue
            seen.add(rid)
            state = self._states.get(rid)
            if state is not None:
                if entry.epoch >= state.epoch and entry.seq > state.next_seq:
                    needs.ranges.append(IdRange(rid, state.next_seq, entry.seq))
            elif self._opens_state(entry):
                if entry.detok is None or entry.seq > 0:
                    needs.states.append(rid)
                if entry.seq > 0:
                    needs.ranges.append(IdRange(rid, 0, entry.seq))
        return needs

    def add_batch(
        self, batch: TokenBatch, fetched: Fetched | None = None
    ) -> dict[str, list[TextEntry]]:
        """Decode one scheduler step; returns the new TextEntries grouped by api_id.

        `fetched` answers `needs(batch)`; without it an unknown request without params is
        dropped and gaps stay gaps. A request that fails to decode is finished with an
        abort; the rest of the batch goes on.
        """
        out: dict[str, list[TextEntry]] = {}
        for entry in batch.entries:
            try:
                routed = self._add_entry(entry, fetched or Fetched())
            except Exception as exc:  # one bad request must not fail the batch
                routed = self._fail(entry, exc)
            if routed is not None:
                out.setdefault(routed[0], []).extend(routed[1])
        return out

    def abort(self, rids: Iterable[str]) -> None:
        """Drop the state of `rids`; a later finishing entry still reaches the api (text-free)."""
        for rid in rids:
            state = self._states.pop(rid, None)
            if state is not None:
                logger.info("rid=%s aborted: state dropped", rid)
                self._bury(rid, _Tombstone(state.epoch, state.api_id, is_aborted=True))

    def reattach(self, rids: Iterable[str], api_id: str) -> None:
        """Route `rids`' output to `api_id` from now on (their client moved replicas)."""
        for rid in rids:
            state, tomb = self._states.get(rid), self._tombstones.get(rid)
            if state is not None:
                state.api_id = api_id
                state.params = msgspec.structs.replace(state.params, api_id=api_id)
            elif tomb is not None:
                tomb.api_id = api_id
            else:
                self._moved[rid] = api_id
                self._moved.move_to_end(rid)
                while len(self._moved) > self.max_states:
                    self._moved.popitem(last=False)
            logger.info("rid=%s reattached to api_id=%s", rid, api_id)

    def resend(self, rid: str, from_seq: int) -> Routed | None:
        """The text from `from_seq` on again, one TextEntry per id (a replica missed it: it
        took the request over from a dead one, or pub/sub dropped messages). Decoded afresh
        from the ids this state holds, so it is what was sent: the text after k ids depends
        only on them. None when this core does not hold the request."""
        state = self._states.get(rid)
        if state is None or from_seq < 0 or from_seq >= state.next_seq:
            return None
        replay = DecodeState(state.api_id, state.params, state.epoch, next_seq=0)
        out = []
        for seq, token_id in enumerate(state.ids):
            replay.append(seq, [token_id])
            text = replay.step(self._tokenizer, None, trim_last=False)
            if seq >= from_seq:
                out.append(TextEntry(rid=rid, epoch=state.epoch, seq=seq, text=text,
                                     token_ids=[token_id], prompt_tokens=state.prompt_tokens,
                                     completion_tokens=seq + 1,
                                     cached_tokens=state.cached_tokens))  # fmt: skip
        logger.info("rid=%s resent from seq %d to %s", rid, from_seq, state.api_id)
        return state.api_id, out

    def forget(self, rids: Iterable[str]) -> None:
        """Drop live states that another detokenizer serves now (their shard moved away)."""
        for rid in rids:
            self._states.pop(rid, None)

    # -- internals ---------------------------------------------------------------------------
    def _opens_state(self, entry: TokenEntry) -> bool:
        """No live state: does this entry start one? Not for a late entry of a finished
        epoch, nor after an abort."""
        tomb = self._tombstones.get(entry.rid)
        return tomb is None or (entry.epoch > tomb.epoch and not tomb.is_aborted)

    def _add_entry(self, entry: TokenEntry, fetched: Fetched) -> Routed | None:
        tomb = self._tombstones.get(entry.rid)
        state = self._states.get(entry.rid)
        if state is None and tomb is not None and not self._opens_state(entry):
            if tomb.is_aborted:
                return self._after_abort(entry, tomb)
            logger.debug("rid=%s late entry after finish dropped", entry.rid)
            return None
        out: list[TextEntry] = []
        if state is None:
            state = self._rebuild(entry, fetched, out)
        elif not self._is_current(state, entry):
            return None
        if state is None:
            return None
        self._fill_gap(state, entry, fetched, out)
        new = self._new_tokens(state, entry)
        if new is not None:
            out.append(self._decode(state, entry, *new))
        return (state.api_id, out) if out else None

    def _is_current(self, state: DecodeState, entry: TokenEntry) -> bool:
        """Fencing: a stale owner's entry is dropped; a new owner continues the same id log,
        hence the same state, under its epoch."""
        if entry.epoch < state.epoch:
            logger.debug("rid=%s stale epoch %d < %d dropped", entry.rid, entry.epoch, state.epoch)
            return False
        if entry.epoch > state.epoch:
            logger.info("rid=%s new owner epoch %d continues at seq %d (expected %d)",
                        entry.rid, entry.epoch, entry.seq, state.next_seq)  # fmt: skip
            state.epoch = entry.epoch
        self._states.move_to_end(entry.rid)
        return True

    def _rebuild(
        self, entry: TokenEntry, fetched: Fetched, out: list[TextEntry]
    ) -> DecodeState | None:
        """A state for a request this core does not hold: its params (the entry's, routed to
        the api_id its request state names now), then its ids [0, seq) replayed into `out`."""
        rid = entry.rid
        api_id = self._moved.pop(rid, None) or fetched.api_ids.get(rid)
        params = entry.detok
        if params is None:
            if api_id is None:
                logger.warning("rid=%s entry without detok params for an unknown request", rid)
                return None
            params = DetokParams(api_id=api_id)
        elif api_id is not None and api_id != params.api_id:
            params = msgspec.structs.replace(params, api_id=api_id)
        state = self._create(entry, params)
        if entry.seq == 0:
            return state
        prefix = fetched.ids.get(IdRange(rid, 0, entry.seq))
        if prefix is None or len(prefix) != entry.seq:
            logger.warning("rid=%s cannot rebuild: id log has %d of %d ids; decoding from seq %d",
                           rid, len(prefix or ()), entry.seq, entry.seq)  # fmt: skip
            state.next_seq = entry.seq
            return state
        logger.info("rid=%s rebuilt from its id log at seq %d", rid, entry.seq)
        bulk = max(0, entry.seq - self.replay_tokens)
        if bulk:
            out.append(self._advance(state, entry, prefix[:bulk]))
        out.extend(self._advance(state, entry, prefix[i : i + 1]) for i in range(bulk, entry.seq))
        return state

    def _fill_gap(
        self, state: DecodeState, entry: TokenEntry, fetched: Fetched, out: list[TextEntry]
    ) -> None:
        """Ids [next_seq, entry.seq) that pub/sub lost, from the id log (else decode on)."""
        if entry.seq <= state.next_seq:
            return
        span = IdRange(entry.rid, state.next_seq, entry.seq)
        ids = fetched.ids.get(span)
        if ids is None or len(ids) != span.end - span.start:
            logger.warning("rid=%s gap: expected seq %d, got %d (not refilled)",
                           entry.rid, state.next_seq, entry.seq)  # fmt: skip
            return
        logger.info("rid=%s gap [%d, %d) refilled from the id log", entry.rid, span.start, span.end)
        out.append(self._advance(state, entry, ids))

    def _advance(self, state: DecodeState, entry: TokenEntry, ids: list[int]) -> TextEntry:
        """Append ids read from the id log (no logprobs known) and emit their safe text."""
        seq = state.next_seq
        state.append(seq, ids)
        text = state.step(self._tokenizer, None, trim_last=False)
        return TextEntry(
            rid=entry.rid,
            epoch=entry.epoch,
            seq=seq,
            text=text,
            token_ids=ids,
            prompt_tokens=entry.prompt_tokens,
            completion_tokens=seq + len(ids),
            cached_tokens=entry.cached_tokens,
        )

    def _decode(
        self, state: DecodeState, entry: TokenEntry, seq: int, token_ids: list[int]
    ) -> TextEntry:
        """The entry's own new ids; a finishing entry retires the state."""
        state.append(seq, token_ids)
        trim_last = is_stop_token(entry.finish, token_ids, state.params)
        text = state.step(self._tokenizer, entry.finish, trim_last)
        if entry.finish is not None:
            del self._states[entry.rid]
            self._bury(entry.rid, _Tombstone(state.epoch, state.api_id, is_aborted=False))
        return text_entry(entry, seq, text, token_ids, entry.finish)

    def _create(self, entry: TokenEntry, params: DetokParams) -> DecodeState:
        self._states.pop(entry.rid, None)
        self._tombstones.pop(entry.rid, None)
        while len(self._states) >= self.max_states:
            evicted, _ = self._states.popitem(last=False)
            logger.warning("rid=%s evicted: more than %d live states", evicted, self.max_states)
        state = DecodeState(params.api_id, params, entry.epoch, next_seq=0)
        state.prompt_tokens, state.cached_tokens = entry.prompt_tokens, entry.cached_tokens
        self._states[entry.rid] = state
        return state

    def _new_tokens(self, state: DecodeState, entry: TokenEntry) -> tuple[int, list[int]] | None:
        """(seq, ids) this entry adds; None for a duplicate."""
        seq, ids = entry.seq, entry.token_ids
        if seq >= state.next_seq:
            return seq, ids
        skip = state.next_seq - seq
        if skip >= len(ids):
            logger.debug("rid=%s duplicate seq %d dropped", entry.rid, seq)
            return None
        return state.next_seq, ids[skip:]

    def _after_abort(self, entry: TokenEntry, tomb: _Tombstone) -> Routed | None:
        if entry.epoch < tomb.epoch or entry.finish is None:
            return None
        self._bury(entry.rid, _Tombstone(entry.epoch, tomb.api_id, is_aborted=False))
        return tomb.api_id, [text_entry(entry, entry.seq, "", entry.token_ids, entry.finish)]

    def _fail(self, entry: TokenEntry, exc: Exception) -> Routed | None:
        logger.error("rid=%s detokenization failed: %r", entry.rid, exc, exc_info=exc)
        state = self._states.pop(entry.rid, None)
        api_id = state.api_id if state else entry.detok.api_id if entry.detok else None
        if api_id is None:
            return None
        self._bury(entry.rid, _Tombstone(entry.epoch, api_id, is_aborted=False))
        finish = FinishReason(type="abort", message="detokenization failed", status_code=500)
        return api_id, [text_entry(entry, entry.seq, "", entry.token_ids, finish)]

    def _bury(self, rid: str, tomb: _Tombstone) -> None:
        self._tombstones[rid] = tomb
        self._tombstones.move_to_end(rid)
        while len(self._tombstones) > self.max_states:
            self._tombstones.popitem(last=False)

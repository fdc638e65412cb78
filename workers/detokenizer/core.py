"""Pure core of the detokenizer worker: TokenEntry ids in, TextEntry deltas out (no Redis).

`DecodeState` turns one request's token ids into text incrementally (SGLang's DecodeStatus
surr/read offsets): it never emits half a UTF-8 character and never lets a stop string leak.
`DetokenizerCore` keeps one DecodeState per rid (bounded, LRU), fences owner epochs, drops
duplicates and routes each TextEntry to the api replica that holds the client.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from shared.protocol import (
    DetokParams,
    FinishReason,
    Logprobs,
    TextEntry,
    TokenBatch,
    TokenEntry,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_STATES = 1 << 16
REPLACEMENT = "\ufffd"  # what a decoder prints for an incomplete UTF-8 sequence


class Tokenizer(Protocol):
    def decode(
        self, token_ids: list[int], skip_special_tokens: bool = ..., **kwargs: bool
    ) -> str: ...


@dataclass(slots=True)
class DecodeState:
    """Incremental detokenization of one request's output under one owner epoch.

    Invariants: `ids[:read_offset]` decodes to `text` (committed, ends on a whole character);
    `sent` characters of the visible text were emitted; `stop_end`, once set, ends the text.
    """

    api_id: str
    params: DetokParams
    epoch: int
    next_seq: int  # seq of the next token this state expects
    ids: list[int] = field(default_factory=list)
    text: str = ""
    surr_offset: int = 0
    read_offset: int = 0
    sent: int = 0
    stop_end: int | None = None

    def append(self, seq: int, token_ids: list[int]) -> None:
        self.ids.extend(token_ids)
        self.next_seq = seq + len(token_ids)

    def step(self, tokenizer: Tokenizer, finish: FinishReason | None, trim_last: bool) -> str:
        """Text that became safe to emit; with `finish`, everything that is left."""
        if self.stop_end is not None:
            return ""  # a stop string ended the text; later tokens only advance counts
        is_final = finish is not None
        ids = self.ids[:-1] if trim_last else self.ids
        pending = self._pending_text(tokenizer, ids)
        if not is_final and pending and not pending.endswith(REPLACEMENT):
            self.text += pending
            self.surr_offset, self.read_offset = self.read_offset, len(ids)
            pending = ""
        full = self.text + (pending if is_final else pending.rstrip(REPLACEMENT))
        end = self._visible_end(full, is_final, finish)
        delta = full[self.sent : end]
        self.sent = max(self.sent, end)
        return delta

    def _pending_text(self, tokenizer: Tokenizer, ids: list[int]) -> str:
        if len(ids) <= self.read_offset:
            return ""
        surr_text = self._decode(tokenizer, ids[self.surr_offset : self.read_offset])
        read_text = self._decode(tokenizer, ids[self.surr_offset :])
        return read_text[len(surr_text) :]

    def _decode(self, tokenizer: Tokenizer, ids: list[int]) -> str:
        if not ids:
            return ""
        return tokenizer.decode(
            ids,
            skip_special_tokens=self.params.skip_special_tokens,
            spaces_between_special_tokens=self.params.spaces_between_special_tokens,
        )

    def _visible_end(self, full: str, is_final: bool, finish: FinishReason | None) -> int:
        """Where the emittable text ends: at a stop string, or before a possible stop prefix."""
        if self.stop_end is not None:
            return self.stop_end
        stops = _stop_strings(self.params.stop, finish)
        if not stops:
            return len(full)
        start = max(0, self.sent - max(map(len, stops)) + 1)
        hit = find_first_stop(full, stops, start)
        if hit is not None:
            pos, stop = hit
            end = pos + len(stop) if self.params.no_stop_trim else pos
            self.stop_end = max(self.sent, end)
            return self.stop_end
        if is_final:
            return len(full)
        return max(self.sent, len(full) - partial_stop_len(full, stops))


def _stop_strings(stop: list[str], finish: FinishReason | None) -> list[str]:
    stops = [s for s in stop if s]
    if finish is not None and finish.type == "stop" and isinstance(finish.matched, str):
        if finish.matched and finish.matched not in stops:
            stops.append(finish.matched)
    return stops


def find_first_stop(text: str, stops: list[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest (position, stop string) in `text[start:]`, or None."""
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop, start)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that could be the start of a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


@dataclass(slots=True)
class _Tombstone:
    """A request whose state is gone: finished (drop its late entries) or aborted."""

    epoch: int
    api_id: str
    is_aborted: bool


class DetokenizerCore:
    """All live DecodeStates of one detokenizer process, driven by TokenBatches."""

    def __init__(self, tokenizer: Tokenizer, max_states: int = DEFAULT_MAX_STATES) -> None:
        self._tokenizer = tokenizer
        self.max_states = max(1, max_states)
        self._states: OrderedDict[str, DecodeState] = OrderedDict()
        self._tombstones: OrderedDict[str, _Tombstone] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, rid: object) -> bool:
        return rid in self._states

    def get(self, rid: str) -> DecodeState | None:
        return self._states.get(rid)

    def rids_missing_params(self, batch: TokenBatch) -> list[str]:
        """Rids that `add_batch` could not route: no live state and no `detok` on the entry."""
        missing: dict[str, None] = {}
        for entry in batch.entries:
            rid = entry.rid
            if rid in self._states or entry.detok is not None:
                continue
            tomb = self._tombstones.get(rid)
            if tomb is None or (entry.epoch > tomb.epoch and not tomb.is_aborted):
                missing[rid] = None
        return list(missing)

    def add_batch(
        self, batch: TokenBatch, fallback: Mapping[str, DetokParams] | None = None
    ) -> dict[str, list[TextEntry]]:
        """Decode one scheduler step; returns the new TextEntries grouped by api_id.

        `fallback` gives params for rids in `rids_missing_params` (looked up by the loop).
        A request that fails to decode is finished with an abort; the rest of the batch goes on.
        """
        out: dict[str, list[TextEntry]] = {}
        for entry in batch.entries:
            try:
                routed = self._add_entry(entry, fallback or {})
            except Exception as exc:  # one bad request must not fail the batch
                routed = self._fail(entry, exc)
            if routed is not None:
                out.setdefault(routed[0], []).append(routed[1])
        return out

    def abort(self, rids: Iterable[str]) -> None:
        """Drop the state of `rids`; a later finishing entry still reaches the api (text-free)."""
        for rid in rids:
            state = self._states.pop(rid, None)
            if state is not None:
                logger.info("rid=%s aborted: state dropped", rid)
                self._bury(rid, _Tombstone(state.epoch, state.api_id, is_aborted=True))

    # -- internals ---------------------------------------------------------------------------
    def _add_entry(
        self, entry: TokenEntry, fallback: Mapping[str, DetokParams]
    ) -> tuple[str, TextEntry] | None:
        tomb = self._tombstones.get(entry.rid)
        if entry.rid not in self._states and tomb is not None:
            if tomb.is_aborted:
                return self._after_abort(entry, tomb)
            if entry.epoch <= tomb.epoch:
                logger.debug("rid=%s late entry after finish dropped", entry.rid)
                return None
        state = self._state_for(entry, fallback)
        if state is None:
            return None
        new = self._new_tokens(state, entry)
        if new is None:
            return None
        seq, token_ids = new
        state.append(seq, token_ids)
        trim_last = _is_stop_token(entry.finish, token_ids, state.params)
        text = state.step(self._tokenizer, entry.finish, trim_last)
        if entry.finish is not None:
            del self._states[entry.rid]
            self._bury(entry.rid, _Tombstone(state.epoch, state.api_id, is_aborted=False))
        return state.api_id, _text_entry(entry, seq, text, token_ids, entry.finish)

    def _state_for(
        self, entry: TokenEntry, fallback: Mapping[str, DetokParams]
    ) -> DecodeState | None:
        rid = entry.rid
        state = self._states.get(rid)
        if state is None:
            params = entry.detok or fallback.get(rid)
            if params is None:
                logger.warning("rid=%s entry without detok params for an unknown request", rid)
                return None
            return self._create(entry, params)
        if entry.epoch < state.epoch:
            logger.debug("rid=%s stale epoch %d < %d dropped", rid, entry.epoch, state.epoch)
            return None
        if entry.epoch > state.epoch:
            logger.info("rid=%s new owner epoch %d, restart at seq %d", rid, entry.epoch, entry.seq)
            return self._create(entry, entry.detok or state.params)
        self._states.move_to_end(rid)
        return state

    def _create(self, entry: TokenEntry, params: DetokParams) -> DecodeState:
        self._states.pop(entry.rid, None)
        self._tombstones.pop(entry.rid, None)
        while len(self._states) >= self.max_states:
            evicted, _ = self._states.popitem(last=False)
            logger.warning("rid=%s evicted: more than %d live states", evicted, self.max_states)
        state = DecodeState(params.api_id, params, entry.epoch, next_seq=entry.seq)
        self._states[entry.rid] = state
        return state

    def _new_tokens(self, state: DecodeState, entry: TokenEntry) -> tuple[int, list[int]] | None:
        """(seq, ids) this entry adds; None for a duplicate. Gaps are logged and accepted."""
        seq, ids = entry.seq, entry.token_ids
        if seq > state.next_seq:
            logger.warning("rid=%s gap: expected seq %d, got %d", entry.rid, state.next_seq, seq)
            return seq, ids
        if seq == state.next_seq:
            return seq, ids
        skip = state.next_seq - seq
        if skip >= len(ids):
            logger.debug("rid=%s duplicate seq %d dropped", entry.rid, seq)
            return None
        return state.next_seq, ids[skip:]

    def _after_abort(self, entry: TokenEntry, tomb: _Tombstone) -> tuple[str, TextEntry] | None:
        if entry.epoch < tomb.epoch or entry.finish is None:
            return None
        self._bury(entry.rid, _Tombstone(entry.epoch, tomb.api_id, is_aborted=False))
        return tomb.api_id, _text_entry(entry, entry.seq, "", entry.token_ids, entry.finish)

    def _fail(self, entry: TokenEntry, exc: Exception) -> tuple[str, TextEntry] | None:
        logger.error("rid=%s detokenization failed: %r", entry.rid, exc, exc_info=exc)
        state = self._states.pop(entry.rid, None)
        api_id = state.api_id if state else entry.detok.api_id if entry.detok else None
        if api_id is None:
            return None
        self._bury(entry.rid, _Tombstone(entry.epoch, api_id, is_aborted=False))
        finish = FinishReason(type="abort", message="detokenization failed", status_code=500)
        return api_id, _text_entry(entry, entry.seq, "", entry.token_ids, finish)

    def _bury(self, rid: str, tomb: _Tombstone) -> None:
        self._tombstones[rid] = tomb
        self._tombstones.move_to_end(rid)
        while len(self._tombstones) > self.max_states:
            self._tombstones.popitem(last=False)


def _is_stop_token(finish: FinishReason | None, new_ids: list[int], params: DetokParams) -> bool:
    """SGLang trims a matched stop token id from the text (unless no_stop_trim)."""
    if finish is None or finish.type != "stop" or params.no_stop_trim or not new_ids:
        return False
    return isinstance(finish.matched, int) and new_ids[-1] == finish.matched


def _text_entry(
    entry: TokenEntry, seq: int, text: str, token_ids: list[int], finish: FinishReason | None
) -> TextEntry:
    return TextEntry(
        rid=entry.rid,
        epoch=entry.epoch,
        seq=seq,
        text=text,
        token_ids=token_ids,
        prompt_tokens=entry.prompt_tokens,
        completion_tokens=seq + len(token_ids),
        finish=finish,
        cached_tokens=entry.cached_tokens,
        output_logprobs=_skip_positions(entry.output_logprobs, seq - entry.seq),
        input_logprobs=entry.input_logprobs,
        embedding=entry.embedding,
    )


def _skip_positions(logprobs: Logprobs | None, skip: int) -> Logprobs | None:
    """The logprobs of an entry's ids past the first `skip` (duplicates already seen)."""
    if logprobs is None or skip <= 0:
        return logprobs
    return Logprobs(
        token_logprobs=logprobs.token_logprobs[skip:],
        top_ids=logprobs.top_ids[skip:],
        top_logprobs=logprobs.top_logprobs[skip:],
        requested_logprobs=logprobs.requested_logprobs[skip:],
    )

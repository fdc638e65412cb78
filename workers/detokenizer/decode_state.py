"""Incremental detokenization of one request (no Redis): token ids in, safe text deltas out.

`DecodeState` follows SGLang's DecodeStatus (surr/read offsets): it never emits half a UTF-8
character and never lets a stop string leak. The text it has emitted after `k` ids depends only
on those ids, whatever their chunking; that is what lets another detokenizer rebuild it from
the request's id log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from shared.protocol import DetokParams, FinishReason

REPLACEMENT = "\ufffd"  # what a decoder prints for an incomplete UTF-8 sequence


class Tokenizer(Protocol):
    def decode(
        self, token_ids: list[int], skip_special_tokens: bool = ..., **kwargs: bool
    ) -> str: ...


@dataclass(slots=True)
class DecodeState:
    """Incremental detokenization of one request's output (`epoch`: the newest owner seen;
    a new owner continues the same id log, so it continues this state too).

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
    prompt_tokens: int = 0  # carried into entries the state makes up itself (a resend)
    cached_tokens: int = 0

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

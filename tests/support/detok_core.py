"""Driving a DetokenizerCore by hand: TokenEntries in, the TextEntries of one api out."""

from __future__ import annotations

from typing import Any

from shared.protocol import DetokParams, FinishReason, TextEntry, TokenBatch, TokenEntry
from workers.detokenizer.core import DetokenizerCore, Fetched

API = "api-1"
LENGTH = FinishReason(type="length", length=1)


def encode(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def entry(
    rid: str,
    seq: int,
    ids: list[int],
    *,
    epoch: int = 0,
    finish: FinishReason | None = None,
    params: DetokParams | None = None,
) -> TokenEntry:
    return TokenEntry(rid, epoch, seq, ids, prompt_tokens=5, finish=finish, detok=params)


def add(
    core: DetokenizerCore, *entries: TokenEntry, fetched: Fetched | None = None
) -> dict[str, list[TextEntry]]:
    return core.add_batch(TokenBatch(worker_id="w", entries=list(entries)), fetched)


def stream(
    core: DetokenizerCore,
    ids: list[int],
    *,
    rid: str = "r",
    params: DetokParams | None = None,
    finish: FinishReason | None = LENGTH,
    chunks: list[int] | None = None,
) -> list[TextEntry]:
    """Feed `ids` in chunks (default one token at a time); the last chunk carries `finish`."""
    params = params or DetokParams(api_id=API)
    sizes = chunks or [1] * len(ids)
    out: list[TextEntry] = []
    seq = 0
    for i, size in enumerate(sizes):
        is_last = i == len(sizes) - 1
        e = entry(rid, seq, ids[seq : seq + size], finish=finish if is_last else None)
        if seq == 0:
            e.detok = params
        out.extend(add(core, e).get(params.api_id, []))
        seq += size
    return out


def joined(entries: list[TextEntry]) -> str:
    return "".join(e.text for e in entries)


def fetch_from_log(
    core: DetokenizerCore, batch: TokenBatch, log: list[int], api_id: str
) -> Fetched:
    """Answer `core.needs(batch)` as the loop would, from one request's whole id log."""
    needs = core.needs(batch)
    return Fetched(
        api_ids={rid: api_id for rid in needs.states},
        ids={span: log[span.start : span.end] for span in needs.ranges},
    )


def received(entries: list[TextEntry]) -> tuple[str, list[int], int]:
    """What a receiver that keeps entries by seq (like the api) ends with: (text, ids, number
    of entries that carried a finish). It drops an entry whose seq it has passed; a gap fails."""
    text = ""
    ids: list[int] = []
    for e in entries:
        if e.seq < len(ids):
            continue
        assert e.seq == len(ids), f"{e.rid}: gap, expected seq {len(ids)}, got {e.seq}"
        text += e.text
        ids += e.token_ids
    return text, ids, sum(e.finish is not None for e in entries)

"""TextEntries as the detokenizer core sends them: an entry's text, ids, counts, finish and
the logprobs of the positions that are new (pure)."""

from __future__ import annotations

from shared.protocol import DetokParams, FinishReason, Logprobs, TextEntry, TokenEntry


def is_stop_token(finish: FinishReason | None, new_ids: list[int], params: DetokParams) -> bool:
    """SGLang trims a matched stop token id from the text (unless no_stop_trim)."""
    if finish is None or finish.type != "stop" or params.no_stop_trim or not new_ids:
        return False
    return isinstance(finish.matched, int) and new_ids[-1] == finish.matched


def text_entry(
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
        queue_time=entry.queue_time,
        weight_version=entry.weight_version,
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

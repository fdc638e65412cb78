"""Logprobs shaped for the client (collected per request by logprob_log.LogprobLog):
SGLang's meta_info `(logprob, token_id, text|None)` lists, OpenAI's completion `logprobs`
{tokens, token_logprobs, top_logprobs, text_offset} and chat `logprobs.content`. The engine
computes the values; a non-finite one (a -inf logprob) becomes null (SGLang) or -9999.0
(OpenAI chat, whose schema has no null)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from api.logprob_log import LogprobLog, Value, align_end, finite
from shared import protocol

if TYPE_CHECKING:
    from api.req_state import ReqOutput

TokenTexts = Callable[[Sequence[int]], list[str]]
OPENAI_MIN_LOGPROB = -9999.0


def needed_token_ids(out: ReqOutput) -> list[int]:
    """Every id whose text a formatted output of `out` may show."""
    log, lr = out.logprobs, out.req.logprobs
    if log is None or lr is None:
        return []
    start = out.start if out.req.incremental else 0
    ids = out.ids[start : out.end]
    for row in log.top_ids[start : out.end]:
        ids.extend(row)
    ids.extend(lr.token_ids)
    if lr.start_len >= 0 and out.first:
        ids.extend(out.req.input_ids[lr.start_len :])
        if log.input is not None:
            for row in log.input.top_ids:
                ids.extend(row)
    return ids


# -- SGLang ---------------------------------------------------------------------------------


def _tuples(
    values: Sequence[Value], ids: Sequence[int], texts: TokenTexts | None
) -> list[tuple[Value, int, str | None]]:
    shown: Sequence[str | None] = texts(ids) if texts else [None] * len(ids)
    return list(zip(values, ids, shown, strict=False))


def sglang_logprobs(out: ReqOutput, texts: TokenTexts, incremental: bool) -> dict[str, Any]:
    """SGLang's meta_info logprob fields; `incremental` slices them to what is new."""
    log, lr = out.logprobs, out.req.logprobs
    if log is None or lr is None:
        return {}
    shown = texts if out.req.return_text_in_logprobs else None
    start = out.start if incremental else 0
    ids = out.ids[start : out.end]
    fields: dict[str, Any] = {}
    if incremental and not out.first:
        fields.update(_empty_input_fields(lr))
    else:
        fields.update(_input_fields(out, lr, log, shown))
    fields["output_token_logprobs"] = _tuples(log.values[start : out.end], ids, shown)
    if lr.top_n > 0:
        fields["output_top_logprobs"] = [
            _tuples(values, top_ids, shown)
            for values, top_ids in zip(
                log.top_values[start : out.end], log.top_ids[start : out.end], strict=True
            )
        ]
    if lr.token_ids:
        fields["output_token_ids_logprobs"] = [
            _tuples(values, lr.token_ids, shown) for values in log.requested[start : out.end]
        ]
    return fields


def _empty_input_fields(lr: protocol.LogprobRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {"input_token_logprobs": []}
    if lr.top_n > 0:
        fields["input_top_logprobs"] = []
    if lr.token_ids:
        fields["input_token_ids_logprobs"] = []
    return fields


def _input_fields(
    out: ReqOutput, lr: protocol.LogprobRequest, log: LogprobLog, shown: TokenTexts | None
) -> dict[str, Any]:
    if lr.start_len < 0:
        return _empty_input_fields(lr)
    ids = out.req.input_ids[lr.start_len :]
    n = len(ids)
    data = log.input or protocol.Logprobs()
    values = align_end([finite(v) for v in data.token_logprobs], n, None)
    fields: dict[str, Any] = {"input_token_logprobs": _tuples(values, ids, shown)}
    if lr.top_n > 0:
        rows = zip(align_end(data.top_logprobs, n, []), align_end(data.top_ids, n, []), strict=True)
        fields["input_top_logprobs"] = [
            _tuples([finite(v) for v in vals], tids, shown) if tids else None for vals, tids in rows
        ]
    if lr.token_ids:
        fields["input_token_ids_logprobs"] = [
            _tuples([finite(v) for v in vals], lr.token_ids, shown) if vals else None
            for vals in align_end(data.requested_logprobs, n, [])
        ]
    return fields


# -- OpenAI ---------------------------------------------------------------------------------


def completion_logprobs(
    out: ReqOutput, texts: TokenTexts, start: int, offset: int
) -> tuple[dict[str, Any], int]:
    """OpenAI completion `logprobs` for ids[start:end]; text offsets continue from `offset`.
    Returns the object and the offset after it."""
    log = out.logprobs
    assert log is not None
    ids = out.ids[start : out.end]
    tokens = texts(ids)
    offsets: list[int] = []
    tops: list[dict[str, Value]] = []
    for i, token in enumerate(tokens):
        offsets.append(offset)
        offset += len(token)
        pos = start + i
        top = {token: log.values[pos]}
        top.update(zip(texts(log.top_ids[pos]), log.top_values[pos], strict=False))
        tops.append(top)
    body = {
        "tokens": tokens,
        "token_logprobs": log.values[start : out.end],
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return body, offset


def _chat_entry(token: str, value: Value) -> dict[str, Any]:
    return {
        "token": token,
        "logprob": OPENAI_MIN_LOGPROB if value is None else value,
        "bytes": list(token.encode("utf-8")),
    }


def chat_logprobs(out: ReqOutput, texts: TokenTexts, start: int) -> dict[str, Any]:
    """OpenAI chat `logprobs` ({"content": [...]}) for ids[start:end]."""
    log = out.logprobs
    assert log is not None
    content = []
    for i, token in enumerate(texts(out.ids[start : out.end])):
        pos = start + i
        entry = _chat_entry(token, log.values[pos])
        entry["top_logprobs"] = [
            _chat_entry(t, v)
            for t, v in zip(texts(log.top_ids[pos]), log.top_values[pos], strict=False)
        ]
        content.append(entry)
    return {"content": content}


def echo_logprobs(out: ReqOutput, texts: TokenTexts) -> dict[str, Any]:
    """OpenAI completion `logprobs` of an `echo` answer: the prompt's tokens (the first has
    none: null, as in vLLM), then the output's; what lm-evaluation-harness scores."""
    log = out.logprobs
    assert log is not None
    prompt = out.req.input_ids
    n = len(prompt)
    data = log.input or protocol.Logprobs()
    values = align_end([finite(v) for v in data.token_logprobs], n, None)
    top_ids = align_end(data.top_ids, n, [])
    top_values = align_end(data.top_logprobs, n, [])
    tokens = texts(prompt)
    tops: list[dict[str, Value] | None] = []
    offsets: list[int] = []
    offset = 0
    for i, token in enumerate(tokens):
        offsets.append(offset)
        offset += len(token)
        if i == 0:
            tops.append(None)
            continue
        top: dict[str, Value] = {token: values[i]}
        top.update(zip(texts(top_ids[i]), [finite(v) for v in top_values[i]], strict=False))
        tops.append(top)
    rest, _ = completion_logprobs(out, texts, 0, offset)
    return {
        "tokens": tokens + rest["tokens"],
        "token_logprobs": values + rest["token_logprobs"],
        "top_logprobs": tops + rest["top_logprobs"],
        "text_offset": offsets + rest["text_offset"],
    }


def echo_text(out: ReqOutput, texts: TokenTexts) -> str:
    """The prompt an `echo` answer starts with: as sent, or its ids' texts joined."""
    prompt = out.req.prompt
    return prompt if isinstance(prompt, str) else "".join(texts(out.req.input_ids))

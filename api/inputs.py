"""HTTP bodies -> GenerateReqs: SGLang's batch normalization (single, batch, parallel sampling
`n > 1` fanned out into a batch with fresh rids, prompt-major), OpenAI prompt shapes, logprob
requests, embedding inputs, and the limits that need no model."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, TypeVar

import msgspec

from api.errors import ApiError, BadRequest
from api.req_state import GenerateReq, ReqOutput, TextPair
from api.sampling import make_sampling
from api.schemas.native import GenerateRequest, SamplingParamsIn
from api.schemas.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    FunctionCall,
    OpenAISamplingRequest,
    ToolCallOut,
)
from api.tools import ToolCall, call_id
from shared import protocol
from shared.config import ApiSettings

T = TypeVar("T")

NATIVE_MAX_NEW_TOKENS = 128  # SGLang's default
_SEED_MOD = 2**63


def new_rid() -> str:
    return uuid.uuid4().hex


def check_n(n: int | None, api: ApiSettings) -> int:
    if n is None:
        return 1
    if n < 1:
        raise BadRequest(f"n must be at least 1, got {n}.", param="n")
    if n > api.max_n:
        raise BadRequest(f"n must be ≤ {api.max_n}, got {n}.", param="n")
    return n


def per_item(value: T | list[T] | None, num: int, name: str) -> list[T | None]:
    """A per-request argument for a batch of `num`: one value for all, or one each."""
    if not isinstance(value, list):
        return [value] * num
    if len(value) != num:
        raise BadRequest(f"The length of {name} should be equal to the batch size.", param=name)
    return list(value)


def fan_out(reqs: list[GenerateReq], n: int) -> list[GenerateReq]:
    """Parallel sampling: n copies of each request (prompt-major), distinct seeds."""
    if n == 1:
        return reqs
    out: list[GenerateReq] = []
    for req in reqs:
        for j in range(n):
            sampling = req.sampling
            if sampling.seed is not None and j:
                sampling = msgspec.structs.replace(sampling, seed=(sampling.seed + j) % _SEED_MOD)
            out.append(dataclasses.replace(req, sampling=sampling))
    return out


def assign_rids(reqs: list[GenerateReq], rid: str | list[str] | None, per_prompt: int) -> None:
    """SGLang's rids: given ones, `{rid}_{i}` for a batch under one rid, else fresh uuids."""
    if rid is None:
        for req in reqs:
            req.rid = new_rid()
    elif isinstance(rid, str):
        if len(reqs) == 1:
            reqs[0].rid = rid
        else:
            for i, req in enumerate(reqs):
                req.rid = f"{rid}_{i}"
    else:
        if len(rid) * per_prompt != len(reqs):
            raise BadRequest("The length of rid should be equal to the batch size.", param="rid")
        for i, req in enumerate(reqs):
            base = rid[i // per_prompt]
            req.rid = base if per_prompt == 1 else f"{base}_{i % per_prompt}"


# -- native /generate -----------------------------------------------------------------------


def native_prompts(body: GenerateRequest) -> tuple[list[str | list[int]], bool]:
    if body.text is not None and body.input_ids is not None:
        raise BadRequest("Only one of text or input_ids should be provided.")
    if body.text is not None:
        is_single = isinstance(body.text, str)
        prompts: list[Any] = [body.text] if isinstance(body.text, str) else list(body.text)
    elif body.input_ids is not None:
        ids: list[Any] = body.input_ids
        is_single = not ids or not isinstance(ids[0], list)
        prompts = [ids] if is_single else ids
    else:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    if not prompts:
        raise BadRequest("The batch cannot be empty.")
    return prompts, is_single


def native_reqs(body: GenerateRequest, api: ApiSettings) -> tuple[list[GenerateReq], bool]:
    """One GenerateReq per prompt and sample; also say if the answer is a single object."""
    prompts, is_single = native_prompts(body)
    num = len(prompts)
    params = body.sampling_params
    plist = [p or SamplingParamsIn() for p in per_item(params, num, "sampling_params")]
    ns = {check_n(p.n, api) for p in plist}
    if len(ns) > 1:
        raise BadRequest(
            "The parallel_sample_num should be the same for all samples in sample params.",
            param="n",
        )
    n = ns.pop()
    logprobs = _native_logprobs(body, num, api)
    incremental = body.stream and api.incremental_streaming_output
    reqs = [
        _native_req(prompt, p, lp, body, incremental)
        for prompt, p, lp in zip(prompts, plist, logprobs, strict=True)
    ]
    reqs = fan_out(reqs, n)
    assign_rids(reqs, body.rid, n)
    return reqs, is_single and n == 1


def _native_req(
    prompt: str | list[int],
    p: SamplingParamsIn,
    logprobs: protocol.LogprobRequest | None,
    body: GenerateRequest,
    incremental: bool,
) -> GenerateReq:
    if p.max_new_tokens is not None and p.max_new_tokens < 0:
        raise BadRequest(
            f"max_new_tokens must be at least 0, got {p.max_new_tokens}.", param="max_new_tokens"
        )
    return GenerateReq(
        rid="",
        prompt=prompt,
        sampling=make_sampling(p),
        max_new_tokens=NATIVE_MAX_NEW_TOKENS if p.max_new_tokens is None else p.max_new_tokens,
        stream=body.stream,
        incremental=incremental,
        skip_special_tokens=_default(p.skip_special_tokens, True),
        spaces_between_special_tokens=_default(p.spaces_between_special_tokens, True),
        no_stop_trim=_default(p.no_stop_trim, False),
        logprobs=logprobs,
        return_text_in_logprobs=body.return_text_in_logprobs,
        priority=body.priority or 0,
        timeout=body.timeout,
    )


def _native_logprobs(
    body: GenerateRequest, num: int, api: ApiSettings
) -> list[protocol.LogprobRequest | None]:
    flags = per_item(body.return_logprob, num, "return_logprob")
    starts = per_item(body.logprob_start_len, num, "logprob_start_len")
    tops = per_item(body.top_logprobs_num, num, "top_logprobs_num")
    ids: Any = body.token_ids_logprob
    is_batch = bool(ids) and isinstance(ids[0], list)
    id_lists = per_item(ids if is_batch else [ids] * num, num, "token_ids_logprob")
    out: list[protocol.LogprobRequest | None] = []
    for flag, start, top, token_ids in zip(flags, starts, tops, id_lists, strict=True):
        if not flag:
            out.append(None)
            continue
        start = -1 if start is None else start
        if start < -1:
            raise BadRequest(
                f"logprob_start_len must be -1 or at least 0, got {start}.",
                param="logprob_start_len",
            )
        top_n = check_top_logprobs(top, api, "top_logprobs_num")
        out.append(protocol.LogprobRequest(start_len=start, top_n=top_n, token_ids=token_ids or []))
    return out


def check_top_logprobs(top: int | None, api: ApiSettings, name: str) -> int:
    cap = api.max_top_logprobs
    if top is not None and not 0 <= top <= cap:
        raise BadRequest(f"{name} must be in [0, {cap}], got {top}.", param=name)
    return top or 0


def _default(value: bool | None, default: bool) -> bool:
    return default if value is None else value


# -- OpenAI ---------------------------------------------------------------------------------


def _check_max_tokens(value: int | None, name: str) -> None:
    if value is not None and value < 1:
        raise BadRequest(f"{name} must be ≥ 1, got {value}.", param=name)


def _openai_req(
    body: OpenAISamplingRequest,
    prompt: str | list[int],
    max_new_tokens: int | None,
    logprobs: protocol.LogprobRequest | None,
) -> GenerateReq:
    stream = bool(body.stream)
    return GenerateReq(
        rid="",
        prompt=prompt,
        sampling=make_sampling(body, openai=True),
        max_new_tokens=max_new_tokens,
        stream=stream,
        incremental=stream,
        skip_special_tokens=_default(body.skip_special_tokens, True),
        spaces_between_special_tokens=_default(body.spaces_between_special_tokens, True),
        no_stop_trim=_default(body.no_stop_trim, False),
        logprobs=logprobs,
        openai=True,
        priority=body.priority or 0,
        timeout=body.timeout,
    )


def _openai_rids(reqs: list[GenerateReq], base: str) -> None:
    for i, req in enumerate(reqs):
        req.rid = base if len(reqs) == 1 else f"{base}-{i}"


def completion_reqs(body: CompletionRequest, api: ApiSettings) -> tuple[str, list[GenerateReq]]:
    """(base rid, one GenerateReq per prompt and sample); choice i*n+j answers prompt i."""
    prompt: str | list[Any] = body.prompt
    prompts: list[Any]
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise BadRequest("prompt must not be empty.", param="prompt")
    n = check_n(body.n, api)
    if not (body.echo and body.max_tokens == 0):  # echo scores a prompt with max_tokens 0
        _check_max_tokens(body.max_tokens, "max_tokens")
    logprobs = None
    if body.logprobs is not None:
        top_n = check_top_logprobs(body.logprobs, api, "logprobs")
        # echo: the prompt's logprobs too (all but its first token's)
        logprobs = protocol.LogprobRequest(top_n=top_n, start_len=0 if body.echo else -1)
    base = body.rid or new_rid()
    reqs = fan_out([_openai_req(body, p, body.max_tokens, logprobs) for p in prompts], n)
    _openai_rids(reqs, base)
    return base, reqs


def chat_reqs(
    body: ChatCompletionRequest, input_ids: list[int], api: ApiSettings
) -> tuple[str, list[GenerateReq]]:
    n = check_n(body.n, api)
    _check_max_tokens(body.max_tokens, "max_tokens")
    _check_max_tokens(body.max_completion_tokens, "max_completion_tokens")
    logprobs = None
    if body.logprobs:
        top_n = check_top_logprobs(body.top_logprobs, api, "top_logprobs")
        logprobs = protocol.LogprobRequest(top_n=top_n)
    elif body.top_logprobs:
        raise BadRequest(
            "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs"
        )
    base = body.rid or new_rid()
    reqs = fan_out([_openai_req(body, input_ids, body.max_new_tokens, logprobs)], n)
    _openai_rids(reqs, base)
    return base, reqs


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    if not body.messages:
        raise BadRequest("messages must not be empty.", param="messages")
    return [m.template_dict() for m in body.messages]


def chat_template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(body.chat_template_kwargs or {})
    kwargs["add_generation_prompt"] = body.add_generation_prompt
    kwargs["continue_final_message"] = body.continue_final_message
    return kwargs


# -- embeddings -----------------------------------------------------------------------------


def embed_prompts(value: Any) -> tuple[list[str | list[int] | TextPair], bool]:
    """An EmbedInput as prompts (pairs become tuples), and whether it was a single one."""
    if isinstance(value, str):
        return [value], True
    if value and isinstance(value[0], int):
        return [list(value)], True
    prompts: list[Any] = [_pair_or_prompt(v) for v in value]
    return prompts, False


def _pair_or_prompt(value: Any) -> Any:
    if isinstance(value, list) and value and isinstance(value[0], str):
        return (value[0], value[1])
    return value


def embed_reqs(
    prompts: list[str | list[int] | TextPair],
    rid: str | list[str] | None,
    *,
    openai: bool,
    priority: int = 0,
) -> list[GenerateReq]:
    if not prompts:
        raise BadRequest("input must not be empty." if openai else "The batch cannot be empty.",
                         param="input" if openai else None)  # fmt: skip
    reqs = [
        GenerateReq(
            rid="",
            prompt=p,
            sampling=protocol.SamplingParams(max_new_tokens=0),
            max_new_tokens=0,
            embed=True,
            openai=openai,
            priority=priority,
        )
        for p in prompts
    ]
    assign_rids(reqs, rid, 1)
    return reqs


# -- outputs --------------------------------------------------------------------------------


def raise_for_error(outputs: list[ReqOutput]) -> None:
    """Non-streaming answers turn server-side aborts (timeouts, dead letters) into errors."""
    for out in outputs:
        status = out.error_status
        if status is not None:
            reason = out.finish_reason
            message = reason.message if reason and reason.message else "Request failed."
            raise ApiError(message, status_code=status)


def openai_finish_reason(out: ReqOutput) -> str | None:
    return out.finish_reason.type if out.finish_reason else None


def tool_finish_reason(out: ReqOutput, calls: list[ToolCall]) -> str | None:
    """OpenAI's finish_reason; `tool_calls` when the model stopped after calling tools."""
    reason = openai_finish_reason(out)
    return "tool_calls" if calls and reason == "stop" else reason


def tool_calls_out(rid: str, calls: list[ToolCall]) -> list[ToolCallOut] | None:
    if not calls:
        return None
    return [
        ToolCallOut(id=call_id(rid, i), function=FunctionCall(name=c.name, arguments=c.arguments))
        for i, c in enumerate(calls)
    ]


def matched_stop(out: ReqOutput) -> int | str | None:
    reason = out.finish_reason
    return reason.matched if reason is not None and reason.type == "stop" else None

"""HTTP bodies -> GenerateReq: SGLang batch normalization, OpenAI prompt shapes, sampling
defaults (temperature 0 = greedy), and the limits that need no model (stop lists)."""

from __future__ import annotations

import uuid
from typing import Any

from api.errors import ApiError, BadRequest
from api.req_state import GenerateReq, ReqOutput
from api.schemas.native import GenerateRequest, SamplingParamsIn
from api.schemas.openai import ChatCompletionRequest, CompletionRequest, OpenAISamplingRequest
from shared import protocol

NATIVE_MAX_NEW_TOKENS = 128  # SGLang's default
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
GREEDY_EPS = 1e-5  # below this a temperature means greedy (SGLang's _SAMPLING_EPS)


def new_rid() -> str:
    return uuid.uuid4().hex


def stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"At most {MAX_STOP_STRINGS} stop strings are allowed.", param="stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise BadRequest(
            f"Stop strings must be 1 to {MAX_STOP_CHARS} characters long.", param="stop"
        )
    return stops


def make_sampling(
    *,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    stop: str | list[str] | None,
    stop_token_ids: list[int] | None,
    ignore_eos: bool | None,
    seed: int | None,
) -> protocol.SamplingParams:
    """Engine sampling parameters with SGLang's defaults; max_new_tokens is set later."""
    token_ids = list(stop_token_ids or [])
    if len(token_ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(
            f"At most {MAX_STOP_TOKEN_IDS} stop token ids are allowed.", param="stop_token_ids"
        )
    temp = 1.0 if temperature is None else temperature
    k = -1 if top_k is None else top_k
    if temp < GREEDY_EPS:  # greedy: say it both ways so no sampler divides by ~0
        temp, k = 0.0, 1
    return protocol.SamplingParams(
        temperature=temp,
        top_p=1.0 if top_p is None else top_p,
        top_k=k,
        stop_token_ids=token_ids,
        ignore_eos=bool(ignore_eos),
        seed=seed,
        stop=stop_list(stop),
    )


# -- native /generate -----------------------------------------------------------------------


def native_reqs(body: GenerateRequest) -> tuple[list[GenerateReq], bool]:
    """Split a /generate body into one GenerateReq per prompt; also say if it was single."""
    prompts: list[str | list[int]]
    if body.text is not None and body.input_ids is not None:
        raise BadRequest("Only one of text or input_ids should be provided.")
    if body.text is not None:
        is_single = isinstance(body.text, str)
        prompts = [body.text] if isinstance(body.text, str) else list(body.text)
    elif body.input_ids is not None:
        ids: list[Any] = body.input_ids
        is_single = not ids or not isinstance(ids[0], list)
        prompts = [ids] if is_single else ids
    else:
        raise BadRequest("Either text or input_ids should be provided.")
    if not prompts:
        raise BadRequest("The batch cannot be empty.")
    num = len(prompts)
    params = body.sampling_params
    if isinstance(params, list):
        if len(params) != num:
            raise BadRequest(
                "The length of sampling_params should be equal to the batch size.",
                param="sampling_params",
            )
        plist = params
    else:
        plist = [params or SamplingParamsIn()] * num
    rids = _native_rids(body.rid, num, is_single)
    reqs = [
        _native_req(rid, prompt, p, body.stream)
        for rid, prompt, p in zip(rids, prompts, plist, strict=True)
    ]
    return reqs, is_single


def _native_rids(rid: str | list[str] | None, num: int, is_single: bool) -> list[str]:
    if rid is None:
        return [new_rid() for _ in range(num)]
    if isinstance(rid, str):
        return [rid] if is_single else [f"{rid}_{i}" for i in range(num)]
    if len(rid) != num:
        raise BadRequest("The length of rid should be equal to the batch size.", param="rid")
    return list(rid)


def _native_req(
    rid: str, prompt: str | list[int], p: SamplingParamsIn, stream: bool
) -> GenerateReq:
    sampling = make_sampling(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        stop=p.stop,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
        seed=p.seed if p.seed is not None else p.sampling_seed,
    )
    return GenerateReq(
        rid=rid,
        prompt=prompt,
        sampling=sampling,
        max_new_tokens=NATIVE_MAX_NEW_TOKENS if p.max_new_tokens is None else p.max_new_tokens,
        stream=stream,
        skip_special_tokens=_default(p.skip_special_tokens, True),
        spaces_between_special_tokens=_default(p.spaces_between_special_tokens, True),
        no_stop_trim=_default(p.no_stop_trim, False),
    )


def _default(value: bool | None, default: bool) -> bool:
    return default if value is None else value


# -- OpenAI ---------------------------------------------------------------------------------


def _openai_req(
    body: OpenAISamplingRequest, rid: str, prompt: str | list[int], max_new_tokens: int | None
) -> GenerateReq:
    sampling = make_sampling(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        seed=body.seed,
    )
    return GenerateReq(
        rid=rid,
        prompt=prompt,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        stream=bool(body.stream),
        skip_special_tokens=_default(body.skip_special_tokens, True),
        spaces_between_special_tokens=_default(body.spaces_between_special_tokens, True),
        no_stop_trim=_default(body.no_stop_trim, False),
    )


def completion_reqs(body: CompletionRequest) -> tuple[str, list[GenerateReq]]:
    """(base rid, one GenerateReq per prompt); choice i answers prompt i."""
    prompt: str | list[Any] = body.prompt
    prompts: list[Any]
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise BadRequest("prompt must not be empty.", param="prompt")
    base = body.rid or new_rid()
    rids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
    reqs = [
        _openai_req(body, rid, p, body.max_tokens) for rid, p in zip(rids, prompts, strict=True)
    ]
    return base, reqs


def chat_req(body: ChatCompletionRequest, input_ids: list[int]) -> GenerateReq:
    return _openai_req(body, body.rid or new_rid(), input_ids, body.max_new_tokens)


def chat_template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(body.chat_template_kwargs or {})
    kwargs["add_generation_prompt"] = body.add_generation_prompt
    kwargs["continue_final_message"] = body.continue_final_message
    return kwargs


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


def matched_stop(out: ReqOutput) -> int | str | None:
    reason = out.finish_reason
    return reason.matched if reason is not None and reason.type == "stop" else None

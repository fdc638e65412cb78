"""Checks that need the model (vocabulary, context length) and the GenerateJob they admit.
Pure functions: nothing here touches Redis or the event loop."""

from __future__ import annotations

import time
from collections.abc import Iterable

import msgspec

from api.errors import BadRequest
from api.model import ModelInfo
from api.req_state import GenerateReq
from shared import deadlines, protocol

# Cheap length check before tokenizing: no real token covers this many characters on average.
MAX_CHARS_PER_TOKEN = 32
MAX_TOKEN_IDS_LOGPROB = 128


def check_chars(num_chars: int, model: ModelInfo) -> None:
    if num_chars > model.context_length * MAX_CHARS_PER_TOKEN:
        raise BadRequest(
            f"The input ({num_chars} characters) is longer than the model's context "
            f"length ({model.context_length} tokens) allows.",
            code="context_length_exceeded",
        )


def check_ids(ids: Iterable[int], model: ModelInfo, param: str) -> None:
    vocab = model.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(f"Token id {bad} is out of vocabulary (vocab size {vocab}).", param=param)


def _context_error(req: GenerateReq, num_input: int, max_new: int | None, ctx: int) -> BadRequest:
    """SGLang's messages on native routes, OpenAI's (and vLLM's) on /v1."""
    if req.openai:
        if max_new is None:
            msg = (
                f"This model's maximum context length is {ctx} tokens. However, your request "
                f"has {num_input} input tokens. Please reduce the length of the input."
            )
        else:
            msg = (
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{num_input + max_new} tokens ({num_input} in the messages, {max_new} in the "
                "completion). Please reduce the length of the messages or completion."
            )
    elif max_new is None:
        msg = (
            f"The input ({num_input} tokens) is longer than the model's context length "
            f"({ctx} tokens)."
        )
    else:
        msg = (
            f"Requested token count exceeds the model's maximum context length of {ctx} "
            f"tokens. You requested a total of {num_input + max_new} tokens: {num_input} "
            f"tokens from the input messages and {max_new} tokens for the completion. "
            "Please reduce the number of tokens in the input messages or the completion "
            "to fit within the limit."
        )
    return BadRequest(msg, code="context_length_exceeded")


def max_new_tokens(req: GenerateReq, num_input: int, ctx: int) -> int:
    """The request's token budget; an error when it does not fit the context."""
    if num_input > ctx or (num_input == ctx and not req.embed):
        raise _context_error(req, num_input, None, ctx)
    if req.embed:
        return 0
    max_new = ctx - num_input if req.max_new_tokens is None else req.max_new_tokens
    if num_input + max_new > ctx:
        raise _context_error(req, num_input, max_new, ctx)
    return max_new


def _check_min_new(req: GenerateReq, budget: int) -> None:
    min_new = req.sampling.min_new_tokens
    if min_new > budget:
        name = "min_tokens" if req.openai else "min_new_tokens"
        raise BadRequest(
            f"{name} must be in [0, max_new_tokens({budget})], got {min_new}.", param=name
        )


def _check_logprobs(req: GenerateReq, num_input: int, model: ModelInfo) -> None:
    lr = req.logprobs
    if lr is None:
        return
    if lr.start_len >= num_input:
        raise BadRequest(
            f"logprob_start_len ({lr.start_len}) must be less than the input length ({num_input}).",
            param="logprob_start_len",
        )
    if len(lr.token_ids) > MAX_TOKEN_IDS_LOGPROB:
        raise BadRequest(
            f"token_ids_logprob may list at most {MAX_TOKEN_IDS_LOGPROB} ids, got "
            f"{len(lr.token_ids)}.",
            param="token_ids_logprob",
        )
    check_ids(lr.token_ids, model, "token_ids_logprob")


def build_job(
    req: GenerateReq, ids: list[int], model: ModelInfo, api_id: str
) -> protocol.GenerateJob:
    """The job for a tokenized request, or BadRequest: nothing invalid reaches a worker."""
    if not ids:
        if req.openai:
            raise BadRequest("prompt must not be empty.", param="prompt")
        raise BadRequest("The input cannot be empty.")
    check_ids(ids, model, "input_ids")
    check_ids(req.sampling.stop_token_ids, model, "stop_token_ids")
    check_ids(req.sampling.logit_bias, model, "logit_bias")
    budget = max_new_tokens(req, len(ids), model.context_length)
    _check_min_new(req, budget)
    _check_logprobs(req, len(ids), model)
    sampling = msgspec.structs.replace(req.sampling, max_new_tokens=budget)
    detok = protocol.DetokParams(
        api_id=api_id,
        stop=list(sampling.stop),
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        no_stop_trim=req.no_stop_trim,
    )
    created_at = time.time()
    return protocol.GenerateJob(
        rid=req.rid,
        input_ids=ids,
        sampling=sampling,
        detok=detok,
        created_at=created_at,
        logprobs=req.logprobs,
        embed=req.embed,
        priority=req.priority,
        deadline=deadlines.deadline_of(created_at, req.timeout),
    )

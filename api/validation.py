"""Checks that need the model (vocabulary, context length) and the GenerateJob they admit.
Pure functions: nothing here touches Redis or the event loop."""

from __future__ import annotations

import time

import msgspec

from api.errors import BadRequest
from api.model import ModelInfo
from api.req_state import GenerateReq
from shared import protocol

# Cheap length check before tokenizing: no real token covers this many characters on average.
MAX_CHARS_PER_TOKEN = 32


def check_chars(num_chars: int, model: ModelInfo) -> None:
    if num_chars > model.context_length * MAX_CHARS_PER_TOKEN:
        raise BadRequest(
            f"The input ({num_chars} characters) is longer than the model's context "
            f"length ({model.context_length} tokens) allows.",
            code="context_length_exceeded",
        )


def check_ids(ids: list[int], model: ModelInfo, param: str) -> None:
    vocab = model.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(f"Token id {bad} is out of vocabulary (vocab size {vocab}).", param=param)


def max_new_tokens(req: GenerateReq, num_input: int, ctx: int) -> int:
    """The request's token budget; SGLang's messages when it does not fit the context."""
    if num_input >= ctx:
        raise BadRequest(
            f"The input ({num_input} tokens) is longer than the model's context length "
            f"({ctx} tokens).",
            code="context_length_exceeded",
        )
    max_new = ctx - num_input if req.max_new_tokens is None else req.max_new_tokens
    if num_input + max_new > ctx:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {ctx} "
            f"tokens. You requested a total of {num_input + max_new} tokens: {num_input} "
            f"tokens from the input messages and {max_new} tokens for the completion. "
            "Please reduce the number of tokens in the input messages or the completion "
            "to fit within the limit.",
            code="context_length_exceeded",
        )
    return max_new


def build_job(
    req: GenerateReq, ids: list[int], model: ModelInfo, api_id: str
) -> protocol.GenerateJob:
    """The job for a tokenized request, or BadRequest: nothing invalid reaches a worker."""
    if not ids:
        raise BadRequest("The input cannot be empty.")
    check_ids(ids, model, "input_ids")
    check_ids(req.sampling.stop_token_ids, model, "stop_token_ids")
    budget = max_new_tokens(req, len(ids), model.context_length)
    sampling = msgspec.structs.replace(req.sampling, max_new_tokens=budget)
    detok = protocol.DetokParams(
        api_id=api_id,
        stop=list(sampling.stop),
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        no_stop_trim=req.no_stop_trim,
    )
    return protocol.GenerateJob(
        rid=req.rid, input_ids=ids, sampling=sampling, detok=detok, created_at=time.time()
    )

"""OpenAI-compatible POST /v1/completions: one prompt or a batch, `n` samples each (choice
i*n+j answers prompt i), logprobs, SSE with include_usage / continuous_usage_stats."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request, Response

from api import sse
from api.deps import TokenizerManagerDep
from api.inputs import completion_reqs, matched_stop, openai_finish_reason, raise_for_error
from api.logprobs import completion_logprobs
from api.req_state import ReqOutput
from api.routes.common import OpenAIHead, collect, make_router, stream_outputs, usage_of
from api.schemas.openai import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
)
from api.tokenizer_manager import TokenizerManager

router = make_router("openai")


@router.post("/v1/completions", response_model=None, responses={200: {"model": CompletionResponse}})
async def create_completion(
    body: CompletionRequest, request: Request, tm: TokenizerManagerDep
) -> Response:
    """Complete one prompt or a batch of prompts."""
    base, reqs = completion_reqs(body, tm.settings.api)
    n = body.n or 1  # checked by completion_reqs
    outputs = await tm.generate(reqs, request)
    head = OpenAIHead(id=f"cmpl-{base}", model=tm.model.served_model_name)
    if body.stream:
        return sse.response(_stream(outputs, head, body, tm, n))
    results = await collect(outputs)
    raise_for_error(results)
    response = CompletionResponse(
        id=head.id,
        created=head.created,
        model=head.model,
        choices=[
            CompletionChoice(
                index=out.index,
                text=out.text,
                logprobs=_logprobs(out, tm, 0, 0)[0],
                finish_reason=openai_finish_reason(out),
                matched_stop=matched_stop(out),
            )
            for out in results
        ],
        usage=usage_of(results, n),
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _logprobs(
    out: ReqOutput, tm: TokenizerManager, start: int, offset: int
) -> tuple[CompletionLogprobs | None, int]:
    if out.logprobs is None:
        return None, offset
    body, offset = completion_logprobs(out, tm.tok.token_texts, start, offset)
    return CompletionLogprobs(**body), offset


async def _stream(
    outputs: AsyncGenerator[ReqOutput, None],
    head: OpenAIHead,
    body: CompletionRequest,
    tm: TokenizerManager,
    n: int,
) -> AsyncIterator[bytes]:
    latest: dict[int, ReqOutput] = {}  # per choice, for usage
    offsets: dict[int, int] = {}  # per choice: text offset of its next token
    async for out in stream_outputs(outputs):
        latest[out.index] = out
        if not out.delta and not out.finished and (out.logprobs is None or out.start == out.end):
            continue
        logprobs, offsets[out.index] = _logprobs(out, tm, out.start, offsets.get(out.index, 0))
        chunk = CompletionStreamResponse(
            id=head.id,
            created=head.created,
            model=head.model,
            choices=[
                CompletionStreamChoice(
                    index=out.index,
                    text=out.delta,
                    logprobs=logprobs,
                    finish_reason=openai_finish_reason(out),
                )
            ],
        )
        if body.continuous_usage:
            chunk.usage = usage_of(list(latest.values()), n)
        yield sse.event(chunk.model_dump_json())
    if body.include_usage:
        final = CompletionStreamResponse(
            id=head.id,
            created=head.created,
            model=head.model,
            choices=[],
            usage=usage_of(list(latest.values()), n),
        )
        yield sse.event(final.model_dump_json())
    yield sse.DONE

"""OpenAI-compatible POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import APIRouter, Request, Response

from api import sse
from api.deps import TokenizerManagerDep
from api.inputs import completion_reqs, matched_stop, openai_finish_reason, raise_for_error
from api.req_state import ReqOutput
from api.routes.common import OpenAIHead, collect, stream_outputs, usage_of
from api.schemas.openai import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
)

router = APIRouter(tags=["openai"])


@router.post("/v1/completions", response_model=None, responses={200: {"model": CompletionResponse}})
async def create_completion(
    body: CompletionRequest, request: Request, tm: TokenizerManagerDep
) -> Response:
    """Complete one prompt or a batch of prompts (choice i answers prompt i)."""
    base, reqs = completion_reqs(body)
    outputs = await tm.generate(reqs, request)
    head = OpenAIHead(id=f"cmpl-{base}", model=tm.model.served_model_name)
    if body.stream:
        return sse.response(_stream(outputs, head, body))
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
                finish_reason=openai_finish_reason(out),
                matched_stop=matched_stop(out),
            )
            for out in results
        ],
        usage=usage_of(results),
    )
    return Response(response.model_dump_json(), media_type="application/json")


async def _stream(
    outputs: AsyncGenerator[ReqOutput, None], head: OpenAIHead, body: CompletionRequest
) -> AsyncIterator[bytes]:
    latest: dict[int, ReqOutput] = {}  # per choice, for usage
    async for out in stream_outputs(outputs):
        latest[out.index] = out
        if not out.delta and not out.finished:
            continue
        chunk = CompletionStreamResponse(
            id=head.id,
            created=head.created,
            model=head.model,
            choices=[
                CompletionStreamChoice(
                    index=out.index,
                    text=out.delta,
                    finish_reason=openai_finish_reason(out),
                )
            ],
        )
        if body.continuous_usage:
            chunk.usage = usage_of(list(latest.values()))
        yield sse.event(chunk.model_dump_json())
    if body.include_usage:
        final = CompletionStreamResponse(
            id=head.id,
            created=head.created,
            model=head.model,
            choices=[],
            usage=usage_of(list(latest.values())),
        )
        yield sse.event(final.model_dump_json())
    yield sse.DONE

"""The generate -> stream or collect -> answer flow that /v1/chat/completions and
/v1/completions share: each route says how one output becomes a choice (of the whole answer,
or of a stream chunk) and `respond` does the rest: SSE chunks with continuous usage, the final
usage chunk, [DONE]; or one JSON body once every output finished."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from typing import Any

from fastapi import Response
from pydantic import BaseModel

from api import sse
from api.inputs import raise_for_error
from api.req_state import ReqOutput
from api.routes.common import OpenAIHead, collect, stream_outputs, usage_of
from api.schemas.openai import ChatCompletionChunk, CompletionStreamResponse, OpenAISamplingRequest

Chunk = type[ChatCompletionChunk] | type[CompletionStreamResponse]


async def respond(
    outputs: AsyncGenerator[ReqOutput, None],
    body: OpenAISamplingRequest,
    n: int,
    answer: Callable[[list[ReqOutput]], BaseModel],
    stream_choice: Callable[[ReqOutput], Any],
    chunk: Chunk,
    head: OpenAIHead,
    opening: Iterable[Any] = (),
) -> Response:
    """`answer` builds the whole body from the final outputs; when streaming, `stream_choice`
    builds a chunk's choice from an output with news, after the choices `opening` (chat's
    role deltas). `n`: samples per prompt, for usage."""
    if body.stream:
        return sse.response(_stream(outputs, body, n, stream_choice, chunk, head, opening))
    results = await collect(outputs)
    raise_for_error(results)
    return Response(answer(results).model_dump_json(), media_type="application/json")


async def _stream(
    outputs: AsyncGenerator[ReqOutput, None],
    body: OpenAISamplingRequest,
    n: int,
    stream_choice: Callable[[ReqOutput], Any],
    chunk: Chunk,
    head: OpenAIHead,
    opening: Iterable[Any],
) -> AsyncIterator[bytes]:
    def event(choices: list[Any], usage: Any = None) -> bytes:
        message = chunk(id=head.id, created=head.created, model=head.model, choices=choices)
        if usage is not None:
            message.usage = usage
        return sse.event(message.model_dump_json())

    for choice in opening:
        yield event([choice])
    latest: dict[int, ReqOutput] = {}  # per choice, for usage
    async for out in stream_outputs(outputs):
        latest[out.index] = out
        if not out.delta and not out.finished and (out.logprobs is None or out.start == out.end):
            continue  # nothing new to show
        usage = usage_of(list(latest.values()), n) if body.continuous_usage else None
        yield event([stream_choice(out)], usage)
    if body.include_usage and latest:
        yield event([], usage_of(list(latest.values()), n))
    yield sse.DONE

"""OpenAI-compatible POST /v1/chat/completions (messages through the model's chat template)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import APIRouter, Request, Response

from api import sse
from api.deps import TokenizerManagerDep
from api.inputs import (
    chat_req,
    chat_template_kwargs,
    matched_stop,
    openai_finish_reason,
    raise_for_error,
)
from api.req_state import ReqOutput
from api.routes.common import OpenAIHead, collect, stream_outputs, usage_of
from api.schemas.openai import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)

router = APIRouter(tags=["openai"])


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={200: {"model": ChatCompletionResponse}},
)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, tm: TokenizerManagerDep
) -> Response:
    """Answer a conversation; the prompt is the chat template with a generation prompt."""
    messages = [m.template_dict() for m in body.messages]
    input_ids = await tm.render_chat(messages, **chat_template_kwargs(body))
    req = chat_req(body, input_ids)
    outputs = await tm.generate([req], request)
    head = OpenAIHead(id=f"chatcmpl-{req.rid}", model=tm.model.served_model_name)
    if body.stream:
        return sse.response(_stream(outputs, head, body))
    results = await collect(outputs)
    raise_for_error(results)
    out = results[0]
    response = ChatCompletionResponse(
        id=head.id,
        created=head.created,
        model=head.model,
        choices=[
            ChatChoice(
                index=0,
                message=AssistantMessage(content=out.text),
                finish_reason=openai_finish_reason(out),
                matched_stop=matched_stop(out),
            )
        ],
        usage=usage_of(results),
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _chunk(
    head: OpenAIHead, delta: DeltaMessage, finish_reason: str | None, usage: UsageInfo | None
) -> bytes:
    chunk = ChatCompletionChunk(
        id=head.id,
        created=head.created,
        model=head.model,
        choices=[ChatStreamChoice(index=0, delta=delta, finish_reason=finish_reason)],
    )
    if usage is not None:
        chunk.usage = usage
    return sse.event(chunk.model_dump_json())


async def _stream(
    outputs: AsyncGenerator[ReqOutput, None], head: OpenAIHead, body: ChatCompletionRequest
) -> AsyncIterator[bytes]:
    yield _chunk(head, DeltaMessage(role="assistant", content=""), None, None)
    last: ReqOutput | None = None
    async for out in stream_outputs(outputs):
        last = out
        if not out.delta and not out.finished:
            continue
        delta = DeltaMessage(content=out.delta) if out.delta else DeltaMessage()
        usage = usage_of([out]) if body.continuous_usage else None
        yield _chunk(head, delta, openai_finish_reason(out), usage)
    if body.include_usage and last is not None:
        final = ChatCompletionChunk(
            id=head.id, created=head.created, model=head.model, choices=[], usage=usage_of([last])
        )
        yield sse.event(final.model_dump_json())
    yield sse.DONE

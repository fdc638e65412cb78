"""OpenAI-compatible POST /v1/chat/completions (messages through the model's chat template),
`n` choices, logprobs, SSE with include_usage / continuous_usage_stats."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request, Response

from api import sse
from api.deps import TokenizerManagerDep
from api.inputs import (
    chat_messages,
    chat_reqs,
    chat_template_kwargs,
    matched_stop,
    openai_finish_reason,
    raise_for_error,
)
from api.logprobs import chat_logprobs
from api.req_state import ReqOutput
from api.routes.common import OpenAIHead, collect, make_router, stream_outputs, usage_of
from api.schemas.openai import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from api.tokenizer_manager import TokenizerManager

router = make_router("openai")


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={200: {"model": ChatCompletionResponse}},
)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, tm: TokenizerManagerDep
) -> Response:
    """Answer a conversation; the prompt is the chat template with a generation prompt."""
    messages = chat_messages(body)
    input_ids = await tm.render_chat(messages, **chat_template_kwargs(body))
    base, reqs = chat_reqs(body, input_ids, tm.settings.api)
    outputs = await tm.generate(reqs, request)
    head = OpenAIHead(id=f"chatcmpl-{base}", model=tm.model.served_model_name)
    if body.stream:
        return sse.response(_stream(outputs, head, body, tm, len(reqs)))
    results = await collect(outputs)
    raise_for_error(results)
    response = ChatCompletionResponse(
        id=head.id,
        created=head.created,
        model=head.model,
        choices=[
            ChatChoice(
                index=out.index,
                message=AssistantMessage(content=out.text),
                logprobs=_logprobs(out, tm, 0),
                finish_reason=openai_finish_reason(out),
                matched_stop=matched_stop(out),
            )
            for out in results
        ],
        usage=usage_of(results, len(reqs)),
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _logprobs(out: ReqOutput, tm: TokenizerManager, start: int) -> ChatLogprobs | None:
    if out.logprobs is None:
        return None
    return ChatLogprobs(**chat_logprobs(out, tm.tok.token_texts, start))


def _chunk(
    head: OpenAIHead,
    choice: ChatStreamChoice,
    usage: UsageInfo | None = None,
) -> bytes:
    chunk = ChatCompletionChunk(id=head.id, created=head.created, model=head.model,
                                choices=[choice])  # fmt: skip
    if usage is not None:
        chunk.usage = usage
    return sse.event(chunk.model_dump_json())


async def _stream(
    outputs: AsyncGenerator[ReqOutput, None],
    head: OpenAIHead,
    body: ChatCompletionRequest,
    tm: TokenizerManager,
    n: int,
) -> AsyncIterator[bytes]:
    for index in range(n):  # each choice opens with the assistant role
        role = DeltaMessage(role="assistant", content="")
        yield _chunk(head, ChatStreamChoice(index=index, delta=role))
    latest: dict[int, ReqOutput] = {}
    async for out in stream_outputs(outputs):
        latest[out.index] = out
        if not out.delta and not out.finished and (out.logprobs is None or out.start == out.end):
            continue
        choice = ChatStreamChoice(
            index=out.index,
            delta=DeltaMessage(content=out.delta) if out.delta else DeltaMessage(),
            logprobs=_logprobs(out, tm, out.start),
            finish_reason=openai_finish_reason(out),
        )
        usage = usage_of(list(latest.values()), n) if body.continuous_usage else None
        yield _chunk(head, choice, usage)
    if body.include_usage and latest:
        usage = usage_of(list(latest.values()), n)
        final = ChatCompletionChunk(
            id=head.id, created=head.created, model=head.model, choices=[], usage=usage
        )
        yield sse.event(final.model_dump_json())
    yield sse.DONE

"""OpenAI-compatible POST /v1/chat/completions (messages through the model's chat template),
`n` choices, logprobs, SSE with include_usage / continuous_usage_stats."""

from __future__ import annotations

from fastapi import Request, Response

from api.deps import TokenizerManagerDep
from api.inputs import (
    chat_messages,
    chat_reqs,
    chat_template_kwargs,
    matched_stop,
    openai_finish_reason,
)
from api.logprobs import chat_logprobs
from api.renderers import OpenAIHead, usage_of
from api.req_state import ReqOutput
from api.routes.common import make_router
from api.routes.respond import openai_spec, respond
from api.schemas.openai import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
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
    head = OpenAIHead(id=f"chatcmpl-{base}", model=tm.model.served_model_name)

    def answer(results: list[ReqOutput]) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=out.index,
                message=AssistantMessage(content=out.text),
                logprobs=_logprobs(out, tm),
                finish_reason=openai_finish_reason(out),
                matched_stop=matched_stop(out),
            )
            for out in results
        ]
        usage = usage_of(results, len(reqs))
        return ChatCompletionResponse(
            id=head.id, created=head.created, model=head.model, choices=choices, usage=usage
        )

    spec = openai_spec("chat", head, len(reqs), body)
    return await respond(tm, reqs, request, body, spec, answer)


def _logprobs(out: ReqOutput, tm: TokenizerManager) -> ChatLogprobs | None:
    if out.logprobs is None:
        return None
    return ChatLogprobs(**chat_logprobs(out, tm.tok.token_texts, 0))

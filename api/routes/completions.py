"""OpenAI-compatible POST /v1/completions: one prompt or a batch, `n` samples each (choice
i*n+j answers prompt i), logprobs, SSE with include_usage / continuous_usage_stats."""

from __future__ import annotations

from fastapi import Request, Response

from api.deps import TokenizerManagerDep
from api.inputs import completion_reqs, matched_stop, openai_finish_reason
from api.logprobs import completion_logprobs
from api.req_state import ReqOutput
from api.routes.common import OpenAIHead, make_router, usage_of
from api.routes.respond import respond
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

    def answer(results: list[ReqOutput]) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=out.index,
                text=out.text,
                logprobs=_logprobs(out, tm, 0, 0)[0],
                finish_reason=openai_finish_reason(out),
                matched_stop=matched_stop(out),
            )
            for out in results
        ]
        usage = usage_of(results, n)
        return CompletionResponse(
            id=head.id, created=head.created, model=head.model, choices=choices, usage=usage
        )

    offsets: dict[int, int] = {}  # per choice: text offset of its next token

    def stream_choice(out: ReqOutput) -> CompletionStreamChoice:
        logprobs, offsets[out.index] = _logprobs(out, tm, out.start, offsets.get(out.index, 0))
        return CompletionStreamChoice(
            index=out.index,
            text=out.delta,
            logprobs=logprobs,
            finish_reason=openai_finish_reason(out),
        )

    return await respond(outputs, body, n, answer, stream_choice, CompletionStreamResponse, head)


def _logprobs(
    out: ReqOutput, tm: TokenizerManager, start: int, offset: int
) -> tuple[CompletionLogprobs | None, int]:
    if out.logprobs is None:
        return None, offset
    body, offset = completion_logprobs(out, tm.tok.token_texts, start, offset)
    return CompletionLogprobs(**body), offset

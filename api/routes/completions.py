"""OpenAI-compatible POST /v1/completions: one prompt or a batch, `n` samples each (choice
i*n+j answers prompt i), logprobs, SSE with include_usage / continuous_usage_stats."""

from __future__ import annotations

from fastapi import Request, Response

from api.deps import TokenizerManagerDep
from api.inputs import completion_reqs, matched_stop, openai_finish_reason
from api.logprobs import completion_logprobs, echo_logprobs, echo_text
from api.renderers import OpenAIHead, usage_of
from api.req_state import ReqOutput
from api.routes.common import make_router
from api.routes.respond import openai_spec, respond
from api.schemas.openai import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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
    head = OpenAIHead(id=f"cmpl-{base}", model=tm.model.served_model_name)

    def answer(results: list[ReqOutput]) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=out.index,
                text=echo_text(out, tm.tok.token_texts) + out.text if body.echo else out.text,
                logprobs=_logprobs(out, tm, bool(body.echo)),
                finish_reason=openai_finish_reason(out),
                matched_stop=matched_stop(out),
            )
            for out in results
        ]
        usage = usage_of(results, n)
        return CompletionResponse(
            id=head.id, created=head.created, model=head.model, choices=choices, usage=usage
        )

    spec = openai_spec("completion", head, n, body)
    spec.echo = bool(body.echo)
    return await respond(tm, reqs, request, body, spec, answer)


def _logprobs(out: ReqOutput, tm: TokenizerManager, echo: bool) -> CompletionLogprobs | None:
    if out.logprobs is None:
        return None
    if echo:
        return CompletionLogprobs(**echo_logprobs(out, tm.tok.token_texts))
    body, _ = completion_logprobs(out, tm.tok.token_texts, 0, 0)
    return CompletionLogprobs(**body)

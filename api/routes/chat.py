"""OpenAI-compatible POST /v1/chat/completions (messages through the model's chat template),
`n` choices, logprobs, SSE with include_usage / continuous_usage_stats."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from fastapi import Request, Response

from api.deps import TokenizerManagerDep
from api.errors import BadRequest
from api.inputs import (
    chat_messages,
    chat_reqs,
    chat_template_kwargs,
    matched_stop,
    tool_calls_out,
    tool_finish_reason,
)
from api.logprobs import chat_logprobs
from api.reasoning import split_reasoning
from api.renderers import OpenAIHead, usage_of
from api.req_state import GenerateReq, ReqOutput
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
from api.tools import ToolCall, ToolSetup, parse_calls, setup_tools

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
    chat = await prepare_chat(body, tm)
    reqs, tools = chat.reqs, chat.tools
    head = OpenAIHead(id=f"chatcmpl-{chat.base}", model=tm.model.served_model_name)

    def answer(results: list[ReqOutput]) -> ChatCompletionResponse:
        choices = []
        for out in results:
            reasoning, content, calls = chat.parse(out)
            message = AssistantMessage(content=content, reasoning_content=reasoning,
                                       tool_calls=tool_calls_out(out.rid, calls))  # fmt: skip
            choices.append(ChatChoice(
                index=out.index,
                message=message,
                logprobs=_logprobs(out, tm),
                finish_reason=tool_finish_reason(out, calls),
                matched_stop=matched_stop(out),
            ))  # fmt: skip
        usage = usage_of(results, len(reqs))
        return ChatCompletionResponse(
            id=head.id, created=head.created, model=head.model, choices=choices, usage=usage
        )

    spec = openai_spec("chat", head, len(reqs), body)
    spec.tool_parser, spec.reasoning_parser = tools.parser or "", chat.thinking
    return await respond(tm, reqs, request, body, spec, answer)


@dataclass
class PreparedChat:
    """A chat request tokenized and constrained, and how its outputs are read."""

    reqs: list[GenerateReq]
    base: str  # the rid the response id is made of
    tools: ToolSetup
    thinking: str  # the reasoning parser, "" when off

    def parse(self, out: ReqOutput) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, tool calls) of a finished output."""
        reasoning: str | None = None
        content: str | None = out.text
        if self.thinking:
            reasoning, content = split_reasoning(self.thinking, out.text)
        calls: list[ToolCall] = []
        if self.tools.parser:
            content, calls = parse_calls(self.tools.parser, content or "")
        return reasoning, content, calls


async def prepare_chat(body: ChatCompletionRequest, tm: TokenizerManager) -> PreparedChat:
    """Tools and history into the prompt through the chat template, the requests built and
    constrained (shared by /v1/chat/completions and /v1/responses)."""
    tools = _tools(body, tm)
    kwargs = chat_template_kwargs(body)
    if tools.tools:
        kwargs["tools"] = tools.tools
    input_ids = await tm.render_chat(tools.messages, **kwargs)
    base, reqs = chat_reqs(body, input_ids, tm.settings.api)
    _constrain(reqs, tools)
    thinking = tm.settings.api.reasoning_parser if body.separate_reasoning else ""
    return PreparedChat(reqs, base, tools, thinking)


def _tools(body: ChatCompletionRequest, tm: TokenizerManager) -> ToolSetup:
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    template = getattr(tm.tok.tokenizer, "chat_template", None)
    return setup_tools(
        chat_messages(body), tools, body.tool_choice, body.parallel_tool_calls,
        tm.settings.api.tool_call_parser, template if isinstance(template, str) else None,
    )  # fmt: skip


def _constrain(reqs: list[GenerateReq], tools: ToolSetup) -> None:
    """The calls' grammar, unless response_format (or vLLM's guided_*) asks for another:
    with tool_choice auto that one wins; a forced call cannot also follow it."""
    if tools.grammar is None:
        return
    for req in reqs:
        if req.sampling.grammar is not None:
            if tools.forced:
                raise BadRequest(
                    "response_format cannot be combined with tool_choice required or a "
                    "named tool.",
                    param="response_format",
                )
            continue
        req.sampling = msgspec.structs.replace(req.sampling, grammar=tools.grammar)


def _logprobs(out: ReqOutput, tm: TokenizerManager) -> ChatLogprobs | None:
    if out.logprobs is None:
        return None
    return ChatLogprobs(**chat_logprobs(out, tm.tok.token_texts, 0))

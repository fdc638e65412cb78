"""OpenAI-compatible request and response bodies: /v1/completions, /v1/chat/completions,
/v1/models. Extra SGLang/vLLM sampling fields are accepted where we implement them."""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.errors import BadRequest
from api.schemas.common import (
    EmbedInput,
    Int64,
    OneOrList,
    PromptInput,
    RequestBody,
    Rid,
    SafeStr,
    Timeout,
    reject_present,
    reject_unsupported,
)
from api.schemas.sampling import SamplingFields
from api.structured import ONLY_ONE, choice_regex, one_grammar, response_format_grammar
from shared.protocol import Grammar

_NEUTRAL: dict[str, tuple[Any, ...]] = {"best_of": (1,)}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: SafeStr | None = None
    description: SafeStr | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format; `structural_tag` (SGLang's, vLLM's) keeps its own fields."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs (the successor of its guided_* fields)."""

    model_config = ConfigDict(extra="ignore")

    json_: SafeStr | dict[str, Any] | None = Field(default=None, alias="json")
    regex: SafeStr | None = None
    choice: list[SafeStr] | None = None
    grammar: SafeStr | None = None
    structural_tag: SafeStr | dict[str, Any] | None = None


class OpenAISamplingRequest(SamplingFields):
    """Fields common to completions and chat completions."""

    model: SafeStr | None = None
    min_tokens: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: SafeStr | None = None
    rid: Rid | None = None
    # SGLang's: schedulers start higher values first (default 0).
    priority: Int64 | None = None
    # Seconds: past it the request ends with a 504 wherever it is.
    timeout: Timeout | None = None
    # Accepted only at its neutral value.
    best_of: int | None = None
    # Structured output (api.structured): OpenAI's, then vLLM's names.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: SafeStr | dict[str, Any] | None = None
    guided_regex: SafeStr | None = None
    guided_choice: list[SafeStr] | None = None
    guided_grammar: SafeStr | None = None

    @model_validator(mode="after")
    def _supported(self) -> Self:
        reject_unsupported(self, _NEUTRAL)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def min_new_tokens_sent(self) -> int | None:
        return self.min_tokens

    @property
    def grammar_sent(self) -> Grammar | None:
        so = self.structured_outputs or StructuredOutputs()
        choice = so.choice if so.choice is not None else self.guided_choice
        if choice is not None and not choice:
            raise BadRequest("guided_choice must list at least one choice.", param="guided_choice")
        vllm = one_grammar(
            {"json_schema": so.json_ or self.guided_json,
             "regex": so.regex or self.guided_regex or (choice and choice_regex(choice)),
             "ebnf": so.grammar or self.guided_grammar, "structural_tag": so.structural_tag}
        )  # fmt: skip
        from_format = response_format_grammar(self.response_format)
        if vllm is not None and from_format is not None:
            raise BadRequest(ONLY_ONE, param="response_format")
        return vllm or from_format


class CompletionRequest(OpenAISamplingRequest):
    prompt: PromptInput
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: Any = None

    @model_validator(mode="after")
    def _supported_completion(self) -> Self:
        reject_present(self, ("suffix",))
        return self


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: SafeStr


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: SafeStr
    arguments: SafeStr = "{}"


class ToolCallIn(BaseModel):
    """An assistant's earlier call, in the history."""

    model_config = ConfigDict(extra="ignore")

    id: SafeStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: OneOrList[ContentPart] | SafeStr | None = None
    name: SafeStr | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: SafeStr | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template expects it (text parts joined by newlines)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        elif isinstance(content, ContentPart):
            content = content.text
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: SafeStr | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDef


class ChatCompletionRequest(OpenAISamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # SGLang's: with a --reasoning-parser, put the thinking in reasoning_content.
    separate_reasoning: bool = True
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _supported_chat(self) -> Self:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message are exclusive")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class EmbeddingRequest(RequestBody):
    """POST /v1/embeddings (plus SGLang's cross-encoder pairs)."""

    input: EmbedInput
    model: SafeStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: SafeStr | None = None
    rid: Rid | None = None
    priority: Int64 | None = None


# -- responses ------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


def _is_none(value: Any) -> bool:
    return value is None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCallOut):
    index: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = Field(default=None, exclude_if=_is_none)
    tool_calls: list[ToolCallOut] | None = Field(default=None, exclude_if=lambda v: not v)


class ChatLogprobs(BaseModel):
    content: list[dict[str, Any]] | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """A chat stream delta: unset parts are left out ({"content": "x"}, {} at the end)."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)
    reasoning_content: str | None = Field(default=None, exclude_if=_is_none)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=_is_none)


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "redserve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage

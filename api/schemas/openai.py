"""OpenAI-compatible request and response bodies: /v1/completions, /v1/chat/completions,
/v1/models. Extra SGLang/vLLM sampling fields are accepted where we implement them."""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

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

_NEUTRAL: dict[str, tuple[Any, ...]] = {"best_of": (1,)}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


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


class CompletionRequest(OpenAISamplingRequest):
    prompt: PromptInput
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: Any = None

    @model_validator(mode="after")
    def _supported_completion(self) -> Self:
        reject_unsupported(self, {"echo": (False,)})
        reject_present(self, ("suffix",))
        return self


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: SafeStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: OneOrList[ContentPart] | SafeStr | None = None
    name: SafeStr | None = None

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
        return out


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]


class ChatCompletionRequest(OpenAISamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None

    @model_validator(mode="after")
    def _supported_chat(self) -> Self:
        reject_unsupported(self, {"tools": ([],), "tool_choice": ("none",)})
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


# -- responses ------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None]] | None
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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


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


def _is_none(value: Any) -> bool:
    return value is None


class DeltaMessage(BaseModel):
    """A chat stream delta: unset parts are left out ({"content": "x"}, {} at the end)."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)


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

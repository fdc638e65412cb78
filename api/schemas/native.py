"""SGLang-compatible native request bodies: /generate, /encode, /tokenize, /detokenize and
/abort_request. Types only: ranges and limits are checked in api.inputs and api.sampling,
with SGLang's messages."""

from __future__ import annotations

from typing import Any, Self

from pydantic import model_validator

from api.schemas.common import (
    EmbedInput,
    Int64,
    OneOrList,
    RequestBody,
    Rid,
    SafeStr,
    Timeout,
    TokenIdsInput,
    reject_present,
)
from api.schemas.openai import ChatMessage
from api.schemas.sampling import SamplingFields
from api.structured import one_grammar
from shared.protocol import Grammar

_UNSUPPORTED_SAMPLING = ("stop_regex",)
_UNSUPPORTED_INPUTS = ("input_embeds", "image_data", "audio_data", "video_data", "lora_path")


class SamplingParamsIn(SamplingFields):
    """SGLang's SamplingParams."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    sampling_seed: Int64 | None = None
    # Accepted and ignored: a streaming cadence hint.
    stream_interval: int | None = None
    # Structured output: at most one (api.structured).
    json_schema: SafeStr | dict[str, Any] | None = None
    regex: SafeStr | None = None
    ebnf: SafeStr | None = None
    structural_tag: SafeStr | dict[str, Any] | None = None
    # Rejected when given.
    stop_regex: Any = None

    @model_validator(mode="after")
    def _supported(self) -> Self:
        reject_present(self, _UNSUPPORTED_SAMPLING)
        return self

    @property
    def min_new_tokens_sent(self) -> int | None:
        return self.min_new_tokens

    @property
    def seed_sent(self) -> int | None:
        return self.seed if self.seed is not None else self.sampling_seed

    @property
    def grammar_sent(self) -> Grammar | None:
        return one_grammar(
            {"json_schema": self.json_schema, "regex": self.regex, "ebnf": self.ebnf,
             "structural_tag": self.structural_tag}
        )  # fmt: skip


class TextOnlyInput(RequestBody):
    """SGLang's multimodal / embedding / LoRA inputs: accepted by name, rejected when set."""

    input_embeds: Any = None
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    lora_path: Any = None

    @model_validator(mode="after")
    def _supported(self) -> Self:
        reject_present(self, _UNSUPPORTED_INPUTS)
        return self


class GenerateRequest(TextOnlyInput):
    """POST /generate: `text` or `input_ids`, single or batch."""

    text: OneOrList[SafeStr] | None = None
    input_ids: TokenIdsInput | None = None
    sampling_params: OneOrList[SamplingParamsIn] | None = None
    stream: bool = False
    rid: OneOrList[Rid] | None = None
    return_logprob: OneOrList[bool] | None = None
    logprob_start_len: OneOrList[int] | None = None
    top_logprobs_num: OneOrList[int] | None = None
    token_ids_logprob: TokenIdsInput | None = None
    return_text_in_logprobs: bool = False
    # SGLang's: schedulers start higher values first (default 0).
    priority: Int64 | None = None
    # Seconds: past it the request ends with a 504 wherever it is.
    timeout: Timeout | None = None


class EncodeRequest(TextOnlyInput):
    """POST /encode (SGLang's EmbeddingReqInput): `text` (strings or cross-encoder pairs) or
    `input_ids`, single or batch."""

    text: EmbedInput | None = None
    input_ids: TokenIdsInput | None = None
    rid: OneOrList[Rid] | None = None
    priority: Int64 | None = None


class TokenizeRequest(RequestBody):
    """POST /tokenize: a prompt (strings or cross-encoder pairs) or chat messages."""

    model: SafeStr | None = None
    prompt: EmbedInput | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestBody):
    """POST /detokenize: ids (or a batch of id lists) back to text."""

    model: SafeStr | None = None
    tokens: TokenIdsInput
    skip_special_tokens: bool = True


class AbortRequestIn(RequestBody):
    """POST /abort_request: one rid, or every request of this api replica."""

    rid: Rid | None = None
    abort_all: bool = False

"""SGLang-compatible native request bodies: /generate and /abort_request."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from api.schemas.common import (
    Int64,
    OneOrList,
    Rid,
    SafeStr,
    TokenIdsInput,
    reject_present,
    reject_unsupported,
)

# SGLang sampling parameters that we accept only at their neutral value.
_NEUTRAL_SAMPLING: dict[str, tuple[Any, ...]] = {
    "min_new_tokens": (0,),
    "min_p": (0.0,),
    "frequency_penalty": (0.0,),
    "presence_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "n": (1,),
    "logit_bias": ({},),
}
_UNSUPPORTED_SAMPLING = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex")
_UNSUPPORTED_INPUTS = ("input_embeds", "image_data", "audio_data", "video_data", "lora_path")


def check_top_k(value: int | None) -> int | None:
    if value is not None and value != -1 and not 1 <= value <= 2**31 - 1:
        raise ValueError("must be -1 (disable) or at least 1")
    return value


class SamplingParamsIn(BaseModel):
    """SGLang's SamplingParams; None means "the default" like SGLang."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    max_new_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    stop: OneOrList[SafeStr] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    seed: Int64 | None = None
    sampling_seed: Int64 | None = None
    # Accepted and ignored: a streaming cadence hint.
    stream_interval: int | None = None
    # Accepted only at their neutral value (see _NEUTRAL_SAMPLING).
    min_new_tokens: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    # Rejected when given.
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    stop_regex: Any = None

    _check_top_k = field_validator("top_k")(check_top_k)

    @model_validator(mode="after")
    def _supported(self) -> SamplingParamsIn:
        reject_unsupported(self, _NEUTRAL_SAMPLING)
        reject_present(self, _UNSUPPORTED_SAMPLING)
        return self


class GenerateRequest(BaseModel):
    """POST /generate: `text` or `input_ids`, single or batch."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    text: OneOrList[SafeStr] | None = None
    input_ids: TokenIdsInput | None = None
    sampling_params: OneOrList[SamplingParamsIn] | None = None
    stream: bool = False
    rid: OneOrList[Rid] | None = None
    return_logprob: OneOrList[bool] | None = None
    input_embeds: Any = None
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    lora_path: Any = None

    @model_validator(mode="after")
    def _supported(self) -> GenerateRequest:
        flags = (
            self.return_logprob if isinstance(self.return_logprob, list) else [self.return_logprob]
        )
        if any(flags):
            raise ValueError("return_logprob is not supported yet")
        reject_present(self, _UNSUPPORTED_INPUTS)
        return self


class AbortRequestIn(BaseModel):
    """POST /abort_request: one rid, or every request of this api replica."""

    model_config = ConfigDict(extra="ignore")

    rid: Rid | None = None
    abort_all: bool = False

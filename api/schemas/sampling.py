"""The sampling fields that the native (`sampling_params`) and the OpenAI bodies share, under
the names both use (SGLang's; OpenAI's where it has them, the rest as SGLang's and vLLM's
extras). Each API adds its own: max_new_tokens / max_tokens, min_new_tokens / min_tokens, ..."""

from __future__ import annotations

from api.schemas.common import Int64, OneOrList, RequestBody, SafeStr
from shared.protocol import Grammar


class SamplingFields(RequestBody):
    """As the client sent them; None means "the default", as in SGLang (api.sampling turns
    them into the engine's SamplingParams)."""

    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: OneOrList[SafeStr] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    seed: Int64 | None = None
    # Detokenization (the detokenizer's params, not the engine's).
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None

    # Named each API's own way: min_new_tokens / min_tokens, seed / seed or sampling_seed.
    @property
    def min_new_tokens_sent(self) -> int | None:
        raise NotImplementedError

    @property
    def seed_sent(self) -> int | None:
        return self.seed

    @property
    def grammar_sent(self) -> Grammar | None:
        """The output constraint (structured output) under this API's names."""
        return None

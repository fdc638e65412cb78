"""Sampling parameters from either API -> the engine's SamplingParams, with SGLang's defaults
and range checks (its messages, OpenAI's names and ranges on /v1). Checks that need the model
(vocabulary, context) are in api.validation."""

from __future__ import annotations

from api.errors import BadRequest
from api.schemas.sampling import SamplingFields
from shared import protocol

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024
MAX_TOP_K = 2**31 - 1  # larger is the whole vocabulary anyway
OPENAI_MAX_TEMPERATURE = 2.0
OPENAI_MAX_LOGIT_BIAS = 100.0
GREEDY_EPS = 1e-5  # below this a temperature means greedy (SGLang's _SAMPLING_EPS)

# name: (low, low excluded, high, high excluded); SGLang's ranges.
_RANGES: dict[str, tuple[float, bool, float, bool]] = {
    "top_p": (0.0, True, 1.0, False),
    "min_p": (0.0, False, 1.0, False),
    "frequency_penalty": (-2.0, False, 2.0, False),
    "presence_penalty": (-2.0, False, 2.0, False),
    "repetition_penalty": (0.0, True, 2.0, False),
}


def make_sampling(raw: SamplingFields, *, openai: bool = False) -> protocol.SamplingParams:
    """Checked engine sampling parameters; max_new_tokens is set once the prompt is known."""
    _check_ranges(raw, openai)
    token_ids = list(raw.stop_token_ids or [])
    if len(token_ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(
            f"At most {MAX_STOP_TOKEN_IDS} stop token ids are allowed, got {len(token_ids)}.",
            param="stop_token_ids",
        )
    temp = 1.0 if raw.temperature is None else raw.temperature
    k = _top_k(raw.top_k, openai)
    if temp < GREEDY_EPS:  # greedy: say it both ways so no sampler divides by ~0
        temp, k = 0.0, 1
    return protocol.SamplingParams(
        temperature=temp,
        top_p=_or(raw.top_p, 1.0),
        top_k=k,
        stop_token_ids=token_ids,
        ignore_eos=bool(raw.ignore_eos),
        seed=raw.seed_sent,
        stop=stop_list(raw.stop),
        min_p=_or(raw.min_p, 0.0),
        frequency_penalty=_or(raw.frequency_penalty, 0.0),
        presence_penalty=_or(raw.presence_penalty, 0.0),
        repetition_penalty=_or(raw.repetition_penalty, 1.0),
        min_new_tokens=raw.min_new_tokens_sent or 0,
        logit_bias=logit_bias(raw.logit_bias, openai),
        grammar=raw.grammar_sent,
    )


def _top_k(top_k: int | None, openai: bool) -> int:
    if top_k is None or top_k == -1 or (openai and top_k == 0):  # vLLM: 0 disables it too
        return -1
    if top_k < 1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {top_k}.", param="top_k")
    return min(top_k, MAX_TOP_K)


def _or(value: float | None, default: float) -> float:
    return default if value is None else float(value)


def _check_ranges(raw: SamplingFields, openai: bool) -> None:
    t = raw.temperature
    if t is not None:
        if openai and not 0 <= t <= OPENAI_MAX_TEMPERATURE:
            raise BadRequest(f"temperature must be in [0, 2], got {t}.", param="temperature")
        if t < 0:
            raise BadRequest(f"temperature must be non-negative, got {t}.", param="temperature")
    for name, (lo, lo_open, hi, hi_open) in _RANGES.items():
        value = getattr(raw, name)
        if value is None:
            continue
        above = value > lo if lo_open else value >= lo
        below = value < hi if hi_open else value <= hi
        if not (above and below):
            interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
            raise BadRequest(f"{name} must be in {interval}, got {value}.", param=name)
    min_new = raw.min_new_tokens_sent
    if min_new is not None and min_new < 0:
        name = "min_tokens" if openai else "min_new_tokens"
        raise BadRequest(f"{name} must be in [0, max_new_tokens], got {min_new}.", param=name)


def stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(
            f"At most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(stops)}.",
            param="stop",
        )
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise BadRequest(
            f"Stop strings must be 1 to {MAX_STOP_CHARS} characters long.", param="stop"
        )
    return stops


def logit_bias(bias: dict[str, float] | None, openai: bool) -> dict[int, float]:
    """Token id -> bias; ids are checked against the vocabulary later (api.validation)."""
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(
            f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}.",
            param="logit_bias",
        )
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise BadRequest(
                f"logit_bias keys must be token ids, got {ascii(key[:32])}.", param="logit_bias"
            ) from None
        if openai and not -OPENAI_MAX_LOGIT_BIAS <= value <= OPENAI_MAX_LOGIT_BIAS:
            raise BadRequest(
                f"logit_bias values must be in [-100, 100], got {value}.", param="logit_bias"
            )
        out[token_id] = float(value)
    return out

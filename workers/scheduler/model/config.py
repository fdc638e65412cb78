"""The model's shape from a Hugging Face folder's config.json: what our forward (llama.py)
builds, for the families it supports.

Families (`SUPPORTED_MODEL_TYPES`) differ only in flags of `ModelArgs`: Llama/SmolLM2
(optional `attention_bias` on q/k/v/o, `mlp_bias`), Qwen2 (bias on q/k/v, none on o), Qwen3
(a per-head RMSNorm on q and k before RoPE, optional `attention_bias`), Mistral (no bias; its
sliding window is not implemented, so the context is capped at the window, where full
attention is exact). Pure Python: no torch.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # bias on q/k/v
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"model_type {cfg.get('model_type')!r} has no built-in forward yet "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        # transformers 5 writes `rope_parameters`; older folders `rope_theta`/`rope_scaling`.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise NotImplementedError(f"RoPE scaling {rope} is not supported yet")
        num_heads = cfg["num_attention_heads"]
        return cls(
            **_family_flags(cfg),
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=_max_positions(cfg),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        )


def _family_flags(cfg: dict[str, Any]) -> dict[str, bool]:
    """Where a family's layers differ from Llama's (HF's modeling_<family>.py)."""
    kind, bias = cfg["model_type"], bool(cfg.get("attention_bias"))
    if kind == "qwen2":
        return {"attention_bias": True}
    if kind == "qwen3":
        return {"attention_bias": bias, "o_proj_bias": bias, "qk_norm": True}
    if kind == "mistral":
        return {}
    return {"attention_bias": bias, "o_proj_bias": bias, "mlp_bias": bool(cfg.get("mlp_bias"))}


def _max_positions(cfg: dict[str, Any]) -> int:
    """The context length; capped at the sliding window where one applies (Mistral, Qwen's
    sliding layers), since up to the window full causal attention is exactly the same."""
    max_positions = int(cfg.get("max_position_embeddings") or 2048)
    window = cfg.get("sliding_window")
    slides = cfg["model_type"] == "mistral" or "sliding_attention" in (cfg.get("layer_types") or [])
    if window and slides and window < max_positions:
        logger.warning(
            "sliding-window attention is not implemented: context capped at the window "
            "(%d tokens instead of %d)",
            window,
            max_positions,
        )
        return int(window)
    return max_positions


def read_model_args(folder: str | Path) -> ModelArgs:
    return ModelArgs.from_hf_config(json.loads((Path(folder) / "config.json").read_text()))

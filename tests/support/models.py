"""Tiny models with random weights, saved as HF folders for our runner to load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from workers.scheduler.model.config import ModelArgs

# A tiny Llama-family shape: every family's config takes these (plus its own flags).
SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


def random_hf_model(config: Any, weight_std: float) -> Any:
    """An fp32 HF model of `config` with every weight drawn at random: norms around 1 (std
    0.2), everything else around 0 (std `weight_std`), biases too."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else weight_std)
    return model


def saved_random_model(
    tmp_path_factory: pytest.TempPathFactory, name: str, config: Any, weight_std: float
) -> Path:
    """`random_hf_model`, saved to a fresh folder."""
    folder = tmp_path_factory.mktemp(name)
    random_hf_model(config, weight_std).save_pretrained(folder)
    return folder


def tiny_args(**overrides: Any) -> ModelArgs:
    """Our ModelArgs of the tiny Llama `SMALL` describes, with HF-named `overrides`."""
    return ModelArgs.from_hf_config({"model_type": "llama", **SMALL, **overrides})

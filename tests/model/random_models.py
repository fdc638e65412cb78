"""Tiny models with random weights, saved as HF folders for our runner to load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch


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

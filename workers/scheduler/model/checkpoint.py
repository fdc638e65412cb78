"""Loads a Hugging Face checkpoint folder (config.json + safetensors) into our forward
(llama.py): no transformers model object exists at run time. q/k/v and gate/up load as
shards of the fused projections; tied and untied embeddings both load.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from workers.scheduler.model.config import read_model_args
from workers.scheduler.model.llama import LlamaForCausalLM, rope_tables

logger = logging.getLogger(__name__)


# Checkpoint projections that we keep fused: name -> (fused name, shard index).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_model(folder: str | Path, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    folder = Path(folder)
    args = read_model_args(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(args, dtype)
    model = model.to_empty(device=device).to(dtype)
    cos, sin = rope_tables(args, dtype)  # buffers were on meta: compute them for real
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    if args.tie_word_embeddings:  # to_empty() unties shared parameters
        model.lm_head.weight = model.embed_tokens.weight
    _load_weights(model, folder)
    return model.eval()


def _load_weights(model: LlamaForCausalLM, folder: Path) -> None:
    args, params = model.args, dict(model.named_parameters())
    q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    # Shards are stacked along the output dim: q, k, v (or gate, up) in that order.
    shard_sizes = {
        "qkv_proj": [q_size, kv_size, kv_size],
        "gate_up_proj": [args.intermediate_size, args.intermediate_size],
    }
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    loaded: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                target, shard = _target(name.removeprefix("model."))
                if target not in params:
                    logger.debug("ignoring checkpoint tensor %s", name)
                    continue
                param = params[target].data
                if shard is not None:
                    sizes = shard_sizes[target.split(".")[-2]]
                    param = param[sum(sizes[:shard]) : sum(sizes[: shard + 1])]
                param.copy_(f.get_tensor(name))
                loaded.add(target)
    missing = set(params) - loaded - ({"lm_head.weight"} if args.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"weights missing from {folder}: {sorted(missing)[:5]}")


def _target(name: str) -> tuple[str, int | None]:
    """Our parameter name for a checkpoint tensor, and its shard index if fused."""
    module, _, leaf = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    if proj in _FUSED:
        fused, shard = _FUSED[proj]
        return f"{parent}.{fused}.{leaf}", shard
    return name, None

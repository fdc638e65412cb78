"""The model's and the KV cache's dtypes, from the settings' names ("auto" resolved here)."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.config import KV_CACHE_DTYPES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str) -> str:
    """`dtype`, or for "auto" the fastest one that is accurate enough: bfloat16 on CUDA and
    on CPUs with native bf16 matmuls (AVX512-BF16 or AMX), else float32. On such CPUs a
    decode step reads half the weight bytes, so bf16 decodes faster than fp32 (measured in
    bench/README.md). Its accuracy: tests/model/test_bf16_tolerance.py."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r} (auto, {', '.join(DTYPES)})")
        return dtype
    if torch.device(device).type == "cuda":
        return "bfloat16"
    return "bfloat16" if cpu_has_bf16() else "float32"


def resolve_kv_dtype(
    kv_cache_dtype: str, model_dtype: torch.dtype, quantized_checkpoint: bool = False
) -> torch.dtype:
    """The KV cache's dtype. "auto": the model's, except bf16 under an fp32 model that
    serves a checkpoint stored quantized (`quantized_checkpoint`: `--quantization auto` on
    a Q4 GGUF), as llama.cpp keeps such a file's K/V in 16 bits; the exact reference
    (`--dtype float32 --quantization none`) keeps fp32. "bfloat16" (or "bf16"): K/V rounded
    to bf16 as they are stored and read back widened to the model's dtype; "float32" the
    exact cache under any model. Under an fp32 model bf16 halves the cache (twice the
    tokens in the same memory) and what a decode step's attention reads, which at many
    sequences is a large share of a step (measured in bench/README.md). Its predictions
    stay within the bounds that tests/model/test_kv_cache_dtype.py sets against the fp32
    cache (teacher-forced)."""
    if kv_cache_dtype == "auto":
        if quantized_checkpoint and model_dtype == torch.float32:
            return torch.bfloat16
        return model_dtype
    if kv_cache_dtype in ("bfloat16", "bf16"):
        return torch.bfloat16
    if kv_cache_dtype == "float32":
        return torch.float32
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r} ({', '.join(KV_CACHE_DTYPES)})")


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16)."""
    if torch.backends.cpu.get_cpu_capability() == "AVX512_BF16":  # not all builds report it
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(word in ("avx512_bf16", "amx_bf16") for word in flags.split())

"""RMSNorm of bf16 rows as one C call (rms_norm.c), for eager bf16 steps on CPU.

Eager, a bf16 RMSNorm is a chain of small torch ops (the upcast, the fused norm's pow, mean,
add and rsqrt, the downcast, the weight), and a decode step runs two norms a layer plus the
final one, so in a small step their per-op cost shows (measured in bench/README.md). The
kernel reads each row once and rounds where those ops round, so its output is eager's but
for the order of one sum (tests/model/test_rms_norm.py). Under `torch.compile` Inductor
fuses the torch ops itself, and fp32 keeps them: the exact reference. Without a C compiler,
or if the build fails, the torch ops serve.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from workers.scheduler.kernels.c_build import build_library

SOURCE = Path(__file__).parent / "csrc" / "rms_norm.c"


@functools.cache
def rms_norm_library() -> ctypes.CDLL | None:
    lib = build_library(SOURCE)
    if lib is not None:
        lib.rms_norm_bf16.restype = ctypes.c_int
        lib.rms_norm_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    return lib


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel serves `x` (contiguous bf16 rows on CPU, eager) with `weight`."""
    return (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.is_contiguous()
        and not torch.compiler.is_compiling()
        and rms_norm_library() is not None
    )


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * bf16(rms_norm(x in fp32)) over the last dim of `x`, as `takes` allows."""
    lib = rms_norm_library()
    dim = weight.shape[0]
    if lib is None or x.shape[-1] != dim or not weight.is_contiguous():
        raise ValueError("rms_norm_bf16: contiguous bf16 rows of the weight's length")
    out = torch.empty_like(x)
    status = lib.rms_norm_bf16(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps
    )
    if status:
        raise RuntimeError(f"rms_norm kernel failed ({status})")
    return out

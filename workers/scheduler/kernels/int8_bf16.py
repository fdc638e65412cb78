"""int8 weights x bf16 activations through AMX-BF16 tiles (int8_bf16.c): `--quantization
w8a8_int8`'s down_proj on CPUs with AMX.

down_proj's input (silu(gate) * up) has the outliers that 8-bit activations lose, so W8A8
does not serve it; on AVX2 CPUs W8A16 does (w8a8.py), but its vpmaddwd loops are
slower than oneDNN's AMX bf16 matmul on an AMX CPU, which would leave down_proj in bf16 for
all but the smallest steps. This kernel reads half of bf16's bytes and keeps the
activations in bf16: the weights are widened to bf16 in L1, chunk by chunk, and multiplied
by AMX-BF16. It computes the same product as torch's `_weight_int8pack_mm` (the LM head's
int8 route), which loses to prepacked bf16 once a step carries more than a few tokens
(bench/kernels.py); this one beats prepacked bf16 there (measured in bench/README.md).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import nn

from workers.scheduler.kernels.c_build import build_library

SOURCE = Path(__file__).parent / "csrc" / "int8_bf16.c"
BLOCK_N, CHUNK_K = 16, 32  # the kernel's channel blocks and input chunks


@functools.cache
def build() -> ctypes.CDLL | None:
    """The kernel built for this CPU, or None (no compiler, or no AMX-BF16 here)."""
    lib = build_library(SOURCE)
    if lib is None:
        return None
    pointer, i32 = ctypes.c_void_p, ctypes.c_int
    lib.int8_bf16_available.restype = i32
    lib.int8_bf16_linear.restype = i32
    lib.int8_bf16_linear.argtypes = [pointer, i32, i32, i32, pointer, pointer, pointer, i32, i32]
    return lib if lib.int8_bf16_available() else None


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel runs here and takes this [out, in] weight."""
    out_features, in_features = weight.shape
    return (
        weight.device.type == "cpu"
        and out_features % BLOCK_N == 0
        and in_features % CHUNK_K == 0
        and build() is not None
    )


class Int8Bf16(nn.Module):
    """x @ w.T with w = q * scale (`q` [out, in] int8, `scale` [out]: layers/quantization.py's
    `int8_channels`); x in bf16 (fp32 rounded to it). Output in x's dtype, no bias."""

    packed: torch.Tensor  # [out / 16][in / 2][16][2] int8
    scale: torch.Tensor  # [out] fp32

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        if not fits(q):
            raise ValueError(f"int8 x bf16 AMX kernel: not here, or shape {tuple(q.shape)}")
        out_features, in_features = q.shape
        packed = q.view(out_features // BLOCK_N, BLOCK_N, in_features // 2, 2).transpose(1, 2)
        self.register_buffer("packed", packed.contiguous(), persistent=False)
        self.register_buffer("scale", scale.float().contiguous(), persistent=False)
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype not in (torch.bfloat16, torch.float32):
            rows = rows.float()
        run = int8_bf16_op if torch.compiler.is_compiling() else _run
        out = run(rows.contiguous(), self.packed, self.scale)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)


def _run(rows: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`Int8Bf16`'s product of contiguous bf16 or fp32 `rows` [tokens, in]."""
    out_features = packed.shape[0] * packed.shape[2]
    out = rows.new_empty(rows.shape[0], out_features)
    if rows.shape[0] == 0:
        return out
    lib = build()
    assert lib is not None
    is_bf16 = int(rows.dtype == torch.bfloat16)
    status = lib.int8_bf16_linear(
        rows.data_ptr(), is_bf16, rows.shape[0], rows.shape[1], packed.data_ptr(),
        scale.data_ptr(), out.data_ptr(), is_bf16, out_features,
    )  # fmt: skip
    if status:
        raise RuntimeError(f"int8 x bf16 kernel failed ({status})")
    return out


# Under `--enable-torch-compile`: one op of the graph (as w8a8.py's), not a break.
int8_bf16_op = torch.library.custom_op("redserve::int8_bf16", _run, mutates_args=())


@int8_bf16_op.register_fake
def _(rows: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], packed.shape[0] * packed.shape[2])

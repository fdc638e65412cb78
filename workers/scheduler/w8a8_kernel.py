"""`--quantization w8a8_int8`'s projection as one C call (w8a8_linear.c) on x86 CPUs with
AVX512-VNNI or AVX2: per-token int8 activations, int8 weights (7 bits on AVX2: its byte
products saturate otherwise), int32 sums, dequantized with the outlier channels added, in
one pass.

The torch version (`DynamicInt8`: fbgemm's int8 GEMM inside ~10 torch ops) spends more on
its ops than its GEMM saves at decode sizes: per layer (qkv + gate_up + o, 16 tokens,
2 Zen 5 cores) 347 us against 172 for prepacked bf16, the GEMM alone 125. A pass over the
model's 120 projections (`bench/kernels.py`, weights from memory): at 16 tokens this
kernel 9.0 ms, prepacked bf16 11.7, `DynamicInt8` 17.2, int4 13.2; at 64 tokens 20.3,
24.5, 35.5, 47.3. Engine decode steps of `w8a8_int8` against `int4` (which takes
prepacked bf16 from 16 tokens on): 20.3 vs 24.1 ms at 16 sequences, 45.9 vs 52.9 at 64.
Its activations keep 8 bits per token where fbgemm's keep 7 (it reduces the range), with
the same smoothing and outlier channels (quantization.py): top-1 159/160 against fp32
where fbgemm's gave 155/160 (tests/model/test_quantization.py).

On AVX2 (2 Zen 3 cores, fp32 model) the kernel against fbgemm's path, engine decode steps
interleaved (`bench/steps.py --modes w8a8_int8 --w8a8-ab`): 47.6 vs 52.9 ms at 4
sequences, 88.3 vs 95.6 and 100.8 vs 106.2 at 16, 239 vs 232 at 64 (fbgemm's GEMM keeps
up at 64 tokens and runs the LM head faster from 16 on). Every step through W8A8: top-1
157/160 against fp32, mean |logprob error| 0.037 (fbgemm's 156/160, 0.042).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import nn

from workers.scheduler.c_build import build_library

SOURCE = Path(__file__).with_name("w8a8_linear.c")


@functools.cache
def build_kernel(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernel built with `extra_flags` after the usual ones (tests build the portable
    loops with -mno-avx512f), or None."""
    lib = build_library(SOURCE, extra_flags)
    if lib is None:
        return None
    pointer, i32 = ctypes.c_void_p, ctypes.c_int
    lib.w8a8_linear.restype = i32
    lib.w8a8_linear.argtypes = [pointer, i32, i32, i32, *[pointer] * 5, i32, pointer, pointer]
    lib.w8a8_linear.argtypes += [i32, i32]
    lib.w8a8_vectorized.restype = i32
    lib.w8a8_weight_levels.restype = i32
    lib.w8a8_tile_n.restype = i32
    return lib


def kernel_fits(weight: torch.Tensor) -> bool:
    """Whether the vectorized kernel builds here (AVX512-VNNI or AVX2) and takes this
    [out, in] weight."""
    out_features, in_features = weight.shape
    lib = build_kernel()
    return (
        weight.device.type == "cpu"
        and lib is not None
        and out_features % lib.w8a8_tile_n() == 0
        and in_features % 4 == 0
        and bool(lib.w8a8_vectorized())
    )


class FusedW8A8(nn.Module):
    """x @ w.T for w = q * scale (int8 per output channel, `q` [out, in]) applied to x *
    `inverse_smooth`, plus x's `outliers` channels times `outlier_weight` [out, outliers]
    in fp32. Output in x's dtype (bf16 or fp32), no bias."""

    packed: torch.Tensor  # [out / tile][in / 4][tile][4] int8 (`w8a8_tile_n()`: 64 or 16)
    colsum: torch.Tensor  # [out] int32, 128 * sum of each output channel's q
    scale: torch.Tensor  # [out] fp32
    inverse_smooth: torch.Tensor  # [in] fp32, 0 at the outlier channels
    outliers: torch.Tensor  # [outliers] int32
    outlier_weight: torch.Tensor  # [out / tile][outliers][tile] fp32

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        inverse_smooth: torch.Tensor,
        outliers: torch.Tensor,
        outlier_weight: torch.Tensor,
        library: ctypes.CDLL | None = None,
    ) -> None:
        super().__init__()
        out_features, in_features = q.shape
        lib = library or build_kernel()
        if lib is None:
            raise RuntimeError("the w8a8 kernel is not built (no C compiler?)")
        tile = lib.w8a8_tile_n()
        if out_features % tile or in_features % 4:
            raise ValueError(f"w8a8 kernel: shape {tuple(q.shape)} is not in whole tiles")
        self.lib = lib
        self.out_features, self.in_features = out_features, in_features
        blocks = out_features // tile
        packed = q.view(blocks, tile, in_features // 4, 4).transpose(1, 2)
        per_block = outlier_weight.float().t().reshape(-1, blocks, tile).transpose(0, 1)
        buffers = {
            "packed": packed.contiguous(),  # [blocks][in / 4][tile][4]
            "colsum": 128 * q.sum(1, dtype=torch.int32),
            "scale": scale.float().contiguous(),
            "inverse_smooth": inverse_smooth.float().contiguous(),
            "outliers": outliers.to(torch.int32).contiguous(),
            "outlier_weight": per_block.contiguous(),  # [blocks][outliers][tile]
        }
        for name, tensor in buffers.items():
            self.register_buffer(name, tensor, persistent=False)

    # A ctypes call: torch.compile (`--enable-torch-compile --torch-compile-max-bs 8` and up,
    # where decode steps reach this kernel's route) leaves it to run eagerly between graphs.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype not in (torch.bfloat16, torch.float32):
            rows = rows.float()
        rows = rows.contiguous()
        out = rows.new_empty(rows.shape[0], self.out_features)
        if rows.shape[0] == 0:
            return out.view(*x.shape[:-1], self.out_features)
        is_bf16 = int(rows.dtype == torch.bfloat16)
        status = self.lib.w8a8_linear(
            rows.data_ptr(),
            is_bf16,
            rows.shape[0],
            self.in_features,
            self.inverse_smooth.data_ptr(),
            self.packed.data_ptr(),
            self.colsum.data_ptr(),
            self.scale.data_ptr(),
            self.outliers.data_ptr(),
            self.outliers.shape[0],
            self.outlier_weight.data_ptr(),
            out.data_ptr(),
            is_bf16,
            self.out_features,
        )
        if status:
            raise RuntimeError(f"w8a8 kernel failed ({status})")
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

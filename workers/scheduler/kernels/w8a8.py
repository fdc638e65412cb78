"""`--quantization w8a8_int8`'s projection as one C call (w8a8_linear.c) on x86 CPUs with
AVX512-VNNI or AVX2: per-token int8 activations, int8 weights (7 bits on AVX2: its byte
products saturate otherwise), int32 sums, dequantized with the outlier channels added, in
one pass.

The torch version (`DynamicInt8`: fbgemm's int8 GEMM inside ~10 torch ops) spends more on
its ops than its GEMM saves at decode sizes, so it loses to prepacked bf16 there. This
kernel does the quantizing, the GEMM, the dequantizing and the outlier channels in one pass,
which beats `DynamicInt8`, prepacked bf16 and int4 on middle-sized steps (`bench/kernels.py`,
weights from memory) and shortens engine decode steps against `int4` (measured in
bench/README.md). Its activations keep 8 bits per token where fbgemm's keep 7 (it reduces
the range), with the same smoothing and outlier channels (layers/quantization.py), so it
agrees with fp32 at least as well as fbgemm's path (tests/model/test_quantization.py).

On AVX2 the same holds against fbgemm's path at small and middle-sized steps; at the
largest decode batches fbgemm's GEMM keeps up and runs the LM head faster, which the
routes timed at load see (`bench/steps.py --modes w8a8_int8 --w8a8-ab`).

Where the CPU has AMX-INT8 as well (Intel Sapphire Rapids and later), steps of 16 tokens or
more go through AMX tiles (tdpbusd: 16 tokens x 16 channels x 64 bytes an instruction) on
the same packed weights, with the same integer sums, so the same bits as the vpdpbusd
tiles. They win where a step is bound by arithmetic, not at the few tokens where reading
the weights bounds both (`bench/kernels.py`, `bench/steps.py --amx-ab`); in large decode
steps the cache reads and the torch ops weigh more, so the gain there is small.

`wide` (W8A16, down_proj's route on AVX2 CPUs): int16 activations, 8-bit weights, vpmaddwd;
as fast as W8A8 on AVX2 and much faster than fp32 and int4 from middle-sized steps on, so
decode steps get shorter where down_proj would otherwise run in fp32 (measured in
bench/README.md).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import nn

from workers.scheduler.kernels.c_build import build_library

SOURCE = Path(__file__).parent / "csrc" / "w8a8_linear.c"


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
    lib.w8a16_linear.restype = i32
    lib.w8a16_linear.argtypes = [pointer, i32, i32, i32, *[pointer] * 4, i32, pointer, pointer]
    lib.w8a16_linear.argtypes += [i32, i32]
    lib.w8a8_vectorized.restype = i32
    lib.w8a8_amx.restype = i32
    lib.w8a16_vectorized.restype = i32
    lib.w8a16_activation_levels.restype = i32
    lib.w8a16_activation_levels.argtypes = [i32]
    lib.w8a8_weight_levels.restype = i32
    lib.w8a8_tile_n.restype = i32
    return lib


W8A16_TILE = 16  # output channels per packed block of w8a16_linear
# Build flags for the kernel without its AMX tiles (benchmarks and tests compare the two).
NO_AMX = ("-mno-amx-tile", "-mno-amx-int8")


def kernel_fits(weight: torch.Tensor, wide: bool = False) -> bool:
    """Whether the vectorized kernel builds here (W8A8: AVX512-VNNI or AVX2; `wide`, W8A16:
    AVX2) and takes this [out, in] weight."""
    out_features, in_features = weight.shape
    lib = build_kernel()
    if weight.device.type != "cpu" or lib is None:
        return False
    if wide:
        return (
            out_features % W8A16_TILE == 0 and in_features % 2 == 0 and bool(lib.w8a16_vectorized())
        )
    return (
        out_features % lib.w8a8_tile_n() == 0
        and in_features % 4 == 0
        and bool(lib.w8a8_vectorized())
    )


class FusedW8A8(nn.Module):
    """x @ w.T for w = q * scale (int8 per output channel, `q` [out, in]) applied to x *
    `inverse_smooth`, plus x's `outliers` channels times `outlier_weight` [out, outliers]
    in fp32. Output in x's dtype (bf16 or fp32), no bias. `wide`: the activations in 16
    bits instead of 8 (w8a16_linear; for inputs with outliers the 16 channels set apart do
    not hold)."""

    packed: torch.Tensor  # [out / tile][in / 4][tile][4] int8 (`w8a8_tile_n()`: 64 or 16);
    # wide: [out / 16][in / 2][16][2]
    colsum: torch.Tensor  # [out] int32, 128 * sum of each output channel's q (wide: unused)
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
        wide: bool = False,
    ) -> None:
        super().__init__()
        out_features, in_features = q.shape
        lib = library or build_kernel()
        if lib is None:
            raise RuntimeError("the w8a8 kernel is not built (no C compiler?)")
        tile, step = (W8A16_TILE, 2) if wide else (lib.w8a8_tile_n(), 4)
        if out_features % tile or in_features % step:
            raise ValueError(f"w8a8 kernel: shape {tuple(q.shape)} is not in whole tiles")
        self.library_index, self.wide = _library_index(lib), wide
        self.out_features, self.in_features = out_features, in_features
        blocks = out_features // tile
        packed = q.view(blocks, tile, in_features // step, step).transpose(1, 2)
        per_block = outlier_weight.float().t().reshape(-1, blocks, tile).transpose(0, 1)
        buffers = {
            "packed": packed.contiguous(),  # [blocks][in / step][tile][step]
            "colsum": 128 * q.sum(1, dtype=torch.int32),
            "scale": scale.float().contiguous(),
            "inverse_smooth": inverse_smooth.float().contiguous(),
            "outliers": outliers.to(torch.int32).contiguous(),
            "outlier_weight": per_block.contiguous(),  # [blocks][outliers][tile]
        }
        for name, tensor in buffers.items():
            self.register_buffer(name, tensor, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype not in (torch.bfloat16, torch.float32):
            rows = rows.float()
        rows = rows.contiguous()
        # Compiled, the op (opaque to Inductor, no graph break); eager, the plain call,
        # which skips the dispatcher's overhead on every projection of a step.
        run = w8a8_linear_op if torch.compiler.is_compiling() else _run
        out = run(
            rows,
            self.inverse_smooth,
            self.packed,
            self.colsum,
            self.scale,
            self.outliers,
            self.outlier_weight,
            self.library_index,
            self.wide,
        )
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)


# The builds FusedW8A8 modules use; the custom op takes an index into this (a ctypes
# library cannot pass through torch's dispatcher).
_LIBRARIES: list[ctypes.CDLL] = []


def _library_index(lib: ctypes.CDLL) -> int:
    for i, known in enumerate(_LIBRARIES):
        if known is lib:
            return i
    _LIBRARIES.append(lib)
    return len(_LIBRARIES) - 1


def _run(
    rows: torch.Tensor,
    inverse_smooth: torch.Tensor,
    packed: torch.Tensor,
    colsum: torch.Tensor,
    scale: torch.Tensor,
    outliers: torch.Tensor,
    outlier_weight: torch.Tensor,
    library: int,
    wide: bool,
) -> torch.Tensor:
    """`FusedW8A8`'s product of contiguous bf16 or fp32 `rows` [tokens, in], by its buffers."""
    out_features = packed.shape[0] * packed.shape[2]
    out = rows.new_empty(rows.shape[0], out_features)
    if rows.shape[0] == 0:
        return out
    is_bf16 = int(rows.dtype == torch.bfloat16)
    lib = _LIBRARIES[library]
    head = (rows.data_ptr(), is_bf16, rows.shape[0], rows.shape[1], inverse_smooth.data_ptr())
    weights = (packed.data_ptr(),) if wide else (packed.data_ptr(), colsum.data_ptr())
    tail = (scale.data_ptr(), outliers.data_ptr(), outliers.shape[0], outlier_weight.data_ptr())
    run = lib.w8a16_linear if wide else lib.w8a8_linear
    status = run(*head, *weights, *tail, out.data_ptr(), is_bf16, out_features)
    if status:
        raise RuntimeError(f"w8a8 kernel failed ({status})")
    return out


# `--enable-torch-compile` with decode steps on this kernel's route: one op in the graph
# (as paged_decode.py's), where a plain ctypes call would break the graph at every
# projection and make compiled steps slower than eager ones (measured in bench/README.md).
w8a8_linear_op = torch.library.custom_op("redserve::w8a8_linear", _run, mutates_args=())


@w8a8_linear_op.register_fake
def _(
    rows: torch.Tensor, inverse_smooth: torch.Tensor, packed: torch.Tensor, *rest: object
) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], packed.shape[0] * packed.shape[2])

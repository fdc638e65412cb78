"""One-token decode steps in one C call (fused_decode.c), for int4-quantized Llama-family
models on CPUs with AVX512-VNNI.

A torch forward of one token runs some 750 small ops for SmolLM2-135M, and their dispatch,
not their arithmetic, is most of a single stream's step: the kernel runs the whole step
(every layer, attention over the paged cache included) as loops in one OpenMP region. Its
projections multiply the int4 groups (`Int4Tiles`, the same grid as the int4 kernel's) by
activations quantized to int8 per group of 32, as llama.cpp multiplies a Q4_1 file, and
keep the residual stream, norms, rope and attention in fp32. Whether it serves is timed at
load against the torch forward (engine/kernel_choices.py).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.scheduler.kernels.c_build import build_library

SOURCE = Path(__file__).parent / "csrc" / "fused_decode.c"
GROUP, TILE = 32, 16  # the kernel's input groups and output tiles
LAYER_POINTERS = 16  # per layer: 4 projections x (packed, scales, mins), 2 norms, K, V


class Shape(ctypes.Structure):
    """The model's sizes and the cache's layout, as fused_decode.c's `Shape`."""

    _fields_ = [
        ("layers", ctypes.c_int),
        ("hidden", ctypes.c_int),
        ("inter", ctypes.c_int),
        ("heads", ctypes.c_int),
        ("kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int),
        ("block_size", ctypes.c_int),
        ("kv_bf16", ctypes.c_int),
        ("slots", ctypes.c_int64),
        ("eps", ctypes.c_float),
    ]


@functools.cache
def build() -> ctypes.CDLL | None:
    """The kernel built for this CPU, or None (no compiler, or no AVX512-VNNI here)."""
    lib = build_library(SOURCE)
    if lib is None:
        return None
    pointer, i32 = ctypes.c_void_p, ctypes.c_int
    lib.fused_available.restype = i32
    lib.fused_scratch_bytes.restype = ctypes.c_int64
    lib.fused_decode.restype = i32
    lib.fused_decode.argtypes = [pointer, pointer, pointer, i32, pointer, pointer, pointer]
    lib.fused_decode.argtypes += [i32, i32, pointer, i32, pointer, i32, pointer]
    return lib if lib.fused_available() else None


def available() -> bool:
    return build() is not None


@dataclass
class Int4Tiles:
    """A projection's int4 groups in the kernel's layout: w = scale * q + low per group of 32
    inputs; tiles of 16 output rows, each 64-byte chunk 4 bytes of every row (8 inputs: the
    low nibbles inputs 0-3, the high ones 4-7); scales and lows fp16 [out / 16][in / 32][16]."""

    packed: torch.Tensor
    scales: torch.Tensor
    lows: torch.Tensor

    @classmethod
    def of(cls, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> Int4Tiles:
        """From `q` [out, in] in 0..15 and `scale`, `low` [out, in / 32]."""
        out_features, in_features = q.shape
        tiles, groups = out_features // TILE, in_features // GROUP
        # (tile, row, group, chunk, nibble, byte) -> (tile, group, chunk, row, byte)
        q = q.to(torch.uint8).view(tiles, TILE, groups, 4, 2, 4)
        packed = q[..., 0, :] | (q[..., 1, :] << 4)
        packed = packed.permute(0, 2, 3, 1, 4).contiguous()

        def per_tile(values: torch.Tensor) -> torch.Tensor:
            return values.view(tiles, TILE, groups).transpose(1, 2).to(torch.float16).contiguous()

        return cls(packed, per_tile(scale), per_tile(low))

    def pointers(self) -> list[int]:
        return [self.packed.data_ptr(), self.scales.data_ptr(), self.lows.data_ptr()]


def tiles_fit(out_features: int, in_features: int) -> bool:
    return out_features % TILE == 0 and in_features % GROUP == 0


class FusedDecoder:
    """The fused step over a model's weights and KV cache: `layers` gives each layer's four
    projections' `Int4Tiles` (qkv, o, gate_up, down) with its two norms' weights, `caches`
    its K and V [kv_heads, slots, head_dim] (bf16 or fp32). The tensors it points at must
    outlive it; it holds them."""

    def __init__(
        self,
        shape: Shape,
        layers: list[tuple[list[Int4Tiles], torch.Tensor, torch.Tensor]],
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        embed: torch.Tensor,
        final_norm: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        out_dtype: torch.dtype,
    ) -> None:
        lib = build()
        assert lib is not None
        self.lib, self.shape, self.out_dtype = lib, shape, out_dtype
        self.embed = embed.contiguous()
        self.norms = [(a.float().contiguous(), b.float().contiguous()) for _, a, b in layers]
        self.final_norm = final_norm.float().contiguous()
        self.rope = tuple(table.float().contiguous() for table in rope)
        self.tiles = [tiles for tiles, _, _ in layers]
        pointers: list[int] = []
        for tiles, (input_norm, post_norm), (k, v) in zip(
            self.tiles, self.norms, caches, strict=True
        ):
            pointers += [p for t in tiles for p in t.pointers()]
            pointers += [input_norm.data_ptr(), post_norm.data_ptr(), k.data_ptr(), v.data_ptr()]
        assert len(pointers) == LAYER_POINTERS * len(layers)
        self.pointers = (ctypes.c_void_p * len(pointers))(*pointers)
        self.caches = caches
        self.scratch = torch.empty(lib.fused_scratch_bytes() + 64, dtype=torch.uint8)

    def __call__(self, token: int, position: int, block_table: list[int]) -> torch.Tensor:
        """The final normed hidden state [1, hidden] of `token` at `position` of a sequence
        whose cache blocks are `block_table`; its K/V are written to the cache."""
        if not (0 <= token < self.embed.shape[0] and 0 <= position < self.rope[0].shape[0]):
            # The C side reads the tables unchecked; the torch forward raises here too.
            raise IndexError(f"token {token} at position {position} is outside the model")
        out = torch.empty(1, self.shape.hidden, dtype=self.out_dtype)
        table = (ctypes.c_int32 * len(block_table))(*block_table)
        scratch = -self.scratch.data_ptr() % 64 + self.scratch.data_ptr()
        failed = self.lib.fused_decode(
            self.pointers,
            ctypes.byref(self.shape),
            self.embed.data_ptr(),
            int(self.embed.dtype == torch.bfloat16),
            self.final_norm.data_ptr(),
            self.rope[0].data_ptr(),
            self.rope[1].data_ptr(),
            token,
            position,
            table,
            len(block_table),
            out.data_ptr(),
            int(self.out_dtype == torch.bfloat16),
            scratch,
        )
        if failed:
            raise RuntimeError(f"fused decode step failed ({failed})")
        return out

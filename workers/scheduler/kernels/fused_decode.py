"""Decode steps (one new token for each of a batch of sequences), and prefill chunks beside
them (a row per new token), in one C call (fused_decode.c), for int4-quantized Llama-family
models on CPUs with AVX512-VNNI or AVX2.

A torch forward of a decode step runs some 750 small ops for SmolLM2-135M, and their
dispatch, not their arithmetic, is most of a small batch's step: the kernel runs the whole
step (every layer, attention over the paged cache included) as loops in one OpenMP region,
reading each weight tile once for the whole batch. Its
projections multiply the int4 groups (`Tiles`, the same grid as the int4 kernel's) by
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
from torch import nn

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
def build(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernel built for this CPU, or None (no compiler, or no AVX512-VNNI nor AVX2).
    `extra_flags`: for tests, e.g. -mno-avx512f for the AVX2 path on an AVX-512 CPU."""
    lib = build_library(SOURCE, extra_flags)
    if lib is None:
        return None
    pointer, i32 = ctypes.c_void_p, ctypes.c_int
    lib.fused_available.restype = i32
    lib.fused_scratch_bytes.restype = ctypes.c_int64
    lib.fused_decode.restype = i32
    lib.fused_scratch_bytes.argtypes = [pointer, i32]
    lib.fused_linear_scratch_bytes.restype = ctypes.c_int64
    lib.fused_linear_scratch_bytes.argtypes = [i32, i32]
    lib.fused_linear.restype = i32
    lib.fused_linear.argtypes = [pointer, pointer, pointer, i32, i32, i32, pointer, i32, i32]
    lib.fused_linear.argtypes += [pointer, pointer]
    lib.fused_decode.argtypes = [pointer, pointer, pointer, i32, pointer, pointer, pointer]
    lib.fused_decode.argtypes += [i32, pointer, pointer, pointer, i32, pointer, i32, pointer]
    return lib if lib.fused_available() else None


def available() -> bool:
    return build() is not None


def _per_tile(values: torch.Tensor, tiles: int, groups: int) -> torch.Tensor:
    """[out, in / 32] -> fp16 [out / 16][in / 32][16]."""
    return values.view(tiles, TILE, groups).transpose(1, 2).to(torch.float16).contiguous()


@dataclass
class Tiles:
    """A matrix's groups in the kernel's layout: w = scale * code + low per group of 32
    inputs; tiles of 16 output rows, each 64-byte chunk 4 bytes of every row; scales and
    lows fp16 [out / 16][in / 32][16]. int4 (`bits` 4): a chunk holds 8 inputs, the low
    nibbles inputs 0-3 and the high ones 4-7. 8-bit: a chunk holds 4 inputs."""

    packed: torch.Tensor
    scales: torch.Tensor
    lows: torch.Tensor
    bits: int = 4

    @classmethod
    def int4(cls, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> Tiles:
        """From `q` [out, in] in 0..15 and `scale`, `low` [out, in / 32]."""
        out_features, in_features = q.shape
        tiles, groups = out_features // TILE, in_features // GROUP
        # (tile, row, group, chunk, nibble, byte) -> (tile, group, chunk, row, byte)
        q = q.to(torch.uint8).view(tiles, TILE, groups, 4, 2, 4)
        packed = q[..., 0, :] | (q[..., 1, :] << 4)
        packed = packed.permute(0, 2, 3, 1, 4).contiguous()
        return cls(packed, _per_tile(scale, tiles, groups), _per_tile(low, tiles, groups))

    @classmethod
    def int8(cls, weight: torch.Tensor) -> Tiles:
        """`weight` [out, in] in symmetric int8 per group of 32 (Q8_0's grid: w = scale * q,
        q in -127..127, fp16 scales), stored as codes q + 128 with low -128 * scale."""
        out_features, in_features = weight.shape
        tiles, groups = out_features // TILE, in_features // GROUP
        grouped = weight.detach().float().view(out_features, groups, GROUP)
        scale = (grouped.abs().amax(-1) / 127).half().float().clamp(min=2**-24)
        q = torch.round(grouped / scale.unsqueeze(-1)).clamp(-127, 127)
        codes = (q + 128).to(torch.uint8).view(tiles, TILE, groups, 8, 4)
        packed = codes.permute(0, 2, 3, 1, 4).contiguous()  # (tile, group, chunk, row, byte)
        scales = _per_tile(scale, tiles, groups)
        return cls(packed, scales, scales * -128, bits=8)

    def pointers(self) -> list[int]:
        return [self.packed.data_ptr(), self.scales.data_ptr(), self.lows.data_ptr()]


def tiles_fit(out_features: int, in_features: int) -> bool:
    return out_features % TILE == 0 and in_features % GROUP == 0


class FusedDecoder:
    """The fused step over a model's weights and KV cache, for steps of up to `max_rows`
    new tokens: `layers` gives each layer's four projections' `Tiles` (qkv, o, gate_up,
    down) with its two norms' weights, `caches` its K and V [kv_heads, slots, head_dim]
    (bf16 or fp32). The tensors it points at must outlive it; it holds them."""

    def __init__(
        self,
        shape: Shape,
        layers: list[tuple[list[Tiles], torch.Tensor, torch.Tensor]],
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        embed: torch.Tensor,
        final_norm: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        out_dtype: torch.dtype,
        max_rows: int,
    ) -> None:
        lib = build()
        assert lib is not None
        self.lib, self.shape, self.out_dtype, self.max_rows = lib, shape, out_dtype, max_rows
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
        scratch_bytes = lib.fused_scratch_bytes(ctypes.byref(shape), max_rows)
        self.scratch = torch.empty(scratch_bytes + 64, dtype=torch.uint8)

    def __call__(
        self, tokens: list[int], positions: list[int], block_tables: list[list[int]]
    ) -> torch.Tensor:
        """The final normed hidden states [B, hidden] of `tokens`, each at its position of
        a sequence whose cache blocks are its row of `block_tables`; their K/V are written
        to the cache."""
        batch = len(tokens)
        if not 0 < batch <= self.max_rows:
            raise ValueError(f"a step of {batch} tokens (this decoder takes 1-{self.max_rows})")
        vocab, max_position = self.embed.shape[0], self.rope[0].shape[0]
        for token, position in zip(tokens, positions, strict=True):
            if not (0 <= token < vocab and 0 <= position < max_position):
                # The C side reads the tables unchecked; the torch forward raises here too.
                raise IndexError(f"token {token} at position {position} is outside the model")
        out = torch.empty(batch, self.shape.hidden, dtype=self.out_dtype)
        width = max(len(table) for table in block_tables)
        rows = [table + [0] * (width - len(table)) for table in block_tables]
        tables = (ctypes.c_int32 * (batch * width))(*(block for row in rows for block in row))
        scratch = -self.scratch.data_ptr() % 64 + self.scratch.data_ptr()
        failed = self.lib.fused_decode(
            self.pointers,
            ctypes.byref(self.shape),
            self.embed.data_ptr(),
            int(self.embed.dtype == torch.bfloat16),
            self.final_norm.data_ptr(),
            self.rope[0].data_ptr(),
            self.rope[1].data_ptr(),
            batch,
            (ctypes.c_int32 * batch)(*tokens),
            (ctypes.c_int32 * batch)(*positions),
            tables,
            width,
            out.data_ptr(),
            int(self.out_dtype == torch.bfloat16),
            scratch,
        )
        if failed:
            raise RuntimeError(f"fused decode step failed ({failed})")
        return out


class FusedLinear(nn.Module):
    """x @ w.T through the step's tile products alone (`fused_linear`): w in `Tiles`, x
    quantized to int8 per group of 32. Offered to the routes (layers/tiered.py) of the LM
    head as 8-bit groups and of int4 projections as their int4 groups, where it is timed
    against torch's kernels. Output in x's dtype (computed in fp32), no bias."""

    def __init__(self, tiles: Tiles) -> None:
        super().__init__()
        self.tiles = tiles
        tile_count, groups = tiles.scales.shape[:2]
        self.out_features, self.in_features = tile_count * TILE, groups * GROUP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype not in (torch.bfloat16, torch.float32):
            rows = rows.float()
        run = fused_linear_op if torch.compiler.is_compiling() else _run
        tiles = self.tiles
        out = run(rows.contiguous(), tiles.packed, tiles.scales, tiles.lows, tiles.bits)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)


def _run(
    rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor, bits: int
) -> torch.Tensor:
    """`FusedLinear`'s product of contiguous bf16 or fp32 `rows` [tokens, in], in fp32."""
    out_features, in_features = scales.shape[0] * TILE, scales.shape[1] * GROUP
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    if rows.shape[0] == 0:
        return out
    lib = build()
    assert lib is not None
    scratch = torch.empty(
        lib.fused_linear_scratch_bytes(in_features, rows.shape[0]) + 64, dtype=torch.uint8
    )
    failed = lib.fused_linear(
        packed.data_ptr(), scales.data_ptr(), lows.data_ptr(), bits, out_features,
        in_features, rows.data_ptr(), int(rows.dtype == torch.bfloat16), rows.shape[0],
        out.data_ptr(), -scratch.data_ptr() % 64 + scratch.data_ptr(),
    )  # fmt: skip
    if failed:
        raise RuntimeError(f"fused linear failed ({failed})")
    return out


# Under `--enable-torch-compile`: one op of the graph (as w8a8.py's), not a break.
fused_linear_op = torch.library.custom_op("redserve::fused_linear", _run, mutates_args=())


@fused_linear_op.register_fake
def _(
    rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor, bits: int
) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], scales.shape[0] * TILE, dtype=torch.float32)

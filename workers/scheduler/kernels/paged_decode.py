"""Decode attention that reads K/V in place from the paged cache on CPU (bf16 caches under bf16
or fp32 queries, and fp32 ones of quantized runners: plain fp32 stays on SDPA, the exact
reference): a small C kernel (paged_decode.c) built with gcc when the scheduler loads,
called through ctypes.

The torch path gathers every decoding sequence's context blocks into a fresh [kv_heads, B,
Lk, head_dim] tensor per layer, then runs two batched matmuls and a softmax over it: the
gather copies the whole context every layer of every step, a visible share of a served
step. The kernel reads each K/V row once where it lies, so decode attention and the engine's
decode steps get shorter, the more so the more sequences a step carries (timed with the
layers' caches visited in turn as a step does, so K/V come from memory, not a warm cache;
`bench/steps.py --paged-ab`; measured in bench/README.md).

Whether it serves is timed at load beside the torch paths (layers/attention_tuning.py);
without a C compiler, or if the build fails, the torch paths serve. `torch.compile` sees it
as a custom op (`redserve::paged_decode`), opaque to Inductor.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from workers.scheduler.kernels.c_build import build_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
MAX_HEAD_DIM, MAX_GROUP = 256, 16  # as the C source's arrays


def kernel_library() -> ctypes.CDLL | None:
    """The kernel built for this CPU, or None where no C compiler is found or the build
    fails."""
    return build_kernel(())


@functools.cache
def build_kernel(extra_flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The kernel built with `extra_flags` after the usual ones (tests build the portable
    loops with -mno-avx512f)."""
    lib = build_library(SOURCE, extra_flags)
    if lib is None:
        return None
    pointer, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    for name in _ENTRY_POINTS.values():
        function = getattr(lib, name)
        function.restype = i32
        function.argtypes = [pointer, i64, pointer, pointer, pointer, pointer, i32, pointer]
        function.argtypes += [i32, i32, i32, i32, i64, i32, ctypes.c_float]
    return lib


def kernel_fits(query: torch.Tensor, kv_dtype: torch.dtype, kv_heads: int) -> bool:
    """Whether the kernel can serve decodes of query rows like `query` [B, heads, head_dim]
    over a cache of `kv_dtype` (and builds here)."""
    _, heads, head_dim = query.shape
    return (
        (query.dtype, kv_dtype) in _ENTRY_POINTS
        and query.device.type == "cpu"
        and head_dim <= MAX_HEAD_DIM
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP
        and kernel_library() is not None
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Attention output [B, heads, head_dim] of one query row per sequence, `q` [B, heads,
    head_dim] (rows may be strided), over each sequence's first `context_lens[b]` cache
    slots through `block_tables` [B, blocks] (int32); K/V caches [kv_heads, slots, d]."""
    if torch.compiler.is_compiling():
        return paged_decode_op(q, k_cache, v_cache, block_tables, context_lens, block_size)
    return _run(q, k_cache, v_cache, block_tables, context_lens, block_size)


def _run(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    lib = kernel_library()
    if lib is None:
        raise RuntimeError("the paged decode kernel is not built")
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    # The C side reads raw pointers: a wrong dtype or layout would read out of bounds.
    # (Plain comparisons: this runs once per layer, where a generator's cost per call shows.)
    function = _ENTRY_POINTS.get((q.dtype, k_cache.dtype))
    if not (
        function is not None
        and block_tables.dtype == context_lens.dtype == torch.int32
        and v_cache.dtype == k_cache.dtype
        and context_lens.shape[0] == block_tables.shape[0] == q.shape[0]
        and block_tables.is_contiguous()
        and context_lens.is_contiguous()
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    ):
        raise ValueError(
            "paged_decode: int32 contiguous tables; contiguous caches of q's dtype (bf16 or "
            "fp32) or bf16 under fp32 queries"
        )
    num_seqs, heads, head_dim = q.shape
    kv_heads, slots, _ = k_cache.shape
    out = q.new_empty((num_seqs, heads, head_dim))
    status = getattr(lib, function)(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        context_lens.data_ptr(),
        num_seqs,
        heads,
        kv_heads,
        head_dim,
        slots,
        block_size,
        head_dim**-0.5,
    )
    if status:
        raise RuntimeError(f"paged decode kernel failed ({status})")
    return out


# (query dtype, cache dtype) -> the C entry point
_ENTRY_POINTS = {
    (torch.bfloat16, torch.bfloat16): "paged_decode_bf16",
    (torch.float32, torch.float32): "paged_decode_f32",
    (torch.float32, torch.bfloat16): "paged_decode_f32_bf16kv",
}


@torch.library.custom_op("redserve::paged_decode", mutates_args=())
def paged_decode_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    return _run(q, k_cache, v_cache, block_tables, context_lens, block_size)


@paged_decode_op.register_fake
def _(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    return q.new_empty(q.shape)

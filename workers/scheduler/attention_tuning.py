"""Which attention kernels a bf16/fp16 (or quantized fp32) CPU runner takes, timed at load on
the machine (as tiered.py does for the projections).

The fastest one differs between CPUs. Per layer, SmolLM2's heads, torch 2.13: on 2 AMD
EPYC cores with AVX512-BF16, torch's bf16 SDPA ran 1.5-4x slower than upcasting q/k/v to
fp32 for it, and one query per sequence ran fastest as two batched matmuls
(`Attention._attend_decodes`); on 2 Sapphire Rapids cores (AMX) bf16 SDPA is 3x faster than
upcasting (16 prefills of 128 tokens: 2.8 vs 8.6 ms) and beats the matmuls on decodes (16
sequences of 256 tokens: 196 vs 298 us; equal at 64). Where gcc builds it, the paged C
kernel (paged_decode.py) is timed on the same decodes, and serves them if fastest.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from workers.scheduler.llama import Attention, AttentionGroup
from workers.scheduler.paged_decode import kernel_fits, paged_decode

PREFILL_SHAPE = (4, 64, 128)  # sequences, new tokens each, context
DECODE_SHAPE = (16, 256)  # sequences, context


@dataclass(frozen=True)
class AttentionChoice:
    upcast_sdpa: bool  # prefill chunks (and decodes without the matmuls): SDPA in fp32
    matmul_decodes: bool  # decode groups: two batched matmuls instead of SDPA
    paged_decodes: bool = False  # decode groups: paged_decode.py's kernel, before both


@torch.inference_mode()
def choose_attention(
    attention: Attention, dtype: torch.dtype, kv_dtype: torch.dtype, repeats: int = 5
) -> AttentionChoice:
    """Times SDPA with and without the upcast on a prefill-shaped call, then the decode
    matmuls, SDPA (as just chosen) and the paged kernel on a decode-shaped one; median of
    `repeats`. Queries in `dtype`, the cache in `kv_dtype`."""
    prefill, prefill_inputs = _prefill_group(attention, dtype, kv_dtype)
    attention.upcast_sdpa = True
    upcast = _median_time(lambda: attention._attend_group(*prefill_inputs, prefill), repeats)
    attention.upcast_sdpa = False
    native = _median_time(lambda: attention._attend_group(*prefill_inputs, prefill), repeats)
    upcast_sdpa = attention.upcast_sdpa = upcast < native
    decode, decode_inputs, score_bias = _decode_group(attention, dtype, kv_dtype)
    sdpa = _median_time(lambda: attention._attend_group(*decode_inputs, decode), repeats)
    by_matmuls = replace(decode, score_bias=score_bias)  # takes Attention._attend_decodes
    matmuls = _median_time(lambda: attention._attend_group(*decode_inputs, by_matmuls), repeats)
    paged = float("inf")
    if kernel_fits(decode_inputs[0], kv_dtype, attention.num_kv_heads):
        paged_inputs = _paged_inputs(decode_inputs)
        paged = _median_time(lambda: paged_decode(*paged_inputs), repeats)
    return AttentionChoice(
        upcast_sdpa=upcast_sdpa,
        matmul_decodes=matmuls < sdpa,
        paged_decodes=paged < min(matmuls, sdpa),
    )


def _median_time(call: Callable[[], object], repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _paged_inputs(
    decode_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The decode inputs as the kernel reads them: the contexts [kv_heads, seqs, context, d]
    seen as a cache of [kv_heads, seqs * context, d] slots, sequence b in blocks b * n ..."""
    q, keys, values = decode_inputs
    kv_heads, seqs, context, head_dim = keys.shape
    block_size = 16
    blocks = context // block_size
    tables = torch.arange(seqs * blocks, dtype=torch.int32).view(seqs, blocks)
    lengths = torch.linspace(context // 2, context, seqs).to(torch.int32)
    k_cache, v_cache = (c.reshape(kv_heads, seqs * context, head_dim) for c in (keys, values))
    return q, k_cache, v_cache, tables, lengths, block_size


def _inputs(
    attention: Attention,
    dtypes: tuple[torch.dtype, torch.dtype],
    queries: int,
    seqs: int,
    context: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q rows [queries, heads, head_dim] and a context [kv_heads, seqs, context, d],
    in `dtypes` (queries', cache's)."""
    kv_shape = (attention.num_kv_heads, seqs, context, attention.head_dim)
    return (
        torch.randn(queries, attention.num_heads, attention.head_dim).to(dtypes[0]),
        torch.randn(kv_shape).to(dtypes[1]),
        torch.randn(kv_shape).to(dtypes[1]),
    )


def _prefill_group(
    attention: Attention, dtype: torch.dtype, kv_dtype: torch.dtype
) -> tuple[AttentionGroup, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    seqs, new, context = PREFILL_SHAPE
    key_pos = torch.arange(context)
    q_pos = torch.arange(context - new, context).unsqueeze(1)
    mask = (key_pos <= q_pos).expand(seqs, 1, new, context)
    rows = torch.arange(seqs * new)
    group = AttentionGroup(token_index=rows, padded_index=rows, kv_rows=rows, mask=mask)
    return group, _inputs(attention, (dtype, kv_dtype), seqs * new, seqs, context)


def _decode_group(
    attention: Attention, dtype: torch.dtype, kv_dtype: torch.dtype
) -> tuple[AttentionGroup, tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    seqs, context = DECODE_SHAPE
    lengths = torch.linspace(context // 2, context, seqs).long()
    mask = (torch.arange(context) < lengths.unsqueeze(1)).view(seqs, 1, 1, context)
    score_bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf")).view(1, seqs, 1, -1)
    rows = torch.arange(seqs)
    group = AttentionGroup(token_index=rows, padded_index=rows, kv_rows=rows, mask=mask)
    return group, _inputs(attention, (dtype, kv_dtype), seqs, seqs, context), score_bias

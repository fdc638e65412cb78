"""Which attention kernels a bf16/fp16 (or quantized fp32) CPU runner takes, timed at load on
the machine (as tiered.py does for the projections).

The fastest one differs between CPUs, and the order can flip: on some, torch's bf16 SDPA
runs slower than upcasting q/k/v to fp32 for it and one query per sequence runs fastest as
two batched matmuls (`Attention._attend_matmuls`); on others (AMX) bf16 SDPA beats both the
upcast and the matmuls (measured in bench/README.md). Where gcc builds it, the paged C
kernel (kernels/paged_decode.py) is timed on the same decodes, and serves them if fastest.
Prefill chunks over short contexts may take the matmuls too: timed on fresh prompts of 128,
256 and 512 tokens, they serve contexts up to the longest at which they still won.

The candidates are timed in rounds, each round calling every one of them once, and each keeps
its best time: `redserve up` starts the api beside the scheduler, and timed back to back a
burst of other work can fall on one candidate's samples only, which would pick a slower
kernel for the whole run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from workers.scheduler.engine.batch import AttentionGroup, score_bias
from workers.scheduler.kernels.paged_decode import kernel_fits, paged_decode
from workers.scheduler.model.llama import Attention

PREFILL_SHAPE = (4, 64, 128)  # sequences, new tokens each, context
DECODE_SHAPE = (16, 256)  # sequences, context
# Fresh prompts of these lengths, as many as fill a step of PREFILL_TOKENS, for the prefill
# matmuls (whose scores grow with the square of the context).
PREFILL_CONTEXTS = (128, 256, 512)
PREFILL_TOKENS = 2048


@dataclass(frozen=True)
class AttentionChoice:
    upcast_sdpa: bool  # prefill chunks (and decodes without the matmuls): SDPA in fp32
    matmul_decodes: bool  # decode groups: two batched matmuls instead of SDPA
    paged_decodes: bool = False  # decode groups: kernels/paged_decode.py's kernel, before both
    # prefill chunks over contexts up to this many tokens: two batched matmuls, not SDPA
    matmul_prefill_max_context: int = 0


@torch.inference_mode()
def choose_attention(
    attention: Attention, dtype: torch.dtype, kv_dtype: torch.dtype, rounds: int = 7
) -> AttentionChoice:
    """Times SDPA with and without the upcast on a prefill-shaped call, then the decode
    matmuls, SDPA (as just chosen) and the paged kernel on a decode-shaped one; best of
    `rounds`. Queries in `dtype`, the cache in `kv_dtype`."""
    prefill, prefill_inputs = _prefill_group(attention, dtype, kv_dtype, PREFILL_SHAPE)

    def sdpa_prefill(upcast: bool) -> Callable[[], object]:
        def call() -> object:
            attention.upcast_sdpa = upcast
            return attention._attend_group(*prefill_inputs, prefill)

        return call

    prefills = _best_times({"upcast": sdpa_prefill(True), "native": sdpa_prefill(False)}, rounds)
    upcast_sdpa = attention.upcast_sdpa = prefills["upcast"] < prefills["native"]
    decode, decode_inputs = _decode_group(attention, dtype, kv_dtype)
    by_matmuls = replace(decode, score_bias=score_bias(decode.mask))
    decodes: dict[str, Callable[[], object]] = {
        "sdpa": lambda: attention._attend_group(*decode_inputs, decode),
        "matmuls": lambda: attention._attend_group(*decode_inputs, by_matmuls),
    }
    if kernel_fits(decode_inputs[0], kv_dtype, attention.num_kv_heads):
        paged_inputs = _paged_inputs(decode_inputs)
        decodes["paged"] = lambda: paged_decode(*paged_inputs)
    best = _best_times(decodes, rounds)
    torch_paths = min(best["matmuls"], best["sdpa"])
    return AttentionChoice(
        upcast_sdpa=upcast_sdpa,
        matmul_decodes=best["matmuls"] < best["sdpa"],
        paged_decodes=best.get("paged", float("inf")) < torch_paths,
        matmul_prefill_max_context=_matmul_prefill_max_context(attention, dtype, kv_dtype, rounds),
    )


def _matmul_prefill_max_context(
    attention: Attention, dtype: torch.dtype, kv_dtype: torch.dtype, rounds: int
) -> int:
    """The longest of PREFILL_CONTEXTS up to which fresh prompts' attention runs faster as
    matmuls than through SDPA (as chosen); 0 where SDPA wins at the shortest."""
    longest = 0
    for context in PREFILL_CONTEXTS:
        shape = (PREFILL_TOKENS // context, context, context)
        group, inputs = _prefill_group(attention, dtype, kv_dtype, shape)
        calls = {
            path: _attend_call(attention, inputs, replace(group, score_bias=bias))
            for path, bias in (("sdpa", None), ("matmuls", score_bias(group.mask)))
        }
        best = _best_times(calls, rounds)
        if best["matmuls"] >= best["sdpa"]:
            break
        longest = context
    return longest


def _attend_call(
    attention: Attention,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    group: AttentionGroup,
) -> Callable[[], object]:
    return lambda: attention._attend_group(*inputs, group)


def _best_times(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each call's shortest time over `rounds` rounds of calling them all in turn (after one
    untimed call each)."""
    for call in calls.values():
        call()
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


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
    attention: Attention,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    shape: tuple[int, int, int],
) -> tuple[AttentionGroup, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Chunks of `new` tokens ending `seqs` contexts of `context` tokens."""
    seqs, new, context = shape
    key_pos = torch.arange(context)
    q_pos = torch.arange(context - new, context).unsqueeze(1)
    mask = (key_pos <= q_pos).expand(seqs, 1, new, context)
    rows = torch.arange(seqs * new)
    group = AttentionGroup(token_index=rows, padded_index=rows, kv_rows=rows, mask=mask)
    return group, _inputs(attention, (dtype, kv_dtype), seqs * new, seqs, context)


def _decode_group(
    attention: Attention, dtype: torch.dtype, kv_dtype: torch.dtype
) -> tuple[AttentionGroup, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    seqs, context = DECODE_SHAPE
    lengths = torch.linspace(context // 2, context, seqs).long()
    mask = (torch.arange(context) < lengths.unsqueeze(1)).view(seqs, 1, 1, context)
    rows = torch.arange(seqs)
    group = AttentionGroup(token_index=rows, padded_index=rows, kv_rows=rows, mask=mask)
    return group, _inputs(attention, (dtype, kv_dtype), seqs, seqs, context)

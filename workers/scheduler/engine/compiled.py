"""Decode steps through torch.compile (`--enable-torch-compile`, `--torch-compile-max-bs`, as
SGLang names them).

A decode step of a few sequences on a few CPU cores is only partly its matmuls: eager
PyTorch dispatches a small op at a time (norms, RoPE, cache writes, views, SiLU), dozens
per layer, and their overhead is a large share of the step. Inductor fuses them into a few
C++ loops per layer; the matmuls and attention stay torch's own kernels (the same packed
int4/int8 and oneDNN calls as eager). Measured in bench/README.md.

Two graphs for steps where every sequence brings one token (decodes): one for a single
sequence (static shapes: the tightest loops, for the latency of a lone stream) and one for 2
to `max_batch` sequences, the batch a dynamic dimension (a graph per size would take the
compile time of one graph for every size up to `max_batch`); the context length is dynamic
in both. Where the step size picks a kernel (quantization's routes), dynamo guards on it and
compiles a graph per route range. Prefill chunks, mixed steps and larger batches stay eager.
Compiling a graph is slow on a CPU, so `warm_up` does it at load, before the scheduler
takes jobs, running every size; a step that would still need a new graph afterwards runs
eager instead: no request waits on the compiler. Needs a C++ compiler (g++) at run time.

Inductor's fused loops sum in another order than eager's kernels (hidden states within 1e-4,
tests/model/test_compiled.py), so a greedy token can differ from eager's at a near-tie:
opt-in, and eager fp32 stays the exact reference.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch
from torch._dynamo import config as dynamo_config
from torch._dynamo.utils import counters

from shared.protocol import SamplingParams
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine.batch import AttentionBatch, LayerCache
from workers.scheduler.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


class CompiledDecode:
    """`model.forward` compiled for decode steps of up to `max_batch` sequences."""

    def __init__(self, model: LlamaForCausalLM, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"torch_compile_max_bs must be at least 1, not {max_batch}")
        if shutil.which("g++") is None:
            raise RuntimeError("--enable-torch-compile needs a C++ compiler (g++) on PATH")
        self.max_batch = max_batch
        self.calls = 0  # steps that ran compiled
        self._compiling = False  # only warm_up compiles; afterwards a new shape runs eager
        self._forward: Callable[..., torch.Tensor] = torch.compile(model.forward)

    def takes(self, seqs: Seq[Sequence]) -> bool:
        return len(seqs) <= self.max_batch and all(seq.num_new_tokens == 1 for seq in seqs)

    def __call__(
        self, input_ids: torch.Tensor, batch: AttentionBatch, kv_cache: Seq[LayerCache]
    ) -> torch.Tensor:
        _mark_dynamic_dims(input_ids, batch, kv_cache)
        self.calls += 1
        with torch.compiler.set_stance("default" if self._compiling else "eager_on_recompile"):
            return self._forward(input_ids, batch, kv_cache)

    def warm_up(
        self, forward: Callable[[list[Sequence]], object], num_kv_blocks: int, block_size: int
    ) -> None:
        """Compiles the graphs by running `forward` (the runner's, which routes decode steps
        here) on decode steps of every size over the first cache blocks (before any request
        holds a block, so the K/V it writes there is never read), each size at two context
        lengths so that the length is compiled as dynamic."""
        num_blocks = min(3, num_kv_blocks)
        # Dynamo must not turn dimensions dynamic on its own (`_mark_dynamic_dims` says
        # which are), and may keep a graph per route range. Compiling happens only here.
        self._compiling = True
        with dynamo_config.patch(automatic_dynamic_shapes=False, recompile_limit=64):
            for size in range(1, self.max_batch + 1):
                started, graphs = time.monotonic(), counters["stats"]["unique_graphs"]
                for blocks in sorted({max(1, num_blocks - 1), num_blocks}):
                    seqs = [_warm_up_sequence(i, blocks, block_size) for i in range(size)]
                    forward(seqs)
                elapsed = time.monotonic() - started
                if counters["stats"]["unique_graphs"] > graphs:
                    logger.info("compiled decode steps of %d sequences in %.1fs", size, elapsed)
        self._compiling = False


def _mark_dynamic_dims(
    input_ids: torch.Tensor, batch: AttentionBatch, kv_cache: Seq[LayerCache]
) -> None:
    """The context length, always; the batch (a token per sequence) from 2 sequences on; the
    KV cache's slots (its size follows the free memory at start, so a restart's graphs are
    those on disk only if they do not depend on it)."""
    for layer_cache in kv_cache:
        for cache in layer_cache:
            torch._dynamo.maybe_mark_dynamic(cache, 1)
    batched = input_ids.shape[0] > 1
    if batched:
        for tensor in (input_ids, batch.positions, batch.slot_mapping, batch.last_index):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
    for group in batch.groups:  # the context length: [kv_heads * blocks] rows, [.., Lk]
        torch._dynamo.maybe_mark_dynamic(group.kv_rows, 0)
        torch._dynamo.maybe_mark_dynamic(group.mask, 3)
        if group.score_bias is not None:
            torch._dynamo.maybe_mark_dynamic(group.score_bias, 4)
        if group.block_tables is not None:
            torch._dynamo.maybe_mark_dynamic(group.block_tables, 1)
        if batched:  # [Tg], [Tg], [B, 1, Lq, Lk], [1, B, 1, Lq, Lk], [B, blocks], [B]
            for tensor in (group.token_index, group.padded_index, group.mask):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
            for optional, dim in (
                (group.score_bias, 1),
                (group.block_tables, 0),
                (group.context_lens, 0),
            ):
                if optional is not None:
                    torch._dynamo.maybe_mark_dynamic(optional, dim)


def _warm_up_sequence(index: int, num_blocks: int, block_size: int) -> Sequence:
    length = max(2, num_blocks * block_size - index % block_size)
    seq = Sequence(f"warm-up-{index}", [0] * length, SamplingParams(max_new_tokens=1))
    seq.block_table = list(range(num_blocks))
    seq.num_computed_tokens, seq.num_new_tokens = length - 1, 1
    return seq

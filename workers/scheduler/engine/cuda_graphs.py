"""Decode steps replayed from CUDA graphs (SGLang's `--cuda-graph-max-bs` and
`--disable-cuda-graph`).

A decode step of a small model launches many small kernels (norms, RoPE, cache writes,
views, SiLU), dozens a layer; on a GPU each launch costs CPU time that the kernels do not
hide, so eager decode at small batch is bound by the launches. A CUDA graph records a
step's kernels once and replays them with one launch.

A graph has fixed shapes and fixed addresses, so each one is recorded for a batch-size
bucket (1, 2, 4, 8, then multiples of 8, as SGLang captures) and a context bucket (blocks
gathered per sequence: powers of two up to the model's longest context). Its inputs live
in static buffers that every step refills: token ids, positions, cache slots, context
lengths and block tables. Rows beyond the step's sequences are padding: token 0 at
position 0, written into the cache's spare padding block (which no sequence owns) and
attending to that block's first slot only. Everything inside a graph is computed from the
buffers on the device (the gather rows and the mask too), with no op that reads a value
back to the host: `SYNCING_OPS` lists what would break a capture, and a test checks a
step's ops against it on the CPU (tests/model/test_cuda_graphs.py).

Only decode steps are graphed (every sequence brings one token, as SGLang does); prefill
chunks, mixed steps, larger batches, longer contexts and steps that need prompt logprobs
stay eager. The LM head and sampling run eagerly on the graph's output.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq

import torch

from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine.batch import AttentionBatch, AttentionGroup, LayerCache
from workers.scheduler.engine.outputs import wants_prompt_outputs
from workers.scheduler.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# What a recorded step runs again: a no-argument call that refills the step's output.
Replay = Callable[[], None]
Capture = Callable[[Callable[[], None]], Replay]

# aten ops that read a tensor's value back to the host (`.item()`, `int(t)`, boolean
# indexing): inside a CUDA graph capture each one fails.
SYNCING_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique_dim"})


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes recorded: 1, 2, 4, 8, then every multiple of 8 up to `max_batch`
    (which is always one of them)."""
    sizes = [size for size in (1, 2, 4) if size < max_batch]
    sizes += list(range(8, max_batch, 8)) + [max_batch]
    return sizes


def context_buckets(min_blocks: int, max_blocks: int) -> list[int]:
    """Blocks gathered per sequence: powers of two from `min_blocks` on, then `max_blocks`."""
    sizes, size = [], min_blocks
    while size < max_blocks:
        sizes.append(size)
        size *= 2
    return sizes + [max_blocks]


def bucket_for(value: int, buckets: Seq[int]) -> int:
    return next(bucket for bucket in buckets if bucket >= value)


def cuda_capture() -> Capture:
    """Records steps as CUDA graphs, all of them in one memory pool, as vLLM and SGLang do:
    one step runs at a time, so their temporaries can share memory."""
    pool = torch.cuda.graph_pool_handle()

    def capture(step: Callable[[], None]) -> Replay:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture (cuBLAS workspaces)
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            step()
        return graph.replay

    return capture


class GraphedDecode:
    """Decode steps of up to `max_batch` sequences with contexts of up to `max_blocks`
    blocks, each replayed from a step recorded by `capture` (`cuda_capture` on a GPU).
    `padding_block` is a cache block no sequence owns."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: Seq[LayerCache],
        block_size: int,
        padding_block: int,
        max_batch: int,
        max_blocks: int,
        min_blocks: int,
    ) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.block_size, self.padding_block = block_size, padding_block
        self.batch_sizes = batch_buckets(max_batch)
        self.block_counts = context_buckets(min(min_blocks, max_blocks), max_blocks)
        self.replays: dict[tuple[int, int], Replay] = {}
        self.calls = 0  # steps that were replayed
        device = model.embed_tokens.weight.device
        # One host-to-device copy per step: [input_ids | positions | slots | context_lens].
        # Every row starts as padding, so the steps that run while graphs are recorded
        # write only the padding block, and no softmax row is empty (NaN).
        self._scalars = torch.zeros(4, max_batch, dtype=torch.long, device=device)
        self._scalars[2], self._scalars[3] = padding_block * block_size, 1
        self._tables = torch.full((max_batch, max_blocks), padding_block, device=device)
        dtype = model.embed_tokens.weight.dtype
        self._hidden = torch.zeros(max_batch, model.args.hidden_size, dtype=dtype, device=device)
        cache_blocks = kv_cache[0][0].shape[1] // block_size
        heads = torch.arange(model.args.num_kv_heads, device=device)
        self._head_rows = heads.view(-1, 1) * cache_blocks  # row offset of each kv head
        self._rows = torch.arange(max_batch, device=device)
        self._key_pos = torch.arange(max_blocks * block_size, device=device)

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    def takes(self, seqs: Seq[Sequence]) -> bool:
        return (
            0 < len(seqs) <= self.max_batch
            and all(seq.num_new_tokens == 1 for seq in seqs)
            and max(len(seq.block_table) for seq in seqs) <= self.block_counts[-1]
            and not any(wants_prompt_outputs(seq) for seq in seqs)
        )

    @torch.inference_mode()
    def capture_all(self, capture: Capture) -> None:
        """Records every (batch, context) bucket, largest first (a shared memory pool
        then never grows)."""
        started = time.monotonic()
        for key in sorted(self.buckets(), reverse=True):
            self.replays[key] = capture(self.step_function(*key))
        logger.info(
            "recorded %d decode graphs (batch %s x context blocks %s) in %.1fs",
            len(self.replays),
            self.batch_sizes,
            self.block_counts,
            time.monotonic() - started,
        )

    def buckets(self) -> Iterator[tuple[int, int]]:
        """Every (batch size, context blocks) pair recorded."""
        return ((b, n) for b in self.batch_sizes for n in self.block_counts)

    def step_function(self, batch: int, blocks: int) -> Callable[[], None]:
        """The step of bucket (`batch`, `blocks`): the forward over the static buffers,
        its final hidden states copied into `_hidden[:batch]`."""
        input_ids, positions, slots, context_lens = self._scalars[:, :batch]
        tables, rows = self._tables[:batch, :blocks], self._rows[:batch]
        key_pos = self._key_pos[: blocks * self.block_size]

        def step() -> None:
            group = AttentionGroup(
                token_index=rows,
                padded_index=rows,
                kv_rows=(tables.flatten() + self._head_rows).flatten(),
                mask=(key_pos < context_lens.view(-1, 1)).view(batch, 1, 1, -1),
            )
            attention = AttentionBatch(positions, slots, [group], rows, self.block_size)
            self._hidden[:batch].copy_(self.model(input_ids, attention, self.kv_cache))

        return step

    def __call__(self, seqs: Seq[Sequence]) -> tuple[torch.Tensor, AttentionBatch]:
        """The final hidden states [len(seqs), hidden] of a decode step (`takes(seqs)`; a
        view of the graphs' output buffer, valid until the next step), and the step's
        positions, slots and last rows as an `AttentionBatch` for the head."""
        count, bs = len(seqs), self.block_size
        batch = bucket_for(count, self.batch_sizes)
        blocks = bucket_for(max(len(seq.block_table) for seq in seqs), self.block_counts)
        pad = batch - count
        positions = [seq.num_computed_tokens for seq in seqs] + [0] * pad
        scalars = [
            [seq.token_ids[seq.num_computed_tokens] for seq in seqs] + [0] * pad,
            positions,
            [
                seq.block_table[pos // bs] * bs + pos % bs
                for seq, pos in zip(seqs, positions, strict=False)
            ]
            + [self.padding_block * bs] * pad,
            [pos + 1 for pos in positions],
        ]
        tables = [
            seq.block_table + [self.padding_block] * (blocks - len(seq.block_table)) for seq in seqs
        ] + [[self.padding_block] * blocks] * pad
        self._scalars[:, :batch].copy_(torch.tensor(scalars))
        self._tables[:batch, :blocks].copy_(torch.tensor(tables))
        self.replays[batch, blocks]()
        self.calls += 1
        (positions_t, slots), rows = self._scalars[1:3, :count], self._rows[:count]
        return self._hidden[:count], AttentionBatch(positions_t, slots, [], rows, bs)

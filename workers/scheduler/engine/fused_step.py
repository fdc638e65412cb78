"""The model runner's steps through the fused C step (kernels/fused_decode.py): a step runs
the whole forward in one call instead of the torch model's ~750 ops, each of its new tokens
one row. It serves int4-quantized models (`--quantization auto` on a Q4 GGUF, or `int4`)
whose every decoder projection has the int4 groups: decode steps (one new token a sequence)
of up to the batch where it was timed faster than the torch forward at load
(`fused_batch_limit`), and steps with prefill chunks beside the decodes up to the rows where
it was timed faster on those too (`fused_prefill_limit`), while their contexts are short
(`MAX_MEAN_CONTEXT`). A larger step of such chunks (a wave of new prompts) goes as several
fused calls of whole sequences where that was timed faster than the torch forward on the
whole step (`fused_split_faster`). Other steps, and other models, keep the torch forward.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from shared.protocol import SamplingParams
from workers.scheduler.core.sequence import Sequence as Seq
from workers.scheduler.engine.batch import AttentionBatch, LayerCache
from workers.scheduler.kernels import fused_decode
from workers.scheduler.layers.quantization import Int4Weights
from workers.scheduler.layers.tiered import TieredLinear
from workers.scheduler.model.llama import DecoderLayer, LlamaForCausalLM

Forward = Callable[[list[Seq]], tuple[torch.Tensor, AttentionBatch]]
TIMING_ROUNDS = 7
# Decode batch sizes timed at load; a step of B sequences counts as the smallest of them
# >= B. The kernel's int4 x int8 products are compute-bound long before 64 sequences, where
# the torch forward's bf16 matmuls (AMX) pull ahead on some CPUs.
TIMED_BATCHES = (1, 2, 4, 8, 16, 32, 64)
# Rows (new tokens) of steps with prefill chunks timed at load, as chunks of one block (the
# largest: the default step budget), best of PREFILL_TIMING_ROUNDS: such steps take tens of
# ms or more. Each chunk row attends to its own context through the decode attention,
# without the reuse across a chunk's queries that SDPA's flash attention has, so over long
# contexts the torch forward wins: a step with chunks takes the fused step only while its
# chunks' rows attend to at most MAX_MEAN_CONTEXT positions on average (bench/README.md,
# `bench.fused_prefill`): fresh prompts, not a long history's next turn.
PREFILL_TIMED_ROWS = (64, 512)
PREFILL_TIMING_ROUNDS = 3
MAX_MEAN_CONTEXT = 512
# A step of this many times `prefill_rows` fresh chunks is timed whole through the torch
# forward against split into fused calls: per token, the torch forward's large steps can
# cost more than its 512-row ones (CPU caches) or less (AMX tiles), so it is timed.
SPLIT_TIMED_PARTS = 4


class FusedStep:
    def __init__(self, decoder: fused_decode.FusedDecoder, block_size: int) -> None:
        self.decoder, self.block_size = decoder, block_size
        self.max_batch = decoder.max_rows  # decodes a step may carry
        self.prefill_rows = 0  # rows of a step with prefill chunks; 0: decode steps only
        self.split_steps = False  # a larger step goes as several calls it takes (`parts`)

    @classmethod
    def of(
        cls,
        model: LlamaForCausalLM,
        kv_cache: Sequence[LayerCache],
        block_size: int,
        max_rows: int = PREFILL_TIMED_ROWS[-1],
    ) -> FusedStep | None:
        """The fused step over `model` and its cache for steps of up to `max_rows` new
        tokens, or None where the kernel does not run here or does not take this model
        (see `_layer_tiles`)."""
        args, embed = model.args, model.embed_tokens.weight
        dtypes = (torch.bfloat16, torch.float32)
        if (
            not fused_decode.available()
            or embed.device.type != "cpu"
            or embed.dtype not in dtypes
            or kv_cache[0][0].dtype not in dtypes
            or args.qk_norm
            or args.head_dim % 2
            or args.head_dim > 256
            or args.num_heads % args.num_kv_heads
            or args.num_heads // args.num_kv_heads > 16
        ):
            return None
        layers: list[tuple[list[fused_decode.Tiles], torch.Tensor, torch.Tensor]] = []
        for layer in model.layers:
            assert isinstance(layer, DecoderLayer)
            tiles = _layer_tiles(layer)
            if tiles is None:
                return None
            layers.append(
                (tiles, layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            )
        shape = fused_decode.Shape(
            layers=args.num_layers,
            hidden=args.hidden_size,
            inter=args.intermediate_size,
            heads=args.num_heads,
            kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            block_size=block_size,
            kv_bf16=int(kv_cache[0][0].dtype == torch.bfloat16),
            slots=kv_cache[0][0].shape[1],
            eps=args.rms_norm_eps,
        )
        decoder = fused_decode.FusedDecoder(
            shape,
            layers,
            list(kv_cache),
            embed.detach(),
            model.norm.weight.detach(),
            (model.rope_cos, model.rope_sin),
            embed.dtype,
            max_rows,
        )
        return cls(decoder, block_size)

    def takes(self, seqs: list[Seq]) -> bool:
        """A step of up to `max_batch` decodes, with prefill chunks beside them only up to
        `prefill_rows` new tokens in all and over short contexts (`MAX_MEAN_CONTEXT`)."""
        chunks = [seq for seq in seqs if seq.num_new_tokens > 1]
        decodes = len(seqs) - len(chunks)
        if decodes > self.max_batch or not seqs:
            return False
        if not chunks:
            return True
        chunk_rows = sum(seq.num_new_tokens for seq in chunks)
        return (
            decodes + chunk_rows <= self.prefill_rows
            and attended(chunks) <= MAX_MEAN_CONTEXT * chunk_rows
        )

    def parts(self, seqs: list[Seq]) -> list[list[Seq]] | None:
        """The step as the fused calls that run it, in order: the whole step where it
        `takes` it, or with `split_steps` consecutive runs of whole sequences that it takes
        each; None where it runs on the torch forward. Sequences do not attend to each
        other, so calling them apart gives the same rows."""
        if self.takes(seqs):
            return [seqs]
        chunks = [seq for seq in seqs if seq.num_new_tokens > 1]
        # Decodes beyond `max_batch` were timed slower fused; a chunk it does not take alone
        # (too many rows, too long a context) keeps the whole step on the torch forward.
        if not self.split_steps or not chunks or not all(self.takes([c]) for c in chunks):
            return None
        parts: list[list[Seq]] = [[]]
        for seq in seqs:  # each part grows while taken; a sequence alone always is
            if parts[-1] and not self.takes([*parts[-1], seq]):
                parts.append([])
            parts[-1].append(seq)
        return parts

    def __call__(
        self, seqs: list[Seq], parts: list[list[Seq]] | None = None
    ) -> tuple[torch.Tensor, AttentionBatch]:
        """The final hidden states [T, hidden] of the step's new tokens (computed by
        `parts`, consecutive runs of `seqs`; default: one call), and the step's batch
        (positions and last indices, as the runner's outputs read them)."""
        rows = [(seq, p) for seq in seqs for p in new_positions(seq)]
        outs = [self._hidden(part) for part in parts or [seqs]]
        hidden = outs[0] if len(outs) == 1 else torch.cat(outs)
        slots = [
            seq.block_table[p // self.block_size] * self.block_size + p % self.block_size
            for seq, p in rows
        ]
        batch = AttentionBatch(
            positions=torch.tensor([p for _, p in rows]),
            slot_mapping=torch.tensor(slots),
            groups=[],
            last_index=torch.tensor(list(itertools.accumulate(s.num_new_tokens for s in seqs))) - 1,
            block_size=self.block_size,
        )
        return hidden, batch

    def _hidden(self, seqs: list[Seq]) -> torch.Tensor:
        rows = [(seq, p) for seq in seqs for p in new_positions(seq)]
        return self.decoder(
            [seq.token_ids[p] for seq, p in rows],
            [p for _, p in rows],
            [seq.block_table for seq, _ in rows],
        )


def new_positions(seq: Seq) -> range:
    return range(seq.num_computed_tokens, seq.num_computed_tokens + seq.num_new_tokens)


def attended(seqs: list[Seq]) -> int:
    """Positions the new tokens of `seqs` attend to, summed: each its context up to itself."""
    return sum(
        seq.num_new_tokens * (2 * seq.num_computed_tokens + seq.num_new_tokens + 1) // 2
        for seq in seqs
    )


def _layer_tiles(layer: DecoderLayer) -> list[fused_decode.Tiles] | None:
    """qkv, o, gate_up and down's int4 tiles, or None where one of them has none (kept
    dense, a bias, a shape the tiles do not take)."""
    tiles: list[fused_decode.Tiles] = []
    for projection in (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    ):
        if not isinstance(projection, TieredLinear) or projection.bias is not None:
            return None
        int4 = projection.kernels["int4"] if "int4" in projection.kernels else None
        if not isinstance(int4, Int4Weights) or int4.tiles is None:
            return None
        tiles.append(int4.tiles)
    return tiles


def fused_batch_limit(
    forward: Forward, fused: FusedStep, padding_block: int, block_size: int
) -> int:
    """The largest of `TIMED_BATCHES` up to which the fused step ran every timed decode step
    faster than `forward` (the torch forward); 0 where it lost at one sequence. Best of
    `TIMING_ROUNDS` each, interleaved. Every sequence attends to a context of one block in
    the padding block, which no sequence owns."""
    sizes = [b for b in TIMED_BATCHES if b <= fused.max_batch]
    steps = ((size, padding_seqs(size, block_size - 1, 1, padding_block)) for size in sizes)
    return largest_faster(fused, forward, steps, TIMING_ROUNDS)


def fused_prefill_limit(
    forward: Forward, fused: FusedStep, padding_block: int, block_size: int
) -> int:
    """The largest of `PREFILL_TIMED_ROWS` (up to the step's capacity) up to which the fused
    step ran every timed step of prefill chunks faster than `forward`; 0 where it lost at
    the first. The chunks are of one block each, in the padding block."""
    sizes = [r for r in PREFILL_TIMED_ROWS if r <= fused.decoder.max_rows]
    steps = (
        (rows, padding_seqs(rows // block_size, 0, block_size, padding_block)) for rows in sizes
    )
    return largest_faster(fused, forward, steps, PREFILL_TIMING_ROUNDS)


def fused_split_faster(
    forward: Forward, fused: FusedStep, padding_block: int, block_size: int
) -> bool:
    """Whether a step of `SPLIT_TIMED_PARTS` times `fused.prefill_rows` rows of prefill
    chunks (one block each, in the padding block) ran faster as fused calls of up to
    `prefill_rows` rows than whole through `forward`."""
    rows = SPLIT_TIMED_PARTS * fused.prefill_rows
    split = FusedStep(fused.decoder, block_size)
    split.max_batch, split.prefill_rows = fused.max_batch, fused.prefill_rows
    split.split_steps = True
    seqs = padding_seqs(rows // block_size, 0, block_size, padding_block)
    parts = split.parts(seqs) if rows else None
    return parts is not None and faster(
        lambda s: split(s, parts), forward, seqs, PREFILL_TIMING_ROUNDS
    )


def padding_seqs(count: int, computed: int, new: int, padding_block: int) -> list[Seq]:
    """`count` timing sequences of `new` tokens after `computed`, all in the padding block."""
    seqs = [
        Seq(f"fused-timing-{i}", [0] * (computed + new), SamplingParams()) for i in range(count)
    ]
    for seq in seqs:
        seq.block_table = [padding_block]
        seq.num_computed_tokens, seq.num_new_tokens = computed, new
    return seqs


def largest_faster(
    fused: Forward, forward: Forward, steps: Iterable[tuple[int, list[Seq]]], rounds: int
) -> int:
    """The size of the last of `steps` (size, sequences) before the first the fused step did
    not run faster than `forward`; 0 where it lost the first."""
    limit = 0
    for size, seqs in steps:
        if not faster(fused, forward, seqs, rounds):
            break
        limit = size
    return limit


def faster(fused: Forward, forward: Forward, seqs: list[Seq], rounds: int) -> bool:
    """Whether the fused step ran `seqs` faster than `forward`: best of `rounds` each,
    interleaved."""
    best = {"torch": float("inf"), "fused": float("inf")}
    for _ in range(rounds):
        for name, step in (("torch", forward), ("fused", fused)):
            started = time.perf_counter()
            step(seqs)
            best[name] = min(best[name], time.perf_counter() - started)
    return best["fused"] < best["torch"]

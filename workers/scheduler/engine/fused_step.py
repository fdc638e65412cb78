"""The model runner's decode steps through the fused C step (kernels/fused_decode.py): a
step that carries one new token for each of its sequences runs the whole forward in one
call instead of the torch model's ~750 ops. It serves int4-quantized models (`--quantization
auto` on a Q4 GGUF, or `int4`) whose every decoder projection has the int4 groups, for
batches up to the size where it was timed faster than the torch forward at load
(`fused_batch_limit`); other steps, and other models, keep the torch forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

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


class FusedStep:
    def __init__(self, decoder: fused_decode.FusedDecoder, block_size: int) -> None:
        self.decoder, self.block_size = decoder, block_size
        self.max_batch = decoder.max_batch

    @classmethod
    def of(
        cls,
        model: LlamaForCausalLM,
        kv_cache: Sequence[LayerCache],
        block_size: int,
        max_batch: int = TIMED_BATCHES[-1],
    ) -> FusedStep | None:
        """The fused step over `model` and its cache for decode steps of up to `max_batch`
        sequences, or None where the kernel does not run here or does not take this model
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
            max_batch,
        )
        return cls(decoder, block_size)

    def takes(self, seqs: list[Seq]) -> bool:
        """A decode step (one new token a sequence) of up to `max_batch` sequences."""
        return len(seqs) <= self.max_batch and all(seq.num_new_tokens == 1 for seq in seqs)

    def __call__(self, seqs: list[Seq]) -> tuple[torch.Tensor, AttentionBatch]:
        """The final hidden states [B, hidden] of the new tokens, and the step's batch
        (positions and last indices, as the runner's outputs read them)."""
        positions = [seq.num_computed_tokens for seq in seqs]
        hidden = self.decoder(
            [seq.token_ids[p] for seq, p in zip(seqs, positions, strict=True)],
            positions,
            [seq.block_table for seq in seqs],
        )
        slots = [
            seq.block_table[p // self.block_size] * self.block_size + p % self.block_size
            for seq, p in zip(seqs, positions, strict=True)
        ]
        batch = AttentionBatch(
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots),
            groups=[],
            last_index=torch.arange(len(seqs)),
            block_size=self.block_size,
        )
        return hidden, batch


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
    limit = 0
    for size in (b for b in TIMED_BATCHES if b <= fused.max_batch):
        seqs = [Seq(f"fused-timing-{i}", [0] * block_size, SamplingParams()) for i in range(size)]
        for seq in seqs:
            seq.block_table = [padding_block]
            seq.num_computed_tokens, seq.num_new_tokens = block_size - 1, 1
        best = {"torch": float("inf"), "fused": float("inf")}
        for _ in range(TIMING_ROUNDS):
            for name, step in (("torch", forward), ("fused", fused)):
                started = time.perf_counter()
                step(seqs)
                best[name] = min(best[name], time.perf_counter() - started)
        if best["fused"] >= best["torch"]:
            break
        limit = size
    return limit

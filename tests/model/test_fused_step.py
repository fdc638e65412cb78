"""The fused one-token step (engine/fused_step.py, kernels/fused_decode.c): a single
sequence's decode runs in one C call, with int4 weights times int8 activations, and must
follow the torch forward it replaces and the fp32 reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from shared.protocol import SamplingParams
from tests.support.models import SMALL, saved_random_model
from tests.support.routing import route_every_size
from tests.support.teacher_forcing import Reference, agreement
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine.model_runner import TorchModelRunner
from workers.scheduler.kernels import fused_decode
from workers.scheduler.kernels.fused_decode import Int4Tiles

needs_kernel = pytest.mark.skipif(
    not fused_decode.available(), reason="the fused step needs AVX512-VNNI and a C compiler"
)
BLOCK_SIZE = 8


def test_tiles_keep_every_group_in_the_kernels_layout() -> None:
    torch.manual_seed(0)
    q = torch.randint(0, 16, (32, 64))
    scale, low = torch.rand(32, 2), torch.rand(32, 2) - 0.5
    tiles = Int4Tiles.of(q, scale, low)
    packed = tiles.packed.view(2, 2, 4, 16, 4).int()  # tile, group, chunk, row, byte
    nibbles = torch.stack([packed & 15, packed >> 4], dim=-2)  # inputs 0-3, then 4-7
    # (tile, group, chunk, row, nibble, byte) -> rows [32], inputs [64]
    unpacked = nibbles.permute(0, 3, 1, 2, 4, 5).reshape(32, 64)
    assert torch.equal(unpacked, q.int())
    assert torch.equal(
        tiles.scales.view(2, 2, 16).transpose(1, 2).reshape(32, 2).float(), scale.half().float()
    )
    assert torch.equal(
        tiles.lows.view(2, 2, 16).transpose(1, 2).reshape(32, 2).float(), low.half().float()
    )


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_random_model(tmp_path_factory, "fused", LlamaConfig(**SMALL), weight_std=0.05)


def decode(runner: TorchModelRunner, prompt: list[int], forced: list[int]) -> list[torch.Tensor]:
    """The prompt prefilled, then one-token steps through `forced`: each step's hidden state."""
    seq = Sequence("s", list(prompt), SamplingParams(max_new_tokens=len(forced)))
    seq.block_table = list(range(runner.num_kv_blocks))
    seq.num_computed_tokens, seq.num_new_tokens = 0, len(prompt)
    runner.forward([seq])
    hidden = []
    for token in forced:
        seq.num_computed_tokens = len(seq.token_ids)
        seq.token_ids.append(token)
        seq.num_new_tokens = 1
        hidden.append(runner.forward([seq])[0].float())
    return hidden


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


@needs_kernel
@pytest.mark.parametrize(("dtype", "kv_dtype"), [("bfloat16", "auto"), ("float32", "bfloat16")])
def test_the_fused_step_is_as_close_to_the_dense_model_as_the_torch_int4_forward(
    tiny_folder: Path, dtype: str, kv_dtype: str
) -> None:
    def load(quantization: str, dtype: str = dtype, kv: str = kv_dtype) -> TorchModelRunner:
        return TorchModelRunner.load(
            str(tiny_folder), 8, BLOCK_SIZE, dtype, quantization=quantization, kv_cache_dtype=kv
        )

    fused, plain, dense = load("int4"), load("int4"), load("none", "float32", "auto")
    fused.use_fused_step(True)
    plain.use_fused_step(False)
    route_every_size(plain.model, "int4")  # the same int4 groups, not the dense weights
    assert fused.fused is not None
    prompt, forced = list(range(3, 14)), [(7 * i) % 120 + 1 for i in range(30)]  # 5 blocks
    steps = zip(*(decode(r, prompt, forced) for r in (fused, plain, dense)), strict=True)
    for got, int4, want in steps:
        assert got.shape == want.shape == (1, SMALL["hidden_size"])
        # Its int8 activations cost little next to the weights' int4 groups (whose fp16
        # scales are closer to the weights than the torch kernel's bf16 ones).
        assert cosine(got, want) > cosine(int4, want) - 0.002
        assert cosine(got, int4) > 0.98
    # The K/V the fused steps wrote, where the others wrote their own.
    positions = len(prompt) + len(forced) - 1
    for layer in range(len(dense.kv_cache)):
        for kv in range(2):
            got, int4, want = (r.kv_cache[layer][kv][:, :positions] for r in (fused, plain, dense))
            assert cosine(got, want) > cosine(int4, want) - 0.002


@needs_kernel
def test_only_a_single_sequences_one_token_step_takes_it(tiny_folder: Path) -> None:
    runner = TorchModelRunner.load(str(tiny_folder), 8, BLOCK_SIZE, quantization="int4")
    runner.use_fused_step(True)
    assert runner.fused is not None
    calls = []
    fused = runner.fused.decoder
    runner.fused.decoder = lambda *args: calls.append(args) or fused(*args)  # type: ignore[assignment]
    seqs = [Sequence(f"s{i}", [1, 2, 3], SamplingParams()) for i in range(2)]
    for i, seq in enumerate(seqs):
        seq.block_table, seq.num_new_tokens = [i], 3
    runner.forward(seqs)  # prefill: the torch forward
    for seq in seqs:
        seq.num_computed_tokens, seq.num_new_tokens = 2, 1
    runner.forward(seqs)  # two decodes: the torch forward
    assert calls == []
    runner.forward(seqs[:1])
    assert calls == [(3, 2, [0])]


@needs_kernel
def test_dense_models_keep_the_torch_forward(tiny_folder: Path) -> None:
    runner = TorchModelRunner.load(str(tiny_folder), 8, BLOCK_SIZE, quantization="none")
    runner.use_fused_step(True)
    assert runner.fused is None


@needs_kernel
def test_fused_steps_follow_the_fp32_greedy_trajectory(
    model_path: str, reference: Reference
) -> None:
    # The default mode on the packaged Q4_1 GGUF, each prompt decoded alone so that every
    # decode step is fused. Measured here: top-1 156/160, mean |logprob error| 0.039, max
    # 0.24 (the torch int4 forward, batched: 156/160 too).
    runner = TorchModelRunner.load(model_path, 64, 16, dtype="auto", quantization="auto")
    runner.use_fused_step(True)
    assert runner.fused is not None
    result = agreement(reference, runner, alone=True)
    assert result.top1 >= 0.95 * result.total, result
    assert result.mean_error <= 0.06, result


@needs_kernel
def test_a_token_or_position_outside_the_model_raises_as_the_torch_forward_does(
    tiny_folder: Path,
) -> None:
    runner = TorchModelRunner.load(str(tiny_folder), 8, BLOCK_SIZE, quantization="int4")
    runner.use_fused_step(True)
    assert runner.fused is not None
    with pytest.raises(IndexError):
        runner.fused.decoder(SMALL["vocab_size"], 0, [0])
    with pytest.raises(IndexError):
        runner.fused.decoder(1, SMALL["max_position_embeddings"], list(range(8)) * 2)

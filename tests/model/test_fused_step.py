"""The fused decode step (engine/fused_step.py, kernels/fused_decode.c): a decode step of
one or more sequences runs in one C call, with int4 weights times int8 activations, and
must follow the torch forward it replaces and the fp32 reference."""

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
from workers.scheduler.engine import fused_step
from workers.scheduler.engine.model_runner import TorchModelRunner
from workers.scheduler.kernels import fused_decode
from workers.scheduler.kernels.fused_decode import FusedLinear, Tiles
from workers.scheduler.layers.quantization import int4_grid
from workers.scheduler.layers.tiered import TieredLinear

needs_kernel = pytest.mark.skipif(
    not fused_decode.available(), reason="the fused step needs AVX512-VNNI or AVX2 and a C compiler"
)
AVX2 = ("-mno-avx512f",)  # the AVX2 path, which AVX-512 CPUs do not run by themselves
BLOCK_SIZE = 8
BLOCKS_EACH = 6  # cache blocks per sequence in `decode`


@pytest.fixture(params=["native", "avx2"])
def kernel_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each build of the kernel: this CPU's, and its AVX2 path (the same on AVX2 CPUs)."""
    if request.param == "avx2":
        lib = fused_decode.build(AVX2)
        if lib is None:
            pytest.skip("no AVX2 here")
        monkeypatch.setattr(fused_decode, "build", lambda extra_flags=(): lib)
    return str(request.param)


def test_tiles_keep_every_group_in_the_kernels_layout() -> None:
    torch.manual_seed(0)
    q = torch.randint(0, 16, (32, 64))
    scale, low = torch.rand(32, 2), torch.rand(32, 2) - 0.5
    tiles = Tiles.int4(q, scale, low)
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


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 9, 17])
def test_the_fused_linear_computes_the_product_of_its_groups(rows: int, kernel_build: str) -> None:
    torch.manual_seed(rows)
    weight, x = torch.randn(48, 96) * 0.05, torch.randn(rows, 96)
    eight = Tiles.int8(weight)
    assert eight.packed.shape == (3, 3, 8, 16, 4) and eight.bits == 8
    codes = eight.packed.permute(0, 3, 1, 2, 4).reshape(48, 96).float()  # back to [out, in]
    scales = eight.scales.transpose(1, 2).reshape(48, 3).float().repeat_interleave(32, dim=1)
    assert (codes - 128).abs().max() <= 127
    assert torch.allclose(scales * (codes - 128), weight, atol=weight.abs().max().item() / 200)
    q, scale, low = int4_grid(weight, 32)
    four = Tiles.int4(q, scale, low)
    four_weight = q.float() * scale.repeat_interleave(32, 1) + low.repeat_interleave(32, 1)
    for tiles, grid, dtype in (
        (eight, scales * (codes - 128), torch.float32),
        (four, four_weight, torch.bfloat16),
    ):
        got = FusedLinear(tiles)(x.to(dtype))
        want = x.to(dtype).float() @ grid.T
        assert got.shape == (rows, 48) and got.dtype == dtype
        for row in range(rows):  # the grid's product, within int8 activations' rounding
            assert cosine(got[row], want[row]) > 0.999


@needs_kernel
def test_the_fused_linear_rounds_activations_to_the_nearest_step_ties_to_even(
    kernel_build: str,
) -> None:
    # Every group's largest |x| is 127, so its step is 1: x is rounded to integers, halves
    # to even (as lrintf), and with integer weights the product is exact in fp32.
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (32, 128), generator=gen)
    scale, low = torch.ones(32, 4), torch.full((32, 4), -8.0)
    x = torch.randint(-126, 126, (5, 128), generator=gen).float()
    x[:, 1::7] += 0.5  # ties: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2
    x[:, 3::11] -= 0.25
    x[:, ::32] = 127.0 * torch.tensor([1.0, -1.0])[torch.randint(0, 2, (5, 4), generator=gen)]
    got = FusedLinear(Tiles.int4(q, scale, low))(x)
    assert torch.equal(got, torch.round(x) @ (q.float() - 8).T)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_random_model(tmp_path_factory, "fused", LlamaConfig(**SMALL), weight_std=0.05)


def decode(
    runner: TorchModelRunner, prompts: list[list[int]], forced: list[list[int]]
) -> list[torch.Tensor]:
    """The prompts prefilled together, then decode steps of all of them through `forced`
    (one token of each a step): each step's hidden states [len(prompts), hidden]. Sequence
    i takes cache blocks from i * BLOCKS_EACH on."""
    seqs = [
        Sequence(f"s{i}", list(prompt), SamplingParams(max_new_tokens=len(forced[i])))
        for i, prompt in enumerate(prompts)
    ]
    for i, seq in enumerate(seqs):
        seq.block_table = list(range(i * BLOCKS_EACH, (i + 1) * BLOCKS_EACH))
        seq.num_computed_tokens, seq.num_new_tokens = 0, len(seq.token_ids)
    runner.forward(seqs)
    hidden = []
    for tokens in zip(*forced, strict=True):
        for seq, token in zip(seqs, tokens, strict=True):
            seq.num_computed_tokens = len(seq.token_ids)
            seq.token_ids.append(token)
            seq.num_new_tokens = 1
        hidden.append(runner.forward(seqs)[0].float())
    return hidden


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


@needs_kernel
@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "batch", "prefill_rows"),
    [
        ("bfloat16", "auto", 1, 0),
        ("float32", "bfloat16", 1, 0),
        ("bfloat16", "auto", 11, 0),
        ("bfloat16", "auto", 11, 256),  # the prompts' prefill fused too
    ],
)
def test_the_fused_step_is_as_close_to_the_dense_model_as_the_torch_int4_forward(
    tiny_folder: Path, dtype: str, kv_dtype: str, batch: int, prefill_rows: int, kernel_build: str
) -> None:
    def load(quantization: str, dtype: str = dtype, kv: str = kv_dtype) -> TorchModelRunner:
        return TorchModelRunner.load(
            str(tiny_folder),
            batch * BLOCKS_EACH,
            BLOCK_SIZE,
            dtype,
            quantization=quantization,
            kv_cache_dtype=kv,
        )

    fused, plain, dense = load("int4"), load("int4"), load("none", "float32", "auto")
    fused.use_fused_step(batch, prefill_rows=prefill_rows)
    plain.use_fused_step(0)
    # The same int4 groups, not the dense weights, for the prefills and torch's decodes.
    for runner in (fused, plain):
        route_every_size(runner.model, "int4")
    assert fused.fused is not None
    # Prompts of 11, 14 or 17 tokens; 30 decode steps take each sequence over 5-6 blocks.
    prompts = [list(range(3 + i, 14 + 3 * (i % 3))) for i in range(batch)]
    forced = [[(7 * j + i) % 120 + 1 for j in range(30)] for i in range(batch)]
    steps = zip(*(decode(r, prompts, forced) for r in (fused, plain, dense)), strict=True)
    for got, int4, want in steps:
        assert got.shape == want.shape == (batch, SMALL["hidden_size"])
        for row in range(batch):
            # Its int8 activations cost little next to the weights' int4 groups (whose fp16
            # scales are closer to the weights than the torch kernel's bf16 ones).
            assert cosine(got[row], want[row]) > cosine(int4[row], want[row]) - 0.002
            assert cosine(got[row], int4[row]) > 0.98
    # The K/V the fused steps wrote, where the others wrote their own.
    for layer in range(len(dense.kv_cache)):
        for kv in range(2):
            got, int4, want = (r.kv_cache[layer][kv] for r in (fused, plain, dense))
            assert cosine(got, want) > cosine(int4, want) - 0.002


def spy_on_the_fused_step(runner: TorchModelRunner) -> list[tuple[object, ...]]:
    """The arguments of every call the runner's fused step makes from now on."""
    assert runner.fused is not None
    calls: list[tuple[object, ...]] = []
    decoder = runner.fused.decoder
    runner.fused.decoder = lambda *args: calls.append(args) or decoder(*args)  # type: ignore[assignment]
    return calls


@needs_kernel
def test_only_decode_steps_up_to_its_batch_limit_take_it(tiny_folder: Path) -> None:
    runner = TorchModelRunner.load(str(tiny_folder), 8, BLOCK_SIZE, quantization="int4")
    runner.use_fused_step(1)
    calls = spy_on_the_fused_step(runner)
    seqs = [Sequence(f"s{i}", [1, 2, 3, 4], SamplingParams()) for i in range(3)]
    for i, seq in enumerate(seqs):
        seq.block_table, seq.num_new_tokens = [i], 3
    runner.forward(seqs)  # prefill: the torch forward
    for seq in seqs:
        seq.num_computed_tokens, seq.num_new_tokens = 3, 1
    runner.forward(seqs[:2])  # two decodes, over the limit: the torch forward
    assert calls == []
    runner.forward(seqs[:1])
    assert calls == [([4], [3], [[0]])]
    runner.use_fused_step(2)
    calls = spy_on_the_fused_step(runner)
    runner.forward(seqs[1:])
    assert calls == [([4, 4], [3, 3], [[1], [2]])]
    seqs[0].num_computed_tokens, seqs[0].num_new_tokens = 2, 2  # a chunk beside a decode
    runner.forward(seqs[:2])
    assert len(calls) == 1
    runner.use_fused_step(2, prefill_rows=3)  # now up to 3 tokens, chunks included
    calls = spy_on_the_fused_step(runner)
    runner.forward(seqs[:2])  # its tokens at positions 2 and 3, then the decode
    assert calls == [([3, 4, 4], [2, 3, 3], [[0], [0], [1]])]
    runner.forward(seqs)  # 4 tokens: the torch forward
    assert len(calls) == 1
    runner.use_fused_step(0)
    assert runner.fused is None


@needs_kernel
def test_a_larger_step_goes_as_several_calls_of_whole_sequences(tiny_folder: Path) -> None:
    runner = TorchModelRunner.load(str(tiny_folder), 8, BLOCK_SIZE, quantization="int4")
    runner.use_fused_step(2, prefill_rows=3, split_steps=True)
    calls = spy_on_the_fused_step(runner)
    seqs = [Sequence(f"s{i}", [1, 2, 3, 4], SamplingParams()) for i in range(3)]
    for i, seq in enumerate(seqs):
        seq.block_table, seq.num_computed_tokens, seq.num_new_tokens = [i], 2, 2
    seqs[1].num_computed_tokens, seqs[1].num_new_tokens = 3, 1  # a decode between chunks
    hidden, batch = runner.forward(seqs)  # 5 tokens: 3, then 2
    assert calls == [([3, 4, 4], [2, 3, 3], [[0], [0], [1]]), ([3, 4], [2, 3], [[2], [2]])]
    assert hidden.shape[0] == 5 and batch.last_index.tolist() == [1, 2, 4]
    seqs[0].num_computed_tokens, seqs[0].num_new_tokens = 0, 4  # alone over 3 tokens
    runner.forward(seqs)
    assert len(calls) == 2  # the torch forward
    for seq in seqs:
        seq.num_computed_tokens, seq.num_new_tokens = 3, 1
    runner.forward(seqs)  # decodes over the batch limit are not split
    assert len(calls) == 2
    runner.use_fused_step(2, prefill_rows=3)  # without split_steps
    calls = spy_on_the_fused_step(runner)
    seqs[0].num_computed_tokens, seqs[0].num_new_tokens = 2, 2
    runner.forward(seqs)
    assert calls == []


@needs_kernel
def test_a_split_step_computes_the_rows_of_the_whole_one(tiny_folder: Path) -> None:
    runner = TorchModelRunner.load(str(tiny_folder), 16, BLOCK_SIZE, quantization="int4")
    prompts = [list(range(5 + i, 5 + i + 6 + 3 * i)) for i in range(4)]
    seqs = [Sequence(f"p{i}", prompt, SamplingParams()) for i, prompt in enumerate(prompts)]
    for i, seq in enumerate(seqs):
        seq.block_table, seq.num_new_tokens = [2 * i, 2 * i + 1], len(seq.token_ids)
    runner.use_fused_step(4, prefill_rows=64)
    whole, _ = runner.forward(seqs)
    runner.use_fused_step(4, prefill_rows=16, split_steps=True)  # 6 + 9 rows, 12, 15
    assert runner.fused is not None and len(runner.fused.parts(seqs) or []) == 3
    split, _ = runner.forward(seqs)  # the same positions again, from the same cache
    assert split.shape == whole.shape
    for row in range(whole.shape[0]):
        assert cosine(split[row], whole[row]) > 0.9999


@needs_kernel
def test_a_step_with_chunks_takes_it_only_over_short_contexts(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = TorchModelRunner.load(str(tiny_folder), 8, BLOCK_SIZE, quantization="int4")
    runner.use_fused_step(4, prefill_rows=16)
    assert runner.fused is not None
    chunk = Sequence("chunk", list(range(1, 14)), SamplingParams())
    chunk.block_table, chunk.num_computed_tokens, chunk.num_new_tokens = [0, 1], 8, 5
    decode = Sequence("decode", list(range(1, 30)), SamplingParams())
    decode.block_table, decode.num_computed_tokens, decode.num_new_tokens = [2, 3, 4, 5], 28, 1
    # Positions 8-12 attend to 9 + 10 + ... + 13 positions: 11 each on average.
    assert fused_step.attended([chunk]) == 55
    assert fused_step.attended([decode]) == 29
    monkeypatch.setattr(fused_step, "MAX_MEAN_CONTEXT", 11)
    assert runner.fused.takes([chunk, decode])  # the decode's context does not count
    monkeypatch.setattr(fused_step, "MAX_MEAN_CONTEXT", 10)
    assert not runner.fused.takes([chunk, decode])
    assert runner.fused.takes([decode])  # decode steps whatever their contexts


@needs_kernel
def test_a_mixed_step_follows_the_torch_forward(tiny_folder: Path) -> None:
    # A prompt's chunk in the middle of a step of decodes, through the fused step and
    # through the torch forward over the same int4 groups, from the same cache.
    runners = [TorchModelRunner.load(str(tiny_folder), 8, BLOCK_SIZE, quantization="int4")]
    runners.append(TorchModelRunner.load(str(tiny_folder), 8, BLOCK_SIZE, quantization="int4"))
    fused, plain = runners
    fused.use_fused_step(4, prefill_rows=32)
    plain.use_fused_step(0)
    for runner in runners:
        route_every_size(runner.model, "int4")
    outputs = []
    for runner in runners:
        seqs = [Sequence(f"s{i}", list(range(3 + i, 19 + i)), SamplingParams()) for i in range(3)]
        for i, seq in enumerate(seqs):
            seq.block_table, seq.num_new_tokens = [2 * i, 2 * i + 1], 10
        runner.forward(seqs)  # the prompts' first 10 tokens
        for seq in seqs:
            seq.num_computed_tokens, seq.num_new_tokens = 10, 1
        seqs[1].num_new_tokens = 6  # the rest of its prompt, beside two decodes
        outputs.append(runner.forward(seqs))
    (got, got_batch), (want, want_batch) = outputs
    assert got.shape == want.shape == (8, SMALL["hidden_size"])
    assert torch.equal(got_batch.positions, want_batch.positions)
    assert torch.equal(got_batch.last_index, want_batch.last_index)
    for row in range(8):  # another row's would be 0.3-0.9 here
        assert cosine(got[row], want[row]) > 0.995
    for layer in range(len(fused.kv_cache)):
        for kv in range(2):
            assert cosine(fused.kv_cache[layer][kv], plain.kv_cache[layer][kv]) > 0.995


@needs_kernel
def test_a_quantized_head_is_offered_the_fused_linear(tiny_folder: Path) -> None:
    runner = TorchModelRunner.load(str(tiny_folder), 8, BLOCK_SIZE, quantization="int4")
    head = runner.model.lm_head
    assert isinstance(head, TieredLinear) and isinstance(head.kernels["int8_vnni"], FusedLinear)
    hidden = torch.randn(5, SMALL["hidden_size"], dtype=head.dtype)
    dense = head.run("dense", hidden).float()
    for row, want in zip(head.run("int8_vnni", hidden).float(), dense, strict=True):
        assert cosine(row, want) > 0.999


@needs_kernel
def test_dense_models_keep_the_torch_forward(tiny_folder: Path) -> None:
    runner = TorchModelRunner.load(str(tiny_folder), 8, BLOCK_SIZE, quantization="none")
    runner.use_fused_step(64)
    assert runner.fused is None


@needs_kernel
@pytest.mark.parametrize("alone", [True, False])
def test_fused_steps_follow_the_fp32_greedy_trajectory(
    model_path: str, reference: Reference, alone: bool
) -> None:
    # The default mode on the packaged Q4_1 GGUF, every step fused, the prompts' prefill too:
    # each prompt decoded alone, or all of them batched. Measured on Zen 4 with only the
    # decodes fused: top-1 156/160, mean |logprob error| 0.039, max 0.24 (the torch int4
    # forward, batched: 156/160 too); on a Xeon with AMX (whose routes may also take int8 x
    # bf16 tiles), 151/160 alone at the same mean error.
    runner = TorchModelRunner.load(model_path, 64, 16, dtype="auto", quantization="auto")
    runner.use_fused_step(64, prefill_rows=256)
    assert runner.fused is not None
    assert sum(map(len, reference.prompts)) <= 256  # so the prefill is fused
    result = agreement(reference, runner, alone=alone)
    assert result.top1 >= 0.93 * result.total, result
    assert result.mean_error <= 0.06, result


@needs_kernel
def test_a_token_or_position_outside_the_model_raises_as_the_torch_forward_does(
    tiny_folder: Path,
) -> None:
    runner = TorchModelRunner.load(str(tiny_folder), 8, BLOCK_SIZE, quantization="int4")
    runner.use_fused_step(4)
    assert runner.fused is not None
    with pytest.raises(IndexError):
        runner.fused.decoder([1, SMALL["vocab_size"]], [0, 0], [[0], [1]])
    with pytest.raises(IndexError):
        runner.fused.decoder([1], [SMALL["max_position_embeddings"]], [list(range(8)) * 2])
    with pytest.raises(ValueError):  # more sequences than its scratch holds
        runner.fused.decoder([1] * 5, [0] * 5, [[0]] * 5)

"""The C decode-attention kernel (paged_decode.py) against fp32 SDPA over the same contexts
gathered by hand, and inside a step that mixes decodes with a prefill chunk."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support.engine import BLOCK_SIZE, hand_seqs, step
from tests.support.models import SMALL, saved_random_model
from workers.scheduler.engine import kernel_choices
from workers.scheduler.engine.model_runner import TorchModelRunner
from workers.scheduler.kernels import paged_decode as paged_decode_module
from workers.scheduler.kernels.paged_decode import (
    build_kernel,
    kernel_fits,
    kernel_library,
    paged_decode,
)
from workers.scheduler.layers.attention_tuning import AttentionChoice
from workers.scheduler.model import llama

pytestmark = [
    pytest.mark.ccompiler,
    pytest.mark.skipif(
        kernel_library() is None, reason="no C compiler here: the paged decode kernel is not built"
    ),
]


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """fp32 SDPA, one sequence at a time, over the slots its block table names."""
    outs = []
    for b, length in enumerate(lengths.tolist()):
        slots = torch.arange(length)
        slots = tables[b, slots // block_size].long() * block_size + slots % block_size
        keys, values = (c[:, slots].float().unsqueeze(0) for c in (k_cache, v_cache))
        query = q[b].float().unsqueeze(0).unsqueeze(2)  # [1, heads, 1, d]
        out = F.scaled_dot_product_attention(query, keys, values, enable_gqa=True)
        outs.append(out[0, :, 0])
    return torch.stack(outs)


@pytest.mark.parametrize(
    ("dtype", "kv_dtype"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("build", ["native", "avx2", "portable"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 32), (16, 2, 16, 16), (6, 2, 8, 16)],
)
def test_the_kernel_follows_fp32_sdpa_over_scattered_blocks(
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    build: str,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each build: this CPU's (AVX-512 paths where it has them), AVX2's (-mno-avx512f) and
    the plain loops (-mno-avx2), which other CPUs run; bf16 and fp32 caches, and fp32 queries
    over a bf16 cache (`--kv-cache-dtype bfloat16` on an fp32 model)."""
    if build != "native":
        flags = ("-mno-avx512f",) if build == "avx2" else ("-mno-avx2",)
        if platform.machine() != "x86_64" or (library := build_kernel(flags)) is None:
            pytest.skip("the other builds are checked on x86-64")
        monkeypatch.setattr(paged_decode_module, "kernel_library", lambda: library)
    gen = torch.Generator().manual_seed(heads * head_dim)
    lengths = torch.tensor([1, 5, block_size, block_size + 1, 300, 77])
    width = -(-int(lengths.max()) // block_size) + 1  # a padding column, never read
    num_blocks = len(lengths) * width + 7
    slots = num_blocks * block_size
    k_cache, v_cache = (
        torch.randn(kv_heads, slots, head_dim, generator=gen).to(kv_dtype) for _ in range(2)
    )
    tables = torch.randperm(num_blocks, generator=gen)[: len(lengths) * width]
    tables = tables.view(len(lengths), width).to(torch.int32)
    # q as the model hands it over: rows of a wider [B, heads + 2 kv heads, d] tensor.
    qkv = torch.randn(len(lengths), heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    q = qkv[:, :heads]
    assert not q.is_contiguous() and kernel_fits(q, kv_dtype, kv_heads)
    out = paged_decode(q, k_cache, v_cache, tables, lengths.to(torch.int32), block_size)
    expected = reference(q, k_cache, v_cache, tables, lengths, block_size)
    assert out.dtype == dtype and out.shape == q.shape
    # bf16: its output rounding, 2^-9 of the value (fp32 everywhere before it); fp32 (over
    # either cache): the order of the sums.
    tolerance = 4e-3 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def test_the_kernel_is_offered_only_where_it_applies() -> None:
    bf16 = torch.zeros(2, 9, 64, dtype=torch.bfloat16)
    assert kernel_fits(bf16, torch.bfloat16, 3)
    assert kernel_fits(bf16.float(), torch.float32, 3)
    assert kernel_fits(bf16.float(), torch.bfloat16, 3)  # fp32 queries over a bf16 cache
    assert not kernel_fits(bf16, torch.float32, 3)
    assert not kernel_fits(bf16.half(), torch.float16, 3)
    assert not kernel_fits(bf16, torch.bfloat16, 2)  # heads not a multiple of kv heads
    big = torch.zeros(2, 9, 512, dtype=torch.bfloat16)
    assert not kernel_fits(big, torch.bfloat16, 3)  # head_dim > 256


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    # 3 query heads per kv head (as SmolLM2), head_dim apart from hidden / heads
    config = LlamaConfig(**{**SMALL, "hidden_size": 96, "num_attention_heads": 6}, head_dim=16)
    return saved_random_model(tmp_path_factory, "llama", config, weight_std=0.05)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_step_of_decodes_and_a_prefill_chunk_takes_the_kernel_for_the_decodes(
    folder: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decodes and a prefill chunk in one step: the decodes' rows go through the kernel, the
    chunk through SDPA, and the step's hidden states follow the all-torch step's."""
    calls: list[int] = []
    monkeypatch.setattr(llama, "paged_decode", lambda *a: calls.append(1) or paged_decode(*a))
    hidden = []
    for paged in (False, True):
        runner = TorchModelRunner.load(str(folder), 32, BLOCK_SIZE, dtype=dtype)
        runner.use_attention(AttentionChoice(True, True, paged_decodes=paged))
        seqs = hand_seqs([list(range(3, 3 + n)) for n in (21, 9, 30)])
        with torch.inference_mode():
            step(runner, seqs[:2])  # two prompts in the cache
            for seq in seqs[:2]:
                seq.append_token(9)
            seqs[2].token_ids = seqs[2].token_ids[:20]  # a first chunk of the third
            step(runner, seqs[2:])
            seqs[2].token_ids.extend(range(40, 50))
            # a 10-token chunk, then 2 decodes: their rows are 10 and 11 of the step
            hidden.append(step(runner, [seqs[2], *seqs[:2]]).float())
    assert len(calls) == len(runner.model.layers)  # the second runner's mixed step
    error = (hidden[1] - hidden[0]).abs().max() / hidden[0].abs().max()
    assert error < (0.03 if dtype == "bfloat16" else 1e-5), error


def test_loading_the_kernel_keeps_subnormal_floats() -> None:
    """A library linked with -ffast-math turns on flush-to-zero for the whole process when
    loaded (gcc 12's crtfastmath.o): fp32, the exact reference, would change with it."""
    assert kernel_library() is not None
    assert sys.float_info.min / 2 > 0
    assert torch.tensor([1e-40]).mul(1.0).item() > 0


def test_only_inexact_fp32_runners_time_the_kernels(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 without quantization, over its own cache, is the exact reference: its decodes
    stay on SDPA, untimed. A quantized fp32 runner, or one over a bf16 cache, is inexact
    anyway: its attention kernels are timed at load."""
    timed: list[tuple[torch.dtype, torch.dtype]] = []
    choice = AttentionChoice(upcast_sdpa=True, matmul_decodes=False, paged_decodes=True)
    monkeypatch.setattr(
        kernel_choices, "choose_attention", lambda _, *dtypes: timed.append(dtypes) or choice
    )
    exact = TorchModelRunner.load(str(folder), 32, BLOCK_SIZE)
    assert not timed and not exact.paged_decodes and not exact.matmul_decodes
    quantized = TorchModelRunner.load(str(folder), 32, BLOCK_SIZE, quantization="int4")
    assert timed == [(torch.float32, torch.float32)] and quantized.paged_decodes
    bf16_cache = TorchModelRunner.load(str(folder), 32, BLOCK_SIZE, kv_cache_dtype="bfloat16")
    assert timed[1:] == [(torch.float32, torch.bfloat16)] and bf16_cache.paged_decodes


def test_inputs_the_kernel_would_misread_are_refused() -> None:
    q = torch.zeros(2, 9, 64, dtype=torch.bfloat16)
    cache = torch.zeros(3, 64, 64, dtype=torch.bfloat16)
    tables, lengths = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    assert paged_decode(q, cache, cache, tables, lengths, 16).shape == q.shape
    for bad in (
        (q, cache, cache, tables.long(), lengths),  # int64 block ids
        (q, cache.float(), cache.float(), tables, lengths),  # fp32 caches under bf16 queries
        (q.float(), cache, cache.float(), tables, lengths),  # K and V of different dtypes
        (q, cache.transpose(1, 2), cache, tables, lengths),  # a strided cache
        (q, cache, cache, tables[:1], lengths),  # a table short of rows
    ):
        with pytest.raises(ValueError):
            paged_decode(*bad, 16)

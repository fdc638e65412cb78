"""`--kv-cache-dtype bfloat16` under an fp32 model: K/V stored rounded to bf16, read back
widened; its accuracy against the fp32 cache on the real SmolLM2 (teacher_forcing.py)."""

from __future__ import annotations

import pytest
import torch

from redserve.cli import build_parser, settings_from_args
from shared.protocol import SamplingParams
from tests.support.teacher_forcing import Reference, agreement
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine.dtypes import resolve_kv_dtype
from workers.scheduler.engine.memory import kv_bytes_per_token
from workers.scheduler.engine.model_runner import TorchModelRunner
from workers.scheduler.kernels.paged_decode import kernel_library
from workers.scheduler.layers.attention_tuning import AttentionChoice

pytestmark = pytest.mark.model

# Measured on 2 AVX2 cores (torch 2.13), 160 teacher-forced predictions, either decode path:
# top-1 160/160, mean |logprob error| 0.0022-0.0023, max 0.017 (int4 weights: 158/160, 0.029;
# test_quantization.py). The bounds leave room for other CPUs.
MIN_TOP1_AGREEMENT = 0.97
MAX_MEAN_LOGPROB_ERROR = 0.01


def test_auto_keeps_the_models_dtype_and_bf16_is_named_either_way() -> None:
    assert resolve_kv_dtype("auto", torch.float32) == torch.float32
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert resolve_kv_dtype("bf16", torch.float32) == torch.bfloat16
    # A checkpoint stored quantized, served so: 16-bit K/V, as llama.cpp keeps them.
    assert resolve_kv_dtype("auto", torch.float32, quantized_checkpoint=True) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.bfloat16, quantized_checkpoint=True) == torch.bfloat16
    for model_dtype in (torch.float32, torch.bfloat16):
        exact = resolve_kv_dtype("float32", model_dtype, quantized_checkpoint=True)
        assert exact == torch.float32
    with pytest.raises(ValueError, match="fp8"):
        resolve_kv_dtype("fp8", torch.float32)


def test_the_flag_reaches_the_settings_and_unknown_names_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    args = parser.parse_args(["scheduler", "--kv-cache-dtype", "bfloat16"])
    assert settings_from_args(args).scheduler.kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["scheduler", "--kv-cache-dtype", "fp8_e5m2"])
    assert "invalid choice" in capsys.readouterr().err


def test_a_bf16_cache_holds_the_rounded_keys_in_half_the_bytes(model_path: str) -> None:
    fp32 = TorchModelRunner.load(model_path, 8, 16, dtype="float32")
    bf16 = TorchModelRunner.load(model_path, 8, 16, dtype="float32", kv_cache_dtype="bf16")
    assert bf16.model.embed_tokens.weight.dtype == torch.float32
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in bf16.kv_cache)
    args = bf16.model.args
    assert kv_bytes_per_token(args, torch.bfloat16) * 2 == kv_bytes_per_token(args, torch.float32)
    prompt = list(range(100, 140))
    for runner in (fp32, bf16):
        _prefill(runner, prompt)
    # Layer 0's K/V come from the same inputs in both: the bf16 cache holds them rounded.
    # Later layers' inputs already saw rounded K/V: close, not equal.
    for layer, exact in ((0, True), (-1, False)):
        for k32, k16 in zip(fp32.kv_cache[layer], bf16.kv_cache[layer], strict=True):
            stored, rounded = k16[:, : len(prompt)], k32[:, : len(prompt)].bfloat16()
            if exact:
                assert torch.equal(stored, rounded)
            else:
                torch.testing.assert_close(stored, rounded, atol=0.05, rtol=0.05)


def _prefill(runner: TorchModelRunner, prompt: list[int]) -> None:
    seq = Sequence("r", prompt, SamplingParams(max_new_tokens=1))
    seq.block_table = list(range(-(-len(prompt) // runner.block_size)))
    seq.num_new_tokens = len(prompt)
    runner.forward([seq])


@pytest.mark.parametrize("paged", [False, True])
def test_a_bf16_cache_follows_the_fp32_greedy_trajectory(
    model_path: str, reference: Reference, paged: bool
) -> None:
    """Decodes through torch's gather + SDPA (K/V widened to fp32) and through the paged
    kernel (fp32 queries over the bf16 cache)."""
    if paged and kernel_library() is None:
        pytest.skip("no C compiler here: the paged decode kernel is not built")
    runner = TorchModelRunner.load(model_path, 64, 16, dtype="float32", kv_cache_dtype="bfloat16")
    runner.use_attention(AttentionChoice(True, False, paged_decodes=paged))
    result = agreement(reference, runner)
    assert result.top1 / result.total >= MIN_TOP1_AGREEMENT, str(result)
    assert result.mean_error <= MAX_MEAN_LOGPROB_ERROR, str(result)

"""`--quantization auto` (the default) serves a checkpoint at the precision it was stored in:
int4 for the projections a GGUF stores in 4 bits or fewer, dense for everything else
(layers/auto_quantization.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from shared.model_files import SOURCE_PRECISION, gguf_tensor_types
from tests.support.models import SMALL, saved_random_model
from tests.support.routing import route_every_size
from tests.support.teacher_forcing import Reference, agreement
from workers.scheduler.engine.model_runner import TorchModelRunner
from workers.scheduler.kernels import fused_decode, int8_bf16
from workers.scheduler.layers.auto_quantization import HEAD, plan_quantization
from workers.scheduler.layers.quantization import INT4_GROUP_SIZE, Int4Weights, int8_channels
from workers.scheduler.layers.tiered import TieredLinear

# The bounds of tests/model/test_quantization.py's teacher-forced tests.
MIN_TOP1_AGREEMENT, MAX_MEAN_LOGPROB_ERROR = 0.95, 0.06
PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def converted_folder(tmp_path: Path, types: dict[str, str]) -> str:
    """A folder as a GGUF conversion leaves it, as far as the plan reads it."""
    (tmp_path / SOURCE_PRECISION).write_text(
        json.dumps({"format": "gguf", "file": "x.gguf", "tensor_types": types})
    )
    return str(tmp_path)


def gguf_types(layers: int, kind: str, head: str = "Q8_0") -> dict[str, str]:
    return {f"blk.{i}.{part}": kind for i in range(layers) for part in PARTS} | {
        "token_embd": head
    }


def test_a_4_bit_gguf_is_served_in_int4_and_its_8_bit_head_in_int8(tmp_path: Path) -> None:
    plan = plan_quantization("auto", "cpu", converted_folder(tmp_path, gguf_types(3, "Q4_1")))
    assert plan.method == "int4" and plan.keep_dense == frozenset()


def test_projections_stored_in_more_bits_stay_dense(tmp_path: Path) -> None:
    # A Q4_K_M file: some ffn_down and attn_v tensors in Q6_K; an F16 head.
    types = gguf_types(2, "Q4_K", head="F16") | {"blk.1.ffn_down": "Q6_K", "blk.0.attn_v": "Q6_K"}
    plan = plan_quantization("auto", "cpu", converted_folder(tmp_path, types))
    assert plan.method == "int4"
    assert plan.keep_dense == {(1, "down_proj"), (0, "qkv_proj"), (-1, HEAD)}


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "F16", "BF16", "F32"])
def test_a_gguf_stored_in_more_than_4_bits_stays_dense(tmp_path: Path, kind: str) -> None:
    plan = plan_quantization("auto", "cpu", converted_folder(tmp_path, gguf_types(2, kind)))
    assert plan.method == "none"


def test_a_dense_checkpoint_and_cuda_stay_dense(tmp_path: Path) -> None:
    assert plan_quantization("auto", "cpu", str(tmp_path)).method == "none"  # no GGUF record
    folder = converted_folder(tmp_path, gguf_types(2, "Q4_0"))
    assert plan_quantization("auto", "cuda", folder).method == "none"
    for explicit in ("none", "int4", "w8a8_int8"):  # a setting other than auto is kept
        assert plan_quantization(explicit, "cpu", folder).method == explicit


def test_the_default_runner_of_a_dense_checkpoint_is_unquantized(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    folder = saved_random_model(tmp_path_factory, "dense", LlamaConfig(**SMALL), weight_std=0.05)
    runner = TorchModelRunner.load(str(folder), 8, 16, dtype="float32", quantization="auto")
    assert not any(isinstance(m, TieredLinear) for m in runner.model.modules())
    assert runner.kv_cache[0][0].dtype == torch.float32  # the model's dtype


def test_the_packaged_q4_1_gguf_loads_in_int4_by_default(model_path: str) -> None:
    types = gguf_tensor_types(model_path)
    assert set(types.values()) == {"Q4_1", "Q8_0"}  # projections Q4_1, the tied head Q8_0
    runner = TorchModelRunner.load(model_path, 8, 16, dtype="float32", quantization="auto")
    tiered = [m for m in runner.model.modules() if isinstance(m, TieredLinear)]
    assert len(tiered) == 4 * runner.model.args.num_layers + 1
    assert sum("int4" in m.kernels for m in tiered) == 4 * runner.model.args.num_layers
    amx = ["int8_bf16"] if int8_bf16.fits(torch.zeros(64, 64)) else []
    vnni = fused_decode.available()
    assert list(runner.model.lm_head.kernels) == ["int8", *["int8_vnni"] * vnni, *amx]
    assert all(list(m.kernels) == ["int4", *["int4_vnni"] * vnni, *amx] for m in tiered[:-1])
    # K/V in 16 bits, as llama.cpp serves the file; the exact reference keeps fp32.
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in runner.kv_cache)
    exact = TorchModelRunner.load(model_path, 8, 16, dtype="float32", quantization="none")
    assert exact.kv_cache[0][0].dtype == torch.float32


def test_auto_follows_the_fp32_greedy_trajectory_through_each_of_its_kernels(
    model_path: str, reference: Reference
) -> None:
    # Every step size routed to one kernel at a time: int4 projections with the int8 head,
    # then (AVX512-VNNI or AVX2 CPUs) both times int8 activations, then (AMX-BF16 CPUs) int8 x bf16
    # everywhere.
    runner = TorchModelRunner.load(model_path, 64, 16, dtype="float32", quantization="auto")
    kernels = [
        ("int4",),
        *([("int4_vnni", "int8_vnni")] if fused_decode.available() else []),
        *([("int8_bf16",)] if int8_bf16.fits(torch.zeros(64, 64)) else []),
    ]
    for kernel in kernels:
        route_every_size(runner.model, *kernel)
        result = agreement(reference, runner)
        assert result.top1 / result.total >= MIN_TOP1_AGREEMENT, f"{kernel}: {result}"
        assert result.mean_error <= MAX_MEAN_LOGPROB_ERROR, f"{kernel}: {result}"


def test_int4_holds_the_q4_1_weights_on_their_own_grid(model_path: str) -> None:
    """Q4_1 stores each group of 32 as q * d + m with q in 0..15, so the de-quantized group's
    min and max are m and m + 15 d: the int4 kernel's groups find the same d, m and q, and
    what it computes differs from the checkpoint's weights by bf16's rounding of d and m
    only. Weights not on such a grid lose up to d / 2 each."""
    runner = TorchModelRunner.load(model_path, 8, 16, dtype="float32", quantization="none")
    checkpoint = runner.model.layers[0].self_attn.qkv_proj.weight.detach().float()
    off_grid = checkpoint + torch.rand_like(checkpoint).sub(0.5) * group_step(checkpoint)
    step = group_step(checkpoint).mean()
    assert int4_error(checkpoint).mean() < 0.05 * step
    assert int4_error(off_grid).mean() > 0.15 * step
    # int8 per output channel (the int8 x bf16 kernel's weights): off the grid, but by a
    # small part of a step (measured: 0.027 of it on average).
    q, scale = int8_channels(checkpoint)
    assert (q.float() * scale.unsqueeze(1) - checkpoint).abs().mean() < 0.06 * step


def group_step(weight: torch.Tensor) -> torch.Tensor:
    """Each weight's group's d = (max - min) / 15."""
    groups = weight.view(weight.shape[0], -1, INT4_GROUP_SIZE)
    step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
    return step.expand_as(groups).reshape(weight.shape)


def int4_error(weight: torch.Tensor) -> torch.Tensor:
    """|w - the weight the int4 kernel multiplies by|, read back through an identity input."""
    identity = torch.eye(weight.shape[1], dtype=torch.bfloat16)
    served = Int4Weights(weight)(identity).float().t()
    return (served - weight).abs()

"""`--quantization int4` and `w8a8_int8`: each step size routed to the kernel timed fastest
for it, and the kernels' accuracy against the fp32 reference on the real SmolLM2
(teacher_forcing.py)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from tests.support.routing import route_every_size
from tests.support.teacher_forcing import Reference, agreement
from workers.scheduler.engine.model_runner import TorchModelRunner
from workers.scheduler.kernels import fused_decode, int8_bf16
from workers.scheduler.kernels.w8a8 import FusedW8A8, kernel_fits
from workers.scheduler.layers import quantization
from workers.scheduler.layers.quantization import (
    DynamicInt8,
    Int4Weights,
    Int8Weights,
    quantize_model,
)
from workers.scheduler.layers.tiered import DENSE, TUNED_TOKENS, TieredLinear, tune_routes

pytestmark = pytest.mark.model

# Measured on 2 AVX2 cores (torch 2.13), compact decodes: top-1 158/160, mean |logprob
# error| 0.029, max 0.17 (int4 projections with the fp32 head: 159/160 and 0.009; an int4
# head instead of int8: 138/160). With the prompts' prefill compact too, as pinned below (2
# Sapphire Rapids cores): 156/160, 0.031, max 0.15. The bounds leave room for other CPUs.
MIN_TOP1_AGREEMENT = 0.95
MAX_MEAN_LOGPROB_ERROR = 0.06


@pytest.mark.parametrize(("kernel", "tolerance"), [("int4", 0.08), ("int8", 0.02), ("w8a8", 0.02)])
def test_each_compact_kernel_follows_the_dense_weights(kernel: str, tolerance: float) -> None:
    # int4: 15 levels per group of 32; int8: 254 levels per channel (plus bf16 activations).
    torch.manual_seed(0)
    dense = nn.Linear(128, 96, bias=True)
    layer = TieredLinear(dense, _kernels(dense)[kernel])
    with torch.inference_mode():
        x = torch.randn(16, 128)
        compact, exact = layer(x), dense(x)
    assert compact.dtype == torch.float32
    assert not torch.equal(compact, exact)  # really the quantized kernel
    assert (compact - exact).abs().max() < tolerance * exact.abs().max()


def test_a_compiled_projection_keeps_a_graph_per_route_range_not_per_size() -> None:
    """Under torch.compile with a dynamic batch (compiled.py), picking the route compares the
    size only where the route changes: steps of 2 to 40 tokens take two graphs (int4 up to
    4 tokens, int8 above), and each still runs its route's kernel."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    dense = nn.Linear(128, 96)
    layer = TieredLinear(dense, {**_kernels(dense)["int4"], **_kernels(dense)["int8"]})
    layer.route = ["int4"] * 3 + ["int8"] * 5  # 1, 2, 4 | 8 .. 256
    compiled = torch.compile(layer)
    graphs = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        for tokens in (2, 3, 4, 5, 8, 9, 40):
            x = torch.randn(tokens, 128)
            torch._dynamo.mark_dynamic(x, 0)
            kernel = "int4" if tokens <= 4 else "int8"
            torch.testing.assert_close(compiled(x), layer.run(kernel, x), rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] - graphs == 2


def _kernels(dense: nn.Linear) -> dict[str, dict[str, nn.Module]]:
    return {
        "int4": {"int4": Int4Weights(dense.weight)},
        "int8": {"int8": Int8Weights(dense.weight)},
        "w8a8": {"w8a8": DynamicInt8(dense.weight, torch.ones(dense.in_features))},
    }


def test_a_step_takes_the_route_of_the_smallest_tuned_size_that_holds_it() -> None:
    torch.manual_seed(0)
    dense = nn.Linear(128, 96)
    layer = TieredLinear(dense, {**_kernels(dense)["int4"], **_kernels(dense)["w8a8"]})
    layer.route = ["int4", "int4", "w8a8", "int4", DENSE, "w8a8", "int4", DENSE]  # 1, 2 .. 256
    expected = {1: "int4", 2: "int4", 3: "w8a8", 4: "w8a8", 5: "int4", 16: DENSE, 17: "w8a8"}
    expected |= {64: "int4", 65: DENSE, 256: DENSE}
    with torch.inference_mode():
        for tokens, kernel in expected.items():
            x = torch.randn(tokens, 128)
            assert torch.equal(layer(x), layer.run(kernel, x)), (tokens, kernel)
    # Steps above the largest tuned size take its route, whichever kernel that is.
    layer.route[-1] = "w8a8"
    expected = {65: "w8a8", 256: "w8a8", 300: "w8a8", 2048: "w8a8"}
    with torch.inference_mode():
        for tokens, kernel in expected.items():
            x = torch.randn(tokens, 128)
            assert torch.equal(layer(x), layer.run(kernel, x)), (tokens, kernel)
        assert not torch.equal(layer.run("int4", x), layer.run("w8a8", x))


class _SlowAbove(nn.Module):
    """A kernel that takes 5 ms for steps of more than `tokens` tokens and no time for the
    rest (its output: zeros); `_Dense2ms` beside it takes 2 ms for any step."""

    def __init__(self, out_features: int, tokens: int) -> None:
        super().__init__()
        self.out_features, self.tokens = out_features, tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.tokens:
            time.sleep(0.005)
        return x.new_zeros(x.shape[0], self.out_features)


class _Dense2ms(nn.Linear):
    """No real product: a parallel matmul waits on a busy second core for milliseconds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)
        return x.new_zeros(x.shape[0], self.out_features)


def test_tune_routes_sends_each_step_size_to_the_kernel_that_ran_it_fastest() -> None:
    model = nn.Sequential(
        *(TieredLinear(_Dense2ms(8, 8), {"fake": _SlowAbove(8, 4)}) for _ in range(3)),
        TieredLinear(_Dense2ms(8, 8), {"other": _SlowAbove(8, 16)}),
    )
    routes = tune_routes(model)
    fake = ["fake"] * 3 + [DENSE] * (len(TUNED_TOKENS) - 3)  # sizes 1, 2, 4, then dense
    other = ["other"] * 5 + [DENSE] * (len(TUNED_TOKENS) - 5)
    assert routes == {"fake x3": fake, "other x1": other}
    assert [layer.route for layer in model] == [fake, fake, fake, other]


def test_quantize_model_wraps_every_projection_and_the_head(model_path: str) -> None:
    runner = TorchModelRunner.load(model_path, 8, 16, dtype="float32", quantization="int4")
    model = runner.model
    # With AVX512-VNNI or AVX2 the int8 and int4 groups also go through the fused step's products.
    vnni = fused_decode.available()
    head, projection = ["int8"] + ["int8_vnni"] * vnni, ["int4"] + ["int4_vnni"] * vnni
    assert isinstance(model.lm_head, TieredLinear) and list(model.lm_head.kernels) == head
    for layer in model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
            assert isinstance(proj, TieredLinear) and list(proj.kernels) == projection
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_model(model, "int3")


def test_int4_follows_the_fp32_greedy_trajectory(model_path: str, reference: Reference) -> None:
    int4 = TorchModelRunner.load(model_path, 64, 16, dtype="float32", quantization="int4")
    route_every_size(int4.model)  # every step up to 64 tokens compact, the head's included
    result = agreement(reference, int4)
    assert result.top1 / result.total >= MIN_TOP1_AGREEMENT, str(result)
    assert result.mean_error <= MAX_MEAN_LOGPROB_ERROR, str(result)


@pytest.mark.parametrize(
    ("outlier_channels", "bound"), [(quantization.OUTLIER_CHANNELS, 0.003), (0, 0.01)]
)
def test_w8a8_keeps_outlier_channels_out_of_the_int8_product(
    monkeypatch: pytest.MonkeyPatch, outlier_channels: int, bound: float
) -> None:
    """Three input channels 60x wider than the rest: with them multiplied apart the error is
    ~0.001 of the output range; quantized with the rest, ~0.015 (so the second case's
    bound must fail: the outlier path is what keeps the first one small)."""
    monkeypatch.setattr(quantization, "OUTLIER_CHANNELS", outlier_channels)
    torch.manual_seed(0)
    dense = nn.Linear(128, 96, bias=True)
    x = torch.randn(16, 128)
    x[:, [3, 40, 77]] *= 60
    layer = TieredLinear(dense, {"w8a8": DynamicInt8(dense.weight, x.abs().amax(0))})
    with torch.inference_mode():
        error = (layer(x) - dense(x)).abs().max() / dense(x).abs().max()
    assert (error < bound) == bool(outlier_channels), float(error)


def test_w8a8_needs_calibrated_input_ranges(model_path: str) -> None:
    runner = TorchModelRunner.load(model_path, 8, 16, dtype="float32")
    with pytest.raises(ValueError, match="input ranges"):
        quantize_model(runner.model, "w8a8_int8")


@pytest.mark.parametrize("kernel", [DynamicInt8, FusedW8A8], ids=["fbgemm", "c-kernel"])
def test_w8a8_follows_the_fp32_greedy_trajectory(
    model_path: str, reference: Reference, kernel: type[nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every step through the W8A8 kernel: qkv, o, gate_up and the head in int8 x int8,
    # down_proj in int4. Measured on 2 Ice Lake cores: top-1 158/160, mean |logprob error|
    # 0.035, max 0.22 (with the int8 weight-only head instead: 158/160, 0.046, max 0.37; on
    # 2 AVX2 cores that one was 155/160, 0.040; int4 alone: 158/160, 0.030).
    # On 2 Zen 5 cores, fp32 (bf16): fbgemm 155/160, 0.039, max 0.44 (154/160, 0.043); the C
    # kernel (AVX512-VNNI, 8-bit activations) 159/160, 0.025, max 0.36 (157/160, 0.036).
    # On 2 Zen 3 cores (AVX2), fp32: fbgemm 156/160, 0.042, max 0.55; the C kernel (7-bit
    # weights) 157/160, 0.037, max 0.30.
    if kernel == FusedW8A8 and not kernel_fits(torch.zeros(64, 64)):
        pytest.skip("neither AVX512-VNNI nor AVX2 here: the C kernel is not offered")
    if kernel == DynamicInt8:
        monkeypatch.setattr(quantization, "kernel_fits", lambda weight, wide=False: False)
    w8a8 = TorchModelRunner.load(model_path, 64, 16, dtype="float32", quantization="w8a8_int8")
    assert route_every_size(w8a8.model, "w8a8") == 4 * len(w8a8.model.layers) + 1
    w8a8_layers = [m for m in w8a8.model.modules() if isinstance(m, kernel) and not wide(m)]
    assert len(w8a8_layers) == 3 * len(w8a8.model.layers) + 1  # the head's too
    result = agreement(reference, w8a8)
    assert result.top1 / result.total >= MIN_TOP1_AGREEMENT, str(result)
    assert result.mean_error <= MAX_MEAN_LOGPROB_ERROR, str(result)


def wide(module: nn.Module) -> bool:
    return isinstance(module, FusedW8A8) and module.wide


def test_w8a16_down_proj_follows_the_fp32_greedy_trajectory(
    model_path: str, reference: Reference
) -> None:
    # As above, down_proj in W8A16 instead of int4 (its input's outliers cost W8A8 22 of 160
    # top-1 agreements; in the AVX2 kernel 154/160, mean 0.071). On 2 Zen 3 cores (AVX2),
    # fp32: 156/160, mean |logprob error| 0.038, max 0.31 (down in int4 in the same run:
    # 155/160, 0.039, max 0.43).
    if not kernel_fits(torch.zeros(64, 64), wide=True):
        pytest.skip("no AVX2 here: W8A16 is not offered")
    w8a8 = TorchModelRunner.load(model_path, 64, 16, dtype="float32", quantization="w8a8_int8")
    assert route_every_size(w8a8.model, "w8a8", "w8a16") == 4 * len(w8a8.model.layers) + 1
    downs = [m for name, m in w8a8.model.named_modules() if name.endswith("down_proj")]
    assert all(d.kernels["w8a16"].wide for d in downs)
    assert sum(wide(m) for m in w8a8.model.modules()) == len(w8a8.model.layers)
    result = agreement(reference, w8a8)
    assert result.top1 / result.total >= MIN_TOP1_AGREEMENT, str(result)
    assert result.mean_error <= MAX_MEAN_LOGPROB_ERROR, str(result)


def test_int8_bf16_down_proj_follows_the_fp32_greedy_trajectory(
    model_path: str, reference: Reference
) -> None:
    # As above, down_proj in int8 weights x bf16 activations through AMX-BF16 (int8_bf16.py)
    # where the CPU has it. On 2 AMX cores (Intel, 2026-12-02), fp32: 158/160, mean |logprob
    # error| 0.029, max 0.22.
    if not int8_bf16.fits(torch.zeros(64, 64)):
        pytest.skip("no AMX-BF16 here: int8 x bf16 is not offered")
    w8a8 = TorchModelRunner.load(model_path, 64, 16, dtype="float32", quantization="w8a8_int8")
    assert route_every_size(w8a8.model, "w8a8", "int8_bf16") == 4 * len(w8a8.model.layers) + 1
    downs = [m for name, m in w8a8.model.named_modules() if name.endswith("down_proj")]
    assert all(d.route == ["int8_bf16"] * len(TUNED_TOKENS) for d in downs)
    result = agreement(reference, w8a8)
    assert result.top1 / result.total >= MIN_TOP1_AGREEMENT, str(result)
    assert result.mean_error <= MAX_MEAN_LOGPROB_ERROR, str(result)

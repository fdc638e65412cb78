"""Quantized kernels for small and middle-sized CPU steps (`--quantization int4`,
`--quantization w8a8_int8`). Each wrapped projection is a `TieredLinear` (tiered.py) that
routes a step by its token count to the kernel measured fastest for that size on this CPU.

A decode step of a few sequences is memory-bound: every step reads all the weights once, so
their size sets its time and compact int4 weights make it much shorter (measured in
bench/README.md); large steps are compute-bound, and there the packed kernels lose.

Decoder projections: int4, asymmetric, groups of 32 along the input dim (scale and zero per
group). SmolLM2's packaged weights come from a Q4_1 GGUF (the same layout), so requantizing
them is close to lossless. The LM head: int8 per output channel (an int4 head loses far
more top-1 agreement with fp32 than an int8 one; bench/README.md). Accuracy against the fp32
reference: tests/model/test_quantization.py. CPU only: the CUDA int4 kernel wants
another packing.

`w8a8_int8` gives qkv, o, gate_up and the head a third kernel, int8 x int8 (`w8a8_projection`;
down_proj int8 x int16 where the CPU has AVX2 and int8 x bf16 where it has AMX-BF16, see
DYNAMIC_INT8_PROJECTIONS):
on x86 CPUs with AVX512-VNNI or AVX2 one C call per projection (kernels/w8a8.py), elsewhere
fbgemm's GEMM inside torch ops (`DynamicInt8`, which on AVX2 beats int4 and fp32 from
middle-sized steps on; bench/kernels.py). Its activations are quantized at run time, which
this model's outlier channels make lossy; a calibration prefill at load (`CALIBRATION_TEXT`)
finds them.

Which kernel a step takes depends on how many tokens it carries, so with quantization on,
a request's tokens can differ (rarely) with the batch it shares: quantization is opt-in and
fp32 without it stays the exact, batch-invariant reference.
"""

from __future__ import annotations

import ctypes
import warnings

import torch
from torch import nn

from shared.config import QUANTIZATIONS
from workers.scheduler.kernels import fused_decode, int8_bf16
from workers.scheduler.kernels.w8a8 import FusedW8A8, build_kernel, kernel_fits
from workers.scheduler.layers.tiered import TieredLinear
from workers.scheduler.model.llama import LlamaForCausalLM

INT4_GROUP_SIZE = 32


class Int4Weights(nn.Module):
    """x @ w.T with w in int4 groups (torch's packed kernel: vectorized for bf16
    activations, far slower on fp32 ones, so fp32 inputs are rounded to bf16). Output bf16,
    no bias."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        q, scale, low = int4_grid(weight.detach().float(), INT4_GROUP_SIZE)
        packed, scales = int4_packed(q, scale, low)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        # The same groups in the fused decode step's layout (kernels/fused_decode.py),
        # where that kernel runs.
        self.tiles: fused_decode.Tiles | None = None
        if fused_decode.available() and fused_decode.tiles_fit(*q.shape):
            self.tiles = fused_decode.Tiles.int4(q, scale, low)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = x.to(torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            low, self.packed, INT4_GROUP_SIZE, self.scales
        )


class Int8Weights(nn.Module):
    """x @ w.T with w in int8 per output channel (bf16 activations). Output bf16, no bias."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        packed, scales = int8_channels(weight.detach().float())
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales", scales.to(torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.packed, self.scales)


def quantize_model(
    model: LlamaForCausalLM,
    method: str,
    input_max: dict[nn.Module, torch.Tensor] | None = None,
    keep_dense: frozenset[tuple[int, str]] = frozenset(),
    int8_bf16_too: bool = False,
) -> int:
    """Wraps the decoder's projections (kernel "int4") and the LM head ("int8") in
    `TieredLinear`; for "w8a8_int8" the projections whose inputs come from a norm or
    attention (qkv, o, gate_up, the head) get a "w8a8" kernel too, which needs `input_max`
    (`projection_input_max` of a calibration run, by projection). Returns the number of
    projections wrapped. Shapes the packed kernels cannot take stay dense (see `fits`), and
    so do those in `keep_dense`: (layer index, name), or (-1, "lm_head"). `int8_bf16_too`:
    "int4" also offers every projection and the head int8 weights x bf16 activations where
    the CPU has AMX-BF16 (kernels/int8_bf16.py), for middle-sized steps.
    Routes stay untuned: `tune_routes` (tiered.py) measures them."""
    if method not in QUANTIZATIONS or method == "auto":
        raise ValueError(f"unknown quantization {method!r} ({', '.join(QUANTIZATIONS)})")
    if method == "none":
        return 0
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(f"--quantization {method} runs on CPU only (its kernels are CPU's)")
    if method == "w8a8_int8" and input_max is None:
        raise ValueError("w8a8_int8 needs the projections' calibrated input ranges")
    wrapped = 0
    for index, layer in enumerate(model.layers):
        for parent, name in (
            (layer.self_attn, "qkv_proj"),
            (layer.self_attn, "o_proj"),
            (layer.mlp, "gate_up_proj"),
            (layer.mlp, "down_proj"),
        ):
            dense = getattr(parent, name)
            if not fits(dense, bits=4) or (index, name) in keep_dense:
                continue
            kernels = _decoder_kernels(name, dense, None if input_max is None else input_max[dense])
            if int8_bf16_too:
                kernels |= _int8_bf16(dense.weight)
            setattr(parent, name, TieredLinear(dense, kernels))
            wrapped += 1
    head = model.lm_head
    assert isinstance(head, nn.Linear)
    if fits(head, bits=8) and (-1, "lm_head") not in keep_dense:
        head_kernels: dict[str, nn.Module] = {"int8": Int8Weights(head.weight)}
        if fused_decode.available() and fused_decode.tiles_fit(*head.weight.shape):
            # int8 groups x int8 activations (AVX512-VNNI or AVX2): reads half of bf16's bytes
            head_kernels["int8_vnni"] = fused_decode.FusedLinear(
                fused_decode.Tiles.int8(head.weight)
            )
        if input_max is not None:
            head_kernels["w8a8"] = w8a8_projection(head.weight, input_max[head])
        if int8_bf16_too:
            head_kernels |= _int8_bf16(head.weight)
        model.lm_head = TieredLinear(head, head_kernels)
        wrapped += 1
    return wrapped


def _decoder_kernels(
    name: str, dense: nn.Linear, input_max: torch.Tensor | None
) -> dict[str, nn.Module]:
    """The compact kernels of decoder projection `name`: int4, and with `input_max`
    (w8a8_int8) W8A8, or for down_proj those that keep its activations in 16 bits."""
    int4 = Int4Weights(dense.weight)
    kernels: dict[str, nn.Module] = {"int4": int4}
    if int4.tiles is not None:  # the same groups times int8 activations (AVX512-VNNI or AVX2)
        kernels["int4_vnni"] = fused_decode.FusedLinear(int4.tiles)
    if input_max is not None and name in DYNAMIC_INT8_PROJECTIONS:
        kernels["w8a8"] = w8a8_projection(dense.weight, input_max)
    elif input_max is not None:
        if kernel_fits(dense.weight, wide=True):
            kernels["w8a16"] = w8a8_projection(dense.weight, input_max, wide=True)
        if int8_bf16.fits(dense.weight):
            kernels["int8_bf16"] = int8_bf16.Int8Bf16(*int8_channels(dense.weight.detach().float()))
    return kernels


def _int8_bf16(weight: torch.Tensor) -> dict[str, nn.Module]:
    """The int8 x bf16 kernel of `weight`, where this CPU and the shape take it."""
    if not int8_bf16.fits(weight):
        return {}
    return {"int8_bf16": int8_bf16.Int8Bf16(*int8_channels(weight.detach().float()))}


def fits(dense: nn.Linear, bits: int) -> bool:
    """Whether the packed kernel takes this shape. int4 packing wants whole groups along
    the input and output channels in multiples of 16 (it raises otherwise); the int8 kernel
    crashes the process (SIGSEGV, torch 2.13) on an input dim that is not a multiple of 8,
    so we ask for whole groups of 32 there too."""
    if dense.in_features % INT4_GROUP_SIZE:
        return False
    return bits == 8 or dense.out_features % 16 == 0


def int4_grid(
    weight: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group` inputs (Q4_1's grid): w ≈ q * scale + low with q
    in [0, 15]. Returns q [out, in] int32, scale and low [out, in / group]."""
    out_features, in_features = weight.shape
    groups = weight.view(out_features, in_features // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-10)
    q = torch.round((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15)
    return q.to(torch.int32).view(out_features, in_features), scale, low


def int4_packed(
    q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`int4_grid`'s groups for torch's packed kernel, whose convention is w ≈ (q - 8) *
    scale + zero: the packed weight and the [in / group, out, 2] bf16 scales and zeros."""
    zero = low + 8 * scale
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed, scales_and_zeros.to(torch.bfloat16)


def int4_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`int4_grid` then `int4_packed`."""
    return int4_packed(*int4_grid(weight, group))


def int8_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: w ≈ q * scale (fp32 scales)."""
    scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-10)
    q = torch.round(weight / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return q, scale


# w8a8_int8's calibration text: prose, code, numbers and another language, unrelated to the
# prompts of the accuracy test (tests/model/teacher_forcing.py).
CALIBRATION_TEXT = (
    "A lighthouse keeper kept a diary for forty years. Each morning he wrote down the wind, "
    "the colour of the sea and the ships that passed; in winter there were few.\n\n"
    "def mean(values):\n    if not values:\n        raise ValueError('empty')\n"
    "    return sum(values) / len(values)\n\n"
    "Q: A train leaves at 09:45 and arrives at 13:10. How long is the trip? "
    "A: 3 hours and 25 minutes.\n"
    "| city | population |\n|---|---|\n| Lyon | 522,250 | \n| Porto | 231,800 |\n"
    "Le chat dort sur le canapé pendant que la pluie tombe. ¿Dónde está la estación?\n"
    "User: Summarise the plot of a famous novel in two sentences.\nAssistant: Sure."
)


def calibration_ids(model_path: str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(model_path)(CALIBRATION_TEXT)["input_ids"])


# w8a8_int8: which decoder projections take int8 activations (and the LM head, whose
# input comes from the final norm). down_proj's input (silu(gate) * up) has the widest
# outliers: W8A8 there alone costs far more top-1 agreement with fp32 than the other three
# projections and the int8 head together. It takes W8A16 instead where the CPU has AVX2
# (16-bit activations, 8-bit weights: as accurate as int4 and as fast as W8A8, where fp32
# and int4 are much slower from middle-sized steps on; bench/kernels.py), and int8 weights
# x bf16 activations through AMX-BF16 where the CPU has that (kernels/int8_bf16.py: faster
# than prepacked bf16, its bf16 activations keep the outliers), else int4/dense. The head
# in W8A8 costs no more accuracy than int8 weights and runs much faster with VNNI.
# Measured in bench/README.md.
DYNAMIC_INT8_PROJECTIONS = frozenset({"qkv_proj", "o_proj", "gate_up_proj"})
# Input channels whose calibrated range is widest stay out of the int8 product (computed
# in the model's dtype), and SmoothQuant moves part of the rest of the activations' range
# into the weights (s = input_max**ALPHA / weight_max**(1 - ALPHA) per input channel).
OUTLIER_CHANNELS = 16
SMOOTHING_ALPHA = 0.7


def w8a8_projection(
    dense_weight: torch.Tensor,
    input_max: torch.Tensor,
    library: ctypes.CDLL | None = None,
    wide: bool = False,
) -> nn.Module:
    """The W8A8 projection: one C call where the CPU has AVX512-VNNI or AVX2 (kernels/w8a8.py;
    `library`: another build of it, for tests), else fbgemm's GEMM inside torch ops
    (`DynamicInt8`); the same smoothing either way. The weights take the levels the
    library's path multiplies exactly (7 bits on AVX2, else 8). `wide`: W8A16 (16-bit
    activations, 8-bit weights), the C call only."""
    library = library or (build_kernel() if kernel_fits(dense_weight, wide) else None)
    if library is None:
        if wide:
            raise ValueError("W8A16 runs on the C kernel only (AVX2)")
        return DynamicInt8(dense_weight, input_max)
    smoothed = Smoothed(dense_weight, input_max)
    levels = 127 if wide else library.w8a8_weight_levels()
    scale = (smoothed.weight.abs().amax(1) / levels).clamp(min=1e-10)
    q = torch.round(smoothed.weight / scale.unsqueeze(1)).clamp(-levels, levels).to(torch.int8)
    inverse, outliers = smoothed.inverse_smooth, smoothed.outliers
    outlier_weight = dense_weight.detach()[:, outliers].float()
    return FusedW8A8(q, scale, inverse, outliers, outlier_weight, library, wide)


class Smoothed:
    """A projection's weight ready for int8 activations: the `OUTLIER_CHANNELS` input
    channels with the widest calibrated range (`input_max`) set apart, the others smoothed
    (SmoothQuant: activations divided by s, the weight's columns multiplied by it)."""

    def __init__(self, dense_weight: torch.Tensor, input_max: torch.Tensor) -> None:
        weight = dense_weight.detach().float()
        smooth = (
            input_max.float().clamp(min=1e-5) ** SMOOTHING_ALPHA
            / weight.abs().amax(0).clamp(min=1e-5) ** (1 - SMOOTHING_ALPHA)
        ).clamp(min=1e-5)
        self.outliers = torch.topk(input_max.float(), OUTLIER_CHANNELS).indices.sort().values
        self.inverse_smooth = 1 / smooth
        self.inverse_smooth[self.outliers] = 0  # no part in the int8 product
        self.weight = weight * smooth * (self.inverse_smooth > 0)  # [out, in], fp32


class DynamicInt8(nn.Module):
    """int8 weights (per output channel) x int8 activations quantized at run time (7 bits,
    per token: fbgemm's `linear_dynamic` on rows scaled to [-1, 1]). Output in the input's
    dtype, no bias. Per-tensor int8 activations alone lose much of the top-1 agreement
    with fp32 on SmolLM2: a few input channels carry values far larger than the others. So
    the `OUTLIER_CHANNELS` widest (from a calibration run) are multiplied apart in the
    weights' precision, and the rest are smoothed (divided by s, the weights' columns
    multiplied by it) before quantizing."""

    inverse_smooth: torch.Tensor  # 1 / s per input channel, 0 for the outlier channels
    outliers: torch.Tensor
    outlier_weight: torch.Tensor  # [outliers, out_features]

    def __init__(self, dense_weight: torch.Tensor, input_max: torch.Tensor) -> None:
        super().__init__()
        weight = dense_weight.detach().float()
        smoothing = Smoothed(dense_weight, input_max)
        smoothed, inverse, outliers = smoothing.weight, smoothing.inverse_smooth, smoothing.outliers
        scale = (smoothed.abs().amax(1) / 127).clamp(min=1e-10).double()
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(smoothed, scale, zero_points, 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(q, None)
        outlier_weight = weight[:, outliers].t().to(dense_weight.dtype)
        self.register_buffer("inverse_smooth", inverse, persistent=False)
        self.register_buffer("outliers", outliers, persistent=False)
        self.register_buffer("outlier_weight", outlier_weight, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.float() * self.inverse_smooth
        # abs().amax(), not vector_norm(inf): the same values, far faster on CPU.
        row_max = rows.abs().amax(-1, keepdim=True).clamp_(min=1e-6)
        out = torch.ops.quantized.linear_dynamic(rows / row_max, self.packed, True).mul_(row_max)
        return torch.addmm(out.to(x.dtype), x.index_select(-1, self.outliers), self.outlier_weight)

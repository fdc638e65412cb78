"""Weight-only quantized projections for small CPU steps (`--quantization int4`).

A decode step of a few sequences is memory-bound: every step reads all the weights once, so
their size sets its time. Measured on 2 AVX2 cores (torch 2.13, the model's 120 projections,
`bench/kernels.py`): fp32 `F.linear` takes 34 ms at 1 token, torch's packed int4 kernel
(`_weight_int4pack_mm_for_cpu`, bf16 activations) 9 ms; from 32 tokens on the packed kernel
is compute-bound and no faster than fp32 (32 tokens: 143-147 vs 119-137 ms). So each
`CompactLinear` keeps the dense weight and a compact copy, and takes the compact one only
for steps of at most `COMPACT_MAX_TOKENS` tokens (16 for the projections; for the head 16
over fp32 weights, 8 over bf16 ones): decodes of small batches; prefills and large batches
stay dense.

Decoder projections: int4, asymmetric, groups of 32 along the input dim (scale and zero per
group). SmolLM2's packaged weights come from a Q4_1 GGUF (the same layout), so requantizing
them is close to lossless. The LM head: int8 per output channel (an int4 head cost 21 of
160 top-1 agreements with fp32; the int8 one costs 1). Accuracy against the fp32
reference: tests/model/test_quantization.py. CPU only: the CUDA int4 kernel wants
another packing.

Whether a step is compact depends on how many tokens it carries, so with quantization on,
a request's tokens can differ (rarely) with the batch it shares: quantization is opt-in and
fp32 without it stays the exact, batch-invariant reference.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.config import QUANTIZATIONS
from workers.scheduler.llama import LlamaForCausalLM

# The most tokens a step may carry and still take the compact weights, by (bits, bytes per
# dense weight): the compact kernels win while a step is bound by reading the weights, which
# lasts longer against fp32 weights than against bf16 ones. int4 projections at 16 tokens:
# 45-78 ms vs fp32 53-88 ms (AVX2), 11.9 vs bf16 13.7 ms (AVX512-BF16). The int8 LM head
# (49152 x 576) against bf16: at 8 rows 1.9 vs 2.4 ms, at 12 rows 3.5 vs 3.0 ms (AVX512-BF16);
# against fp32: at 16 rows 22.5 vs 36.4 ms, at 32 rows 40.9 vs 40.8 ms (AVX2).
COMPACT_MAX_TOKENS = {(4, 4): 16, (4, 2): 16, (8, 4): 16, (8, 2): 8}
INT4_GROUP_SIZE = 32


class CompactLinear(nn.Module):
    """An `nn.Linear` (kept, for large steps) plus a compact copy of its weight for small
    ones; the output has the input's dtype either way."""

    def __init__(self, dense: nn.Linear, bits: int) -> None:
        super().__init__()
        self.dense = dense
        self.bits = bits
        self.max_tokens = COMPACT_MAX_TOKENS[bits, dense.weight.element_size()]
        weight = dense.weight.detach().float()
        packed, scales = (
            int4_groups(weight, INT4_GROUP_SIZE) if bits == 4 else int8_channels(weight)
        )
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_tokens:
            return self.dense(x)
        # The packed kernels are vectorized for bf16 activations (fp32 ones are ~10x slower).
        low = x.to(torch.bfloat16)
        if self.bits == 4:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                low, self.packed, INT4_GROUP_SIZE, self.scales
            )
        else:
            out = torch.ops.aten._weight_int8pack_mm(low, self.packed, self.scales)
        out = out.to(x.dtype)
        return out if self.dense.bias is None else out + self.dense.bias


def quantize_model(model: LlamaForCausalLM, method: str) -> int:
    """Wraps the decoder's projections (int4) and the LM head (int8) in `CompactLinear`;
    the number wrapped. Shapes the packed kernels cannot take stay dense (see `fits`)."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {method!r} ({', '.join(QUANTIZATIONS)})")
    if method == "none":
        return 0
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("--quantization int4 runs on CPU only (its packed kernels are CPU's)")
    wrapped = 0
    for layer in model.layers:
        for parent, name in (
            (layer.self_attn, "qkv_proj"),
            (layer.self_attn, "o_proj"),
            (layer.mlp, "gate_up_proj"),
            (layer.mlp, "down_proj"),
        ):
            dense = getattr(parent, name)
            if fits(dense, bits=4):
                setattr(parent, name, CompactLinear(dense, bits=4))
                wrapped += 1
    assert isinstance(model.lm_head, nn.Linear)
    if fits(model.lm_head, bits=8):
        model.lm_head = CompactLinear(model.lm_head, bits=8)
        wrapped += 1
    return wrapped


def fits(dense: nn.Linear, bits: int) -> bool:
    """Whether the packed kernel takes this shape. int4 packing wants whole groups along
    the input and output channels in multiples of 16 (it raises otherwise); the int8 kernel
    crashes the process (SIGSEGV, torch 2.13) on an input dim that is not a multiple of 8,
    so we ask for whole groups of 32 there too."""
    if dense.in_features % INT4_GROUP_SIZE:
        return False
    return bits == 8 or dense.out_features % 16 == 0


def int4_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group` inputs: w ≈ (q - 8) * scale + zero with q in
    [0, 15] (the packed kernel's convention). Returns the packed weight and the
    [in / group, out, 2] bf16 scales and zeros."""
    out_features, in_features = weight.shape
    groups = weight.view(out_features, in_features // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-10)
    q = torch.round((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15)
    q = q.to(torch.int32).view(out_features, in_features)
    zero = low + 8 * scale
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed, scales_and_zeros.to(torch.bfloat16)


def int8_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: w ≈ q * scale."""
    scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-10)
    q = torch.round(weight / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return q, scale.to(torch.bfloat16)

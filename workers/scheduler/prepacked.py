"""bf16 projections on CPU with their weights reordered once, at load, into oneDNN's blocked
layout.

`F.linear` on bf16 CPU tensors already runs oneDNN's matmul, but it reorders the plain
[out, in] weight into the kernel's blocked layout on every call: for this model's 120
projections (~200 MB in bf16) that is one extra pass over the weights per forward, which is
most of a small decode step. `torch.ops.mkldnn._linear_pointwise` takes the weight already
reordered (`_reorder_linear_weight`, what inductor's weight prepacking does) and gives the
same bits as `F.linear` (tests/model/test_families.py). Measured on 2 Sapphire Rapids
cores (AMX, torch 2.13, bench/kernels.py): 120 projections at 1 token 12.7 vs 21.7 ms, at
64 tokens 26.1 vs 38.6 ms. fp32 stays on `F.linear` (MKL): it is the exact reference.
"""

from __future__ import annotations

import torch
from torch import nn


class PrepackedLinear(nn.Module):
    """An `nn.Linear` whose bf16 weight lives only in oneDNN's layout (an opaque tensor)."""

    def __init__(self, dense: nn.Linear) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(dense.weight.detach(), None)
        self.bias = dense.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def prepack_linears(model: nn.Module) -> int:
    """Replaces every bf16 CPU `nn.Linear` under `model` (quantization wrappers' dense
    weights included) by a `PrepackedLinear`; the number replaced. Call it last at load:
    the others read the plain weights."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and can_prepack(child.weight)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PrepackedLinear(child))
    return len(targets)

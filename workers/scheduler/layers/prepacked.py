"""bf16 projections on CPU with their weights reordered once, at load, into oneDNN's blocked
layout.

`F.linear` on bf16 CPU tensors already runs oneDNN's matmul, but it reorders the plain
[out, in] weight into the kernel's blocked layout on every call: for this model's 120
projections (~200 MB in bf16) that is one extra pass over the weights per forward, which is
most of a small decode step. `torch.ops.mkldnn._linear_pointwise` takes the weight already
reordered (`_reorder_linear_weight`, what inductor's weight prepacking does) and gives the
same bits as `F.linear` (tests/model/test_families.py) without the reorder, so the
projections run faster at small and large steps alike (bench/kernels.py; measured in
bench/README.md). fp32 stays on `F.linear` (MKL): it is the exact reference.

The call is a custom op (`redserve::prepacked_linear`) so that `torch.compile` keeps it
opaque: Inductor's own lowering of `_linear_pointwise` wants the packed weight as a frozen
graph constant and fails on a module attribute, which would stop `--enable-torch-compile`
in bf16 at load. Eager steps call the mkldnn op directly, skipping the custom op's dispatch
cost on every call.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.library.custom_op("redserve::prepacked_linear", mutates_args=())
def prepacked_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@prepacked_linear.register_fake
def _(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


class PrepackedLinear(nn.Module):
    """An `nn.Linear` whose bf16 weight lives only in oneDNN's layout (an opaque tensor)."""

    def __init__(self, dense: nn.Linear) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(dense.weight.detach(), None)
        self.bias = dense.bias
        self.out_features = dense.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return prepacked_linear(x, self.packed, self.bias, self.out_features)
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

"""Pinning `TieredLinear` routes in tests: tuned routes follow this machine's timings, so a
test of a kernel's accuracy says which kernel it means."""

from __future__ import annotations

from torch import nn

from workers.scheduler.layers.tiered import DENSE, TUNED_TOKENS, TieredLinear


def route_every_size(model: nn.Module, *preferred: str) -> int:
    """Every tuned step size of each `TieredLinear` in `model` takes the first kernel of
    `preferred` that it has (`DENSE`: every one), else its first kernel; the number of
    layers routed."""
    layers = [m for m in model.modules() if isinstance(m, TieredLinear)]
    for layer in layers:
        kernel = next(
            (k for k in preferred if k in layer.kernels or k == DENSE), next(iter(layer.kernels))
        )
        layer.route = [kernel] * len(TUNED_TOKENS)
    return len(layers)

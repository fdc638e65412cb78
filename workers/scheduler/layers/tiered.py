"""Projections with several kernels, each step routed by how many tokens it carries.

A step of a few tokens is bound by reading the weights, so compact copies win there; a
large one is bound by arithmetic, where the dense weights (or int8 x int8) win. Where the
crossovers lie differs from CPU to CPU, by several step sizes (bench/kernels.py; measured in
bench/README.md): a fast bf16 matmul (AMX) takes over from torch's packed int4 kernel much
earlier than a slower one. So `tune_routes` times every kernel on the machine at load
instead of trusting a table made on another one.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch import nn

# Step sizes that get a measured route; a step of n tokens takes the route of the smallest
# size >= n, and steps above the last one take the last one's: from 256 tokens on every
# kernel is compute-bound, so their order no longer changes with the size (prefill chunks
# of 512-2048 tokens keep the order timed at 256; measured in bench/README.md).
TUNED_TOKENS = (1, 2, 4, 8, 16, 32, 64, 256)
DENSE = "dense"


class TieredLinear(nn.Module):
    """An `nn.Linear` (kept, for large steps) plus compact kernels that compute the same
    product without its bias; `route[i]` names the kernel for steps of up to
    `TUNED_TOKENS[i]` tokens. The output has the input's dtype whichever runs."""

    bias: torch.Tensor | None

    def __init__(self, dense: nn.Linear, kernels: dict[str, nn.Module]) -> None:
        super().__init__()
        self.dense: nn.Module = dense
        self.kernels = nn.ModuleDict(kernels)
        self.bias = dense.bias
        self.in_features, self.dtype = dense.in_features, dense.weight.dtype
        # Until `tune_routes` measures: the first compact kernel for every tuned size.
        self.route = [next(iter(kernels))] * len(TUNED_TOKENS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self.kernel_for(x.shape[0]), x)

    def kernel_for(self, tokens: int) -> str:
        """The route of the smallest tuned size >= `tokens`, found by comparing `tokens` only
        where the route changes: under torch.compile with a dynamic batch
        (engine/compiled.py) each comparison is a guard, so a graph serves every size
        between two changes (an index into a table by `tokens` would fix the graph to one
        size)."""
        route = self.route
        for i in range(len(route) - 1):
            if route[i] != route[i + 1] and tokens <= TUNED_TOKENS[i]:
                return route[i]
        return route[-1]

    def run(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        if kernel == DENSE:
            return self.dense(x)
        out = self.kernels[kernel](x).to(x.dtype)
        return out if self.bias is None else out + self.bias


@torch.inference_mode()
def tune_routes(model: nn.Module, rounds: int = 5) -> dict[str, list[str]]:
    """Routes every tuned step size of each `TieredLinear` in `model` to the kernel that ran
    it fastest here. Projections with the same kernels are timed together, one pass over
    all of them as a forward makes it (so their weights come from memory, not cache), the
    kernels' passes interleaved, best of `rounds`. A round times every size once, so a
    size's samples lie seconds apart: `redserve up` starts the api beside the scheduler, and
    its imports can keep a core busy through back-to-back samples, which would pin a wrong
    route (a slow kernel serving every step of that size) for the whole run. Returns the
    routes by kernel set."""
    routes = {}
    for names, layers in _groups(model).items():
        kernels = [*names, DENSE]
        best = {tokens: dict.fromkeys(kernels, float("inf")) for tokens in TUNED_TOKENS}
        for _ in range(rounds):
            for tokens, fastest in best.items():
                for kernel, spent in _time_kernels(layers, kernels, tokens).items():
                    fastest[kernel] = min(fastest[kernel], spent)
        route = [min(fastest, key=fastest.__getitem__) for fastest in best.values()]
        for layer in layers:
            layer.route = list(route)
        routes[_group_name(names, layers)] = route
    return routes


def apply_routes(model: nn.Module, routes: dict[str, list[str]]) -> bool:
    """Sets the routes `tune_routes` returned for this model (read back from the tuning
    cache). False, changing nothing, where they do not fit its projections' kernels."""
    groups = {_group_name(*group): group for group in _groups(model).items()}
    if set(groups) != set(routes):
        return False
    for name, (kernels, _) in groups.items():
        route = routes[name]
        if len(route) != len(TUNED_TOKENS) or not set(route) <= {*kernels, DENSE}:
            return False
    for name, (_, layers) in groups.items():
        for layer in layers:
            layer.route = list(routes[name])
    return True


def _groups(model: nn.Module) -> dict[tuple[str, ...], list[TieredLinear]]:
    """The model's `TieredLinear`s by their kernels' names."""
    groups: dict[tuple[str, ...], list[TieredLinear]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, TieredLinear):
            groups[tuple(module.kernels)].append(module)
    return groups


def _group_name(kernels: tuple[str, ...], layers: list[TieredLinear]) -> str:
    return f"{'/'.join(kernels)} x{len(layers)}"


def _time_kernels(layers: list[TieredLinear], kernels: list[str], tokens: int) -> dict[str, float]:
    """Seconds one pass over `layers` takes with each kernel at `tokens` tokens."""
    inputs = {
        (layer.in_features, layer.dtype): torch.randn(tokens, layer.in_features).to(layer.dtype)
        for layer in layers
    }
    spent = {}
    for kernel in kernels:
        started = time.perf_counter()
        for layer in layers:
            layer.run(kernel, inputs[layer.in_features, layer.dtype])
        spent[kernel] = time.perf_counter() - started
    return spent

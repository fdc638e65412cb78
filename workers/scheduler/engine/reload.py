"""Live weight updates (`TorchModelRunner.reload`): the runner serves another checkpoint of
the same architecture without a restart, keeping its KV cache allocation.

The new checkpoint is resolved like the one at start (shared.model_files: an HF folder, or a
`.gguf` converted once) and must have exactly the loaded model's shape (`ModelArgs`: sizes,
heads, vocabulary, context, family flags); anything else raises before the running model is
touched, so a failed reload leaves the old weights serving as they were.

Two ways in, by what the running model holds:
- plain weights (no quantization, no prepacked bf16: always so on CUDA): the checkpoint
  loads on the CPU and is copied into the running tensors in place. Their addresses stay,
  so compiled decode steps and recorded CUDA graphs keep working on the new values, and
  the device never holds two copies of the weights.
- derived copies (int4/W8A8 kernels, oneDNN-prepacked bf16: CPU only): those cannot be
  written in place, so the same preparation as at load builds a new model (w8a8
  calibrated on it), the kernel routes and attention choices timed at load carry over
  (same shapes, same machine, same timings), and the model is swapped; compiled steps
  (and graphs) are rebuilt on it.
The caller runs it with nothing in flight (the loop drains first) and flushes the prefix
cache afterwards: the cached K/V came from the old weights.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from shared.model_files import resolve_model
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine.batch import AttentionBatch
from workers.scheduler.engine.compiled import CompiledDecode
from workers.scheduler.engine.cuda_graphs import GraphedDecode, cuda_capture
from workers.scheduler.layers.prepacked import PrepackedLinear
from workers.scheduler.layers.tiered import TieredLinear
from workers.scheduler.model.checkpoint import load_model
from workers.scheduler.model.config import ModelArgs, read_model_args
from workers.scheduler.model.llama import Attention, LlamaForCausalLM

logger = logging.getLogger(__name__)

# prepare_model(folder, dtype, device, quantization, block_size): the load's preparation.
Prepare = Callable[[str, torch.dtype, str, str, int], LlamaForCausalLM]


class Runner(Protocol):
    """What a reload reads and replaces of the model runner (engine/model_runner.py)."""

    model: LlamaForCausalLM
    device: torch.device
    block_size: int
    num_kv_blocks: int
    quantization: str
    cache_dir: str
    model_path: str
    compiled: CompiledDecode | None
    graphs: GraphedDecode | None

    def forward(self, seqs: list[Sequence]) -> tuple[torch.Tensor, AttentionBatch]: ...

    def graphed_decode(self, max_batch: int) -> GraphedDecode: ...


class ReloadError(ValueError):
    """The checkpoint cannot replace the loaded one (missing, or another shape)."""


def reload_runner(runner: Runner, model_path: str, prepare: Prepare) -> None:
    """Load `model_path` into `runner` in place of its weights (see the module docstring);
    raises, with the old weights intact, if the checkpoint is missing or of another shape."""
    started = time.monotonic()
    folder = checkpoint_folder(model_path, runner.cache_dir)
    old = runner.model
    check_same_shape(old.args, read_model_args(folder), model_path)
    dtype = old.embed_tokens.weight.dtype
    if has_derived_copies(old):
        fresh = prepare(folder, dtype, runner.device.type, runner.quantization, runner.block_size)
        swap_model(runner, fresh)
    else:
        copy_weights(old, load_model(folder, dtype, "cpu"))
    runner.model_path = model_path
    logger.info("reloaded weights from %s in %.1fs", model_path, time.monotonic() - started)


def checkpoint_folder(model_path: str, cache_dir: str = "") -> str:
    """The local HF folder of `model_path` (a `.gguf` file is converted once, as at start)."""
    if not model_path:
        raise ReloadError("model_path is empty")
    try:
        folder = resolve_model(model_path, cache_dir)
    except FileNotFoundError as e:
        raise ReloadError(str(e)) from e
    if not (Path(folder) / "config.json").is_file():
        raise ReloadError(
            f"no model at {model_path}: not a folder with a config.json, nor a .gguf file"
        )
    return folder


def check_same_shape(loaded: ModelArgs, new: ModelArgs, model_path: str) -> None:
    """Raise unless the checkpoint's shape is the loaded model's, naming what differs."""
    differs = [
        f"{field.name} {getattr(new, field.name)} (loaded: {getattr(loaded, field.name)})"
        for field in dataclasses.fields(ModelArgs)
        if getattr(new, field.name) != getattr(loaded, field.name)
    ]
    if differs:
        raise ReloadError(
            f"{model_path} has another architecture than the loaded model: {', '.join(differs)}"
        )


def has_derived_copies(model: nn.Module) -> bool:
    """Whether the model holds weights derived at load that cannot be written in place."""
    return any(isinstance(m, TieredLinear | PrepackedLinear) for m in model.modules())


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@torch.no_grad()
def copy_weights(target: nn.Module, source: nn.Module) -> None:
    """Every parameter and buffer of `source` into `target`'s tensor of the same name; all
    names, shapes and dtypes are checked before the first copy."""
    into, values = _tensors(target), _tensors(source)
    mismatched = sorted(
        name
        for name in into.keys() | values.keys()
        if name not in into
        or name not in values
        or (into[name].shape, into[name].dtype) != (values[name].shape, values[name].dtype)
    )
    if mismatched:
        raise ReloadError(f"the checkpoint's tensors do not match the model's: {mismatched[:5]}")
    for name, tensor in into.items():
        tensor.copy_(values[name])


def swap_model(runner: Runner, fresh: LlamaForCausalLM) -> None:
    """Serve `fresh` (prepared as at load) instead of the runner's model: the load's kernel
    choices carry over, compiled steps and graphs are rebuilt on it."""
    old = runner.model
    old_modules = dict(old.named_modules())
    fresh_types = [(name, type(m)) for name, m in fresh.named_modules()]
    if fresh_types != [(name, type(m)) for name, m in old_modules.items()]:
        raise ReloadError("the checkpoint prepares into other modules than the loaded model")
    for name, module in fresh.named_modules():
        if isinstance(module, TieredLinear):
            module.route = list(old_modules[name].route)
        elif isinstance(module, Attention):
            module.upcast_sdpa = old_modules[name].upcast_sdpa
    runner.model = fresh
    if runner.compiled is not None:
        runner.compiled = CompiledDecode(fresh, runner.compiled.max_batch)
        runner.compiled.warm_up(runner.forward, runner.num_kv_blocks, runner.block_size)
    if runner.graphs is not None:
        runner.graphs = runner.graphed_decode(runner.graphs.max_batch)
        runner.graphs.capture_all(cuda_capture())

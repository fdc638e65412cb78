"""The kernels a runner takes on this machine: timed at load (layers/tiered.py for the
projections, layers/attention_tuning.py for attention), or recalled from what an earlier
start timed with the same key (tuning_cache.py)."""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch

from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine.batch import AttentionBatch, LayerCache
from workers.scheduler.engine.fused_step import (
    FusedStep,
    fused_batch_limit,
    fused_prefill_limit,
    fused_split_faster,
)
from workers.scheduler.engine.tuning_cache import TuningCache, tuning_key
from workers.scheduler.layers.attention_tuning import AttentionChoice, choose_attention
from workers.scheduler.layers.tiered import TUNED_TOKENS, apply_routes, tune_routes
from workers.scheduler.model.llama import Attention, LlamaForCausalLM

logger = logging.getLogger(__name__)


class TunedRunner(Protocol):
    """What the choices read and set of the runner (engine/model_runner.py)."""

    model: LlamaForCausalLM
    kv_cache: list[LayerCache]
    device: torch.device
    model_path: str
    quantization: str
    block_size: int
    padding_block: int

    def forward(self, seqs: list[Sequence]) -> tuple[torch.Tensor, AttentionBatch]: ...

    def use_attention(self, choice: AttentionChoice) -> None: ...

    def use_fused_step(
        self,
        max_batch: int,
        built: FusedStep | None = None,
        prefill_rows: int = 0,
        split_steps: bool = False,
    ) -> None: ...


def recall_or_time_kernels(runner: TunedRunner, tuning_dir: Path | None) -> None:
    """Takes the choices stored under the runner's key in `tuning_dir`, or times them and
    stores them there, one process at a time per key (None: times them, stores nothing)."""
    if tuning_dir is None:
        time_kernels(runner)
        return
    cache, key = TuningCache(tuning_dir / "tuning"), choices_key(runner)
    with cache.timing_alone(key):
        stored = cache.load(key)
        if stored is not None and use_choices(runner, stored):
            logger.info("kernel choices as timed at an earlier start: %s", cache.path(key))
            return
        cache.save(key, time_kernels(runner))


def time_kernels(runner: TunedRunner) -> dict[str, Any]:
    """Routes each projection's step sizes, picks the attention kernels and up to how many
    sequences decode steps (and up to how many tokens steps with prefill chunks) take the
    fused step, timing them here; returns the choices (as `use_choices` takes them)."""
    logger.info("choosing kernels: timing them on this machine")
    model = runner.model
    routes = tune_routes(model)
    if routes:
        logger.info("kernel by step size (tokens %s), as timed here: %s", TUNED_TOKENS, routes)
    # fp32 without quantization (and its own cache) is the exact reference: SDPA, untimed.
    # Quantized fp32 runners, or fp32 over a bf16 cache, are not exact anyway, so their
    # decodes may take the faster kernels too.
    kv_dtype, dtype = runner.kv_cache[0][0].dtype, model.embed_tokens.weight.dtype
    choice = None
    if runner.device.type == "cpu" and (kv_dtype != torch.float32 or routes):
        attention = next(m for m in model.modules() if isinstance(m, Attention))
        choice = choose_attention(attention, dtype, kv_dtype)
        runner.use_attention(choice)
    fused = FusedStep.of(model, runner.kv_cache, runner.block_size)
    runner.use_fused_step(0)  # timing the torch forward
    limit = rows = 0
    split = False
    if fused is not None:
        timed = (runner.forward, fused, runner.padding_block, runner.block_size)
        limit = fused_batch_limit(*timed)
        rows = fused_prefill_limit(*timed) if limit else 0
        fused.max_batch, fused.prefill_rows = limit, rows
        split = rows > 0 and fused_split_faster(*timed)
    logger.info(
        "decode steps: %s; with prefill chunks: %s%s",
        f"the fused step up to {limit} sequences" if limit else "the torch forward",
        f"the fused step up to {rows} tokens" if rows else "the torch forward",
        ", larger steps as several fused calls" if split else "",
    )
    runner.use_fused_step(limit, fused, rows, split)
    return {
        "routes": routes,
        "attention": None if choice is None else asdict(choice),
        "fused_step": limit,
        "fused_prefill_rows": rows,
        "fused_split_steps": split,
    }


def use_choices(runner: TunedRunner, choices: dict[str, Any]) -> bool:
    """Takes the routes, attention kernels and fused step `time_kernels` returned at an
    earlier start; False where they do not fit this model (then nothing changed)."""
    try:
        routes, attention = choices["routes"], choices["attention"]
        choice = None if attention is None else AttentionChoice(**attention)
        fused_limit, prefill_rows = choices["fused_step"], choices["fused_prefill_rows"]
        split = choices["fused_split_steps"]
    except (KeyError, TypeError):  # a record of another layout
        return False
    if type(fused_limit) is not int or type(prefill_rows) is not int or type(split) is not bool:
        return False
    if not apply_routes(runner.model, routes):
        return False
    if choice is not None:
        runner.use_attention(choice)
    runner.use_fused_step(fused_limit, prefill_rows=prefill_rows, split_steps=split)
    return True


def choices_key(runner: TunedRunner) -> dict[str, Any]:
    """What the runner's kernel choices depend on (tuning_cache.py)."""
    return tuning_key(
        runner.model_path,
        {
            "dtype": str(runner.model.embed_tokens.weight.dtype),
            "kv_dtype": str(runner.kv_cache[0][0].dtype),
            "quantization": runner.quantization,
            "threads": torch.get_num_threads(),
            "block_size": runner.block_size,
            "device": str(runner.device),
        },
    )

"""Driving the torch engine without Redis: the pure core and a model runner step by step
(`run_core`), or a runner alone on sequences whose KV blocks are assigned by hand."""

from __future__ import annotations

from typing import Any

import torch

from shared.protocol import SamplingParams
from tests.support.core import drive
from workers.scheduler.core.scheduler import Scheduler, SchedulerConfig
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine.model_runner import TorchModelRunner

BLOCK_SIZE = 16


def run_core(
    runner: TorchModelRunner,
    prompts: list[list[int]],
    sampling: list[SamplingParams],
    arrival_step: list[int] | None = None,
    num_kv_blocks: int = 256,
    block_size: int = 16,
    **config: Any,
) -> list[Sequence]:
    """Drive our core + runner; request i joins at step `arrival_step[i]` (default 0).
    `config` overrides SchedulerConfig fields (token budget, KV blocks, prefix caching)."""
    core = Scheduler(
        SchedulerConfig(
            **{
                "num_kv_blocks": num_kv_blocks,
                "vocab_size": runner.vocab_size,
                "max_model_len": 2048,
                "block_size": block_size,
                "eos_token_ids": frozenset({2}),
                **config,
            }
        ),
        decode_tail=lambda ids: "",
    )
    seqs = [Sequence(f"r{i}", p, s) for i, (p, s) in enumerate(zip(prompts, sampling, strict=True))]
    drive(core, seqs, runner.run, arrival_step)
    return seqs


def hand_seqs(prompts: list[list[int]], block_size: int = BLOCK_SIZE) -> list[Sequence]:
    """Sequences with KV blocks assigned by hand (no block manager needed)."""
    seqs, next_block = [], 0
    for i, p in enumerate(prompts):
        seq = Sequence(f"r{i}", p, SamplingParams(temperature=0))
        n = -(-(len(p) + 4) // block_size)
        seq.block_table = list(range(next_block, next_block + n))
        next_block += n
        seqs.append(seq)
    return seqs


def step(runner: TorchModelRunner, seqs: list[Sequence]) -> torch.Tensor:
    """Hidden states of every token not yet in the cache (the scheduler's part by hand)."""
    for seq in seqs:
        seq.num_new_tokens = seq.num_uncomputed_tokens
    hidden, _ = runner.forward(seqs)
    for seq in seqs:
        seq.num_computed_tokens += seq.num_new_tokens
        seq.num_new_tokens = 0
    return hidden

"""Decode steps driven by hand (no scheduler), for comparing two ways of running them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shared.protocol import SamplingParams
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine.model_runner import TorchModelRunner


def decode_steps(
    runner: TorchModelRunner,
    step: Callable[[list[Sequence]], torch.Tensor],
    prompts: list[list[int]],
    batch_sizes: tuple[int, ...],
) -> torch.Tensor:
    """The hidden states `step` gives over 20 decode steps of `prompts` (sequence i in
    blocks 4i to 4i + 3), after the runner's eager prefill of all of them; step t decodes
    the first `batch_sizes[t % len(batch_sizes)]` sequences, every sequence advancing."""
    seqs = []
    for i, prompt in enumerate(prompts):
        seq = Sequence(f"r{i}", prompt, SamplingParams(temperature=0))
        seq.block_table = [4 * i + b for b in range(4)]
        seq.num_new_tokens = len(prompt)
        seqs.append(seq)
    runner.forward(seqs)
    hidden = []
    for token in range(20):
        for seq in seqs:
            seq.num_computed_tokens += seq.num_new_tokens
            seq.append_token(token)
            seq.num_new_tokens = 1
        hidden.append(step(seqs[: batch_sizes[token % len(batch_sizes)]]))
    return torch.cat(hidden)

"""Batched sampling on tensors: greedy, top-k/top-p, per-request seeds."""

from __future__ import annotations

import torch

from shared.protocol import SamplingParams
from workers.scheduler.sampler import sample


def logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_temperature_zero_is_argmax() -> None:
    x = logits()
    assert sample(x, [SamplingParams(temperature=0)] * 4, [0] * 4) == x.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    x = logits()
    greedy = x.argmax(-1).tolist()
    for _ in range(5):
        assert sample(x, [SamplingParams(temperature=1.5, top_k=1)] * 4, [0] * 4) == greedy
        assert sample(x, [SamplingParams(temperature=1.5, top_p=1e-6)] * 4, [0] * 4) == greedy


def test_top_k_samples_only_among_the_k_best() -> None:
    x = logits(rows=1, vocab=1000)
    best = set(x[0].topk(3).indices.tolist())
    drawn = {sample(x, [SamplingParams(top_k=3, seed=5)], [i])[0] for i in range(50)}
    assert drawn <= best and len(drawn) > 1


def test_a_seeded_row_does_not_depend_on_its_batch() -> None:
    x = logits(rows=3, vocab=1000)
    seeded = SamplingParams(temperature=0.8, seed=1234)
    alone = [sample(x[1:2], [seeded], [i])[0] for i in range(20)]
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0)]
    batched = [sample(x, [others[0], seeded, others[1]], [7, i, 3])[1] for i in range(20)]
    assert alone == batched and len(set(alone)) > 1


def test_different_seeds_draw_differently() -> None:
    x = logits(rows=1, vocab=1000)
    a = [sample(x, [SamplingParams(seed=1)], [i])[0] for i in range(20)]
    b = [sample(x, [SamplingParams(seed=2)], [i])[0] for i in range(20)]
    assert a != b

"""The KV cache's memory on CPU (engine/memory.py): zeros in fresh pages that cost nothing
at start."""

from __future__ import annotations

import psutil
import torch

from workers.scheduler.engine.memory import cache_zeros

CPU = torch.device("cpu")
MIB = 2**20


def test_cache_zeros_are_zeros_of_the_shape_and_writable() -> None:
    tensor = cache_zeros((3, 40, 64), torch.bfloat16, CPU)
    assert tensor.shape == (3, 40, 64) and tensor.dtype == torch.bfloat16
    assert not tensor.any()
    tensor[1, 7] = 2.5
    assert tensor[1, 7].eq(2.5).all() and tensor.sum() == 2.5 * 64


def test_a_cache_takes_memory_as_it_is_written_not_at_start() -> None:
    rss = psutil.Process().memory_info().rss
    tensor = cache_zeros((256 * MIB // 4,), torch.float32, CPU)
    assert psutil.Process().memory_info().rss - rss < 16 * MIB
    tensor[: 64 * MIB // 4] = 1.0  # a quarter written: about a quarter held
    grown = psutil.Process().memory_info().rss - rss
    assert 60 * MIB < grown < 100 * MIB

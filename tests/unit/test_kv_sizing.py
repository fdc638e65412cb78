"""KV cache sizing: a share of the free memory, capped by an explicit size."""

from __future__ import annotations

import psutil
import pytest
import torch

from tests.support.models import tiny_args
from workers.scheduler.engine.memory import available_memory, kv_bytes_per_token, num_kv_blocks_for

MiB = 2**20


def test_the_memory_fraction_sizes_the_cache_and_an_explicit_size_caps_it() -> None:
    assert num_kv_blocks_for(0, 0.5, 1000 * MiB, 10 * MiB) == 50
    assert num_kv_blocks_for(20, 0.5, 1000 * MiB, 10 * MiB) == 20
    assert num_kv_blocks_for(100, 0.5, 1000 * MiB, 10 * MiB) == 50  # memory wins: no OOM
    assert num_kv_blocks_for(30, 0.0, 0, 10 * MiB) == 30  # explicit size alone


def test_a_cache_that_cannot_be_sized_is_an_error() -> None:
    with pytest.raises(ValueError):
        num_kv_blocks_for(0, 0.0, 1000 * MiB, 10 * MiB)
    with pytest.raises(MemoryError, match="no room for a KV cache"):
        num_kv_blocks_for(0, 0.01, 500 * MiB, 10 * MiB)
    with pytest.raises(MemoryError):  # an explicit size does not override the memory bound
        num_kv_blocks_for(100, 0.01, 500 * MiB, 10 * MiB)


def test_bytes_per_token_count_k_and_v_of_every_layer() -> None:
    args = tiny_args(num_hidden_layers=30, num_key_value_heads=3, head_dim=64)  # SmolLM2-135M's KV
    assert kv_bytes_per_token(args, torch.float32) == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(args, torch.bfloat16) == 2 * 30 * 3 * 64 * 2


def test_available_cpu_memory_is_positive_and_at_most_the_total() -> None:
    assert 0 < available_memory(torch.device("cpu")) <= psutil.virtual_memory().total

"""`choose_attention` keeps the attention kernels that ran fastest: SDPA is slowed down on
purpose in one dtype, and the choice must follow."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.support.models import tiny_args
from workers.scheduler.kernels.paged_decode import kernel_library, paged_decode
from workers.scheduler.layers import attention_tuning
from workers.scheduler.layers.attention_tuning import choose_attention
from workers.scheduler.model.llama import Attention

sdpa_of_torch = F.scaled_dot_product_attention

ARGS = tiny_args(
    vocab_size=64, num_hidden_layers=1, max_position_embeddings=512, tie_word_embeddings=True
)


@pytest.mark.parametrize("slow_dtype", [torch.float32, torch.bfloat16])
def test_the_faster_sdpa_dtype_wins_and_the_matmuls_beat_a_slow_sdpa(
    monkeypatch: pytest.MonkeyPatch, slow_dtype: torch.dtype
) -> None:
    sdpa = F.scaled_dot_product_attention

    def slowed(query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # a 10x gap: the test must hold while something else loads the machine (a 2 ms gap
        # did not, with a build on the other core)
        time.sleep(0.02 if query.dtype == slow_dtype else 0.002)  # the matmuls: ~0.1 ms
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", slowed)
    attention = Attention(ARGS)
    choice = choose_attention(attention, torch.bfloat16, torch.bfloat16)
    assert choice.upcast_sdpa is (slow_dtype == torch.bfloat16)
    assert attention.upcast_sdpa is choice.upcast_sdpa
    assert choice.matmul_decodes


@pytest.mark.parametrize("slow_from", [128, 512, None])
def test_prefill_matmuls_serve_contexts_up_to_the_longest_at_which_they_won(
    monkeypatch: pytest.MonkeyPatch, slow_from: int | None
) -> None:
    """SDPA takes 20 ms, the matmuls 60 ms from `slow_from` context tokens on and nothing
    before (None: never); steps of 512 prompt tokens. Both stand-ins skip the real math
    (their outputs are zeros of the right shape), so the choice depends on these times alone
    and not on how fast this CPU runs bf16 (on AVX2 alone, unslowed bf16 matmuls over 512
    tokens took longer than the 20 ms and the real math decided)."""

    def slowed(self: Attention, queries: torch.Tensor, keys: torch.Tensor, *args: Any) -> Any:
        if slow_from is not None and keys.shape[2] >= slow_from:
            time.sleep(0.06)
        return queries.new_zeros(queries.shape[0] * queries.shape[1], *queries.shape[2:])

    def slowed_sdpa(query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        time.sleep(0.02)
        return torch.zeros_like(query)

    monkeypatch.setattr(attention_tuning, "PREFILL_TOKENS", 512)
    monkeypatch.setattr(Attention, "_attend_matmuls", slowed)
    monkeypatch.setattr(F, "scaled_dot_product_attention", slowed_sdpa)
    choice = choose_attention(Attention(ARGS), torch.bfloat16, torch.bfloat16, rounds=3)
    expected = {128: 0, 512: 256, None: 512}[slow_from]
    assert choice.matmul_prefill_max_context == expected


@pytest.mark.skipif(kernel_library() is None, reason="no C compiler: no paged decode kernel")
@pytest.mark.parametrize("slow", ["kernel", "torch paths"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_paged_kernel_serves_decodes_only_when_it_ran_fastest(
    monkeypatch: pytest.MonkeyPatch, slow: str, dtype: torch.dtype
) -> None:
    """bf16 runners, and fp32 ones over a bf16 cache (`--kv-cache-dtype bfloat16`)."""

    def slowed(call: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(*args: Any, **kwargs: Any) -> torch.Tensor:
            time.sleep(0.02)
            return call(*args, **kwargs)

        return run

    if slow == "kernel":
        monkeypatch.setattr(attention_tuning, "paged_decode", slowed(paged_decode))
    else:
        monkeypatch.setattr(F, "scaled_dot_product_attention", slowed(sdpa_of_torch))
        monkeypatch.setattr(Attention, "_attend_matmuls", slowed(Attention._attend_matmuls))
    choice = choose_attention(Attention(ARGS), dtype, torch.bfloat16)
    assert choice.paged_decodes is (slow == "torch paths")


@pytest.mark.skipif(kernel_library() is None, reason="no C compiler: no paged decode kernel")
def test_a_burst_of_other_work_does_not_decide_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call slowed by 30 ms for 250 ms from the kernel's first call on (something
    else busy on the machine), and the torch paths 5 ms slower than the kernel throughout:
    timed in rounds, the kernel still wins (timed back to back, its samples all fell in the
    burst)."""
    burst: dict[str, float] = {}

    def slowed(call: Callable[..., torch.Tensor], extra: float) -> Callable[..., torch.Tensor]:
        def run(*args: Any, **kwargs: Any) -> torch.Tensor:
            if call is paged_decode:
                burst.setdefault("start", time.perf_counter())
            in_burst = "start" in burst and time.perf_counter() - burst["start"] < 0.25
            time.sleep(extra + (0.03 if in_burst else 0.0))
            return call(*args, **kwargs)

        return run

    monkeypatch.setattr(attention_tuning, "paged_decode", slowed(paged_decode, 0.0))
    monkeypatch.setattr(F, "scaled_dot_product_attention", slowed(sdpa_of_torch, 0.005))
    monkeypatch.setattr(Attention, "_attend_matmuls", slowed(Attention._attend_matmuls, 0.005))
    assert choose_attention(Attention(ARGS), torch.bfloat16, torch.bfloat16).paged_decodes

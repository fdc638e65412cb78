"""Our Llama forward + paged KV cache + sampler against Hugging Face, on the real SmolLM2."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from shared.protocol import SamplingParams
from tests.support.engine import run_core
from workers.scheduler.engine.model_runner import TorchModelRunner
from workers.scheduler.kernels.paged_decode import kernel_library
from workers.scheduler.layers.attention_tuning import AttentionChoice

pytestmark = pytest.mark.model

MAX_NEW_TOKENS = 32
NUM_KV_BLOCKS = 256
BLOCK_SIZE = 16
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning Python.",
]
PLAIN = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
GREEDY = SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    chat = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True
            )["input_ids"]
        )
        for q in CHAT
    ]
    return chat + [list(tokenizer(p)["input_ids"]) for p in PLAIN]


@pytest.fixture(scope="module")
def runner(model_path: str) -> TorchModelRunner:
    return TorchModelRunner.load(model_path, NUM_KV_BLOCKS, BLOCK_SIZE)


@pytest.fixture(scope="module")
def hf_outputs(model_path: str, prompts: list[list[int]]) -> Iterator[list[list[int]]]:
    """Hugging Face's own greedy generation of every prompt (the model is loaded once)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    yield outputs


def generate(
    runner: TorchModelRunner,
    prompts: list[list[int]],
    sampling: list[SamplingParams],
    arrival_step: list[int] | None = None,
    **config: Any,
) -> list[list[int]]:
    seqs = run_core(runner, prompts, sampling, arrival_step, **config)
    return [seq.output_ids for seq in seqs]


@pytest.fixture(scope="module")
def alone(runner: TorchModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    return [generate(runner, [p], [GREEDY])[0] for p in prompts]


def test_greedy_equals_hugging_face_token_for_token(
    alone: list[list[int]], hf_outputs: list[list[int]]
) -> None:
    for i, (ours, theirs) in enumerate(zip(alone, hf_outputs, strict=True)):
        assert ours == theirs, f"prompt {i}"
    assert any(len(o) == MAX_NEW_TOKENS for o in alone)


def test_continuous_batching_gives_each_request_its_solo_tokens(
    runner: TorchModelRunner, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    # Requests join while others decode, so prefill and decode batches mix lengths.
    arrivals = [0, 0, 1, 4, 9, 20]
    assert generate(runner, prompts, [GREEDY] * len(prompts), arrivals) == alone


def test_sixteen_concurrent_requests_give_their_solo_tokens(
    runner: TorchModelRunner, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    many = prompts + prompts[::-1] + prompts[:4]
    assert len(many) == 16
    assert generate(runner, many, [GREEDY] * 16) == alone + alone[::-1] + alone[:4]


def test_a_seeded_sampled_request_is_the_same_alone_and_in_a_batch(
    runner: TorchModelRunner, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    seeded = SamplingParams(temperature=0.8, seed=1234, max_new_tokens=16, ignore_eos=True)
    solo = generate(runner, [prompts[0]], [seeded])[0]
    others = [
        SamplingParams(temperature=1.0, max_new_tokens=16),
        SamplingParams(temperature=0, max_new_tokens=16),
        SamplingParams(temperature=0.7, top_p=0.9, seed=7, max_new_tokens=16),
    ]
    mixed = [prompts[1], prompts[0], prompts[4], prompts[5]]
    batch = generate(runner, mixed, [others[0], seeded, *others[1:]], [0, 0, 2, 5])
    assert batch[1] == solo and len(solo) == 16
    assert solo != alone[0][:16]  # it really sampled


def test_top_k_one_equals_greedy(
    runner: TorchModelRunner, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    top1 = SamplingParams(temperature=1.0, top_k=1, max_new_tokens=MAX_NEW_TOKENS)
    assert generate(runner, prompts[:2], [top1] * 2) == alone[:2]


# -- chunked prefill, prefix caching, preemption ---------------------------------------------
# Greedy outputs of 12 tokens, which must be the first 12 of the solo ones (cheaper to run).
SHORT = SamplingParams(temperature=0, max_new_tokens=12)


@pytest.fixture(scope="module")
def short(alone: list[list[int]]) -> list[list[int]]:
    return [out[: SHORT.max_new_tokens] for out in alone]


def test_chunked_prefill_mixed_with_decodes_gives_the_solo_tokens(
    runner: TorchModelRunner, prompts: list[list[int]], short: list[list[int]]
) -> None:
    # 16 tokens a step: prompts arrive while others decode and are prefilled in chunks
    # (of whatever the decodes leave) that do not line up with the KV blocks.
    assert max(len(p) for p in prompts) > 16
    arrivals = [0, 0, 1, 3, 5, 8]
    budget = {"max_num_batched_tokens": 16}
    assert generate(runner, prompts, [SHORT] * len(prompts), arrivals, **budget) == short


def test_prefix_caching_gives_the_solo_tokens_and_reports_cached_tokens(
    runner: TorchModelRunner, prompts: list[list[int]], short: list[list[int]]
) -> None:
    # The chat prompts share the chat template's system prefix; the last is a repeat.
    chat = [prompts[0], prompts[1], prompts[2], prompts[0]]
    seqs = run_core(runner, chat, [SHORT] * 4, [0, 1, 2, 3])
    assert [seq.output_ids for seq in seqs] == [short[0], short[1], short[2], short[0]]
    assert seqs[0].num_cached_tokens == 0
    assert all(seq.num_cached_tokens >= BLOCK_SIZE for seq in seqs[1:])
    repeat = seqs[3]
    assert repeat.num_cached_tokens == (len(prompts[0]) - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_a_tiny_kv_budget_still_gives_the_solo_tokens(
    runner: TorchModelRunner, prompts: list[list[int]], short: list[list[int]], prefix_caching: bool
) -> None:
    # 6 blocks hold 96 tokens; the six requests need about three times that at their longest.
    config = {"num_kv_blocks": 6, "enable_prefix_caching": prefix_caching}
    seqs = run_core(runner, prompts, [SHORT] * len(prompts), **config)
    assert [seq.output_ids for seq in seqs] == short
    assert any(seq.num_preemptions for seq in seqs)


# -- the same with decodes through the paged C kernel (paged_decode.py) -----------------------
@pytest.fixture(scope="module", params=["auto", "bfloat16"])
def paged_runner(model_path: str, request: pytest.FixtureRequest) -> TorchModelRunner:
    """fp32 with the kernel forced on: it reads each sequence's blocks alone, in a fixed
    order, so batching, chunking, cache hits and preemption must not move a token. Over an
    fp32 cache, and over a bf16 one (`--kv-cache-dtype bfloat16`)."""
    if kernel_library() is None:
        pytest.skip("no C compiler here: the paged decode kernel is not built")
    runner = TorchModelRunner.load(
        model_path, NUM_KV_BLOCKS, BLOCK_SIZE, kv_cache_dtype=request.param
    )
    runner.use_attention(
        AttentionChoice(upcast_sdpa=True, matmul_decodes=False, paged_decodes=True)
    )
    return runner


def test_the_paged_kernel_keeps_solo_tokens_through_chunks_cache_hits_and_preemption(
    paged_runner: TorchModelRunner, prompts: list[list[int]], short: list[list[int]]
) -> None:
    solo = [generate(paged_runner, [p], [SHORT])[0] for p in prompts]
    # SDPA's tokens over the fp32 cache, but for at most one of the prompts (either cache)
    assert sum(a == b for a, b in zip(solo, short, strict=True)) >= len(short) - 1, (solo, short)
    sampling = [SHORT] * len(prompts)
    chunked = generate(
        paged_runner, prompts, sampling, [0, 0, 1, 3, 5, 8], max_num_batched_tokens=16
    )
    assert chunked == solo
    cached = run_core(paged_runner, prompts + prompts[:2], [SHORT] * 8, [0, 0, 1, 2, 3, 4, 5, 6])
    assert [seq.output_ids for seq in cached] == solo + solo[:2]
    assert cached[6].num_cached_tokens > 0
    tiny = run_core(paged_runner, prompts, sampling, num_kv_blocks=6)
    assert [seq.output_ids for seq in tiny] == solo
    assert any(seq.num_preemptions for seq in tiny)

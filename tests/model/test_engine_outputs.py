"""Sampling parameters, logprobs and embeddings through our core + runner on the real SmolLM2,
checked against Hugging Face's forward (both loaded once for the module)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import torch

from shared.protocol import LogprobRequest, SamplingParams
from tests.support.core import drive
from workers.scheduler.core.scheduler import Scheduler, SchedulerConfig
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine.model_runner import TorchModelRunner

pytestmark = pytest.mark.model

ATOL = 2e-4  # our fp32 forward vs HF's: same math, different op order
TEXTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, in a small village, there lived",
    "1, 2, 3, 4, 5,",
]


@pytest.fixture(scope="module")
def prompts(model_path: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return [list(tokenizer(t)["input_ids"]) for t in TEXTS]


@pytest.fixture(scope="module")
def runner(model_path: str) -> TorchModelRunner:
    return TorchModelRunner.load(model_path, num_kv_blocks=128, block_size=16)


@pytest.fixture(scope="module")
def hf(model_path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def run(
    runner: TorchModelRunner,
    seqs: list[Sequence],
    arrivals: list[int] | None = None,
    eos: frozenset[int] = frozenset(),
    chunk: int = 4096,
) -> list[Sequence]:
    """Drive core + runner until every sequence finished; seq i joins at step arrivals[i];
    a step computes at most `chunk` tokens (chunked prefill)."""
    runner.eos_token_ids = eos
    config = SchedulerConfig(
        num_kv_blocks=runner.num_kv_blocks,
        vocab_size=runner.vocab_size,
        max_model_len=1024,
        block_size=runner.block_size,
        max_num_batched_tokens=chunk,
        eos_token_ids=eos,
    )
    core = Scheduler(config, decode_tail=lambda ids: "")
    drive(core, seqs, runner.run, arrivals)
    return seqs


def close(a: list[float] | torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), b, rtol=0, atol=ATOL)


# -- logprobs --------------------------------------------------------------------------------


def penalized(
    logits: torch.Tensor, prompt: list[int], output: list[int], sp: SamplingParams
) -> torch.Tensor:
    """Reference penalties, one token at a time (HF repetition; OpenAI frequency/presence)."""
    out = logits.clone()
    for t in set(prompt + output):
        r = sp.repetition_penalty
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t in set(output):
        out[t] -= output.count(t) * sp.frequency_penalty + sp.presence_penalty
    return out


def test_logprobs_equal_log_softmax_of_hugging_face_logits(
    runner: TorchModelRunner, hf: Any, prompts: list[list[int]]
) -> None:
    requested = [13, 28, 330]
    cases: list[tuple[SamplingParams, LogprobRequest]] = [
        (SamplingParams(temperature=0, max_new_tokens=6), LogprobRequest(0, 5, requested)),
        (SamplingParams(temperature=0.7, seed=3, max_new_tokens=6), LogprobRequest(2, 3)),
        (
            SamplingParams(
                temperature=0,
                max_new_tokens=6,
                repetition_penalty=1.3,
                frequency_penalty=0.4,
                presence_penalty=0.2,
            ),
            LogprobRequest(-1, 0, requested),
        ),
    ]
    seqs = [Sequence(f"r{i}", prompts[i], sp, logprobs=lr) for i, (sp, lr) in enumerate(cases)]
    run(runner, seqs, chunk=7)  # prompts of 6-12 tokens: chunks cross prompt boundaries
    for seq, (sp, lr) in zip(seqs, cases, strict=True):
        state, n = seq.logprobs, seq.num_prompt_tokens
        assert state is not None and len(seq.output_ids) == 6
        logits = hf_logits(hf, seq.token_ids)
        temperature = sp.temperature or 1.0
        for i, token in enumerate(seq.output_ids):
            prior = seq.output_ids[:i]
            want = penalized(logits[n - 1 + i], seq.token_ids[:n], prior, sp) / temperature
            want = want.log_softmax(-1)
            close([state.output.token_logprobs[i]], want[token : token + 1])
            if lr.top_n:
                assert state.output.top_ids[i] == want.topk(lr.top_n).indices.tolist()
                close(state.output.top_logprobs[i], want.topk(lr.top_n).values)
            if lr.token_ids:
                close(state.output.requested_logprobs[i], want[lr.token_ids])
        raw = logits.log_softmax(-1)  # prompt logprobs: raw, whatever the sampling
        if lr.start_len < 0:
            assert state.input is None
            continue
        assert state.input is not None
        first = max(lr.start_len, 1)
        positions = torch.arange(first - 1, n - 1)
        close(state.input.token_logprobs, raw[positions, seq.token_ids[first:n]])
        if lr.top_n:
            assert state.input.top_ids == raw[positions].topk(lr.top_n).indices.tolist()
        if lr.token_ids:
            close(state.input.requested_logprobs, raw[positions][:, lr.token_ids])


def test_embedding_is_the_normalised_last_hidden_state(
    runner: TorchModelRunner, hf: Any, prompts: list[list[int]]
) -> None:
    embed = Sequence("e", prompts[2], SamplingParams(max_new_tokens=0), embed=True)
    other = Sequence("g", prompts[0], SamplingParams(temperature=0, max_new_tokens=3))
    run(runner, [embed, other])
    assert embed.output_ids == [] and embed.finish is not None
    assert (embed.finish.type, embed.finish.length) == ("length", 0)
    assert len(other.output_ids) == 3
    with torch.inference_mode():
        last = hf.model(torch.tensor([prompts[2]])).last_hidden_state[0, -1]
    close(embed.embedding or [], torch.nn.functional.normalize(last, dim=-1))


# -- sampling parameters end to end ----------------------------------------------------------


def outputs(
    runner: TorchModelRunner, prompts: list[list[int]], sp: SamplingParams, **kw: Any
) -> list[list[int]]:
    seqs = [Sequence(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    return [s.output_ids for s in run(runner, seqs, **kw)]


def test_a_seeded_request_is_the_same_alone_and_in_a_batch_of_16(
    runner: TorchModelRunner, prompts: list[list[int]]
) -> None:
    seeded = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, min_p=0.02, frequency_penalty=0.3, seed=77,
        max_new_tokens=6, ignore_eos=True,
    )  # fmt: skip
    alone = outputs(runner, [prompts[2]], seeded)[0]
    variety: list[Callable[[int], SamplingParams]] = [
        lambda i: SamplingParams(temperature=0, max_new_tokens=6 - i % 3),
        lambda i: SamplingParams(temperature=1.2, top_k=5, max_new_tokens=5),
        lambda i: SamplingParams(temperature=0.8, top_p=0.5, seed=i, max_new_tokens=6),
        lambda i: SamplingParams(min_p=0.1, repetition_penalty=1.2, max_new_tokens=4),
        lambda i: SamplingParams(logit_bias={42: 5.0}, presence_penalty=0.5, max_new_tokens=6),
    ]
    seqs = [Sequence(f"o{i}", prompts[i % 4], variety[i % 5](i)) for i in range(15)]
    seqs.insert(7, Sequence("seeded", prompts[2], seeded))
    run(runner, seqs, arrivals=[i // 4 for i in range(16)])
    assert len(seqs) == 16
    assert seqs[7].output_ids == alone and len(alone) == 6
    greedy = next(s.output_ids for s in seqs if s.rid == "o10")  # greedy, same prompt
    assert len(greedy) == 5
    assert alone[:5] != greedy  # it really sampled


def test_logit_bias_forces_a_token(runner: TorchModelRunner, prompts: list[list[int]]) -> None:
    sp = SamplingParams(temperature=1.0, max_new_tokens=4, logit_bias={1234: 100.0})
    assert outputs(runner, prompts[:2], sp) == [[1234] * 4] * 2


def test_min_new_tokens_suppresses_eos_and_stop_ids(
    runner: TorchModelRunner, prompts: list[list[int]]
) -> None:
    greedy = outputs(runner, prompts[:1], SamplingParams(temperature=0, max_new_tokens=4))[0]
    eos = frozenset({greedy[0]})  # make the greedy first token the eos
    stop_second = SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[greedy[1]])
    assert outputs(runner, prompts[:1], SamplingParams(temperature=0), eos=eos) == [greedy[:1]]
    held = msgspec.structs.replace(stop_second, min_new_tokens=4)
    out = outputs(runner, prompts[:1], held, eos=eos)[0]
    assert len(out) >= 4 and greedy[0] not in out[:4] and greedy[1] not in out[:4]

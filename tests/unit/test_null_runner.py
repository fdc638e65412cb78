"""The null engine through the pure core: tokens are a function of (prompt, position) only, so
batching, chunked prefill, preemption and resuming elsewhere never change a request's output;
it never emits a special token; logprobs and embeddings have the shapes the real engine's do."""

from __future__ import annotations

import math
from typing import Any

from shared.protocol import LogprobRequest, SamplingParams
from tests.support.core import drive
from workers.scheduler.core.scheduler import Scheduler, SchedulerConfig
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine.null_runner import NullModelRunner, null_token, prompt_digest

FIRST_ID = 17  # ids below are "special"
VOCAB = 100


def make_core(**overrides: Any) -> Scheduler:
    config: dict[str, Any] = dict(
        num_kv_blocks=64, vocab_size=VOCAB, max_model_len=256, block_size=4, max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    return Scheduler(SchedulerConfig(**{**config, **overrides}, eos_token_ids=frozenset({2})),
                     lambda ids: "".join(f"<{i}>" for i in ids))  # fmt: skip


def _runner() -> NullModelRunner:
    return NullModelRunner(VOCAB, num_kv_blocks=64, block_size=4, step_s=0,
                           first_token_id=FIRST_ID, hidden_size=8)  # fmt: skip


def _seq(rid: str, prompt: list[int], max_new_tokens: int = 12, **kw: Any) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_new_tokens=max_new_tokens), **kw)


def _expected(prompt: list[int], n: int) -> list[int]:
    digest = prompt_digest(prompt)
    return [null_token(digest, i, FIRST_ID, VOCAB) for i in range(n)]


PROMPTS = [[20 + i, 30 + i, 40 + (i * 7) % 50] * (1 + i % 5) for i in range(10)]


def test_output_is_a_function_of_prompt_and_position_whatever_the_batch() -> None:
    alone = []
    for i, prompt in enumerate(PROMPTS):
        seq = _seq(f"a{i}", prompt)
        drive(make_core(), [seq], _runner().run)
        alone.append(seq.output_ids)
    # All at once, on a small KV cache with a small token budget: chunked prefills, preemption.
    together = [_seq(f"b{i}", p) for i, p in enumerate(PROMPTS)]
    core = make_core(num_kv_blocks=16, max_num_batched_tokens=8, max_num_seqs=4)
    drive(core, together, _runner().run, arrivals=[i % 3 for i in range(len(PROMPTS))])
    assert [s.output_ids for s in together] == alone
    assert alone == [_expected(p, 12) for p in PROMPTS]
    assert len({tuple(ids) for ids in alone}) == len(PROMPTS)  # prompts differ, outputs differ


def test_a_resumed_request_continues_where_it_was() -> None:
    whole = _seq("whole", PROMPTS[3])
    drive(make_core(), [whole], _runner().run)
    resumed = _seq("resumed", PROMPTS[3])
    resumed.resume(whole.output_ids[:5])  # another scheduler had published five tokens
    drive(make_core(), [resumed], _runner().run)
    assert resumed.output_ids == whole.output_ids


def test_never_a_special_token_and_every_id_in_the_vocabulary() -> None:
    digest = prompt_digest([1, 2, 3])
    ids = [null_token(digest, i, FIRST_ID, VOCAB) for i in range(5000)]
    assert min(ids) == FIRST_ID and max(ids) == VOCAB - 1  # spread over the whole range


def test_logprobs_and_embeddings_have_the_real_shapes() -> None:
    lp = LogprobRequest(top_n=2, token_ids=[FIRST_ID, FIRST_ID + 1])
    seq = _seq("lp", PROMPTS[0], max_new_tokens=4, logprobs=lp)
    drive(make_core(), [seq], _runner().run)
    out = seq.logprobs.output if seq.logprobs else None
    assert out is not None and out.token_logprobs == [0.0] * 4
    assert out.top_ids == [[t] for t in seq.output_ids]
    assert all(len(r) == 2 and 0.0 >= max(r) for r in out.requested_logprobs)

    embed = Sequence("e", PROMPTS[1], SamplingParams(max_new_tokens=0), embed=True)
    drive(make_core(), [embed], _runner().run)
    again = Sequence("e2", PROMPTS[1], SamplingParams(max_new_tokens=0), embed=True)
    drive(make_core(), [again], _runner().run)
    assert embed.embedding is not None and len(embed.embedding) == 8
    assert math.isclose(sum(x * x for x in embed.embedding), 1.0)
    assert again.embedding == embed.embedding

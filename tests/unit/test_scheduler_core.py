"""The scheduler core driven by plain calls: batching, limits, aborts and finish rules."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from shared.protocol import FinishReason, SamplingParams
from tests.support.core import drive
from workers.scheduler.core.scheduler import Scheduler, SchedulerConfig
from workers.scheduler.core.sequence import Sequence, SequenceStatus

EOS = 2
VOCAB = 100


def decode_tail(ids: list[int]) -> str:
    """A toy tokenizer: id i is the text `<i>`."""
    return "".join(f"<{i}>" for i in ids)


def make_core(**overrides: Any) -> Scheduler:
    config: dict[str, Any] = dict(
        num_kv_blocks=64,
        vocab_size=VOCAB,
        max_model_len=256,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        eos_token_ids=frozenset({EOS}),
    )
    return Scheduler(SchedulerConfig(**{**config, **overrides}), decode_tail)


_first_tokens = itertools.count()


def make_seq(rid: str, num_tokens: int = 3, **sampling: Any) -> Sequence:
    """A prompt of its own (its first token differs from other calls' first tokens), so
    that only the tests about prefix caching share blocks."""
    sampling.setdefault("max_new_tokens", 16)
    prompt = [10 + next(_first_tokens) % 80] + [10 + i for i in range(1, num_tokens)]
    return Sequence(rid, prompt[:num_tokens], SamplingParams(**sampling))


def rids(seqs: list[Sequence]) -> list[str]:
    return [seq.rid for seq in seqs]


def step(core: Scheduler, token: int = 50) -> tuple[dict[str, int], list[str]]:
    """One scheduled step where every sequence that samples gets `token`:
    ({rid: new tokens computed}, rids finished)."""
    seqs = core.schedule()
    scheduled = {seq.rid: seq.num_new_tokens for seq in seqs}
    finished = core.postprocess(seqs, [token] * sum(seq.will_sample for seq in seqs))
    return scheduled, rids(finished)


def test_core_imports_neither_torch_nor_redis() -> None:
    code = (
        "import importlib, pkgutil, sys, workers.scheduler.core as core;"
        "[importlib.import_module(m.name)"
        " for m in pkgutil.walk_packages(core.__path__, 'workers.scheduler.core.')];"
        "assert len(sys.modules) and 'workers.scheduler.core.sequence' in sys.modules;"
        "assert not {'torch', 'redis'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_continuous_batching_joins_new_and_drops_finished_between_steps() -> None:
    core = make_core()
    core.add(make_seq("a", max_new_tokens=3))
    core.add(make_seq("b"))
    assert step(core) == ({"a": 3, "b": 3}, [])
    assert step(core) == ({"a": 1, "b": 1}, [])
    core.add(make_seq("c"))
    # c's prefill joins the decodes of the next step, which gives a its third token.
    assert step(core) == ({"a": 1, "b": 1, "c": 3}, ["a"])
    assert step(core) == ({"b": 1, "c": 1}, [])  # a left the batch


def test_max_num_seqs_bounds_the_batch() -> None:
    core = make_core(max_num_seqs=2)
    for rid in "abc":
        core.add(make_seq(rid, max_new_tokens=2))
    assert step(core) == ({"a": 3, "b": 3}, [])
    assert step(core) == ({"a": 1, "b": 1}, ["a", "b"])
    assert step(core) == ({"c": 3}, [])


def test_the_token_budget_cuts_prompts_into_chunks_that_fill_each_step() -> None:
    core = make_core(max_num_batched_tokens=10)
    seqs = [make_seq(rid, num_tokens=6) for rid in "abc"]
    for seq in seqs:
        core.add(seq)
    assert step(core) == ({"a": 6, "b": 4}, [])  # b's first chunk does not sample
    assert [len(seq.output_ids) for seq in seqs] == [1, 0, 0]
    assert step(core) == ({"a": 1, "b": 2, "c": 6}, [])
    assert [len(seq.output_ids) for seq in seqs] == [2, 1, 1]
    core = make_core(max_num_batched_tokens=10)
    long = make_seq("long", num_tokens=25)
    core.add(long)
    core.add(make_seq("short", num_tokens=2))
    assert step(core) == ({"long": 10}, [])
    assert step(core) == ({"long": 10}, [])
    assert step(core) == ({"long": 5, "short": 2}, [])
    assert long.num_computed_tokens == 25 and len(long.output_ids) == 1


def test_running_streams_get_a_token_every_step_while_a_long_prompt_is_prefilled() -> None:
    core = make_core(max_num_batched_tokens=8, max_model_len=512, num_kv_blocks=128)
    streams = [make_seq(rid, num_tokens=2, max_new_tokens=100) for rid in "ab"]
    for seq in streams:
        core.add(seq)
    step(core)
    long = make_seq("long", num_tokens=40)
    core.add(long)
    chunks = []
    while not long.output_ids:
        before = [len(seq.output_ids) for seq in streams]
        scheduled, _ = step(core)
        assert sum(scheduled.values()) <= 8
        assert [len(seq.output_ids) for seq in streams] == [n + 1 for n in before]
        chunks.append(scheduled["long"])
    assert chunks == [6] * 6 + [4]


def test_admission_is_limited_by_free_blocks() -> None:
    core = make_core(num_kv_blocks=4, block_size=4)  # 16 token slots
    assert core.num_free_slots() == 4
    core.add(make_seq("a", num_tokens=8))  # promised 2 blocks while waiting
    assert core.num_free_slots() == 2
    core.add(make_seq("b", num_tokens=8))
    assert core.num_free_slots() == 0
    core.add(make_seq("c", num_tokens=4))
    assert step(core) == ({"a": 8, "b": 8}, [])  # c does not fit yet
    assert core.block_manager.num_free_blocks == 0
    assert rids(list(core.waiting)) == ["c"]


def test_abort_frees_blocks_of_running_and_waiting_sequences() -> None:
    core = make_core(num_kv_blocks=8, max_num_seqs=1)
    core.add(make_seq("a", num_tokens=5))
    core.add(make_seq("b", num_tokens=5))
    step(core)
    assert core.block_manager.num_free_blocks == 6
    aborted = core.abort(["a", "b", "unknown"])
    assert rids(aborted) == ["a", "b"]
    assert all(s.finish == FinishReason(type="abort", message="Abort requested.") for s in aborted)
    assert all(s.status == SequenceStatus.FINISHED for s in aborted)
    assert core.block_manager.num_free_blocks == 8 and core.is_idle


def test_decode_preempts_the_newest_sequence_when_blocks_run_out() -> None:
    core = make_core(num_kv_blocks=2, block_size=4, max_num_seqs=2)
    core.add(make_seq("a", num_tokens=4, ignore_eos=True))
    core.add(make_seq("b", num_tokens=4, ignore_eos=True))
    step(core)  # both prefilled; each now needs a 2nd block for its 5th token
    assert step(core) == ({"a": 1}, [])
    assert rids(list(core.waiting)) == ["b"] and core.waiting[0].block_table == []
    assert core.waiting[0].num_preemptions == 1
    core.abort(["a"])
    [b] = core.schedule()  # b is recomputed from prompt + output
    assert b.rid == "b" and b.num_new_tokens == 5 and b.will_sample


@pytest.mark.parametrize(
    ("sampling", "tokens", "reason"),
    [
        ({}, [50, EOS], FinishReason(type="stop", matched=EOS)),
        ({"stop_token_ids": [51]}, [50, 51], FinishReason(type="stop", matched=51)),
        ({"max_new_tokens": 3}, [50, 50, 50], FinishReason(type="length", length=3)),
        ({"stop": ["<7><8>"]}, [7, 9, 7, 8], FinishReason(type="stop", matched="<7><8>")),
        ({"stop": ["zz", "9><7"]}, [9, 7], FinishReason(type="stop", matched="9><7")),
    ],
)
def test_finish_rules(sampling: dict[str, Any], tokens: list[int], reason: FinishReason) -> None:
    core = make_core()
    seq = make_seq("a", **sampling)
    core.add(seq)
    for i, token in enumerate(tokens):
        seqs = core.schedule()
        finished = core.postprocess(seqs, [token])
        assert finished == ([seq] if i == len(tokens) - 1 else []), i
    assert seq.finish == reason and seq.output_ids == tokens
    assert seq.block_table == [] and core.block_manager.num_free_blocks == 64 and core.is_idle


def test_ignore_eos_keeps_going_past_eos() -> None:
    core = make_core()
    seq = make_seq("a", ignore_eos=True, max_new_tokens=3)
    core.add(seq)
    for token in (EOS, EOS):
        seqs = core.schedule()
        assert core.postprocess(seqs, [token]) == []
    seqs = core.schedule()
    assert core.postprocess(seqs, [EOS]) == [seq]
    assert seq.finish == FinishReason(type="length", length=3)


def test_stop_strings_only_look_at_the_output() -> None:
    core = make_core()
    seq = Sequence("a", [7], SamplingParams(stop=["<7><8>"]))
    core.add(seq)
    seqs = core.schedule()
    assert core.postprocess(seqs, [8]) == []


def test_context_length_finishes_with_length() -> None:
    core = make_core(max_model_len=6)
    seq = make_seq("a", num_tokens=4, max_new_tokens=100)
    core.add(seq)
    assert step(core)[1] == []
    assert step(core)[1] == ["a"]
    assert seq.finish == FinishReason(type="length", length=2) and len(seq) == 6


@pytest.mark.parametrize(
    ("prompt", "sampling", "message"),
    [
        ([], {}, "The input is empty."),
        (list(range(10, 266)), {}, "The input (256 tokens) is longer than the model's context"),
        ([5, VOCAB], {}, f"Token id {VOCAB} is out of vocabulary"),
        ([5, -1], {}, "Token id -1 is out of vocabulary"),
        ([5], {"max_new_tokens": -1}, "max_new_tokens must be at least 0"),
    ],
)
def test_bad_requests_are_refused_alone(
    prompt: list[int], sampling: dict[str, Any], message: str
) -> None:
    core = make_core()
    core.add(make_seq("good"))
    seq = Sequence("bad", prompt, SamplingParams(**sampling))
    reason = core.add(seq)
    assert reason is not None and reason.type == "abort" and reason.status_code == 400
    assert reason.message is not None and reason.message.startswith(message)
    assert seq.finish == reason and rids(list(core.waiting)) == ["good"]


def test_zero_max_new_tokens_finishes_at_once() -> None:
    core = make_core()
    seq = make_seq("a", max_new_tokens=0)
    assert core.add(seq) == FinishReason(type="length", length=0)
    assert core.is_idle


# -- prefix caching, chunking and preemption against a paged fake model ---------------------


def test_a_prompt_sharing_a_prefix_with_an_earlier_one_skips_the_cached_blocks() -> None:
    core = make_core(block_size=4)
    first = Sequence("first", list(range(10, 23)), SamplingParams(max_new_tokens=1))
    core.add(first)
    step(core)
    assert first.is_finished and first.num_cached_tokens == 0
    second = Sequence("second", [*range(10, 20), 90, 91], SamplingParams(max_new_tokens=1))
    core.add(second)
    assert step(core) == ({"second": 4}, ["second"])  # 8 of 12 tokens came from the cache
    assert second.num_cached_tokens == 8


def test_nothing_waiting_starts_in_a_step_that_preempted() -> None:
    core = make_core(
        num_kv_blocks=3, block_size=4, max_num_batched_tokens=5, enable_prefix_caching=False
    )
    core.add(make_seq("a", num_tokens=4, ignore_eos=True))
    assert step(core) == ({"a": 4}, [])
    core.add(make_seq("b", num_tokens=4))
    assert step(core) == ({"a": 1, "b": 4}, [])  # a: 2 blocks, b: 1, none free
    core.add(make_seq("c", num_tokens=1))
    # b needs a 2nd block and is preempted; its first 4 tokens would fit the block it freed
    # and the budget left, but starting it again at once would only thrash.
    assert step(core) == ({"a": 1}, [])
    assert rids(list(core.waiting)) == ["b", "c"]


class PagedFakeModel:
    """Stands in for the model runner over a paged cache: writes each new token into its
    slot, reads each sampling sequence's whole context back from the cache and "samples" a
    hash of it. Shared, stale or overwritten blocks change the tokens."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.cache: dict[int, int] = {}
        self.steps: list[list[tuple[int, bool]]] = []  # (num_new_tokens, will_sample)

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def run(self, seqs: list[Sequence]) -> list[int]:
        self.steps.append([(seq.num_new_tokens, seq.will_sample) for seq in seqs])
        for seq in seqs:
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + seq.num_new_tokens):
                self.cache[self.slot(seq, pos)] = seq.token_ids[pos]
        tokens = []
        for seq in seqs:
            if seq.will_sample:
                context = [self.cache[self.slot(seq, pos)] for pos in range(len(seq))]
                assert context == seq.token_ids, seq.rid
                tokens.append(10 + zlib.crc32(bytes(context)) % 80)
        return tokens


def drive_paged(core: Scheduler, seqs: list[Sequence], arrivals: list[int]) -> PagedFakeModel:
    model = PagedFakeModel(core.config.block_size)

    def within_budget(batch: list[Sequence]) -> None:
        assert sum(seq.num_new_tokens for seq in batch) <= core.config.max_num_batched_tokens
        assert len(batch) <= core.config.max_num_seqs

    drive(core, seqs, model.run, arrivals, within_budget)
    assert core.block_manager.num_free_blocks == core.config.num_kv_blocks
    return model


def workload(seed: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Prompts sharing system prefixes (plus exact repeats), lengths and arrival steps."""
    rng = random.Random(seed)
    systems = [[rng.randrange(10, 90) for _ in range(n)] for n in (9, 14, 30)]
    prompts = []
    for _ in range(24):
        own = [rng.randrange(10, 90) for _ in range(rng.randrange(1, 30))]
        prompts.append(rng.choice([*systems, []]) + own)
    prompts += prompts[:3]
    lengths = [rng.randrange(1, 24) for _ in prompts]
    arrivals = sorted(rng.randrange(0, 60) for _ in prompts)
    return prompts, lengths, arrivals


def outputs(seed: int, **config: Any) -> tuple[list[Sequence], PagedFakeModel]:
    prompts, lengths, arrivals = workload(seed)
    seqs = [
        Sequence(f"r{i}", p, SamplingParams(max_new_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    core = make_core(**{"max_model_len": 128, **config})
    return seqs, drive_paged(core, seqs, arrivals)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunks_prefix_hits_and_preemption_give_the_reference_tokens(seed: int) -> None:
    reference, _ = outputs(
        seed, num_kv_blocks=1024, max_num_batched_tokens=4096, enable_prefix_caching=False
    )
    assert all(seq.num_preemptions == 0 for seq in reference)
    seqs, model = outputs(seed, num_kv_blocks=40, max_num_batched_tokens=16, max_num_seqs=6)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in reference]
    assert all(len(s.output_ids) == s.sampling.max_new_tokens for s in seqs)
    # It took every path: chunked prompts, mixed steps, prefix hits and preemptions.
    assert any((n > 1, sampled) == (True, False) for batch in model.steps for n, sampled in batch)
    assert any({(1, True)} < set(batch) for batch in model.steps)  # decodes beside a prefill
    assert sum(s.num_cached_tokens for s in seqs) >= 4 * 8
    # cached_tokens counts the first prefill's hits only: never output tokens.
    assert all(s.num_cached_tokens < s.num_prompt_tokens for s in seqs)
    assert any(s.num_preemptions for s in seqs)

"""The scheduler core driven by plain calls: batching, limits, aborts and finish rules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shared.protocol import FinishReason, SamplingParams
from workers.scheduler.scheduler import Scheduler, SchedulerConfig
from workers.scheduler.sequence import Sequence, SequenceStatus

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


def make_seq(rid: str, num_tokens: int = 3, **sampling: Any) -> Sequence:
    sampling.setdefault("max_new_tokens", 16)
    return Sequence(rid, [10 + i for i in range(num_tokens)], SamplingParams(**sampling))


def rids(seqs: list[Sequence]) -> list[str]:
    return [seq.rid for seq in seqs]


def step(core: Scheduler, token: int = 50) -> tuple[list[str], bool, list[str]]:
    """One scheduled step where every sequence samples `token`."""
    seqs, is_prefill = core.schedule()
    finished = core.postprocess(seqs, [token] * len(seqs))
    return rids(seqs), is_prefill, rids(finished)


def test_core_imports_neither_torch_nor_redis() -> None:
    code = (
        "import sys, workers.scheduler.scheduler, workers.scheduler.block_manager;"
        "assert not {'torch', 'redis'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_continuous_batching_joins_new_and_drops_finished_between_steps() -> None:
    core = make_core()
    core.add(make_seq("a", max_new_tokens=3))
    core.add(make_seq("b"))
    assert step(core) == (["a", "b"], True, [])
    assert step(core) == (["a", "b"], False, [])
    core.add(make_seq("c"))
    assert step(core) == (["c"], True, [])  # joins at the next step
    assert step(core) == (["a", "b", "c"], False, ["a"])  # a's third token
    assert step(core) == (["b", "c"], False, [])  # a left the batch


def test_max_num_seqs_bounds_the_batch() -> None:
    core = make_core(max_num_seqs=2)
    for rid in "abc":
        core.add(make_seq(rid, max_new_tokens=2))
    assert step(core) == (["a", "b"], True, [])
    assert step(core) == (["a", "b"], False, ["a", "b"])
    assert step(core) == (["c"], True, [])


def test_token_budget_bounds_a_prefill_but_a_long_prompt_still_runs_alone() -> None:
    core = make_core(max_num_batched_tokens=10)
    for rid in "abc":
        core.add(make_seq(rid, num_tokens=6))
    assert step(core)[:2] == (["a"], True)
    assert step(core)[:2] == (["b"], True)
    core = make_core(max_num_batched_tokens=10)
    core.add(make_seq("long", num_tokens=30))
    core.add(make_seq("short", num_tokens=2))
    assert step(core)[:2] == (["long"], True)


def test_admission_is_limited_by_free_blocks() -> None:
    core = make_core(num_kv_blocks=4, block_size=4)  # 16 token slots
    assert core.num_free_slots() == 4
    core.add(make_seq("a", num_tokens=8))  # promised 2 blocks while waiting
    assert core.num_free_slots() == 2
    core.add(make_seq("b", num_tokens=8))
    assert core.num_free_slots() == 0
    core.add(make_seq("c", num_tokens=4))
    assert step(core) == (["a", "b"], True, [])  # c does not fit yet
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
    assert step(core) == (["a"], False, [])
    assert rids(list(core.waiting)) == ["b"] and core.waiting[0].block_table == []
    core.abort(["a"])
    seqs, is_prefill = core.schedule()  # b is recomputed from prompt + output
    assert rids(seqs) == ["b"] and is_prefill and len(seqs[0]) == 5


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
        seqs, _ = core.schedule()
        finished = core.postprocess(seqs, [token])
        assert finished == ([seq] if i == len(tokens) - 1 else []), i
    assert seq.finish == reason and seq.output_ids == tokens
    assert seq.block_table == [] and core.block_manager.num_free_blocks == 64 and core.is_idle


def test_ignore_eos_keeps_going_past_eos() -> None:
    core = make_core()
    seq = make_seq("a", ignore_eos=True, max_new_tokens=3)
    core.add(seq)
    for token in (EOS, EOS):
        seqs, _ = core.schedule()
        assert core.postprocess(seqs, [token]) == []
    seqs, _ = core.schedule()
    assert core.postprocess(seqs, [EOS]) == [seq]
    assert seq.finish == FinishReason(type="length", length=3)


def test_stop_strings_only_look_at_the_output() -> None:
    core = make_core()
    seq = Sequence("a", [7], SamplingParams(stop=["<7><8>"]))
    core.add(seq)
    seqs, _ = core.schedule()
    assert core.postprocess(seqs, [8]) == []


def test_context_length_finishes_with_length() -> None:
    core = make_core(max_model_len=6)
    seq = make_seq("a", num_tokens=4, max_new_tokens=100)
    core.add(seq)
    assert step(core)[2] == []
    assert step(core)[2] == ["a"]
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

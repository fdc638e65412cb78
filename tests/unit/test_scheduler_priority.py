"""The pure scheduler core's priorities (higher first, then arrival; the lowest-priority newest
sequence is preempted) and deadlines (a late sequence ends with a 504, waiting or running)."""

from __future__ import annotations

import itertools
from typing import Any

from shared.protocol import FinishReason, SamplingParams
from workers.scheduler.core.scheduler import Scheduler, SchedulerConfig
from workers.scheduler.core.sequence import Sequence, SequenceStatus

VOCAB = 100
NOW = 1_000_000.0
_prompts = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def make_core(clock: Clock | None = None, **overrides: Any) -> Scheduler:
    config: dict[str, Any] = dict(
        num_kv_blocks=64, vocab_size=VOCAB, max_model_len=256, block_size=4, max_num_seqs=8,
        max_num_batched_tokens=64,
    )  # fmt: skip
    return Scheduler(SchedulerConfig(**{**config, **overrides}), lambda ids: "", clock or Clock())


def make_seq(
    rid: str, priority: int = 0, num_tokens: int = 3, deadline: float = 0.0, **sampling: Any
) -> Sequence:
    sampling.setdefault("max_new_tokens", 8)
    sampling.setdefault("ignore_eos", True)
    first = 10 + next(_prompts) % 80  # no two prompts share a cached prefix
    prompt = [first] + [10 + i for i in range(1, num_tokens)]
    return Sequence(rid, prompt, SamplingParams(**sampling), priority=priority,
                    deadline=deadline, created_at=NOW - 1)  # fmt: skip


def start_order(core: Scheduler) -> list[str]:
    """Step `core` until idle; the rids in the order their first step ran."""
    started: list[str] = []
    while not core.is_idle:
        seqs = core.schedule()
        started += [seq.rid for seq in seqs if seq.rid not in started]
        core.postprocess(seqs, [50] * sum(seq.will_sample for seq in seqs))
    return started


def test_higher_priority_starts_first_then_arrival_order() -> None:
    core = make_core(max_num_seqs=1)
    for rid, priority in [("low1", 0), ("high1", 5), ("low2", 0), ("mid", 2), ("high2", 5)]:
        assert core.add(make_seq(rid, priority, max_new_tokens=1)) is None
    assert [seq.rid for seq in core.waiting] == ["high1", "high2", "mid", "low1", "low2"]
    assert start_order(core) == ["high1", "high2", "mid", "low1", "low2"]


def test_negative_and_default_priorities_keep_fifo_among_equals() -> None:
    core = make_core(max_num_seqs=1)
    for rid, priority in [("a", 0), ("b", -1), ("c", 0), ("d", -1)]:
        core.add(make_seq(rid, priority, max_new_tokens=1))
    assert start_order(core) == ["a", "c", "b", "d"]


def test_a_later_high_priority_request_overtakes_the_waiting_queue() -> None:
    core = make_core(max_num_seqs=1)
    core.add(make_seq("first", max_new_tokens=3))
    core.add(make_seq("second", max_new_tokens=1))
    core.schedule()  # "first" runs; "second" waits
    core.add(make_seq("urgent", 1, max_new_tokens=1))
    assert [seq.rid for seq in core.waiting] == ["urgent", "second"]


def test_the_token_budget_goes_to_higher_priority_running_sequences_first() -> None:
    core = make_core(max_num_batched_tokens=6)
    core.add(make_seq("low", 0, num_tokens=6))
    core.add(make_seq("high", 1, num_tokens=6))
    seqs = core.schedule()
    assert [(seq.rid, seq.num_new_tokens) for seq in seqs] == [("high", 6)]


def test_blocks_running_out_preempt_the_lowest_priority_not_the_newest() -> None:
    # 2 blocks of 4: each prefilled 4-token prompt needs a second block for its 5th token.
    core = make_core(num_kv_blocks=2, block_size=4, max_num_seqs=2)
    core.add(make_seq("low", 0, num_tokens=4))
    core.add(make_seq("high", 1, num_tokens=4))  # arrives last: FIFO would preempt it
    seqs = core.schedule()
    core.postprocess(seqs, [50, 50])
    seqs = core.schedule()
    assert [seq.rid for seq in seqs] == ["high"]
    [low] = core.waiting
    assert low.rid == "low" and low.num_preemptions == 1 and low.block_table == []


def test_among_equal_priorities_the_newest_is_preempted() -> None:
    core = make_core(num_kv_blocks=3, block_size=4, max_num_seqs=3)
    for rid in ("old", "mid", "new"):
        core.add(make_seq(rid, 1, num_tokens=4))
    core.add(make_seq("low", 0, num_tokens=1))  # waits: no block left after the prefills
    core.postprocess(seqs := core.schedule(), [50] * len(seqs))
    assert [seq.rid for seq in core.running] == ["old", "mid", "new"]
    # Each needs a second block: "new" goes for "old"'s, then "mid" has none left either.
    assert [seq.rid for seq in core.schedule()] == ["old"]
    # The preempted ones go back in arrival order, before the lower-priority one.
    assert [seq.rid for seq in core.waiting] == ["mid", "new", "low"]


def test_a_preempted_sequence_waits_behind_higher_priority_arrivals() -> None:
    core = make_core(num_kv_blocks=2, block_size=4, max_num_seqs=2)
    core.add(make_seq("a", 0, num_tokens=4))
    core.add(make_seq("b", 0, num_tokens=4))
    core.postprocess(core.schedule(), [50, 50])
    core.add(make_seq("urgent", 3, num_tokens=1))
    core.schedule()  # b is preempted for a's 5th token
    assert [seq.rid for seq in core.waiting] == ["urgent", "b"]


def test_a_job_already_past_its_deadline_ends_when_added() -> None:
    clock = Clock()
    core = make_core(clock)
    seq = make_seq("late", deadline=NOW - 0.5)  # created at NOW - 1: a timeout of 0.5 s
    reason = core.add(seq)
    assert reason == FinishReason(
        type="abort", message="The request exceeded its timeout of 0.5 s.", status_code=504
    )
    assert seq.finish == reason and seq.status == SequenceStatus.FINISHED and core.is_idle


def test_expire_ends_waiting_and_running_sequences_past_their_deadline() -> None:
    clock = Clock()
    core = make_core(clock, max_num_seqs=1)
    running = make_seq("running", deadline=NOW + 2, max_new_tokens=100)
    waiting = make_seq("waiting", deadline=NOW + 1)
    patient = make_seq("patient")  # no deadline
    for seq in (running, waiting, patient):
        assert core.add(seq) is None
    core.postprocess(core.schedule(), [50])
    assert core.expire() == []
    clock.now = NOW + 1
    assert core.expire() == [waiting]
    assert waiting.finish is not None and waiting.finish.message == (
        "The request exceeded its timeout of 2 s."
    )
    clock.now = NOW + 2.5
    assert core.expire() == [running]
    assert running.finish is not None and running.finish.status_code == 504
    assert running.output_ids == [50] and running.block_table == []
    assert [seq.rid for seq in core.unfinished] == ["patient"]
    assert core.block_manager.num_free_blocks == 64
    clock.now = NOW + 10**6
    assert core.expire() == []
    assert start_order(core) == ["patient"]


def _step(core: Scheduler) -> dict[str, int]:
    """One step: {rid: tokens it computed}."""
    seqs = core.schedule()
    computed = {seq.rid: seq.num_new_tokens for seq in seqs}
    core.postprocess(seqs, [50] * sum(seq.will_sample for seq in seqs))
    return computed


def test_background_sits_out_the_steps_where_a_foreground_request_prefills() -> None:
    core = make_core()
    for rid in ("bg1", "bg2"):
        core.add(make_seq(rid, priority=-1, num_tokens=5, max_new_tokens=20))
    assert _step(core) == {"bg1": 5, "bg2": 5}  # alone, background runs
    assert _step(core) == {"bg1": 1, "bg2": 1}
    core.add(make_seq("chat", priority=0, num_tokens=6))
    assert _step(core) == {"chat": 6}  # its prefill runs alone: the first token comes at once
    assert _step(core) == {"chat": 1, "bg1": 1, "bg2": 1}  # then all decode together
    core.add(make_seq("bg3", priority=-1, num_tokens=4))
    assert _step(core) == {"chat": 1, "bg1": 1, "bg2": 1, "bg3": 4}  # a background prefill


def test_a_foreground_prompt_prefilled_in_chunks_keeps_background_out_until_done() -> None:
    core = make_core(max_num_batched_tokens=8)
    core.add(make_seq("bg", priority=-1, num_tokens=3, max_new_tokens=20))
    _step(core)
    core.add(make_seq("long", priority=0, num_tokens=20))
    assert _step(core) == {"long": 8}
    assert _step(core) == {"long": 8}
    assert _step(core) == {"long": 4}
    assert _step(core) == {"long": 1, "bg": 1}


def test_without_yielding_background_decodes_beside_a_prefill() -> None:
    core = make_core(background_yields=False)
    core.add(make_seq("bg", priority=-1, num_tokens=5, max_new_tokens=20))
    _step(core)
    core.add(make_seq("chat", priority=0, num_tokens=6))
    assert _step(core) == {"chat": 6, "bg": 1}


def test_background_goes_on_when_the_foreground_request_cannot_start() -> None:
    # 6 blocks of 4 tokens: the background sequence holds 3, the foreground prompt needs 4.
    core = make_core(num_kv_blocks=6)
    core.add(make_seq("bg", priority=-1, num_tokens=10, max_new_tokens=3))
    _step(core)
    core.add(make_seq("big", priority=0, num_tokens=16, max_new_tokens=1))
    assert _step(core) == {"bg": 1}  # "big" does not fit: no prefill to yield to
    started = start_order(core)
    assert "big" in started and core.is_idle  # "bg" finished, freed its blocks, "big" ran

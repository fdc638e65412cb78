"""The scheduler core's side of min_new_tokens and embedding jobs (no torch)."""

from __future__ import annotations

from shared.protocol import FinishReason, SamplingParams
from workers.scheduler.core.scheduler import Scheduler, SchedulerConfig
from workers.scheduler.core.sequence import Sequence

EOS = 2


def core(max_model_len: int = 64) -> Scheduler:
    config = SchedulerConfig(
        num_kv_blocks=32,
        vocab_size=100,
        max_model_len=max_model_len,
        block_size=4,
        eos_token_ids=frozenset({EOS}),
    )
    return Scheduler(config, decode_tail=lambda ids: "".join(f"<{i}>" for i in ids))


def drive(sched: Scheduler, seq: Sequence, tokens: list[int]) -> None:
    """Step until `seq` finished, sampling tokens[i] at its i-th sample."""
    assert sched.add(seq) is None
    script = iter(tokens)
    while not seq.is_finished:
        batch = sched.schedule()
        sched.postprocess(batch, [next(script) for s in batch if s.will_sample])


def test_no_stop_string_ends_a_request_before_min_new_tokens() -> None:
    sp = SamplingParams(stop=["<7>"], min_new_tokens=3, max_new_tokens=10)
    seq = Sequence("r", [1, 2, 3], sp)
    drive(core(), seq, [7, 7, 7, 5])
    assert seq.output_ids == [7, 7, 7]  # matched from the third token on
    assert seq.finish == FinishReason(type="stop", matched="<7>")
    plain = Sequence("p", [1, 2, 3], SamplingParams(stop=["<7>"]))
    drive(core(), plain, [7])
    assert plain.output_ids == [7]


def test_an_embedding_job_ends_after_its_prefill_without_tokens() -> None:
    sched = core(max_model_len=16)
    seq = Sequence("e", list(range(16)), SamplingParams(max_new_tokens=0), embed=True)
    drive(sched, seq, [99])
    assert seq.output_ids == [] and seq.finish == FinishReason(type="length", length=0)
    assert sched.is_idle and sched.block_manager.num_free_blocks == 32
    # A generation request may not fill the context with its prompt, nor ask for 0 tokens.
    too_long = Sequence("g", list(range(16)), SamplingParams())
    assert (sched.add(too_long) or FinishReason(type="stop")).status_code == 400
    zero = Sequence("z", [1, 2], SamplingParams(max_new_tokens=0))
    assert sched.add(zero) == FinishReason(type="length", length=0)


def test_out_of_vocabulary_ids_in_sampling_or_logprobs_fail_the_request_alone() -> None:
    from shared.protocol import LogprobRequest

    sched = core()
    bad = [
        Sequence("a", [1], SamplingParams(logit_bias={100: 1.0})),
        Sequence("b", [1], SamplingParams(stop_token_ids=[-1])),
        Sequence("c", [1], SamplingParams(), logprobs=LogprobRequest(token_ids=[5, 1000])),
    ]
    for seq in bad:
        reason = sched.add(seq)
        assert reason is not None and reason.status_code == 400
        assert "out of vocabulary" in (reason.message or "")
    assert sched.is_idle

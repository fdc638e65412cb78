"""Engine logprobs and embeddings on synthetic tensors: which distribution, which positions."""

from __future__ import annotations

import math

import torch

from shared.protocol import LogprobRequest, SamplingParams
from workers.scheduler.core.logprob_state import LogprobState
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine.outputs import (
    Span,
    record_embeddings,
    record_input_logprobs,
    record_output_logprobs,
    step_spans,
)
from workers.scheduler.engine.sampler import process_logits

VOCAB, HIDDEN = 40, 8
HEAD = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))


def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
    return hidden @ HEAD.T


def seq(lr: LogprobRequest | None, prompt: list[int], **sampling: object) -> Sequence:
    return Sequence("r", prompt, SamplingParams(**sampling), logprobs=lr)  # type: ignore[arg-type]


# -- output logprobs -------------------------------------------------------------------------


def test_output_logprobs_come_from_the_processed_tempered_distribution() -> None:
    x = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    lr = LogprobRequest(top_n=3, token_ids=[5, 7])
    seqs = [
        seq(lr, [1, 2], temperature=0.5, repetition_penalty=1.3),
        seq(None, [3]),  # no logprobs asked: nothing stored
        seq(LogprobRequest(), [4], temperature=0),  # greedy: temperature 1
    ]
    processed = process_logits(x, seqs, frozenset())
    record_output_logprobs(processed, seqs, [9, 0, 11])
    want0 = (processed[0] / 0.5).log_softmax(-1)
    out0 = seqs[0].logprobs.output  # type: ignore[union-attr]
    assert math.isclose(out0.token_logprobs[0], want0[9].item(), rel_tol=1e-6)
    assert out0.top_ids[0] == want0.topk(3).indices.tolist()
    assert torch.allclose(torch.tensor(out0.top_logprobs[0]), want0.topk(3).values)
    assert torch.allclose(torch.tensor(out0.requested_logprobs[0]), want0[[5, 7]])
    assert seqs[1].logprobs is None
    out2 = seqs[2].logprobs.output  # type: ignore[union-attr]
    assert math.isclose(out2.token_logprobs[0], x[2].log_softmax(-1)[11].item(), rel_tol=1e-6)
    assert out2.top_ids == [] and out2.requested_logprobs == []


def test_a_redone_sample_overwrites_its_slot() -> None:
    state = LogprobState(LogprobRequest(top_n=1), num_prompt_tokens=3)
    state.set_output(0, -1.0, ([4], [-1.0]), None)
    state.set_output(1, -2.0, ([5], [-0.5]), None)
    state.set_output(1, -3.0, ([6], [-0.1]), None)  # index 1 sampled again
    assert state.output.token_logprobs == [-1.0, -3.0]
    assert state.output.top_ids == [[4], [6]]
    assert state.output_slice(1, 2).token_logprobs == [-3.0]


# -- prompt logprobs -------------------------------------------------------------------------


def prefill(seqs: list[Sequence], starts: list[int]) -> tuple[torch.Tensor, list[Span]]:
    """Hidden states for tokens [start, len) of each sequence, and their spans."""
    positions, last, n = [], [], 0
    for s, start in zip(seqs, starts, strict=True):
        positions += list(range(start, len(s)))
        n += len(s) - start
        last.append(n - 1)
    hidden = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(n))
    return hidden, step_spans(torch.tensor(positions), torch.tensor(last))


def test_prompt_logprobs_from_start_len_are_raw_log_softmax_of_the_previous_position() -> None:
    prompt = [3, 14, 15, 9, 26, 5]
    lr = LogprobRequest(start_len=2, top_n=2, token_ids=[1])
    s = seq(lr, prompt, temperature=0.3, repetition_penalty=2.0)  # neither applies to prompts
    hidden, spans = prefill([s], [0])
    record_input_logprobs(compute_logits, hidden, [s], spans)
    want = compute_logits(hidden).log_softmax(-1)  # row p predicts token p + 1
    inp = s.logprobs.input  # type: ignore[union-attr]
    assert inp is not None
    expected = [want[t - 1, prompt[t]].item() for t in range(2, 6)]
    assert torch.allclose(torch.tensor(inp.token_logprobs), torch.tensor(expected))
    assert inp.top_ids == [want[t - 1].topk(2).indices.tolist() for t in range(2, 6)]
    requested = [[want[t - 1, 1].item()] for t in range(2, 6)]
    assert torch.allclose(torch.tensor(inp.requested_logprobs), torch.tensor(requested))


def test_start_len_zero_starts_at_token_one_and_chunks_add_up() -> None:
    prompt = list(range(10, 22))
    one = seq(LogprobRequest(start_len=0), prompt)
    hidden, spans = prefill([one], [0])
    record_input_logprobs(compute_logits, hidden, [one], spans)
    whole = one.logprobs.input.token_logprobs  # type: ignore[union-attr]
    assert len(whole) == len(prompt) - 1  # token 0 has no context

    # The same prompt in two chunks, positions [0, 5) then [5, 12) (chunked prefill).
    two = seq(LogprobRequest(start_len=0), prompt)
    record_input_logprobs(compute_logits, hidden[:5], [two], [Span(0, 4, 0, 4)])
    record_input_logprobs(compute_logits, hidden[5:], [two], [Span(0, 6, 5, 11)])
    chunked = two.logprobs.input.token_logprobs  # type: ignore[union-attr]
    assert torch.allclose(torch.tensor(chunked), torch.tensor(whole))
    assert two.logprobs.next_input_token == len(prompt)  # type: ignore[union-attr]
    # A recompute (preemption) over prompt + output adds nothing.
    two.append_token(1)
    h3, s3 = prefill([two], [0])
    record_input_logprobs(compute_logits, h3, [two], s3)
    assert two.logprobs.input.token_logprobs == chunked  # type: ignore[union-attr]


def test_prompt_positions_in_a_cached_prefix_are_nan() -> None:
    prompt = list(range(10, 20))
    s = seq(LogprobRequest(start_len=1, top_n=1), prompt)
    hidden, spans = prefill([s], [4])  # positions 0..3 came from the prefix cache
    record_input_logprobs(compute_logits, hidden, [s], spans)
    inp = s.logprobs.input  # type: ignore[union-attr]
    assert inp is not None and len(inp.token_logprobs) == 9  # tokens 1..9
    assert all(math.isnan(v) for v in inp.token_logprobs[:4])  # tokens 1..4
    assert not any(math.isnan(v) for v in inp.token_logprobs[4:])
    assert inp.top_ids[:4] == [[]] * 4 and all(len(t) == 1 for t in inp.top_ids[4:])


def test_embedding_is_the_normalised_last_prompt_state() -> None:
    a = Sequence("a", [1, 2, 3], SamplingParams(), embed=True)
    b = Sequence("b", [4, 5], SamplingParams())
    hidden, spans = prefill([a, b], [0, 0])
    record_embeddings(hidden, [a, b], spans)
    assert a.embedding is not None and b.embedding is None
    want = hidden[2] / hidden[2].norm()
    assert torch.allclose(torch.tensor(a.embedding), want)

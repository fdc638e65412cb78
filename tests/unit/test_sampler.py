"""Batched logit processing and sampling on tensors: each SGLang sampling parameter's effect."""

from __future__ import annotations

import math

import torch

from shared.protocol import SamplingParams
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine.sampler import process_logits, sample

EOS = 2


def logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def seq(
    params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None
) -> Sequence:
    s = Sequence("r", prompt or [0], params)
    for t in output or []:
        s.append_token(t)
    return s


def rows(params: SamplingParams, n: int, index: int = 0) -> list[Sequence]:
    """n sequences with `params` whose next token is output index `index`."""
    return [seq(params, output=[0] * index) for _ in range(n)]


def draws(x: torch.Tensor, params: SamplingParams, n: int = 200) -> set[int]:
    """The tokens drawn from row 0 of `x` over n seeded draws."""
    return {sample(x, [seq(params, output=[0] * i)])[0] for i in range(n)}


def probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


# -- sampling --------------------------------------------------------------------------------


def test_temperature_zero_is_argmax() -> None:
    x = logits()
    assert sample(x, rows(SamplingParams(temperature=0), 4)) == x.argmax(-1).tolist()


def test_greedy_takes_the_first_of_equal_maxima() -> None:
    """As argmax does (and Hugging Face's greedy search): the lowest token id of a tie."""
    x = torch.zeros(3, 49152)
    x[0, [7, 300, 40000]] = 1.0
    x[1, [48000, 12]] = 2.0
    greedy = rows(SamplingParams(temperature=0), 3)
    assert sample(x, greedy) == [7, 12, 0]


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    x = logits()
    greedy = x.argmax(-1).tolist()
    for i in range(5):
        assert sample(x, rows(SamplingParams(temperature=1.5, top_k=1), 4, i)) == greedy
        assert sample(x, rows(SamplingParams(temperature=1.5, top_p=1e-6), 4, i)) == greedy


def test_top_k_samples_only_among_the_k_best() -> None:
    x = logits(rows=1, vocab=1000)
    best = set(x[0].topk(3).indices.tolist())
    drawn = draws(x, SamplingParams(top_k=3, seed=5), 50)
    assert drawn <= best and len(drawn) > 1


def test_rows_keep_their_own_top_k_in_one_batch() -> None:
    x = logits(rows=1, vocab=1000).expand(3, -1).contiguous()
    batch = [
        seq(SamplingParams(top_k=2)),
        seq(SamplingParams(temperature=0)),
        seq(SamplingParams()),
    ]
    best2 = set(x[0].topk(2).indices.tolist())
    picks = [sample(x, batch) for _ in range(40)]
    assert {p[0] for p in picks} <= best2
    assert {p[1] for p in picks} == {int(x[0].argmax())}
    assert len({p[2] for p in picks} - best2) > 0  # the unrestricted row goes beyond


def test_top_p_keeps_the_nucleus() -> None:
    x = probs_logits([0.5, 0.3, 0.15, 0.05])
    # Mass before token 2 is 0.8 > 0.7: only tokens 0 and 1 (0.5 + 0.3 covers 0.7).
    assert draws(x, SamplingParams(top_p=0.7, seed=1)) == {0, 1}
    assert draws(x, SamplingParams(top_p=0.85, seed=1)) == {0, 1, 2}
    assert draws(x, SamplingParams(top_p=1.0, seed=1), 400) == {0, 1, 2, 3}


def test_min_p_filters_tokens_below_a_fraction_of_the_best() -> None:
    x = probs_logits([0.5, 0.3, 0.15, 0.05])
    assert draws(x, SamplingParams(min_p=0.2, seed=3)) == {0, 1, 2}  # floor 0.1
    assert draws(x, SamplingParams(min_p=0.5, seed=3)) == {0, 1}  # floor 0.25
    assert draws(x, SamplingParams(min_p=0.0, seed=3), 400) == {0, 1, 2, 3}


def test_temperature_sharpens_and_flattens() -> None:
    x = probs_logits([0.6, 0.4])
    cold = [
        sample(x, [seq(SamplingParams(temperature=0.05, seed=9), output=[0] * i)])[0]
        for i in range(100)
    ]
    hot = [
        sample(x, [seq(SamplingParams(temperature=5.0, seed=9), output=[0] * i)])[0]
        for i in range(100)
    ]
    assert cold.count(0) >= 99
    assert 30 < hot.count(0) < 70


def test_a_seeded_row_does_not_depend_on_its_batch() -> None:
    x = logits(rows=3, vocab=1000)
    seeded = SamplingParams(temperature=0.8, seed=1234, top_p=0.95, min_p=0.01)
    alone = [sample(x[1:2], [seq(seeded, output=[0] * i)])[0] for i in range(20)]
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0)]
    batched = [
        sample(x, [seq(others[0]), seq(seeded, output=[0] * i), seq(others[1])])[1]
        for i in range(20)
    ]
    assert alone == batched and len(set(alone)) > 1


def test_different_seeds_draw_differently() -> None:
    x = logits(rows=1, vocab=1000)
    assert draws(x, SamplingParams(seed=1), 20) != draws(x, SamplingParams(seed=2), 20)


# -- logit processing ------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    x = torch.tensor([[2.0, -1.0, 3.0, -4.0, 0.5, 1.0]])
    s = seq(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[3, 3])
    out = process_logits(x, [s], frozenset())
    # 0 and 1 in the prompt, 3 in the output (counted once); 2, 4, 5 unseen.
    assert out.tolist() == [[1.0, -2.0, 3.0, -8.0, 0.5, 1.0]]
    below_one = process_logits(
        x, [seq(SamplingParams(repetition_penalty=0.5), prompt=[0])], frozenset()
    )
    assert below_one[0, 0].item() == 4.0  # < 1 encourages repetition


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    x = torch.zeros(1, 10)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    s = seq(params, prompt=[8, 8], output=[7, 7, 7, 9])
    out = process_logits(x, [s], frozenset())[0]
    assert out[7].item() == -(3 * 0.5 + 0.25)
    assert out[9].item() == -(1 * 0.5 + 0.25)
    assert out[8].item() == 0.0  # the prompt does not count (OpenAI)
    assert out.count_nonzero().item() == 2
    negative = process_logits(
        x, [seq(SamplingParams(presence_penalty=-1.0), output=[4])], frozenset()
    )
    assert negative[0, 4].item() == 1.0


def test_logit_bias_forces_and_bans_tokens() -> None:
    x = logits(rows=2, vocab=50)
    forced = SamplingParams(logit_bias={11: 100.0}, seed=4)
    banned_best = SamplingParams(temperature=0, logit_bias={int(x[1].argmax()): -math.inf})
    batch = [seq(forced), seq(banned_best)]
    out = process_logits(x, batch, frozenset())
    assert out[0, 11] == x[0, 11] + 100.0
    for _ in range(10):
        batch[0].append_token(0)
        tokens = sample(process_logits(x, batch, frozenset()), batch)
        assert tokens[0] == 11
        assert tokens[1] == int(x[1].topk(2).indices[1])


def test_min_new_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    x = torch.zeros(1, 10)
    x[0, EOS] = 10.0  # eos is the greedy choice
    params = SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=[5])
    s = seq(params, output=[1])
    out = process_logits(x, [s], frozenset({EOS}))
    assert out[0, EOS].item() == -math.inf and out[0, 5].item() == -math.inf
    assert sample(out, [s])[0] not in (EOS, 5)
    s.append_token(1)  # two output tokens: min_new_tokens reached
    out = process_logits(x, [s], frozenset({EOS}))
    assert torch.equal(out, x) and sample(out, [s]) == [EOS]


def test_unused_parameters_leave_logits_untouched() -> None:
    x = logits()
    out = process_logits(x, rows(SamplingParams(), 4, 3), frozenset({EOS}))
    assert torch.equal(out, x)


def test_draws_follow_the_distribution() -> None:
    x = probs_logits([0.5, 0.3, 0.15, 0.05])
    batch = [seq(SamplingParams()) for _ in range(2000)]
    counts = torch.bincount(torch.tensor(sample(x.expand(2000, -1), batch)), minlength=4)
    assert torch.allclose(counts / 2000, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.04)

"""Batched logit processing and sampling of one token per sequence (torch; runner side).

Every SGLang sampling parameter runs on [B, vocab] tensors; Python only loops over the
rows (or the token ids) that use a parameter, never over the vocabulary:

1. `process_logits`: the distribution a request samples from, before temperature —
   repetition penalty (HF/SGLang: a logit of a token already in the prompt or the output is
   divided by the penalty when positive, multiplied when negative), frequency and presence
   penalties (OpenAI: `logit -= count * frequency + (count > 0) * presence`, counts over the
   output only), `logit_bias` (added), and `min_new_tokens` (eos and `stop_token_ids` get
   -inf until that many tokens were generated; `ignore_eos` only changes the finish check).
2. `sample`: greedy rows (temperature 0) take the argmax; the others divide by their
   temperature, keep top-k, then the top-p nucleus of what top-k left (the most likely token
   always stays), drop tokens below min_p times the best probability, and draw by inverse
   CDF: one uniform number per row, located in the row's cumulative probabilities.

A request with a `seed` draws its number from a generator seeded by (seed, output index), so
its tokens depend on nothing else in the batch, and a recomputed or reclaimed request
continues exactly as it would have.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from shared.protocol import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15  # spreads (seed, index) pairs over the 64-bit seed space
NUCLEUS_CANDIDATES = 1024  # top-p looks among this many best tokens before sorting a row


class SamplingRow(Protocol):
    """What sampling reads of a sequence (workers.scheduler.core.sequence.Sequence has it)."""

    sampling: SamplingParams
    token_ids: list[int]  # prompt followed by the output so far
    num_prompt_tokens: int


def _output_len(row: SamplingRow) -> int:
    return len(row.token_ids) - row.num_prompt_tokens


# -- 1. logit processing ---------------------------------------------------------------------


def process_logits(
    logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: frozenset[int]
) -> torch.Tensor:
    """fp32 logits [B, vocab] with every row's penalties, bias and min_new_tokens mask
    (a new tensor when any applies: `logits` itself is left alone)."""
    if not any(_is_processed(row, eos_token_ids) for row in rows):
        return logits.float()
    logits = logits.to(torch.float32, copy=True)
    _repetition_penalty(logits, rows)
    _frequency_presence_penalties(logits, rows)
    _logit_bias(logits, rows)
    _min_new_tokens(logits, rows, eos_token_ids)
    return logits


def _is_processed(row: SamplingRow, eos_token_ids: frozenset[int]) -> bool:
    sp = row.sampling
    return bool(
        sp.repetition_penalty != 1.0
        or sp.frequency_penalty
        or sp.presence_penalty
        or sp.logit_bias
        or (_output_len(row) < sp.min_new_tokens and (eos_token_ids or sp.stop_token_ids))
    )


def _seen_pairs(
    rows: Sequence[SamplingRow], which: list[int], with_prompt: bool, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct (batch row, token id) pairs over the prompt + output (or the output only) of
    the rows `which`, with how often each occurs: work in tokens, not in rows x vocab."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    for r in which:
        row = rows[r]
        ids = row.token_ids if with_prompt else row.token_ids[row.num_prompt_tokens :]
        row_ids += [r] * len(ids)
        token_ids += ids
    device, vocab = logits.device, logits.shape[1]
    keys = torch.tensor(row_ids, device=device) * vocab + torch.tensor(token_ids, device=device)
    keys, counts = torch.unique(keys, return_counts=True)
    return keys // vocab, keys % vocab, counts.to(logits.dtype)


def _per_row(rows: Sequence[SamplingRow], name: str, like: torch.Tensor) -> torch.Tensor:
    values = [getattr(row.sampling, name) for row in rows]
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def _repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    which = [i for i, r in enumerate(rows) if r.sampling.repetition_penalty != 1.0]
    if not which:
        return
    row, token, _ = _seen_pairs(rows, which, True, logits)
    penalty = _per_row(rows, "repetition_penalty", logits)[row]
    seen = logits[row, token]
    logits[row, token] = torch.where(seen > 0, seen / penalty, seen * penalty)


def _frequency_presence_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    which = [
        i
        for i, r in enumerate(rows)
        if (r.sampling.frequency_penalty or r.sampling.presence_penalty) and _output_len(r)
    ]
    if not which:
        return
    row, token, counts = _seen_pairs(rows, which, False, logits)
    frequency = _per_row(rows, "frequency_penalty", logits)[row]
    presence = _per_row(rows, "presence_penalty", logits)[row]
    logits[row, token] -= counts * frequency + presence


def _logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    row_ids: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in row.sampling.logit_bias.items():
            row_ids.append(i)
            token_ids.append(int(token_id))
            biases.append(bias)
    if row_ids:
        device = logits.device
        logits.index_put_(
            (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device)),
            torch.tensor(biases, dtype=logits.dtype, device=device),
            accumulate=True,
        )


def _min_new_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: frozenset[int]
) -> None:
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        sp = row.sampling
        if _output_len(row) < sp.min_new_tokens:
            stops = eos_token_ids.union(sp.stop_token_ids)
            row_ids += [i] * len(stops)
            token_ids += sorted(stops)
    if row_ids:
        device = logits.device
        index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
        logits.index_put_(index, torch.tensor(-math.inf, device=device))


# -- 2. sampling -----------------------------------------------------------------------------


def effective_temperature(params: Sequence[SamplingParams], like: torch.Tensor) -> torch.Tensor:
    """Each row's temperature [B, 1]; greedy rows (temperature 0) count as 1."""
    t = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    return torch.tensor(t, dtype=like.dtype, device=like.device).unsqueeze(1)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """One token id per row of the processed `logits` [B, vocab]."""
    params = [r.sampling for r in rows]
    # max's indices: argmax's (the first of equal maxima, NaN wins alike), and faster than
    # argmax on the CPU (measured in bench/README.md)
    tokens = logits.max(dim=-1).indices
    drawn = [i for i, p in enumerate(params) if p.temperature > 0]
    if drawn:
        sub_params = [params[i] for i in drawn]
        sub = logits[drawn] / effective_temperature(sub_params, logits)
        sub = _min_p(_top_k_top_p(sub, sub_params), sub_params)
        uniform = _uniform(sub_params, [_output_len(rows[i]) for i in drawn], logits.device)
        tokens[drawn] = _inverse_cdf(sub.softmax(dim=-1), uniform)
    return tokens.tolist()


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Only the rows that use top-k or top-p are touched."""
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    which = [i for i, p in enumerate(params) if top_k[i] < vocab or p.top_p < 1.0]
    if which:
        top_p = [params[i].top_p if params[i].top_p < 1.0 else math.inf for i in which]
        logits[which] = _keep_best(logits[which], [top_k[i] for i in which], top_p)
    return logits


def _keep_best(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Top-k, then the top-p nucleus of what top-k left (the most likely token always stays).
    Both are found among the best candidates of one topk: the top-k, or NUCLEUS_CANDIDATES
    tokens, which hold the nucleus whenever their mass exceeds top_p; only a row where
    they do not (a flat distribution) is sorted whole."""
    device, vocab = logits.device, logits.shape[-1]
    limits = [k if k < vocab else min(NUCLEUS_CANDIDATES, vocab) for k in top_k]
    values, order = logits.topk(max(limits), dim=-1)  # sorted, best first
    k = torch.tensor(top_k, device=device).unsqueeze(1)
    values = values.masked_fill(torch.arange(values.shape[1], device=device) >= k, -math.inf)
    # top-p's probabilities: over the top-k survivors when top-k is set, else the vocabulary.
    has_k = k.squeeze(1) < vocab
    norm = torch.where(has_k, values.logsumexp(-1), logits.logsumexp(-1)).unsqueeze(1)
    probs = (values - norm).exp()
    p = torch.tensor(top_p, device=device, dtype=probs.dtype).unsqueeze(1)
    values = values.masked_fill(probs.cumsum(dim=-1) - probs > p, -math.inf)
    out = torch.full_like(logits, -math.inf).scatter(-1, order, values)
    uncovered = (~has_k & (probs.sum(-1) <= p.squeeze(1))).nonzero().squeeze(1).tolist()
    if uncovered:
        out[uncovered] = _sorted_top_p(logits[uncovered], p[uncovered])
    return out


def _sorted_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p of whole rows by a full sort (`top_p` [R, 1])."""
    values, order = logits.sort(dim=-1, descending=True)
    probs = values.softmax(-1)
    values = values.masked_fill(probs.cumsum(-1) - probs > top_p, -math.inf)
    return torch.full_like(logits, -math.inf).scatter(-1, order, values)


def _min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the best one's:
    p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)."""
    which = [i for i, p in enumerate(params) if p.min_p > 0]
    if which:
        sub = logits[which]
        log_min_p = [math.log(min(params[i].min_p, 1.0)) for i in which]
        floor = torch.tensor(log_min_p, device=logits.device)
        threshold = sub.max(dim=-1, keepdim=True).values + floor.unsqueeze(1)
        logits[which] = torch.where(sub < threshold, -math.inf, sub)
    return logits


def _uniform(
    params: list[SamplingParams], output_index: list[int], device: torch.device
) -> torch.Tensor:
    """One uniform number in [0, 1) per row; a seeded row's comes from its own generator,
    keyed by (seed, output index)."""
    uniform = torch.rand(len(params), dtype=torch.float64, device=device)
    for row, (p, index) in enumerate(zip(params, output_index, strict=True)):
        if p.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed((p.seed * _GOLDEN + index) % 2**64)
            uniform[row] = torch.rand(1, generator=generator, dtype=torch.float64, device=device)
    return uniform


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Token i of each row with probability probs[i]: the first index whose cumulative
    probability exceeds uniform * total. fp64, so a zero-probability token (its cumulative
    sum equals its predecessor's) is never the first to exceed it."""
    cdf = probs.double().cumsum(dim=-1)
    target = (uniform * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max_(probs.shape[1] - 1)

"""What a model step yields besides the sampled tokens: logprobs and embeddings (torch).

Which distribution the logprobs describe (SGLang's defaults):
- Output tokens: `log_softmax(processed_logits / temperature)`, where the processed logits
  carry the penalties, logit_bias and min_new_tokens mask (`sampler.process_logits`) and a
  greedy request counts as temperature 1. It is the distribution the token was drawn from
  before top-k / top-p / min-p truncation, so it never depends on the rest of the batch.
  (SGLang also renormalises over the top-p nucleus when a batch samples; we do not.)
- Prompt tokens (from LogprobRequest.start_len): `log_softmax` of the model's raw logits —
  there is nothing to process on a prompt (SGLang's temp_scaled_logprobs=False).
- Top-n: the n best of that same distribution; requested ids: its values at those ids.
Embeddings (GenerateJob.embed): the last prompt token's final hidden state (after the final
norm), L2-normalised — SGLang's pooling for generative models (LAST, normalize=True).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine.sampler import effective_temperature

# Prompt rows whose [rows, vocab] logits are materialised at once (≈100 MB at 49k vocab).
INPUT_CHUNK_ROWS = 512


@dataclass(frozen=True)
class Span:
    """The new tokens of one sequence in a step: flat rows first_row..last_row hold the
    positions first_pos..last_pos."""

    first_row: int
    last_row: int
    first_pos: int
    last_pos: int


def step_spans(positions: torch.Tensor, last_index: torch.Tensor) -> list[Span]:
    """Per sequence, where its new tokens sit in the step (each one's are contiguous)."""
    pos, last = positions.tolist(), last_index.tolist()
    spans, first = [], 0
    for row in last:
        spans.append(Span(first, row, pos[row] - (row - first), pos[row]))
        first = row + 1
    return spans


def wants_prompt_outputs(seq: Sequence) -> bool:
    """Whether the sequence still needs something from its prompt positions."""
    lp = seq.logprobs
    return seq.embed or (lp is not None and lp.next_input_token < seq.num_prompt_tokens)


# -- output logprobs -------------------------------------------------------------------------


def record_output_logprobs(
    logits: torch.Tensor, seqs: list[Sequence], token_ids: list[int]
) -> None:
    """Store each sampled token's logprobs (rows of the processed `logits` [B, vocab])."""
    which = [i for i, seq in enumerate(seqs) if seq.logprobs is not None]
    if not which:
        return
    sub = logits[which]
    lp = (sub / effective_temperature([seqs[i].sampling for i in which], sub)).log_softmax(-1)
    chosen = torch.tensor([token_ids[i] for i in which], device=lp.device)
    values = lp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    states = [seqs[i].logprobs for i in which]
    tops = _top(lp, [s.request.top_n for s in states if s is not None])
    requested = _requested(lp, [s.request.token_ids for s in states if s is not None])
    for j, i in enumerate(which):
        state = states[j]
        assert state is not None
        state.set_output(seqs[i].num_completion_tokens, values[j], tops[j], requested[j])


def _top(lp: torch.Tensor, top_n: list[int]) -> list[tuple[list[int], list[float]] | None]:
    """The top_n[i] best (ids, logprobs) of row i (None where top_n is 0)."""
    k = min(max(top_n, default=0), lp.shape[1])
    if k <= 0:
        return [None] * len(top_n)
    best = lp.topk(k, dim=-1)
    ids, values = best.indices.tolist(), best.values.tolist()
    return [(ids[i][:n], values[i][:n]) if n > 0 else None for i, n in enumerate(top_n)]


def _requested(lp: torch.Tensor, token_ids: list[list[int]]) -> list[list[float] | None]:
    return [lp[i, ids].tolist() if ids else None for i, ids in enumerate(token_ids)]


# -- prompt logprobs -------------------------------------------------------------------------


def record_input_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    seqs: list[Sequence],
    spans: list[Span],
) -> None:
    """Logprobs of the prompt tokens that this step's positions predict (position p predicts
    token p + 1), for every sequence that asked for them and lacks them."""
    for seq, span in zip(seqs, spans, strict=True):
        state = seq.logprobs
        if state is None or state.input is None:
            continue
        first = max(state.next_input_token, span.first_pos + 1, state.input_start)
        end = min(span.last_pos + 2, seq.num_prompt_tokens)  # tokens first..end-1
        if first >= end:
            continue
        rows = torch.arange(first - 1, end - 1, device=hidden.device)
        rows += span.first_row - span.first_pos
        targets = torch.tensor(seq.token_ids[first:end], device=hidden.device)
        for start in range(0, len(rows), INPUT_CHUNK_ROWS):
            chunk = slice(start, start + INPUT_CHUNK_ROWS)
            lp = compute_logits(hidden[rows[chunk]]).log_softmax(-1)
            values = lp.gather(1, targets[chunk].unsqueeze(1)).squeeze(1).tolist()
            n = len(values)
            tops = _top(lp, [state.request.top_n] * n)
            requested = _requested(lp, [state.request.token_ids] * n)
            state.add_input(
                first + start,
                values,
                _columns(tops) if state.request.top_n > 0 else None,
                [r for r in requested if r is not None] if state.request.token_ids else None,
            )


def _columns(
    tops: list[tuple[list[int], list[float]] | None],
) -> tuple[list[list[int]], list[list[float]]]:
    return [t[0] for t in tops if t], [t[1] for t in tops if t]


# -- embeddings ------------------------------------------------------------------------------


def record_embeddings(hidden: torch.Tensor, seqs: list[Sequence], spans: list[Span]) -> None:
    """An embedding job's vector, once its prefill reached the last prompt token."""
    for seq, span in zip(seqs, spans, strict=True):
        if seq.embed and span.last_pos == seq.num_prompt_tokens - 1:
            seq.embedding = F.normalize(hidden[span.last_row].float(), dim=-1).tolist()

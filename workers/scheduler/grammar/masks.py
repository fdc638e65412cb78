"""The constrained rows of a step's logits, masked to what their grammars allow next: one
bitmask for the batch, filled by one xgrammar call over all the batch's matchers, applied in
place before sampling (greedy and sampled rows alike).

A row where nothing is left (its grammar allows only eos while `min_new_tokens` still
forbids it) takes the grammar's tokens: the output must stay valid.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class ConstrainedRow(Protocol):
    grammar: Any  # grammar.constraint.Constraint or None


@functools.cache
def _batch_matcher() -> Any:
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(max_threads=1)


def apply_grammars(logits: torch.Tensor, rows: Sequence[ConstrainedRow]) -> None:
    """Mask `logits` [B, vocab] in place, row i by rows[i]'s grammar (if it has one)."""
    which = [
        i for i, row in enumerate(rows)
        if row.grammar is not None and not row.grammar.matcher().is_terminated()
    ]  # fmt: skip
    if not which:
        return
    import xgrammar as xgr

    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    matchers = [rows[i].grammar.matcher() for i in which]
    _batch_matcher().batch_fill_next_token_bitmask(matchers, bitmask, indices=which)
    bitmask = bitmask.to(logits.device)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=which)
    stuck = [i for i in which if torch.isneginf(logits[i]).all()]
    if stuck:  # only what the grammar allows, equally likely (see the module docstring)
        logits[stuck] = 0.0
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=stuck)

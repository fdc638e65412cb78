"""The constrained rows of a step's logits, masked to what their grammars allow next: one
bitmask for the batch, filled by one xgrammar call over all the batch's matchers, applied in
place before sampling (greedy and sampled rows alike).

The fill runs on a worker thread while the model computes the step (`start` before the
forward, `apply` after it): the matchers only change in postprocess, after the step, and
xgrammar releases the GIL. A grammar with bounded repetitions (a string's maxLength) makes
the fill cost milliseconds per row, which this hides behind the forward where cores allow.

A row where nothing is left (its grammar allows only eos while `min_new_tokens` still
forbids it) takes the grammar's tokens: the output must stay valid.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class ConstrainedRow(Protocol):
    grammar: Any  # grammar.constraint.Constraint or None


@dataclass
class Masks:
    bitmask: torch.Tensor  # [rows, ceil(vocab / 32)] int32, the constrained rows filled
    which: list[int]  # the constrained rows


class GrammarMasks:
    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._matcher: Any = None
        self._guidance: Any = None  # llguidance's batch executor

    def start(self, rows: Sequence[ConstrainedRow], vocab: int) -> Future[Masks | None] | None:
        """Begin filling the masks of `rows` (the step's sampling rows, in order); None when
        none is constrained."""
        which = [
            i for i, row in enumerate(rows)
            if row.grammar is not None and not row.grammar.is_terminated()
        ]  # fmt: skip
        if not which:
            return None
        if self._pool is None:
            import xgrammar as xgr

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
            self._matcher = xgr.BatchGrammarMatcher(max_threads=1)
        xgr_rows = [i for i in which if rows[i].grammar.backend == "xgrammar"]
        llg_rows = [i for i in which if rows[i].grammar.backend == "llguidance"]
        groups = (
            ([rows[i].grammar.matcher() for i in xgr_rows], xgr_rows),
            ([rows[i].grammar.matcher() for i in llg_rows], llg_rows),
        )
        return self._pool.submit(self._fill, groups, which, len(rows), vocab)

    def _fill(self, groups: Any, which: list[int], num_rows: int, vocab: int) -> Masks:
        """One batch call per backend: xgrammar's rows, then llguidance's."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(num_rows, vocab)
        (xgr_matchers, xgr_rows), (llg_matchers, llg_rows) = groups
        if xgr_rows:
            self._matcher.batch_fill_next_token_bitmask(xgr_matchers, bitmask, indices=xgr_rows)
        if llg_rows:
            import llguidance
            import llguidance.torch

            if self._guidance is None:
                self._guidance = llguidance.LLExecutor(num_threads=1)
            rows = list(zip(llg_matchers, llg_rows, strict=True))
            llguidance.torch.fill_next_token_bitmask_par(self._guidance, rows, bitmask)
        return Masks(bitmask, which)


def apply_masks(logits: torch.Tensor, pending: Future[Masks | None] | None) -> None:
    """Mask `logits` [rows, vocab] in place with the masks `GrammarMasks.start` filled."""
    masks = pending.result() if pending is not None else None
    if masks is None:
        return
    import xgrammar as xgr

    vocab = logits.shape[-1]
    bitmask = masks.bitmask.to(logits.device)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=masks.which)
    dead = torch.isneginf(logits[masks.which]).all(dim=-1).nonzero().squeeze(1).tolist()
    stuck = [masks.which[i] for i in dead]
    if stuck:  # only what the grammar allows, equally likely (see the module docstring)
        logits[stuck] = 0.0
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=stuck)

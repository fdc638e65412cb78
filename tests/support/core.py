"""Driving the pure scheduler core: requests join at given steps, a runner (a real model
runner or a fake one) computes each scheduled batch, until every request finished."""

from __future__ import annotations

from collections.abc import Callable

from workers.scheduler.core.scheduler import Scheduler
from workers.scheduler.core.sequence import Sequence

MAX_STEPS = 10_000


def drive(
    core: Scheduler,
    seqs: list[Sequence],
    run: Callable[[list[Sequence]], list[int]],
    arrivals: list[int] | None = None,
    check_batch: Callable[[list[Sequence]], None] | None = None,
) -> None:
    """Steps `core` until it is idle: sequence i joins at step `arrivals[i]` (default 0),
    `run` gives the next token of each scheduled sequence that samples, and `check_batch`
    (if any) sees every scheduled batch before it runs."""
    arrivals = arrivals or [0] * len(seqs)
    step = 0
    while step <= max(arrivals) or not core.is_idle:
        for seq, arrival in zip(seqs, arrivals, strict=True):
            if arrival == step:
                assert core.add(seq) is None, seq.rid
        batch = core.schedule()
        if check_batch is not None:
            check_batch(batch)
        core.postprocess(batch, run(batch) if batch else [])
        step += 1
        assert step < MAX_STEPS, "the core never went idle"

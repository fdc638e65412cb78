"""One request's logprobs as the engine's entries arrive (the listener appends them; the
routes shape them through logprobs.py). A non-finite value (a -inf logprob) is kept as None."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

from shared import protocol

T = TypeVar("T")
Value = float | None


def finite(value: float) -> Value:
    return value if math.isfinite(value) else None


def fit(values: Sequence[T], n: int, fill: T) -> list[T]:
    """`values` cut or padded (at the end) to n positions."""
    out = list(values[:n])
    out.extend([fill] * (n - len(out)))
    return out


def align_end(values: Sequence[T], n: int, fill: T) -> list[T]:
    """The last n of `values`, padded at the front: prompt logprobs run to the prompt's end,
    and the first prompt position has none."""
    out = list(values[-n:]) if n else []
    return [fill] * (n - len(out)) + out


class LogprobLog:
    """Output logprobs of one request, one position per output id (appended by the listener),
    and its prompt logprobs (from the first entry)."""

    def __init__(self) -> None:
        self.values: list[Value] = []
        self.top_ids: list[list[int]] = []
        self.top_values: list[list[Value]] = []
        self.requested: list[list[Value]] = []
        self.input: protocol.Logprobs | None = None

    def extend(self, lp: protocol.Logprobs | None, n: int) -> None:
        """Add n positions; missing data (an engine that sent less) becomes nulls."""
        lp = lp or protocol.Logprobs()
        self.values.extend(fit([finite(v) for v in lp.token_logprobs[:n]], n, None))
        self.top_ids.extend(fit(lp.top_ids, n, []))
        tops = [[finite(v) for v in row] for row in lp.top_logprobs[:n]]
        self.top_values.extend(fit(tops, n, []))
        req = [[finite(v) for v in row] for row in lp.requested_logprobs[:n]]
        self.requested.extend(fit(req, n, []))

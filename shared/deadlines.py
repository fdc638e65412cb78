"""Request deadlines: a request may carry `timeout` (seconds); the api sets
GenerateJob.deadline = created_at + timeout, and whichever tier finds it late (a scheduler
taking the job or stepping it, the api's waiter) ends it with the same error."""

from __future__ import annotations

from shared.protocol import FinishReason

# Gateway Timeout, as for a request that saw no output for REQUEST_TIMEOUT_S.
DEADLINE_STATUS = 504
# The api ends a late request itself this long after its deadline: a scheduler that holds
# it ends it first, with its output so far.
API_GRACE_S = 1.0


def deadline_of(created_at: float, timeout_s: float | None) -> float:
    """The unix time a request started at `created_at` ends at (0 = no deadline)."""
    return created_at + timeout_s if timeout_s else 0.0


def is_past(deadline: float, now: float) -> bool:
    return bool(deadline) and now >= deadline


def message(timeout_s: float) -> str:
    return f"The request exceeded its timeout of {round(timeout_s, 3):g} s."


def exceeded(timeout_s: float) -> FinishReason:
    """How a request past its deadline ends (an abort with a 504)."""
    return FinishReason(type="abort", message=message(timeout_s), status_code=DEADLINE_STATUS)

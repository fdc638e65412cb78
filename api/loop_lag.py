"""How late this replica's event loop runs what is due: the overshoot of a short sleep,
sampled every EVERY_S, the worst over the last WINDOW_S; overloaded when two samples in a
row ran OVERLOAD_LAG_S late.

An overloaded replica (more streams than one core serves) runs everything late, its Redis
replies included: a call bounded by REDIS_TIMEOUT_S then times out with Redis healthy. So
while the loop lags past OVERLOAD_LAG_S, new requests are refused at once with a 503 that
says so (before any Redis work: the streams already open keep the core), and a timed-out
heartbeat is not taken for a Redis outage (which would fail every request held here)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

EVERY_S = 0.05
WINDOW_S = 2.0
OVERLOAD_LAG_S = 0.5  # under api.redis_errors.REDIS_TIMEOUT_S (0.9 s)


class LoopLag:
    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque()  # (monotonic time, lag)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="api-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def observe(self, lag_s: float, now: float) -> None:
        self._samples.append((now, lag_s))
        while self._samples and self._samples[0][0] < now - WINDOW_S:
            self._samples.popleft()

    def lag_s(self, now: float | None = None) -> float:
        """The worst lag seen in the last WINDOW_S."""
        since = (time.monotonic() if now is None else now) - WINDOW_S
        return max((lag for at, lag in self._samples if at >= since), default=0.0)

    def overloaded(self, now: float | None = None) -> bool:
        """The last two samples (in the window) both ran late: a lasting overload, not one
        hiccup (a collection, a blocking call)."""
        since = (time.monotonic() if now is None else now) - WINDOW_S
        last = list(self._samples)[-2:]
        return len(last) == 2 and all(at >= since and lag >= OVERLOAD_LAG_S for at, lag in last)

    async def _run(self) -> None:
        while True:
            due = time.monotonic() + EVERY_S
            await asyncio.sleep(EVERY_S)
            now = time.monotonic()
            self.observe(max(0.0, now - due), now)

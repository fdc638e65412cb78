"""A scheduler's way through a weight update (no Redis: the loop writes what it reports).

When FleetControl has weights to switch to (with mode `rolling`: once this scheduler holds
the fleet's turn), the update starts: no new jobs; the running requests go on for up to
`drain_s` (at once when paused), then what is still running is retracted to the waiting
queue (KV freed: recomputed with the new weights). With nothing running, the runner loads
the new weights in a thread while the loop keeps beating; then the prefix cache is
emptied (its K/V came from the old weights) and the result ("ok" or why not) is reported.
A failed load keeps the old weights, and that version is not tried again here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from shared.fleet_control import Weights
from workers.scheduler.control import FleetControl
from workers.scheduler.core.scheduler import Scheduler

logger = logging.getLogger(__name__)

OK = "ok"


class Reloadable(Protocol):
    def reload(self, model_path: str) -> None:
        """Load `model_path`'s weights in place of the current ones (nothing running);
        raise, keeping the current ones, if they cannot be loaded."""
        ...


class Updater:
    def __init__(
        self, control: FleetControl, core: Scheduler, runner: Any, drain_s: float
    ) -> None:
        self.control, self.core, self.runner, self.drain_s = control, core, runner, drain_s
        self.update: Weights | None = None  # the weights being switched to
        self.has_turn = False  # this scheduler holds the rolling update's turn
        self.reports: list[tuple[str, str]] = []  # (weight_version, result) to write
        self.turn_done = False  # the turn is to be given back
        self._task: asyncio.Task[None] | None = None
        self._drain_until = 0.0

    @property
    def wants_turn(self) -> bool:
        """A rolling update waits for this scheduler's turn."""
        pending = self.control.pending_update()
        return self.update is None and pending is not None and pending.mode == "rolling"

    @property
    def may_take_jobs(self) -> bool:
        return self.update is None

    @property
    def loading(self) -> bool:
        return self._task is not None

    def plan(self, now: float, stopping: bool) -> None:
        """Start the pending update, or drop one overtaken before its load began."""
        pending = self.control.pending_update()
        if self.update is not None and self._task is None and pending != self.update:
            logger.info("weights %s no longer wanted", self.update.weight_version)
            self.update = None
        if self.update is not None or pending is None or stopping:
            return
        if pending.mode == "rolling" and not self.has_turn:
            return
        logger.info("updating weights to %s (%s, %s): draining %d requests",
                    pending.weight_version, pending.model_path, pending.mode,
                    len(self.core.running))  # fmt: skip
        self.update, self._drain_until = pending, now + self.drain_s

    def advance(self, now: float, paused: bool, flushed: bool) -> None:
        """Once drained (or out of time), retract the rest; once nothing is unpublished
        (`flushed`), start the load."""
        if self.update is None or self._task is not None:
            return
        if self.core.running and now < self._drain_until and not paused:
            return
        if self.core.running:
            logger.info("retracting %d requests for the weight update", self.core.retract_all())
        if not flushed:
            return
        path = self.update.model_path
        self._task = asyncio.get_running_loop().create_task(asyncio.to_thread(self._load, path))

    def _load(self, model_path: str) -> None:
        reload = getattr(self.runner, "reload", None)
        if reload is None:
            raise RuntimeError("this model runner cannot load new weights")
        reload(model_path)

    async def wait(self, timeout_s: float) -> None:
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=timeout_s)

    def collect(self) -> bool:
        """After a load ended: switch (or not) and queue the report. True if one ended."""
        task, update = self._task, self.update
        if task is None or update is None or not task.done():
            return False
        self._task = self.update = None
        error = task.exception()
        if error is None:
            self.control.loaded_new(update)
            self.core.block_manager.reset_prefix_cache()
            logger.info("now serving weights %s (%s)", update.weight_version, update.model_path)
            self.reports.append((update.weight_version, OK))
        else:
            self.control.load_failed(update)
            logger.error("loading weights %s failed: %s", update.weight_version, error)
            self.reports.append((update.weight_version, f"{type(error).__name__}: {error}"))
        if self.has_turn:
            self.has_turn, self.turn_done = False, True
        return True

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

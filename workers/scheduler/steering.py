"""The scheduler loop's side of the fleet's control plane: it applies what FleetControl
heard (a prefix cache flush, a pause, a weight update) to the core, says whether the loop
may take jobs and step, and queues the control plane's part of each heartbeat transaction
(update results, the rolling turn, the reads that resync FleetControl with Redis).

Pause modes (SGLang's): `abort` ends every request here with finish_reason abort;
`retract` returns the running ones to the waiting queue with their KV freed (they are
recomputed from their tokens on continue, so greedy outputs do not change); `in_place`
freezes them with their KV. While paused no job is taken: new ones wait in the stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import redis.asyncio as aioredis

from shared import fleet_control, heartbeat, protocol
from shared.config import Settings
from shared.fleet_control import STARTED_VERSION, Weights
from workers.scheduler.control import FleetControl
from workers.scheduler.core.scheduler import Scheduler
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.updates import Updater

logger = logging.getLogger(__name__)

TURN_TTL_MS = 30_000  # a rolling update's turn outlives a holder that stopped beating by this
PAUSED_ABORT = protocol.FinishReason(
    type="abort", message="Generation was paused (pause_generation, mode abort)."
)


class Steering:
    def __init__(self, core: Scheduler, runner: Any, settings: Settings, model_path: str) -> None:
        self.core = core
        self.control = FleetControl(Weights(model_path, STARTED_VERSION))
        self.updater = Updater(self.control, core, runner, settings.scheduler.drain_s)
        self.paused: protocol.PauseMode | None = None  # the pause mode applied

    @property
    def may_take_jobs(self) -> bool:
        return self.paused is None and self.updater.may_take_jobs

    @property
    def may_step(self) -> bool:
        return self.paused is None and not self.updater.loading

    def beat(self, stopping: bool, gen_throughput: float) -> heartbeat.SchedulerBeat:
        """This scheduler as its heartbeat describes it: batch, KV, state, weights."""
        bm, loaded = self.core.block_manager, self.control.loaded
        return heartbeat.SchedulerBeat(
            num_running=len(self.core.running),
            num_waiting=len(self.core.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_total_blocks,
            state=self.state(stopping),
            model_path=loaded.model_path,
            weight_version=loaded.weight_version,
            gen_throughput=gen_throughput,
        )

    def state(self, stopping: bool) -> str:
        """What the heartbeat says this scheduler is doing."""
        if stopping:
            return "draining"
        if self.updater.update is not None:
            return "updating"
        return "paused" if self.paused else "ready"

    # -- between steps ---------------------------------------------------------------------
    def apply(self, stopping: bool, outbox: dict[str, Sequence]) -> bool:
        """Act on what changed; requests that a pause ended go to `outbox`. Returns whether
        the batch or the state changed (the loop then beats at once)."""
        if self.control.take_flush():
            num_cached = self.core.block_manager.reset_prefix_cache()
            logger.info("prefix cache flushed (%d blocks)", num_cached)
        changed = False
        if self.control.pause_mode != self.paused:
            self._enter_pause(self.control.pause_mode, outbox)
            changed = True
        was_updating = self.updater.update is not None
        self.updater.plan(time.monotonic(), stopping)
        return changed or was_updating != (self.updater.update is not None)

    def _enter_pause(self, mode: protocol.PauseMode | None, outbox: dict[str, Sequence]) -> None:
        self.paused = mode
        core = self.core
        if mode is None:
            logger.info("generation continues")
            return
        logger.info("generation paused (%s): %d running, %d waiting",
                    mode, len(core.running), len(core.waiting))  # fmt: skip
        if mode == "abort":
            for seq in core.abort([seq.rid for seq in core.unfinished], PAUSED_ABORT):
                outbox[seq.rid] = seq
        elif mode == "retract":
            core.retract_all()

    def advance(self, flushed: bool) -> bool:
        """Move a weight update on; True when a load just ended."""
        self.updater.advance(time.monotonic(), self.paused is not None, flushed)
        return self.updater.collect()

    async def idle(self, wait_s: float) -> None:
        """Paused or loading weights: wait a little for news instead of spinning."""
        if self.updater.loading:
            await self.updater.wait(wait_s)
        else:
            await asyncio.sleep(wait_s)

    # -- with each heartbeat ---------------------------------------------------------------
    def queue(self, pipe: aioredis.client.Pipeline, keys: Any, me: str) -> int:
        """Queue the update results, the rolling turn, then the reads of the control state.
        Returns the index of the first reply `took` wants."""
        updater = self.updater
        for version, result in updater.reports:
            fleet_control.report(pipe, keys, version, me, result)
        if updater.turn_done:
            fleet_control.give_turn(pipe, keys, me)
        at = len(pipe)
        if updater.wants_turn or updater.has_turn:
            fleet_control.take_turn(pipe, keys, me, TURN_TTL_MS)
        fleet_control.read(pipe, keys)
        return at

    def took(self, replies: list[Any]) -> None:
        """The replies from `queue`'s index on (its transaction went through)."""
        updater = self.updater
        updater.reports.clear()
        updater.turn_done = False
        if len(replies) == 3:
            updater.has_turn = bool(int(replies[0]))
        self.control.sync(fleet_control.decode(*replies[-2:]))

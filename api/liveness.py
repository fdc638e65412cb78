"""The api replica's background upkeep, one task ticking every TICK_S:

- heartbeat (kind API) every HEARTBEAT_EVERY_S, with a TTL refresh of its held-rid set; the
  beat is deleted on a clean stop so the others see the replica gone at once;
- the orphan reaper (api.orphans) every ORPHAN_SCAN_S;
- the soft watchdog (api.soft_watchdog): requests with no output for a while are logged;
- Redis outages: when Redis (the beat, or the result subscription) has been unreachable for
  `api.redis_outage_s`, every request in flight here ends with a 503 rather than hang; when it is
  back, the live requests ask for a resend of what they missed, and aborts that could not
  be written meanwhile are written."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

from api.aborts import Aborts
from api.host import Core
from api.loop_lag import LoopLag
from api.orphans import ORPHAN_SCAN_S, OrphanReaper
from api.redis_errors import REDIS_ERRORS, REDIS_TIMEOUT_S, is_oom
from api.result_listener import ResultListener
from api.soft_watchdog import SoftWatchdog
from shared import heartbeat, reattach
from shared.keys import HEARTBEAT_EVERY_S

logger = logging.getLogger(__name__)

TICK_S = 0.5


class Host(Core, Protocol):
    listener: ResultListener
    aborts: Aborts
    loop_lag: LoopLag


class Maintenance:
    def __init__(self, tm: Host) -> None:
        self.tm = tm
        self.reaper = OrphanReaper(tm)
        self.soft_watchdog = SoftWatchdog(tm)
        self.failing_since = 0.0  # monotonic time of the first failed beat (0 = beating)
        self._next_beat = 0.0
        self._next_scan = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="api-upkeep")

    async def stop(self) -> None:
        """Stop ticking and delete the beat (best effort)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        tm = self.tm
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                async with tm.redis.pipeline(transaction=False) as pipe:
                    heartbeat.forget(pipe, tm.keys, tm.api_id, heartbeat.API)
                    await pipe.execute()
        except REDIS_ERRORS as e:
            logger.warning("could not delete the heartbeat: %r", e)

    def down_for(self) -> float:
        """How long Redis has been unreachable, as far as this replica can tell (0 = up)."""
        now = time.monotonic()
        beat_down = now - self.failing_since if self.failing_since else 0.0
        return max(beat_down, self.tm.listener.down_for())

    def redis_down(self) -> bool:
        return self.down_for() > 0

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception as e:  # a tick never kills the loop
                logger.warning("upkeep tick failed: %r", e)
            await asyncio.sleep(TICK_S)

    async def tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_beat or self.failing_since:
            self._next_beat = now + HEARTBEAT_EVERY_S
            await self._beat()
        self._fail_if_outage()
        if self.failing_since:
            return
        await self.tm.aborts.retry_pending()
        if now >= self._next_scan:
            self._next_scan = now + ORPHAN_SCAN_S
            await self.reaper.scan()
        await self.soft_watchdog.tick()

    async def _beat(self) -> None:
        tm = self.tm
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                async with tm.redis.pipeline(transaction=False) as pipe:
                    heartbeat.beat(pipe, tm.keys, tm.api_id, heartbeat.Beat(), kind=heartbeat.API)
                    reattach.refresh(pipe, tm.keys, tm.api_id)
                    await pipe.execute()
        except REDIS_ERRORS as e:
            if isinstance(e, TimeoutError) and tm.loop_lag.overloaded():
                logger.warning("heartbeat timed out while the event loop ran %.1f s late: "
                               "overloaded, not a Redis outage", tm.loop_lag.lag_s())  # fmt: skip
                return
            if not is_oom(e):  # full, not gone: the EXPIREs still refreshed the keys
                if not self.failing_since:
                    logger.warning("Redis unreachable (heartbeat failed): %r", e)
                    self.failing_since = time.monotonic()
                return
        if self.failing_since:
            logger.info("Redis is back after %.1fs", time.monotonic() - self.failing_since)
            self.failing_since = 0.0
            tm.resync()

    def _fail_if_outage(self) -> None:
        tm = self.tm
        down = self.down_for()
        rids = [rid for rid, s in tm.rid_to_state.items() if not s.released]
        if down < tm.settings.api.redis_outage_s or not rids:
            return
        logger.error("Redis unreachable for %.1fs: failing %d requests", down, len(rids))
        tm.aborts.pending.update(rids)
        tm.aborts.finish_locally(rids, f"Redis has been unreachable for {down:.0f} s.", 503)

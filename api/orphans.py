"""Orphans (DESIGN §4.9): requests held by an api replica whose heartbeat is gone. Every
ORPHAN_SCAN_S a live replica SCANs the held-rid sets `api:{api_id}:rids`. A rid of a dead
replica (or one in this replica's own set that it holds no state for: a previous process
under the same api_id, a release that Redis refused) that is still held there orphan_grace_s
after this replica first saw it is aborted, unless a re-attach moved it meanwhile (the abort
is compare-and-set on the state's api_id). The set entries are dropped either way; a finished
request's result stays readable through GET /v1/requests/{rid} for the state TTL."""

from __future__ import annotations

import asyncio
import logging
import time

from api.host import Core
from api.redis_errors import REDIS_TIMEOUT_S
from shared import heartbeat, reattach

logger = logging.getLogger(__name__)

ORPHAN_SCAN_S = 2.0


class OrphanReaper:
    def __init__(self, tm: Core) -> None:
        self.tm = tm
        self.first_seen: dict[tuple[str, str], float] = {}  # (api_id, rid) -> monotonic

    async def scan(self) -> None:
        """One pass over every held-rid set (SCAN); abort the orphans past their grace."""
        tm = self.tm
        grace = tm.settings.api.orphan_grace_s
        async with asyncio.timeout(4 * REDIS_TIMEOUT_S):
            live = set(await heartbeat.live_workers(tm.redis, tm.keys, heartbeat.API))
            holders = await reattach.holders(tm.redis, tm.keys)
        now = time.monotonic()
        seen: set[tuple[str, str]] = set()
        for api_id in holders:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                orphans = await self._orphans(api_id, live)
            due = []
            for rid in orphans:
                key = (api_id, rid)
                seen.add(key)
                if now - self.first_seen.setdefault(key, now) >= grace:
                    due.append(rid)
            if due:
                async with asyncio.timeout(2 * REDIS_TIMEOUT_S):
                    await self._resolve(api_id, sorted(due))
        self.first_seen = {k: v for k, v in self.first_seen.items() if k in seen}

    async def _orphans(self, api_id: str, live: set[str]) -> set[str]:
        """A dead replica's held rids; for this replica, those it holds no state for (left
        by a previous process under this api_id, or by a release that Redis refused)."""
        tm = self.tm
        if api_id != tm.api_id and api_id in live:
            return set()
        rids = await reattach.held_rids(tm.redis, tm.keys, api_id)
        return rids - set(tm.rid_to_state) if api_id == tm.api_id else rids

    async def _resolve(self, api_id: str, rids: list[str]) -> None:
        tm = self.tm
        aborted = await reattach.abort_if_held(tm.redis, tm.keys, rids, api_id)
        async with tm.redis.pipeline(transaction=False) as pipe:
            reattach.drop(pipe, tm.keys, api_id, rids)
            await pipe.execute()
        for rid in aborted:
            logger.warning("orphan rid=%s of api %s not re-attached in time: aborted", rid,
                           api_id)  # fmt: skip
        if len(aborted) < len(rids):
            logger.info("%d rids of api %s ended or were re-attached", len(rids) - len(aborted),
                        api_id)  # fmt: skip

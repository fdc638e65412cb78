"""A running batch's lease (`batch:{id}:lease`, SET NX PX): one run at a time per batch, and
the sign the maintenance job reads to tell a live run from a dead one. The holder renews it
every BATCH_LEASE_S / 4; a renewal that finds the lease gone (Redis lost it, or another run
took the batch) cancels the run."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from shared.keys import BATCH_LEASE_S, Keys

logger = logging.getLogger(__name__)

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@contextlib.asynccontextmanager
async def batch_lease(r: aioredis.Redis, keys: Keys, batch_id: str) -> AsyncIterator[bool]:
    """Yields whether this run holds the batch; while it does, the lease is kept alive and
    the run is cancelled if it is lost."""
    key = keys.batch_lease(batch_id)
    token = secrets.token_hex(8)
    ttl_ms = int(BATCH_LEASE_S * 1000)
    if not await r.set(key, token, nx=True, px=ttl_ms):
        yield False
        return
    owner = asyncio.current_task()
    assert owner is not None

    async def renew() -> None:
        while True:
            await asyncio.sleep(BATCH_LEASE_S / 4)
            try:
                kept = await r.eval(_RENEW, 1, key, token, str(ttl_ms))  # type: ignore[misc]
            except Exception:  # noqa: BLE001 (Redis away: try again; the TTL is the bound)
                logger.warning("batch %s: could not renew its lease", batch_id, exc_info=True)
                continue
            if not kept:
                logger.error("batch %s: lease lost; stopping this run", batch_id)
                owner.cancel()
                return

    renewer = asyncio.create_task(renew())
    try:
        yield True
    finally:
        renewer.cancel()
        with contextlib.suppress(Exception):
            await r.eval(_RELEASE, 1, key, token)  # type: ignore[misc]

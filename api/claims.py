"""Fleet-wide unique request ids: a rid is claimed (SET NX `rs:rid:{rid}`, with a TTL) before any
state of its request exists, and released when the request ends (aborted ones keep the claim
while their abort marker lives); the release also drops the rid from this replica's held-rid
set (`api:{api_id}:rids`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import redis.asyncio as aioredis

from api.errors import BadRequest
from api.redis_errors import REDIS_ERRORS, REDIS_TIMEOUT_S, unavailable
from shared import reattach, request_state
from shared.keys import Keys

logger = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, None]], bool]


class RidClaims:
    def __init__(self, redis: aioredis.Redis, keys: Keys, api_id: str, spawn: Spawn) -> None:
        self.redis = redis
        self.keys = keys
        self.api_id = api_id
        self._spawn = spawn  # runs a release in the background

    async def claim(self, rids: list[str]) -> None:
        """Claim `rids` for this replica; a taken rid is a 400 "Duplicate request ID" and the
        claims made here are given back."""
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                async with self.redis.pipeline(transaction=False) as pipe:
                    request_state.claim(pipe, self.keys, rids, self.api_id)
                    results = await pipe.execute()
        except REDIS_ERRORS as e:
            logger.error("claim failed rid=%s: %r", rids[0], e)
            raise unavailable(e, "The request queue (Redis) is unavailable.") from e
        taken = [rid for rid, ok in zip(rids, results, strict=True) if not ok]
        if taken:
            self.release_soon([rid for rid, ok in zip(rids, results, strict=True) if ok], [])
            logger.info("duplicate rid=%s", taken[0])
            raise BadRequest(f"Duplicate request ID detected: {taken[0]}", param="rid")

    def release_soon(self, finished: list[str], aborted: list[str]) -> None:
        """Release in the background (one pipeline); a failure leaves the TTLs to clean up."""
        if finished or aborted:
            self._spawn(self._release(finished, aborted))

    async def _release(self, finished: list[str], aborted: list[str]) -> None:
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                async with self.redis.pipeline(transaction=False) as pipe:
                    request_state.release(pipe, self.keys, finished, aborted)
                    reattach.drop(pipe, self.keys, self.api_id, [*finished, *aborted])
                    await pipe.execute()
        except REDIS_ERRORS as e:
            rid = (finished or aborted)[0]
            logger.warning("could not release rid=%s (and %d more): %r", rid,
                           len(finished) + len(aborted) - 1, e)  # fmt: skip

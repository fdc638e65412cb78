"""Admission control at the api edge, before a request is tokenized (nothing accepted is
ever dropped: a refused request was never submitted).

1. The fleet-wide queue bound (SGLang's --max-queued-requests, `max_queued_requests`): the
   requests accepted but not yet running on any scheduler are the request streams'
   undelivered entries (per priority band, XLEN minus the group's pending count: finished
   jobs are XDEL'ed, so this holds on Redis 6.2 too) plus every live scheduler's
   `num_waiting` (its heartbeat). A replica reads that at most every REFRESH_S (one read at
   a time, shared by the requests that wait for it) and adds what it admitted itself since:
   those still being tokenized and those submitted after the read began. Above the bound:
   a 503 with Retry-After. Other replicas' admissions since the last read are not seen, so
   the fleet can go over by what they admit in REFRESH_S; a scheduler's waiting count is as
   fresh as its last beat.
2. Per API key (shared.limits): a token bucket and a cap on requests in flight, one Lua
   script for every replica; beyond either a 429 with Retry-After. One HTTP request takes
   one token and one slot, whatever its batch size or `n`. The slot is held while this
   replica waits for the request's outputs, renewed every RENEW_EVERY_S, and released when
   they end, however they end.

3. The replica's own load (api.loop_lag): while its event loop runs late, new requests
   get a 503 before any Redis work, so the streams already open keep the core.

The client of a request is the digest of its bearer key, which api.middleware.EdgeGuard
puts in CLIENT (a context variable: the route and the TokenizerManager run in the request's
task); without API keys configured, every request is shared.limits.ANONYMOUS."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from api.errors import ServiceUnavailable, TooManyRequests
from api.loop_lag import LoopLag
from api.redis_errors import REDIS_ERRORS, REDIS_TIMEOUT_S, unavailable
from shared import heartbeat, limits
from shared.config import ApiSettings
from shared.keys import IN_FLIGHT_LEASE_S, SCHEDULER_GROUP, Keys
from shared.redis_conn import atomic

logger = logging.getLogger(__name__)

T = TypeVar("T")
Spawn = Callable[[Coroutine[Any, Any, None]], bool]

CLIENT: ContextVar[str] = ContextVar("redserve_client", default=limits.ANONYMOUS)
QUEUE_FULL = "The request queue is full."
REFRESH_S = 0.2  # the fleet's queue is read at most this often per replica
RENEW_EVERY_S = IN_FLIGHT_LEASE_S / 6


@dataclass(frozen=True)
class Ticket:
    """What one admitted HTTP request holds until its outputs end."""

    num_jobs: int
    slot: str | None = None  # its in-flight slot, when the key's concurrency is capped


class QueueBound:
    """The fleet's queued requests as this replica sees them, and the bound on them."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, max_queued: int) -> None:
        self.redis, self.keys, self.max_queued = redis, keys, max_queued
        self.fleet = 0  # queued fleet-wide at the last read
        self.read_at = float("-inf")  # monotonic time that read began
        self.unsubmitted = 0  # admitted here, not submitted yet
        self.submitted = 0  # submitted here, ever
        self._submitted_at_read = 0
        self._reading: asyncio.Task[None] | None = None

    def estimate(self) -> int:
        return self.fleet + self.unsubmitted + self.submitted - self._submitted_at_read

    async def reserve(self, num_jobs: int) -> None:
        """Count `num_jobs` more, or raise the 503 when that goes over the bound."""
        if not self.max_queued:
            return
        if time.monotonic() - self.read_at >= REFRESH_S:
            await self._refresh()
        queued = self.estimate()
        if queued + num_jobs > self.max_queued:
            logger.info("queue full: %d queued, bound %d: 503", queued, self.max_queued)
            raise ServiceUnavailable(QUEUE_FULL, code="queue_full")
        self.unsubmitted += num_jobs

    def on_submitted(self, num_jobs: int) -> None:
        if self.max_queued:
            self.unsubmitted -= num_jobs
            self.submitted += num_jobs

    def cancel(self, num_jobs: int) -> None:
        """The admitted jobs were not submitted after all."""
        if self.max_queued:
            self.unsubmitted -= num_jobs

    async def _refresh(self) -> None:
        """One read at a time; the requests that arrive meanwhile wait for it."""
        task = self._reading
        if task is None or task.done():
            task = self._reading = asyncio.get_running_loop().create_task(self._read())
        try:
            await asyncio.shield(task)
        except REDIS_ERRORS as e:
            raise unavailable(e, "The request queue (Redis) is unavailable.") from e

    async def _read(self) -> None:
        started, submitted = time.monotonic(), self.submitted
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            undelivered, beats = await asyncio.gather(
                self._undelivered(), heartbeat.live_scheduler_beats(self.redis, self.keys)
            )
        self.fleet = undelivered + sum(beat.num_waiting for beat in beats.values())
        self.read_at, self._submitted_at_read = started, submitted

    async def _undelivered(self) -> int:
        """Jobs in the request streams (every priority band) that no scheduler read yet."""
        streams = self.keys.request_streams
        async with atomic(self.redis) as pipe:
            for stream in streams:
                pipe.xlen(stream)
                pipe.xpending(stream, SCHEDULER_GROUP)
            replies = await pipe.execute(raise_on_error=False)
        total = 0
        for length, pending in zip(replies[::2], replies[1::2], strict=True):
            if isinstance(length, Exception):
                raise length
            if isinstance(pending, ResponseError):  # no group (yet): nothing was read
                total += int(length)
            elif isinstance(pending, Exception):
                raise pending
            else:
                total += max(0, int(length) - int(pending["pending"]))
        return total


class KeyLimiter:
    """The per-key token bucket and in-flight cap (shared.limits), and the slots held here."""

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, key_limits: limits.KeyLimits, spawn: Spawn
    ) -> None:
        self.redis, self.keys, self.limits = redis, keys, key_limits
        self._spawn = spawn
        self.held: dict[str, str] = {}  # slot id -> client

    async def acquire(self, client: str) -> str | None:
        """A token (and a slot: its id) for `client`, or the 429."""
        if not self.limits.enabled:
            return None
        slot = uuid.uuid4().hex
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                verdict = await limits.acquire(self.redis, self.keys, client, slot, self.limits)
        except REDIS_ERRORS as e:
            raise unavailable(e, "The rate limiter (Redis) is unavailable.") from e
        if not verdict.admitted:
            logger.info("429 client=%s: %s", client[:8], verdict.reason)
            raise TooManyRequests(self._message(verdict), retry_after=verdict.retry_after_s)
        if not self.limits.max_in_flight:
            return None
        self.held[slot] = client
        return slot

    def _message(self, verdict: limits.Verdict) -> str:
        lim = self.limits
        if verdict.reason == "concurrency":
            return (
                f"Too many concurrent requests: at most {lim.max_in_flight} in flight per API "
                "key. Try again when one has finished."
            )
        return (
            f"Rate limit reached: at most {lim.rate:g} requests per second per API key "
            f"(bursts of {lim.bucket_size}). Try again in {max(1, round(verdict.retry_after_s))} s."
        )

    def release_soon(self, slot: str | None) -> None:
        """Give the slot back in the background (a failure leaves it to its lease)."""
        client = self.held.pop(slot, None) if slot else None
        if slot and client is not None:
            self._spawn(self._release({slot: client}))

    async def _release(self, slots: dict[str, str]) -> None:
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                async with self.redis.pipeline(transaction=False) as pipe:
                    limits.release(pipe, self.keys, slots)
                    await pipe.execute()
        except REDIS_ERRORS as e:
            logger.warning("could not release %d in-flight slots: %r", len(slots), e)

    async def renew(self) -> None:
        if self.held:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await limits.renew(self.redis, self.keys, dict(self.held))


class Admission:
    def __init__(
        self,
        api: ApiSettings,
        redis: aioredis.Redis,
        keys: Keys,
        spawn: Spawn,
        loop_lag: LoopLag | None = None,
    ) -> None:
        self.loop_lag = loop_lag or LoopLag()
        self.queue = QueueBound(redis, keys, api.max_queued_requests)
        key_limits = limits.KeyLimits(
            api.rate_limit_rps, api.rate_limit_burst, api.max_concurrent_requests_per_key
        )
        self.limiter = KeyLimiter(redis, keys, key_limits, spawn)
        self._renewer: asyncio.Task[None] | None = None

    async def admit(self, num_jobs: int) -> Ticket:
        """Admit one HTTP request of `num_jobs` jobs, or raise the 503 (queue full) or the
        429 (its key's limits) before anything is written; a 503 at once while this
        replica's event loop lags (api.loop_lag: it is overloaded)."""
        if self.loop_lag.overloaded():
            lag = self.loop_lag.lag_s()
            raise ServiceUnavailable(f"This api replica is overloaded (its event loop runs "
                                     f"{lag:.1f} s late); try again later or another replica.",
                                     retry_after=1)  # fmt: skip
        await self.queue.reserve(num_jobs)
        try:
            slot = await self.limiter.acquire(CLIENT.get())
        except BaseException:
            self.queue.cancel(num_jobs)
            raise
        return Ticket(num_jobs, slot)

    async def guard(
        self, ticket: Ticket, outputs: AsyncGenerator[T, None]
    ) -> AsyncGenerator[T, None]:
        """`outputs` (whose first item means "submitted"), giving the ticket back however
        they end: the queue count if nothing was submitted, the in-flight slot always."""
        submitted = False
        try:
            first = await anext(outputs)
            submitted = True
            self.queue.on_submitted(ticket.num_jobs)
            yield first
            async for out in outputs:
                yield out
        finally:
            try:
                await outputs.aclose()
            finally:
                if not submitted:
                    self.queue.cancel(ticket.num_jobs)
                self.limiter.release_soon(ticket.slot)

    # -- the renewal of the slots held here ------------------------------------------------
    def start(self) -> None:
        if self.limiter.limits.max_in_flight:
            loop = asyncio.get_running_loop()
            self._renewer = loop.create_task(self._renew_forever(), name="api-slot-renewal")

    async def stop(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(RENEW_EVERY_S)
            try:
                await self.limiter.renew()
            except REDIS_ERRORS as e:  # the next tick tries again, within the lease
                logger.warning("could not renew %d in-flight slots: %r", len(self.limiter.held), e)

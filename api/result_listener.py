"""The api process's ONE subscription: `out:{api_id}` (TextBatch from the detokenizers),
and on the same connection `ctl` (Reattach notices: another replica took a request over).

Decodes each message and hands it to `on_message` (the TokenizerManager's type dispatcher).
Garbage is logged and dropped; a lost connection is retried with backoff, and because
pub/sub may drop messages meanwhile, `on_resubscribe` then asks for a resend of what the
replica missed; receivers also rely on `seq`, never on exceptions (redis-py 6+ resubscribes
without telling anyone)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import redis.asyncio as aioredis

from shared import protocol, pubsub
from shared.redis_conn import REDIS_FAILURES

logger = logging.getLogger(__name__)

_BACKOFF_MIN_S = 0.1
_BACKOFF_MAX_S = 1.0  # short: an outage longer than a few seconds fails the requests anyway
_POLL_S = 1.0


class ResultListener:
    def __init__(
        self,
        redis: aioredis.Redis,
        channel: str,
        on_message: Callable[[Any], None],
        *,
        control_channel: str | None = None,
        on_resubscribe: Callable[[], None] = lambda: None,
    ) -> None:
        self.redis = redis
        self.channel = channel
        self.control_channel = control_channel
        self.on_message = on_message
        self.on_resubscribe = on_resubscribe
        self.num_received = 0
        self.num_dropped = 0
        self._subscribed = asyncio.Event()
        self._first_attempt = asyncio.Event()
        self._ever_subscribed = False
        self._down_since = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    @property
    def subscribed(self) -> bool:
        return self._subscribed.is_set()

    def down_for(self) -> float:
        """Seconds since the subscription was lost (0 while subscribed)."""
        return 0.0 if self.subscribed else time.monotonic() - self._down_since

    async def start(self, timeout_s: float = 5.0) -> None:
        """Start listening; wait until the first subscribe attempt succeeded or failed."""
        self._task = asyncio.create_task(self._run(), name=f"result-listener:{self.channel}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first_attempt.wait(), timeout_s)
        if not self.subscribed:
            logger.warning("not subscribed to %s yet; retrying in the background", self.channel)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        backoff = _BACKOFF_MIN_S
        while True:
            sub = pubsub.subscriber(self.redis)
            try:
                channels = [c for c in (self.channel, self.control_channel) if c]
                await sub.subscribe(*channels)
                self._on_subscribed()
                backoff = _BACKOFF_MIN_S
                while True:
                    msg = await sub.get_message(ignore_subscribe_messages=True, timeout=_POLL_S)
                    if msg is not None and msg.get("type") == "message":
                        self._route(msg["channel"], msg["data"])
            except REDIS_FAILURES as e:
                logger.warning("subscription to %s failed: %s; retry in %.1fs", self.channel, e,
                               backoff)  # fmt: skip
            finally:
                if self.subscribed:
                    self._down_since = time.monotonic()
                self._subscribed.clear()
                self._first_attempt.set()
                with contextlib.suppress(Exception):
                    await sub.aclose()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    def _on_subscribed(self) -> None:
        self._subscribed.set()
        self._first_attempt.set()
        logger.info("subscribed to %s", self.channel)
        if self._ever_subscribed:
            self.on_resubscribe()  # messages published meanwhile are gone: ask again
        self._ever_subscribed = True

    def _route(self, channel: bytes | str, data: bytes) -> None:
        name = channel.decode() if isinstance(channel, bytes) else channel
        if name == self.control_channel:
            self.handle(data, protocol.ControlMessage)
        else:
            self.handle(data)

    def handle(self, data: bytes, kind: Any = protocol.OutputMessage) -> None:
        """Decode one message and dispatch it; a bad message never stops the listener."""
        try:
            msg = protocol.decode(data, kind)
        except (msgspec.DecodeError, protocol.ProtocolVersionError, TypeError) as e:
            self.num_dropped += 1
            logger.warning("dropping undecodable message on %s: %s", self.channel, e)
            return
        self.num_received += 1
        try:
            self.on_message(msg)
        except Exception:
            logger.exception("failed to dispatch a %s message", type(msg).__name__)

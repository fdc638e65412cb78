"""The detokenizer loop: TokenBatch in, TextBatch out.

Subscribes to its shards' `tok:{shard}` channels and to `ctl` (aborts) on one pub/sub
connection; publishes one TextBatch per api replica per input batch to `out:{api_id}`, in one
pipeline. Reads `state:{rid}` only for a request it has no params for. Decoding lives in
`core.py`; `__main__.py` wires it up.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import protocol, request_state
from shared.config import Settings
from shared.keys import Keys
from workers.detokenizer.core import DetokenizerCore, Tokenizer

logger = logging.getLogger(__name__)

_MAX_BACKOFF_S = 5.0


class DetokenizerLoop:
    """Translates Redis pub/sub messages into DetokenizerCore calls and publishes the text."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: Settings,
        tokenizer: Tokenizer,
        core: DetokenizerCore | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.shards = settings.detokenizer.shards or list(range(settings.num_token_shards))
        self.core = core or DetokenizerCore(tokenizer, max_states=settings.detokenizer.max_states)
        self._pubsub: Any = None
        self._is_stopping = False

    @property
    def channels(self) -> list[str]:
        return [self.keys.token_channel(s) for s in self.shards] + [self.keys.control_channel]

    async def start(self) -> None:
        """Subscribe (idempotent). Messages published before this are not seen: pub/sub."""
        if self._pubsub is None:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            await pubsub.subscribe(*self.channels)
            self._pubsub = pubsub
            logger.info("subscribed to %s", ", ".join(self.channels))

    async def close(self) -> None:
        """Drop the subscription (errors ignored: the connection may already be gone)."""
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                await pubsub.aclose()
            except (RedisError, OSError) as exc:
                logger.debug("closing pub/sub: %r", exc)

    def stop(self) -> None:
        """Make `run()` return after the message in hand (safe from a signal handler)."""
        self._is_stopping = True

    async def run_once(self, timeout: float) -> bool:
        """Handle at most one message, waiting up to `timeout` s; False when none came."""
        await self.start()
        clock = asyncio.get_running_loop().time
        deadline = clock() + timeout
        while True:
            # None also stands for a subscribe confirmation: wait on until the deadline.
            message = await self._pubsub.get_message(timeout=max(0.0, deadline - clock()))
            if message is not None and message.get("type") == "message":
                break
            if clock() >= deadline:
                return False
        await self.handle(_as_str(message["channel"]), message["data"])
        return True

    async def run(self, burst: bool = False, idle_timeout: float = 0.5) -> None:
        """Loop until `stop()`; with `burst`, return once no message came for `idle_timeout` s.

        Redis errors are logged and retried with backoff (re-subscribing); others propagate.
        """
        backoff = 0.1
        while not self._is_stopping:
            try:
                got = await self.run_once(idle_timeout)
            except (RedisError, OSError) as exc:
                logger.warning("redis error: %r; reconnecting in %.1fs", exc, backoff)
                await self.close()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
                continue
            backoff = 0.1
            if burst and not got:
                return

    async def handle(self, channel: str, data: bytes) -> None:
        """Dispatch one pub/sub message by channel; undecodable messages are logged and skipped."""
        if channel == self.keys.control_channel:
            self._handle_control(data)
            return
        try:
            batch = protocol.decode(data, protocol.TokenMessage)
        except (msgspec.DecodeError, protocol.ProtocolVersionError) as exc:
            logger.warning("skipping undecodable message on %s: %s", channel, exc)
            return
        await self.handle_batch(batch)

    async def handle_batch(self, batch: protocol.TokenBatch) -> None:
        fallback = await self._lookup_params(self.core.rids_missing_params(batch))
        outputs = self.core.add_batch(batch, fallback)
        if not outputs:
            return
        pipe = self.redis.pipeline(transaction=False)
        for api_id, entries in outputs.items():
            message = protocol.encode(protocol.TextBatch(entries=entries))
            pipe.publish(self.keys.output_channel(api_id), message)
        await pipe.execute()

    def _handle_control(self, data: bytes) -> None:
        try:
            message = protocol.decode(data, protocol.ControlMessage)
        except (msgspec.DecodeError, protocol.ProtocolVersionError) as exc:
            logger.warning("skipping undecodable control message: %s", exc)
            return
        if isinstance(message, protocol.AbortRequests):
            self.core.abort(message.rids)

    async def _lookup_params(self, rids: list[str]) -> dict[str, protocol.DetokParams]:
        """Default params for requests seen without them (e.g. after an eviction or restart)."""
        found: dict[str, protocol.DetokParams] = {}
        for rid in rids:
            state = await request_state.read(self.redis, self.keys, rid)
            api_id = state.api_id if state else None
            if api_id:
                logger.info("rid=%s no detok params: default params, api_id=%s", rid, api_id)
                found[rid] = protocol.DetokParams(api_id=api_id)
            else:
                logger.warning("rid=%s no detok params and no request state: dropped", rid)
        return found


def _as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

"""The detokenizer loop: TokenBatch in, TextBatch out, over Redis pub/sub.

One pub/sub connection carries `ctl` (aborts, re-attaches) and the `tok:{shard}` channels of
the shards this replica holds a lease on (leases.py); every tick (at most HEARTBEAT_EVERY_S)
it beats (its shards, live states and counts: `figures`), renews and rebalances the leases and
follows them with its subscriptions. For each batch it fetches what the core asks for (request
states, ranges of `ids:{rid}`), then publishes one TextBatch per api replica to `out:{api_id}`,
in one pipeline. Redis errors are retried with backoff forever: a restarted Redis gets the
subscriptions and leases back, and what pub/sub lost meanwhile shows as seq gaps that the id
log fills. Decoding lives in `core.py`; `__main__.py` wires it up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
import redis.asyncio as aioredis

from shared import heartbeat, protocol, pubsub, request_state
from shared.config import Settings
from shared.keys import HEARTBEAT_EVERY_S, Keys, shard_of
from shared.redis_conn import REDIS_FAILURES
from workers.detokenizer.core import DetokenizerCore, Fetched, Needs, Tokenizer
from workers.detokenizer.leases import ShardLeases

logger = logging.getLogger(__name__)

_MIN_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 5.0
# TextEntries per published message (a rebuilt request replays many; keep messages small).
MAX_ENTRIES_PER_MESSAGE = 1024


class DetokenizerLoop:
    """Translates Redis pub/sub messages into DetokenizerCore calls and publishes the text."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: Settings,
        tokenizer: Tokenizer,
        core: DetokenizerCore | None = None,
        leases: ShardLeases | None = None,
    ) -> None:
        detok = settings.detokenizer
        self.redis = redis
        self.keys = keys
        self.worker_id = detok.worker_id
        self.num_shards = settings.num_token_shards
        self.core = core or DetokenizerCore(tokenizer, max_states=detok.max_states)
        self.leases = leases or ShardLeases(
            redis, keys, detok.worker_id, self.num_shards, detok.shards, detok.lease_ttl_s
        )
        self._pubsub: Any = None
        self._subscribed: dict[str, int] = {}  # token channel -> shard, on this pub/sub
        self._serving: set[int] = set()  # shards whose requests the core's states follow
        self._next_tick = 0.0
        self._stopping = asyncio.Event()
        self.num_batches = 0  # TokenBatches handled, TextEntries published (its beat says)
        self.num_entries = 0

    @property
    def shards(self) -> list[int]:
        """The shards whose token channel this loop listens to now."""
        return sorted(self._subscribed.values())

    @property
    def channels(self) -> list[str]:
        return [self.keys.token_channel(s) for s in self.shards] + [self.keys.control_channel]

    @property
    def tick_every_s(self) -> float:
        return min(self.leases.renew_every_s, HEARTBEAT_EVERY_S)

    async def start(self) -> None:
        """Subscribe to `ctl`, then beat and take leases if a tick is due (idempotent).
        Messages published before a subscription are not seen: pub/sub."""
        if self._pubsub is None:
            sub = pubsub.subscriber(self.redis, ignore_subscribe_messages=True)
            self._pubsub, self._subscribed, self._next_tick = sub, {}, 0.0
            await sub.subscribe(self.keys.control_channel)
        if time.monotonic() >= self._next_tick:
            await self.maintain()

    async def maintain(self) -> None:
        """One tick: beat, renew and rebalance the leases, follow them with subscriptions."""
        if self._pubsub is None:
            await self.start()  # subscribes, then ticks
            return
        pipe = self.redis.pipeline(transaction=False)
        heartbeat.beat(pipe, self.keys, self.worker_id, self.figures(), heartbeat.DETOKENIZER)
        await pipe.execute()
        live = await heartbeat.live_workers(self.redis, self.keys, heartbeat.DETOKENIZER)
        await self._follow(await self.leases.tick(set(live)))
        self._next_tick = time.monotonic() + self.tick_every_s

    def figures(self) -> heartbeat.DetokenizerBeat:
        """What its beat reports (the fleet views and /metrics read it)."""
        return heartbeat.DetokenizerBeat(
            shards=",".join(str(s) for s in self.shards),
            num_states=len(self.core),
            num_batches=self.num_batches,
            num_entries=self.num_entries,
        )

    async def close(self) -> None:
        """Drop the subscription (errors ignored: the connection may already be gone)."""
        sub, self._pubsub, self._subscribed = self._pubsub, None, {}
        if sub is not None:
            try:
                await sub.aclose()
            except REDIS_FAILURES as exc:
                logger.debug("closing pub/sub: %r", exc)

    async def shutdown(self) -> None:
        """A planned stop: hand the shards over at once (release the leases, forget the
        heartbeat so peers recount), then close. Redis errors are logged: the leases then
        simply expire."""
        try:
            await self.leases.release()
            async with self.redis.pipeline(transaction=False) as pipe:
                heartbeat.forget(pipe, self.keys, self.worker_id, heartbeat.DETOKENIZER)
                await pipe.execute()
        except REDIS_FAILURES as exc:
            logger.warning("could not release the leases: %r", exc)
        await self.close()

    def stop(self) -> None:
        """Make `run()` return after the message in hand (safe from a signal handler)."""
        self._stopping.set()

    async def run_once(self, timeout: float) -> bool:
        """Handle at most one message, waiting up to `timeout` s (ticking when due); False
        when none came."""
        await self.start()
        deadline = time.monotonic() + timeout
        while True:
            wait = min(deadline, self._next_tick) - time.monotonic()
            # None also stands for a (un)subscribe confirmation: wait on until the deadline.
            message = await self._pubsub.get_message(timeout=max(0.0, wait))
            if message is not None and message.get("type") == "message":
                break
            if time.monotonic() >= self._next_tick:
                await self.maintain()
            if time.monotonic() >= deadline:
                return False
        await self.handle(_as_str(message["channel"]), message["data"])
        return True

    async def run(self, burst: bool = False, idle_timeout: float = 0.5) -> None:
        """Loop until `stop()`; with `burst`, return once no message came for `idle_timeout` s.

        Redis errors are logged and retried with backoff (re-subscribing, re-taking leases);
        others propagate.
        """
        backoff = _MIN_BACKOFF_S
        while not self._stopping.is_set():
            try:
                got = await self.run_once(idle_timeout)
            except REDIS_FAILURES as exc:
                logger.warning("redis error: %r; reconnecting in %.1fs", exc, backoff)
                await self.close()
                await self._sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
                continue
            backoff = _MIN_BACKOFF_S
            if burst and not got:
                return

    async def handle(self, channel: str, data: bytes) -> None:
        """Dispatch one pub/sub message by channel; undecodable messages are logged and skipped,
        and so are those of a shard given up since they were sent."""
        if channel == self.keys.control_channel:
            await self._publish(self._handle_control(data))
            return
        if channel not in self._subscribed:
            return
        try:
            batch = protocol.decode(data, protocol.TokenMessage)
        except (msgspec.DecodeError, protocol.ProtocolVersionError) as exc:
            logger.warning("skipping undecodable message on %s: %s", channel, exc)
            return
        await self.handle_batch(batch)

    async def handle_batch(self, batch: protocol.TokenBatch) -> None:
        self.num_batches += 1
        needs = self.core.needs(batch)
        fetched = await self._fetch(needs) if needs else None
        await self._publish(self.core.add_batch(batch, fetched))

    async def _publish(self, outputs: dict[str, list[protocol.TextEntry]]) -> None:
        """One TextBatch per api replica (chunked), in one pipeline."""
        if not outputs:
            return
        self.num_entries += sum(len(entries) for entries in outputs.values())
        pipe = self.redis.pipeline(transaction=False)
        for api_id, entries in outputs.items():
            for i in range(0, len(entries), MAX_ENTRIES_PER_MESSAGE):
                chunk = entries[i : i + MAX_ENTRIES_PER_MESSAGE]
                message = protocol.encode(protocol.TextBatch(entries=chunk))
                pubsub.publish(pipe, self.keys.output_channel(api_id), message)
        await pipe.execute()

    # -- internals ---------------------------------------------------------------------------
    async def _follow(self, owned: set[int]) -> None:
        """Subscribe to the shards held, unsubscribe from the others. The states of a shard
        given up, or whose lease lapsed, go: another detokenizer may have served it since,
        so its requests are rebuilt from their id logs if they come back."""
        stale = (self._serving - owned) | self.leases.lapsed
        if stale:
            gone = [rid for rid in self.core.rids() if shard_of(rid, self.num_shards) in stale]
            self.core.forget(gone)
            logger.info("shards %s left or lapsed: %d states dropped", sorted(stale), len(gone))
        self._serving = set(owned)
        drop = [ch for ch, shard in self._subscribed.items() if shard not in owned]
        if drop:
            await self._pubsub.unsubscribe(*drop)
            for channel in drop:
                del self._subscribed[channel]
        add = {self.keys.token_channel(s): s for s in sorted(owned)}
        add = {ch: s for ch, s in add.items() if ch not in self._subscribed}
        if add:
            await self._pubsub.subscribe(*add)
            self._subscribed.update(add)
            logger.info("serving shards %s", sorted(self._subscribed.values()))

    async def _fetch(self, needs: Needs) -> Fetched:
        """The request states' api_ids and the id-log ranges the core asked for."""
        api_ids: dict[str, str] = {}
        for rid in needs.states:
            state = await request_state.read(self.redis, self.keys, rid)
            if state is not None and state.api_id:
                api_ids[rid] = state.api_id
        ids = {}
        if needs.ranges:
            pipe = self.redis.pipeline(transaction=False)
            for span in needs.ranges:
                request_state.read_ids(pipe, self.keys, span.rid, span.start, span.end)
            for span, raw in zip(needs.ranges, await pipe.execute(), strict=True):
                ids[span] = [int(v) for v in raw]
        return Fetched(api_ids=api_ids, ids=ids)

    def _handle_control(self, data: bytes) -> dict[str, list[protocol.TextEntry]]:
        """Aborts and re-attaches; returns the text a re-attach asked to be sent again."""
        try:
            message = protocol.decode(data, protocol.ControlMessage)
        except (msgspec.DecodeError, protocol.ProtocolVersionError) as exc:
            logger.warning("skipping undecodable control message: %s", exc)
            return {}
        out: dict[str, list[protocol.TextEntry]] = {}
        if isinstance(message, protocol.AbortRequests):
            self.core.abort(message.rids)
        elif isinstance(message, protocol.Reattach):
            self.core.reattach(message.rids, message.api_id)
            for rid, from_seq in zip(message.rids, message.from_seqs, strict=False):
                routed = self.core.resend(rid, from_seq)
                if routed is not None:
                    out.setdefault(routed[0], []).extend(routed[1])
        return out

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but wake up at once on `stop()`."""
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            pass


def _as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

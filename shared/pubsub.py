"""Pub/sub on one Redis or on a Redis Cluster, behind one interface.

On one Redis: PUBLISH and a plain subscription. On a cluster of Redis 7+ (or Valkey):
sharded pub/sub, SPUBLISH to the node that owns the channel's slot and SSUBSCRIBE there, so
the token and text traffic is spread over the nodes instead of broadcast to all of them
(classic PUBLISH in a cluster goes to every node). A cluster older than 7 has no sharded
pub/sub: `prepare` finds that out once, and then PUBLISH (broadcast) and a subscription on
any one node are used.

`Subscriber` mirrors the parts of redis-py's PubSub the tiers use (subscribe, unsubscribe,
get_message, aclose); on a cluster it holds one connection per node it subscribed on, each
read by its own task into one queue. A connection error surfaces from `get_message`, as it
does from a plain PubSub, and the caller subscribes again (the channel may have moved).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.redis_conn import REDIS_FAILURES, is_cluster

# Whether a cluster client publishes and subscribes sharded (set by `prepare`).
_SHARDED_ATTR = "_redserve_sharded_pubsub"


async def prepare(r: aioredis.Redis) -> None:
    """Find out, once per client, whether its cluster has sharded pub/sub (Redis 7+)."""
    if not is_cluster(r) or hasattr(r, _SHARDED_ATTR):
        return
    info = await r.info("server", target_nodes=RedisCluster.RANDOM)
    version = str(info.get("redis_version", "0"))
    setattr(r, _SHARDED_ATTR, int(version.split(".")[0]) >= 7)


def sharded(client: Any) -> bool:
    """Whether `client` (or a pipeline of it) uses sharded pub/sub."""
    if not is_cluster(client):
        return False
    owner = getattr(client, "_client", client)  # a ClusterPipeline's client
    return bool(getattr(owner, _SHARDED_ATTR, True))


def publish(client: Any, channel: str, payload: bytes) -> Any:
    """PUBLISH, or SPUBLISH on a cluster with sharded pub/sub (client or pipeline). A
    classic PUBLISH on a cluster goes to any one node (each forwards it to all)."""
    if sharded(client):
        return client.execute_command("SPUBLISH", channel, payload)
    if is_cluster(client):
        target = RedisCluster.DEFAULT_NODE
        return client.execute_command("PUBLISH", channel, payload, target_nodes=target)
    return client.publish(channel, payload)


def subscriber(r: aioredis.Redis, ignore_subscribe_messages: bool = False) -> Any:
    """A PubSub-like subscription for `r` (see the module doc)."""
    if is_cluster(r):
        return Subscriber(r, ignore_subscribe_messages)  # type: ignore[arg-type]
    return r.pubsub(ignore_subscribe_messages=ignore_subscribe_messages)


class _ShardPubSub(aioredis.client.PubSub):
    """redis-py's PubSub speaking SSUBSCRIBE/SUNSUBSCRIBE, one channel per command (a
    multi-channel SSUBSCRIBE must stay in one slot); messages look like plain ones."""

    _RENAMED = {b"smessage": b"message", b"ssubscribe": b"subscribe",
                b"sunsubscribe": b"unsubscribe"}  # fmt: skip

    async def execute_command(self, *args: Any) -> Any:
        verb, *channels = args
        if verb not in ("SUBSCRIBE", "UNSUBSCRIBE") or len(channels) <= 1:
            return await super().execute_command(_sharded_verb(verb), *channels)
        for channel in channels:
            await super().execute_command(_sharded_verb(verb), channel)
        return None

    async def handle_message(self, response: Any, ignore_subscribe_messages: bool = False) -> Any:
        if isinstance(response, list) and response:
            response = [self._RENAMED.get(response[0], response[0]), *response[1:]]
        return await super().handle_message(response, ignore_subscribe_messages)


def _sharded_verb(verb: str) -> str:
    return {"SUBSCRIBE": "SSUBSCRIBE", "UNSUBSCRIBE": "SUNSUBSCRIBE"}.get(verb, verb)


class Subscriber:
    """Subscriptions on a cluster: one connection per node, read into one queue."""

    def __init__(self, cluster: RedisCluster, ignore_subscribe_messages: bool) -> None:
        self.cluster = cluster
        self.ignore = ignore_subscribe_messages
        self._nodes: dict[str, tuple[aioredis.Redis, aioredis.client.PubSub]] = {}
        self._node_of: dict[str, str] = {}  # channel -> node name
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._queue: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue()

    async def subscribe(self, *channels: str) -> None:
        await prepare(self.cluster)  # type: ignore[arg-type]
        await self.cluster.initialize()
        for channel in channels:
            name, pubsub = await self._pubsub_for(channel)
            await pubsub.subscribe(channel)
            self._node_of[channel] = name
            if name not in self._readers:
                self._readers[name] = asyncio.create_task(self._read(pubsub))

    async def unsubscribe(self, *channels: str) -> None:
        for channel in channels:
            name = self._node_of.pop(channel, None)
            if name is not None:
                await self._nodes[name][1].unsubscribe(channel)

    async def get_message(
        self, ignore_subscribe_messages: bool = False, timeout: float | None = 0.0
    ) -> dict[str, Any] | None:
        try:
            item = await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None
        if isinstance(item, BaseException):
            raise item
        if (ignore_subscribe_messages or self.ignore) and item.get("type") != "message":
            return None
        return item

    async def aclose(self) -> None:
        for task in self._readers.values():
            task.cancel()
        for task in self._readers.values():
            with contextlib.suppress(asyncio.CancelledError, *REDIS_FAILURES):
                await task
        for client, pubsub in self._nodes.values():
            with contextlib.suppress(*REDIS_FAILURES):
                await pubsub.aclose()
                await client.aclose()
        self._nodes.clear()
        self._readers.clear()

    async def _pubsub_for(self, channel: str) -> tuple[str, aioredis.client.PubSub]:
        """The node a channel's messages come from, and this subscriber's connection there."""
        if sharded(self.cluster):
            node = self.cluster.get_node_from_key(channel)
        else:  # classic pub/sub is broadcast: any one node hears everything
            node = self.cluster.get_default_node()
        if node is None:
            raise RedisConnectionError(f"no node serves {channel}")
        if node.name not in self._nodes:
            client = aioredis.Redis(host=node.host, port=int(node.port), decode_responses=False)
            kind = _ShardPubSub if sharded(self.cluster) else aioredis.client.PubSub
            pubsub = kind(client.connection_pool, ignore_subscribe_messages=False)
            self._nodes[node.name] = (client, pubsub)
        return node.name, self._nodes[node.name][1]

    async def _read(self, pubsub: aioredis.client.PubSub) -> None:
        try:
            while True:
                message = await pubsub.get_message(timeout=1.0)
                if message is not None:
                    self._queue.put_nowait(message)
        except REDIS_FAILURES as e:
            self._queue.put_nowait(e)

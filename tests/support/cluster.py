"""The tests' view of a Redis Cluster: the local 3-node cluster (shared.embedded_cluster),
and clients that work on one Redis or a cluster alike."""

from __future__ import annotations

import redis

from shared.config import Settings
from shared.embedded_cluster import LocalCluster

__all__ = ["LocalCluster", "subscribe", "sync_client"]


# -- clients the tests use, on one Redis or a cluster ---------------------------------------
def sync_client(settings: Settings, decode_responses: bool = False) -> redis.Redis:
    """A synchronous client for `settings`' Redis (a RedisCluster on a cluster)."""
    if settings.redis_cluster:
        cluster = redis.RedisCluster.from_url(settings.redis_url, decode_responses=decode_responses)
        return cluster  # type: ignore[return-value]
    return redis.Redis.from_url(settings.redis_url, decode_responses=decode_responses)


def subscribe(settings: Settings, channel: str) -> redis.client.PubSub:
    """A subscription to `channel`: on a cluster, SSUBSCRIBE on the node that owns it (what
    the tiers publish there with SPUBLISH); messages come as "smessage"."""
    if not settings.redis_cluster:
        pubsub = redis.Redis.from_url(settings.redis_url).pubsub()
        pubsub.subscribe(channel)
        return pubsub
    node = redis.RedisCluster.from_url(settings.redis_url).get_node_from_key(channel)
    pubsub = redis.Redis(host=node.host, port=int(node.port)).pubsub()
    pubsub.ssubscribe(channel)
    return pubsub

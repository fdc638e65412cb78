"""Connecting to Redis (one server, or a Redis Cluster / Valkey cluster). Nothing
key-specific lives here.

On a cluster, MULTI cannot span slots (and redis-py's asyncio cluster client has no
transactions at all), so `atomic` pipelines are plain pipelines there: what must be atomic
on a cluster is a script on one slot (one request's keys share a hash tag, shared.keys).

Commands are packed by hiredis (C), as redis-py's synchronous client already does: the
asyncio client packs in Python, copying its growing buffer once per argument, and a
scheduler's step transaction has thousands of arguments at hundreds of running requests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import hiredis
import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection
from redis.exceptions import ClusterDownError, RedisClusterException, RedisError, TryAgainError

# Every way a call to Redis fails. redis-py's cluster client raises RedisClusterException,
# which is no RedisError, when it cannot map a slot to a node (a node down, the topology
# changing).
REDIS_FAILURES: tuple[type[Exception], ...] = (RedisError, RedisClusterException, OSError)
# A cluster answers CLUSTERDOWN while a master without a replica is down (every node refuses
# every command) and TRYAGAIN while a slot migrates: both pass, like a restarting Redis.
CLUSTER_TRANSIENT: tuple[type[Exception], ...] = (
    ClusterDownError,
    TryAgainError,
    RedisClusterException,
)


class ReseedingCluster(RedisCluster):
    """redis-py's asyncio cluster client, which never runs out of nodes to ask for the topology.

    redis-py 5 drops a node from its startup nodes on each connection error and then closes
    every connection it holds, so the commands in flight on the live nodes fail and drop
    theirs too: once none is left it can never find the cluster again, even after the dead
    node is back ("Please provide at least one reachable node: None"). This client puts back
    every node it has known before each topology refresh; live ones stay first."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.known_nodes = {
            n.name: (n.host, n.port) for n in self.nodes_manager.startup_nodes.values()
        }

    async def initialize(self) -> RedisCluster:
        manager = self.nodes_manager
        if self._initialize:
            for name, (host, port) in self.known_nodes.items():
                if name not in manager.startup_nodes:
                    manager.startup_nodes[name] = ClusterNode(
                        host, port, **manager.connection_kwargs
                    )
        await super().initialize()
        self.known_nodes.update((n.name, (n.host, n.port)) for n in manager.startup_nodes.values())
        return self


def connect(url: str, cluster: bool = False) -> aioredis.Redis:
    """An asyncio client (bytes in, bytes out); with `cluster`, a Redis Cluster client that
    finds every node from `url`'s. Does no I/O until first used."""
    if cluster:
        return ReseedingCluster.from_url(  # type: ignore[return-value]
            url, decode_responses=False, connection_class=with_hiredis_packing(Connection)
        )
    pool = aioredis.ConnectionPool.from_url(url, decode_responses=False, health_check_interval=30)
    pool.connection_class = with_hiredis_packing(pool.connection_class)
    return aioredis.Redis.from_pool(pool)


def connect_sync(url: str, cluster: bool = False) -> redis.Redis:
    """A synchronous client, for a thread beside the event loop (bytes in, bytes out)."""
    if cluster:
        return redis.RedisCluster.from_url(url, decode_responses=False)
    return redis.Redis.from_url(url, decode_responses=False)


def eval_script(client: Any, script: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """EVAL with the script's text (never NOSCRIPT, also right after a Redis restart) on a
    client or a pipeline; on a cluster it goes to the node of its keys' one slot."""
    return client.eval(script, len(keys), *keys, *args)


def is_cluster(client: object) -> bool:
    """Whether `client` (a client or a pipeline) talks to a Redis Cluster."""
    return isinstance(client, RedisCluster | ClusterPipeline)


def atomic(r: aioredis.Redis) -> aioredis.client.Pipeline:
    """A MULTI/EXEC pipeline on one Redis; a plain one on a cluster (see the module doc)."""
    return r.pipeline(transaction=not is_cluster(r))


def with_hiredis_packing(cls: type[AbstractConnection]) -> type[AbstractConnection]:
    """`cls` (TCP, TLS or unix socket) packing its commands with hiredis."""
    return type(f"Hiredis{cls.__name__}", (_HiredisPacking, cls), {})


class _HiredisPacking:
    def pack_command(self, *args: Any) -> list[bytes]:
        # As redis-py: a command name with a space ("CLIENT SETNAME") is several words.
        if isinstance(args[0], str) and " " in args[0]:
            args = (*args[0].split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:  # a value hiredis does not take: redis-py's own error for it
            return super().pack_command(*args)  # type: ignore[misc]

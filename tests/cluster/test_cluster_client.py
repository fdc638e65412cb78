"""The asyncio cluster client (shared.redis_conn.connect) rides out a master's kill -9 and
restart while commands are in flight on every node: it finds the cluster again once the
node is back, instead of running out of nodes to ask for the topology."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from shared.redis_conn import REDIS_FAILURES, connect
from tests.support.cluster import LocalCluster

pytestmark = pytest.mark.redis

KEYS = [f"k{i}" for i in range(30)]  # spread over the three masters


async def _hammer(r: aioredis.Redis, key: str, stop: asyncio.Event, ok: dict[str, float]) -> None:
    while not stop.is_set():
        try:
            await r.set(key, "v")
            ok[key] = time.monotonic()
        except REDIS_FAILURES:
            pass
        await asyncio.sleep(0.01)


async def _kill_and_restart(cluster: LocalCluster, node: int) -> tuple[float, dict[str, float]]:
    r = connect(cluster.url, cluster=True)
    stop, ok = asyncio.Event(), dict[str, float]()
    tasks = [asyncio.create_task(_hammer(r, key, stop, ok)) for key in KEYS]
    await asyncio.sleep(0.5)
    cluster.kill(node)
    await asyncio.sleep(1)
    await asyncio.to_thread(cluster.restart, node)
    back = time.monotonic()
    deadline = back + 20
    while min((ok.get(key, 0.0) for key in KEYS), default=0.0) <= back + 0.5:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.gather(*tasks)
    await r.aclose()
    return back, ok


@pytest.mark.parametrize("node", [0, 1])  # the seed node, and another
def test_commands_on_every_node_succeed_again_after_a_master_restarts(node: int) -> None:
    with LocalCluster() as cluster:
        back, ok = asyncio.run(_kill_and_restart(cluster, node))
    stuck = [key for key in KEYS if ok.get(key, 0.0) <= back + 0.5]
    assert not stuck, f"{len(stuck)} of {len(KEYS)} keys never written after the restart"

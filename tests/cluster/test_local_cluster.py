"""The local cluster is a real one: keys spread over its 3 masters by hash slot, each master
serves reads and writes, and a master killed (-9) and restarted rejoins from its nodes.conf."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import RedisCluster

from tests.support.cluster import LocalCluster

pytestmark = pytest.mark.redis


def _one_key_per_node(rc: RedisCluster, prefix: str) -> dict[int, str]:
    """node port -> a key (`{<tag>}...`) whose hash tag puts it on that node."""
    keys: dict[int, str] = {}
    for i in range(1000):
        key = f"{{{prefix}-{i}}}:k"
        keys.setdefault(rc.get_node_from_key(key).port, key)
        if len(keys) == 3:
            break
    return keys


@pytest.fixture
def rc(cluster_url: str) -> Iterator[RedisCluster]:
    client = RedisCluster.from_url(cluster_url, decode_responses=True)
    yield client
    client.close()


def test_hash_tags_spread_keys_over_all_three_nodes(rc: RedisCluster) -> None:
    keys = _one_key_per_node(rc, "spread")
    assert len(keys) == 3
    assert len({rc.keyslot(k) for k in keys.values()}) == 3
    assert {n.port for n in rc.get_primaries()} == set(keys)


def test_set_and_get_on_every_node(rc: RedisCluster) -> None:
    for port, key in _one_key_per_node(rc, "rw").items():
        assert rc.set(key, f"on {port}")
        assert rc.get(key) == f"on {port}"
        # It is stored on that node itself, not just reachable through redirects.
        with redis.Redis(host="127.0.0.1", port=port, decode_responses=True) as node:
            assert node.get(key) == f"on {port}"
        rc.delete(key)


def _state(port: int) -> str | None:
    try:
        with redis.Redis(host="127.0.0.1", port=port, decode_responses=True,
                         socket_timeout=1) as r:  # fmt: skip
            info = r.execute_command("CLUSTER", "INFO")
    except redis.RedisError:
        return None
    return dict(line.split(":", 1) for line in info.splitlines() if ":" in line).get(
        "cluster_state"
    )


def _wait_state(port: int, state: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while _state(port) != state:
        assert time.monotonic() < deadline, f":{port} never reported cluster_state:{state}"
        time.sleep(0.1)


def test_a_killed_node_restarts_and_the_cluster_is_ok_again() -> None:
    # Its own cluster: a node down would fail the session one's tests meanwhile.
    with LocalCluster() as cluster:
        cluster.kill(1)
        # No replica takes over its slots, so the others see the cluster fail...
        _wait_state(cluster.ports[0], "fail")
        cluster.restart(1)
        # ...until it is back, from its nodes.conf, on the same port.
        for port in cluster.ports:
            assert _state(port) == "ok"
        rc = RedisCluster.from_url(cluster.url, decode_responses=True)
        try:
            key = _one_key_per_node(rc, "back")[cluster.ports[1]]
            assert rc.set(key, "v") and rc.get(key) == "v"
        finally:
            rc.close()

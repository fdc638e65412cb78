"""Two real detokenizer processes on a real redis-server, two token shards, no configuration
of who serves what: kill -9 one mid-request and the other takes its shards over within
seconds, rebuilding its requests from their id logs, so that every client still gets exactly
the no-fault text, every id once and in order, and one finish; SIGTERM hands the shards over
at once and exits 0."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from transformers import AutoTokenizer

from shared import heartbeat
from shared.config import DetokenizerSettings, Settings
from shared.keys import Keys
from tests.support.detok_core import received
from tests.support.detok_loop import rid_on
from tests.support.detok_procs import Collector, Detokenizers, Traffic, holders
from tests.support.waiting import wait_until

pytestmark = pytest.mark.faults

API_ID = "api-f"
LEASE_TTL_S = 1.5  # a tick every 0.5 s
STEP_S = 0.02
TEXT = (
    "Crème brûlée 🙂, naïve café — 日本語のテキスト and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👩‍👩‍👧 go on; "
    "def f(x):\n\treturn x ** 2  # squares\n"
)


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Any:
    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture
def detoks(redis_url: str, model_path: str, tmp_path: Path) -> Iterator[Detokenizers]:
    settings = Settings(
        redis_url=redis_url,
        key_prefix=f"d{uuid.uuid4().hex[:6]}",
        num_token_shards=2,
        model=model_path,
        detokenizer=DetokenizerSettings(lease_ttl_s=LEASE_TTL_S),
    )
    procs = Detokenizers(settings, tmp_path)
    yield procs
    procs.close()


@pytest.fixture
async def r(redis_url: str) -> Any:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def requests(tokenizer: Any) -> dict[str, list[int]]:
    """Three long requests per shard, each from another point of the text."""
    ids: list[int] = tokenizer.encode(TEXT * 12, add_special_tokens=False)
    rids = [rid_on(shard, 2, f"s{shard}x{i}-") for shard in (0, 1) for i in range(3)]
    return {rid: ids[7 * i :] for i, rid in enumerate(rids)}


async def start_balanced(detoks: Detokenizers, r: aioredis.Redis) -> None:
    detoks.start("d1", shards=[0])
    detoks.start("d2", shards=[1])

    async def balanced() -> bool:
        assert all(p.poll() is None for p in detoks.procs.values()), detoks.logs()
        return await holders(r, detoks.keys, 2) == ["d1", "d2"]

    await wait_until(balanced, timeout=60)


def assert_exact(collector: Collector, traffic: Traffic, tokenizer: Any) -> None:
    for rid, ids in traffic.requests.items():
        text, got_ids, finishes = received(collector.of(rid))
        assert got_ids == ids, rid
        assert text == tokenizer.decode(ids, skip_special_tokens=True), rid
        assert finishes == 1, rid


async def test_a_killed_detokenizer_is_replaced_and_no_text_is_lost(
    detoks: Detokenizers, r: aioredis.Redis, keys: Keys, tokenizer: Any
) -> None:
    await start_balanced(detoks, r)
    traffic = Traffic(r, detoks.keys, 2, API_ID, requests(tokenizer))
    await traffic.create()
    async with Collector(r, detoks.keys, API_ID) as collector:
        for _ in range(20):
            await traffic.step()
            await asyncio.sleep(STEP_S)
        detoks.kill("d1")
        killed_at, taken_after = time.monotonic(), None
        while taken_after is None or time.monotonic() - killed_at < taken_after + 0.5:
            await traffic.step()  # shard 0's steps go nowhere until d2 holds its lease
            await asyncio.sleep(STEP_S)
            if taken_after is None and await holders(r, detoks.keys, 2) == ["d2", "d2"]:
                taken_after = time.monotonic() - killed_at
            assert time.monotonic() - killed_at < 10, detoks.logs()
        await traffic.step(finish=True)

        async def all_finished() -> bool:
            return collector.num_finished() == len(traffic.requests)

        await wait_until(all_finished, timeout=10)
        await asyncio.sleep(0.2)  # anything that would come twice
    assert taken_after is not None and taken_after < 10
    assert_exact(collector, traffic, tokenizer)


async def test_sigterm_hands_the_shards_over_at_once_and_exits_0(
    detoks: Detokenizers, r: aioredis.Redis, tokenizer: Any
) -> None:
    await start_balanced(detoks, r)
    traffic = Traffic(r, detoks.keys, 2, API_ID, requests(tokenizer))
    await traffic.create()
    async with Collector(r, detoks.keys, API_ID) as collector:
        for _ in range(10):
            await traffic.step()
            await asyncio.sleep(STEP_S)
        assert await asyncio.to_thread(detoks.stop, "d1") == 0
        # Released, not left to expire: the lease is gone (or d2's) the moment d1 exited.
        assert (await holders(r, detoks.keys, 2))[0] in (None, "d2")
        live = await heartbeat.live_workers(r, detoks.keys, heartbeat.DETOKENIZER)
        assert live == ["d2"]
        stopped_at = time.monotonic()
        while await holders(r, detoks.keys, 2) != ["d2", "d2"]:
            await traffic.step()
            await asyncio.sleep(STEP_S)
            assert time.monotonic() - stopped_at < 3, detoks.logs()
        for _ in range(10):
            await traffic.step()
            await asyncio.sleep(STEP_S)
        await traffic.step(finish=True)

        async def all_finished() -> bool:
            return collector.num_finished() == len(traffic.requests)

        await wait_until(all_finished, timeout=10)
        await asyncio.sleep(0.2)
    assert_exact(collector, traffic, tokenizer)

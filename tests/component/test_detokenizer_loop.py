"""DetokenizerLoop on fakeredis: token channels in (a lone detokenizer holds every shard),
output channels out, control channel aborts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import pytest
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from transformers import AutoTokenizer

from shared import protocol, request_state
from shared.config import Settings
from shared.keys import Keys
from shared.protocol import DetokParams, FinishReason, TextBatch, TokenBatch, TokenEntry
from workers.detokenizer.core import Tokenizer
from workers.detokenizer.loop import DetokenizerLoop

TEXT = "Hello 🙂, how are you?"
LENGTH = FinishReason(type="length", length=8)


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Any:
    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture
def settings(keys: Keys) -> Settings:
    return Settings(key_prefix=keys.prefix, num_token_shards=2)


@pytest.fixture
async def loop(
    fake_server: fakeredis.FakeServer, keys: Keys, settings: Settings, tokenizer: Tokenizer
) -> AsyncIterator[DetokenizerLoop]:
    """The worker under test, on its own connection (another "process" on the same server)."""
    redis = fakeredis.FakeAsyncRedis(server=fake_server)
    worker = DetokenizerLoop(redis, keys, settings, tokenizer)
    await worker.start()
    yield worker
    await worker.close()
    await redis.aclose()


@pytest.fixture
async def outputs(fake_redis: aioredis.Redis, keys: Keys) -> AsyncIterator[PubSub]:
    pubsub = fake_redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(keys.output_channel("api-1"), keys.output_channel("api-2"))
    yield pubsub
    await pubsub.aclose()


def encode(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


async def publish(r: aioredis.Redis, channel: str, *entries: TokenEntry) -> None:
    await r.publish(channel, protocol.encode(TokenBatch(worker_id="w", entries=list(entries))))


async def received(pubsub: PubSub) -> list[tuple[str, TextBatch]]:
    """Everything published so far (None also stands for a skipped subscribe confirmation)."""
    got = []
    deadline = asyncio.get_running_loop().time() + 0.2
    while asyncio.get_running_loop().time() < deadline:
        msg = await pubsub.get_message(timeout=0.05)
        if msg is not None:
            batch = protocol.decode(msg["data"], protocol.OutputMessage)
            got.append((msg["channel"].decode(), batch))
    return got


def first(rid: str, ids: list[int], api_id: str = "api-1") -> TokenEntry:
    return TokenEntry(rid, 0, 0, ids, prompt_tokens=4, detok=DetokParams(api_id=api_id))


async def test_streams_text_batches_to_the_api_channel(
    fake_redis: aioredis.Redis,
    keys: Keys,
    loop: DetokenizerLoop,
    outputs: PubSub,
    tokenizer: Tokenizer,
) -> None:
    ids = encode(tokenizer, TEXT)
    await publish(fake_redis, keys.token_channel(0), first("r1", ids[:2]))
    await publish(fake_redis, keys.token_channel(0), TokenEntry("r1", 0, 2, ids[2:], 4, LENGTH))
    await loop.run(burst=True, idle_timeout=0.1)
    got = await received(outputs)
    assert [ch for ch, _ in got] == [keys.output_channel("api-1")] * 2
    entries = [e for _, batch in got for e in batch.entries]
    assert "".join(e.text for e in entries) == TEXT
    assert [e.seq for e in entries] == [0, 2] and entries[-1].completion_tokens == len(ids)
    assert entries[-1].finish == LENGTH and entries[-1].prompt_tokens == 4
    assert "r1" not in loop.core


async def test_one_batch_per_api_id_on_two_channels(
    fake_redis: aioredis.Redis,
    keys: Keys,
    loop: DetokenizerLoop,
    outputs: PubSub,
    tokenizer: Tokenizer,
) -> None:
    ids = encode(tokenizer, "one two")
    await publish(
        fake_redis,
        keys.token_channel(1),
        first("a", ids, "api-1"),
        first("b", ids, "api-2"),
        first("c", ids, "api-1"),
    )
    assert await loop.run_once(timeout=1.0) is True
    got = {ch: [e.rid for e in batch.entries] for ch, batch in await received(outputs)}
    assert got == {keys.output_channel("api-1"): ["a", "c"], keys.output_channel("api-2"): ["b"]}


async def test_garbage_does_not_kill_the_loop(
    fake_redis: aioredis.Redis,
    keys: Keys,
    loop: DetokenizerLoop,
    outputs: PubSub,
    tokenizer: Tokenizer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    newer = TokenBatch(worker_id="w", entries=[first("x", [28])], v=protocol.PROTOCOL_VERSION + 1)
    await fake_redis.publish(keys.token_channel(0), b"\x00garbage")
    await fake_redis.publish(keys.token_channel(0), protocol.encode(newer))
    await fake_redis.publish(keys.control_channel, b"not msgpack either")
    await publish(fake_redis, keys.token_channel(0), first("ok", encode(tokenizer, "fine")))
    with caplog.at_level(logging.WARNING):
        await loop.run(burst=True, idle_timeout=0.1)
    assert caplog.text.count("undecodable") == 3
    got = await received(outputs)
    assert [e.text for _, b in got for e in b.entries] == ["fine"]
    assert "x" not in loop.core


async def test_abort_on_control_channel_drops_state(
    fake_redis: aioredis.Redis,
    keys: Keys,
    loop: DetokenizerLoop,
    outputs: PubSub,
    tokenizer: Tokenizer,
) -> None:
    await publish(fake_redis, keys.token_channel(0), first("r1", [28]), first("r2", [28]))
    await loop.run(burst=True, idle_timeout=0.1)
    assert "r1" in loop.core and "r2" in loop.core
    pipe = fake_redis.pipeline()
    request_state.abort(pipe, keys, ["r1"])
    await pipe.execute()
    await loop.run(burst=True, idle_timeout=0.1)
    assert "r1" not in loop.core and "r2" in loop.core


async def test_unknown_rid_gets_api_id_from_request_state(
    fake_redis: aioredis.Redis,
    keys: Keys,
    loop: DetokenizerLoop,
    outputs: PubSub,
    tokenizer: Tokenizer,
) -> None:
    pipe = fake_redis.pipeline()
    request_state.create(pipe, keys, "r9", "api-2", prompt_tokens=4)
    await pipe.execute()
    ids = encode(tokenizer, "after a restart")
    await publish(fake_redis, keys.token_channel(0), TokenEntry("r9", 0, 3, ids, 4))
    await publish(fake_redis, keys.token_channel(0), TokenEntry("nobody", 0, 3, ids, 4))
    await loop.run(burst=True, idle_timeout=0.1)
    got = await received(outputs)
    assert [(ch, [e.rid for e in b.entries]) for ch, b in got] == [
        (keys.output_channel("api-2"), ["r9"])
    ]
    assert got[0][1].entries[0].text == "after a restart"


async def test_only_shards_it_holds_a_lease_on(
    fake_server: fakeredis.FakeServer,
    fake_redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    outputs: PubSub,
    tokenizer: Tokenizer,
) -> None:
    await fake_redis.set(keys.shard_lease(0), "another-detokenizer", px=60_000)
    worker = DetokenizerLoop(
        fakeredis.FakeAsyncRedis(server=fake_server), keys, settings, tokenizer
    )
    await worker.start()
    assert worker.channels == [keys.token_channel(1), keys.control_channel]
    await publish(fake_redis, keys.token_channel(0), first("s0", [28]))
    await publish(fake_redis, keys.token_channel(1), first("s1", [28]))
    await worker.run(burst=True, idle_timeout=0.1)
    await worker.close()
    assert [e.rid for _, b in await received(outputs) for e in b.entries] == ["s1"]


async def test_run_once_times_out_quietly(loop: DetokenizerLoop) -> None:
    assert await loop.run_once(timeout=0.05) is False

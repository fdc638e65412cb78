"""Driving DetokenizerLoops as a scheduler and an api would: token steps in (id log appended
and PUBLISHed in one transaction), TextEntries out of `out:{api_id}`."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from shared import protocol, request_state
from shared.config import DetokenizerSettings, Settings
from shared.keys import Keys, shard_of
from shared.protocol import TextEntry, TokenBatch, TokenEntry
from workers.detokenizer.core import Tokenizer
from workers.detokenizer.loop import DetokenizerLoop


def make_loop(
    redis: aioredis.Redis,
    keys: Keys,
    tokenizer: Tokenizer,
    worker_id: str,
    *,
    num_shards: int = 2,
    lease_ttl_s: float = 0.3,
    shards: Iterable[int] = (),
) -> DetokenizerLoop:
    detok = DetokenizerSettings(worker_id=worker_id, shards=list(shards), lease_ttl_s=lease_ttl_s)
    settings = Settings(key_prefix=keys.prefix, num_token_shards=num_shards, detokenizer=detok)
    return DetokenizerLoop(redis, keys, settings, tokenizer)


def rid_on(shard: int, num_shards: int, name: str = "r") -> str:
    """A request id that the scheduler routes to `shard`."""
    return next(f"{name}{i}" for i in range(1000) if shard_of(f"{name}{i}", num_shards) == shard)


async def publish_step(
    r: aioredis.Redis, keys: Keys, num_shards: int, entries: list[TokenEntry], *, lost: bool = False
) -> None:
    """One scheduler step: the ids appended to each id log and, in the same transaction, one
    TokenBatch per shard (left out with `lost`: pub/sub dropped it)."""
    pipe = r.pipeline(transaction=True)
    batches: dict[int, list[TokenEntry]] = defaultdict(list)
    for entry in entries:
        request_state.append_ids(pipe, keys, entry.rid, entry.token_ids)
        batches[shard_of(entry.rid, num_shards)].append(entry)
    if not lost:
        for shard, batch in batches.items():
            message = protocol.encode(TokenBatch(worker_id="sched", entries=batch))
            pipe.publish(keys.token_channel(shard), message)
    await pipe.execute()


async def drain(pubsub: PubSub, wait_s: float = 0.2) -> list[TextEntry]:
    """Every TextEntry that arrives within `wait_s`."""
    return [entry for _, entry in await drain_routed(pubsub, wait_s)]


async def drain_routed(pubsub: PubSub, wait_s: float = 0.2) -> list[tuple[str, TextEntry]]:
    """(channel, TextEntry) for every entry that arrives within `wait_s` (None also stands
    for a skipped subscribe confirmation)."""
    got: list[tuple[str, TextEntry]] = []
    deadline = asyncio.get_running_loop().time() + wait_s
    while asyncio.get_running_loop().time() < deadline:
        msg = await pubsub.get_message(timeout=0.05)
        if msg is not None:
            batch = protocol.decode(msg["data"], protocol.OutputMessage)
            got.extend((msg["channel"].decode(), entry) for entry in batch.entries)
    return got

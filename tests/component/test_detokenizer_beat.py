"""A detokenizer's heartbeat carries its figures (shards held, live decode states, batches
handled, entries published), which the api's fleet views and /metrics read."""

from __future__ import annotations

from typing import Any

import fakeredis
import redis.asyncio as aioredis
from transformers import AutoTokenizer

from shared import heartbeat, protocol
from shared.config import Settings
from shared.keys import Keys
from shared.protocol import DetokParams, TokenBatch, TokenEntry
from workers.detokenizer.loop import DetokenizerLoop


async def test_the_beat_reports_shards_states_and_counts(
    fake_server: fakeredis.FakeServer, fake_redis: aioredis.Redis, keys: Keys, model_path: str
) -> None:
    tokenizer: Any = AutoTokenizer.from_pretrained(model_path)
    r = fakeredis.FakeAsyncRedis(server=fake_server)
    settings = Settings(key_prefix=keys.prefix, num_token_shards=2)
    settings.detokenizer.worker_id = "detok-a"
    loop = DetokenizerLoop(r, keys, settings, tokenizer)
    await loop.start()
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    for rid in ("a", "b"):
        entry = TokenEntry(rid, 0, 0, ids, prompt_tokens=3, detok=DetokParams(api_id="api-1"))
        batch = TokenBatch(worker_id="w", entries=[entry])
        await fake_redis.publish(keys.token_channel(0), protocol.encode(batch))
    await loop.run(burst=True, idle_timeout=0.1)
    await loop.maintain()
    beats = await heartbeat.live_beats(fake_redis, keys, heartbeat.DETOKENIZER,
                                       heartbeat.DetokenizerBeat)  # fmt: skip
    assert set(beats) == {"detok-a"}
    beat = beats["detok-a"]
    assert beat.shards == "0,1"  # a lone detokenizer holds every shard
    assert (beat.num_states, beat.num_batches, beat.num_entries) == (2, 2, 2)
    await loop.shutdown()
    assert await heartbeat.live_beats(fake_redis, keys, heartbeat.DETOKENIZER,
                                      heartbeat.DetokenizerBeat) == {}  # fmt: skip
    await r.aclose()

"""The scheduler loop taking over after other schedulers (fakeredis, scripted runner):
reclaim and resume from the id log, fencing of a stale owner, dead letters, planned stops."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from shared import protocol, request_state, request_stream
from shared.keys import SCHEDULER_GROUP, Keys
from tests.support.scheduler_loop import (
    ScriptedRunner,
    entries_of,
    generated_before,
    make_idle,
    make_loop,
    num_pending,
    pending,
    pending_entry,
    received,
    submit,
    subscribe,
    take_as,
    take_over,
)

SCRIPT = {"a": [5, 6, 7, 8]}


async def _ids(r: aioredis.Redis, keys: Keys, rid: str) -> list[int]:
    return [int(i) for i in await r.lrange(keys.ids(rid), 0, -1)]


async def test_a_dead_schedulers_job_resumes_after_the_ids_it_published(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    await submit(fake_redis, keys, "a", [10, 11, 12], max_new_tokens=4)
    entry_id = await take_as(fake_redis, keys, "ghost")
    await generated_before(fake_redis, keys, "a", epoch=1, ids=[5, 6])
    await make_idle(fake_redis, keys, "ghost", entry_id)
    runner = ScriptedRunner(SCRIPT)
    loop = make_loop(fake_redis, keys, runner)
    pubsub = await subscribe(fake_redis, keys)
    await loop.run(burst=True)

    entries = entries_of(await received(pubsub), "a")
    assert [(e.epoch, e.seq, e.token_ids) for e in entries] == [(2, 2, [7]), (2, 3, [8])]
    assert entries[0].detok == protocol.DetokParams(api_id="api-1")  # the new epoch's first
    assert entries[-1].finish == protocol.FinishReason(type="length", length=4)
    assert runner.steps[0] == {"a": 5}  # prompt + the 2 ids already generated, prefilled
    assert await _ids(fake_redis, keys, "a") == SCRIPT["a"]
    state = await request_state.read(fake_redis, keys, "a")
    assert state is not None and (state.status, state.epoch, state.worker) == ("finished", 2, "w1")
    assert await num_pending(fake_redis, keys) == 0


async def test_a_job_whose_owner_still_renews_it_is_not_taken(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    await submit(fake_redis, keys, "a", max_new_tokens=4)
    await take_as(fake_redis, keys, "alive")  # just delivered: far from the reclaim time
    loop = make_loop(fake_redis, keys, ScriptedRunner(SCRIPT))
    await loop.run(burst=True)
    assert [p[0] for p in await pending(fake_redis, keys)] == ["alive"]
    assert await fake_redis.llen(keys.ids("a")) == 0


async def test_a_stale_owner_cannot_append_publish_or_finish(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    loop = make_loop(fake_redis, keys, ScriptedRunner(SCRIPT))
    pubsub = await subscribe(fake_redis, keys)
    await submit(fake_redis, keys, "a", max_new_tokens=4)
    await loop.run_once()  # owns it (epoch 1) and publishes seq 0
    [(owner, _idle, _n)] = await pending(fake_redis, keys)
    assert owner == "w1"
    await take_over(fake_redis, keys, "a", "w2")  # while w1 was frozen
    await loop.run(burst=True)  # w1 wakes up and steps on

    entries = entries_of(await received(pubsub), "a")
    assert [(e.epoch, e.seq) for e in entries] == [(1, 0)]  # nothing after the takeover
    assert await _ids(fake_redis, keys, "a") == [5]
    assert [p[0] for p in await pending(fake_redis, keys)] == ["w2"]  # not acked by w1
    state = await request_state.read(fake_redis, keys, "a")
    assert state is not None and state.status == "running" and state.finish_reason is None
    assert loop.core.is_idle  # w1 dropped it and freed its KV blocks
    assert loop.core.block_manager.num_free_blocks == loop.core.block_manager.num_total_blocks


async def test_a_renewal_that_finds_the_job_taken_drops_it(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    loop = make_loop(fake_redis, keys, ScriptedRunner(SCRIPT))
    await submit(fake_redis, keys, "a", max_new_tokens=4)
    await loop.run_once()
    entry_id = await pending_entry(fake_redis, keys)
    await fake_redis.xclaim(keys.request_stream, SCHEDULER_GROUP, "w2", 0, [entry_id])
    loop._batch_changed = True  # the next step beats and renews
    await loop.run_once()
    assert loop.core.is_idle
    assert [p[0] for p in await pending(fake_redis, keys)] == ["w2"]  # renew did not take it back


async def test_a_job_delivered_too_often_is_dead_lettered_with_an_error_for_its_client(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    await submit(fake_redis, keys, "a", max_new_tokens=4)
    entry_id = await take_as(fake_redis, keys, "ghost")
    await generated_before(fake_redis, keys, "a", epoch=3, ids=[5])
    await make_idle(fake_redis, keys, "ghost", entry_id, deliveries=3)  # the 4th is one too many
    loop = make_loop(fake_redis, keys, ScriptedRunner(SCRIPT))
    pubsub = await subscribe(fake_redis, keys)
    await loop.run(burst=True)

    [entry] = entries_of(await received(pubsub), "a")
    assert (entry.epoch, entry.seq, entry.token_ids) == (4, 1, [])
    assert entry.finish is not None and entry.finish.type == "abort"
    assert entry.finish.status_code == 500 and "4 deliveries" in (entry.finish.message or "")
    [(_id, letter)] = await request_stream.dead_letters(fake_redis, keys)
    assert (letter["rid"], letter["deliveries"]) == ("a", "4")
    assert "4 deliveries" in letter["reason"]
    state = await request_state.read(fake_redis, keys, "a")
    assert state is not None and state.status == "aborted"
    assert await num_pending(fake_redis, keys) == 0


async def test_a_dead_letter_retried_runs_again_from_the_start(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    await submit(fake_redis, keys, "a", max_new_tokens=4)
    entry_id = await take_as(fake_redis, keys, "ghost")
    await make_idle(fake_redis, keys, "ghost", entry_id, deliveries=3)
    loop = make_loop(fake_redis, keys, ScriptedRunner(SCRIPT))
    await loop.run(burst=True)
    assert await request_stream.retry_dead_letter(fake_redis, keys, "a")
    assert not await request_stream.retry_dead_letter(fake_redis, keys, "a")  # gone from the DLQ
    await loop.run(burst=True)
    assert await _ids(fake_redis, keys, "a") == SCRIPT["a"]
    state = await request_state.read(fake_redis, keys, "a")
    assert state is not None and state.status == "finished"
    assert await request_stream.dead_letters(fake_redis, keys) == []


async def test_stop_hands_unfinished_jobs_over_at_once_without_counting_a_delivery(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    first = make_loop(fake_redis, keys, ScriptedRunner(SCRIPT), scheduler={"drain_s": 0})
    await submit(fake_redis, keys, "a", max_new_tokens=4)
    await first.run_once()
    first.stop()
    await first.run()
    [(owner, idle_ms, deliveries)] = await pending(fake_redis, keys)
    assert owner == "w1" and idle_ms > 12_000 and deliveries == 0
    assert not await fake_redis.exists(keys.heartbeat("scheduler", "w1"))

    second = make_loop(fake_redis, keys, ScriptedRunner(SCRIPT), worker_id="w2")
    await second.run(burst=True)
    assert await _ids(fake_redis, keys, "a") == SCRIPT["a"]
    state = await request_state.read(fake_redis, keys, "a")
    assert state is not None and (state.status, state.epoch, state.worker) == ("finished", 2, "w2")


async def test_stop_finishes_running_requests_within_the_drain_time(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    loop = make_loop(fake_redis, keys, ScriptedRunner(SCRIPT), scheduler={"drain_s": 30})
    await submit(fake_redis, keys, "a", max_new_tokens=4)
    await loop.run_once()
    await submit(fake_redis, keys, "b", max_new_tokens=4)  # arrives after the stop: not read
    loop.stop()
    await loop.run()
    assert await _ids(fake_redis, keys, "a") == SCRIPT["a"]
    assert await num_pending(fake_redis, keys) == 0
    assert await fake_redis.xlen(keys.request_stream) == 1  # b waits for another scheduler


async def test_a_step_whose_reply_was_lost_is_sent_again_without_doubling_the_log(
    fake_redis: aioredis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = make_loop(fake_redis, keys, ScriptedRunner(SCRIPT))
    pubsub = await subscribe(fake_redis, keys)
    await submit(fake_redis, keys, "a", max_new_tokens=4)
    real_pipeline = fake_redis.pipeline
    calls = iter(range(100))

    def reply_lost_once(transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = real_pipeline(transaction=transaction, shard_hint=shard_hint)
        if transaction and next(calls) == 1:
            execute = pipe.execute

            async def run_then_fail(*args: Any, **kwargs: Any) -> Any:
                await execute(*args, **kwargs)  # Redis did it; the reply never came back
                raise RedisConnectionError("connection lost")

            pipe.execute = run_then_fail  # type: ignore[method-assign]
        return pipe

    monkeypatch.setattr(fake_redis, "pipeline", reply_lost_once)
    await loop.run(burst=True)
    assert await _ids(fake_redis, keys, "a") == SCRIPT["a"]
    entries = entries_of(await received(pubsub), "a")
    assert [e.seq for e in entries] == [0, 1, 1, 3]  # the resent step repeats seq 1 (deduped)
    assert await num_pending(fake_redis, keys) == 0

"""The scheduler loop on fakeredis with a scripted model runner: jobs in, TokenBatches out."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from shared import protocol, request_state
from shared.keys import Keys
from tests.support.scheduler_loop import (
    EOS,
    VOCAB,
    ScriptedRunner,
    entries_of,
    make_loop,
    num_pending,
    received,
    submit,
    subscribe,
)
from workers.scheduler.loop import SchedulerLoop


async def test_jobs_come_out_as_one_token_batch_per_step(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    runner = ScriptedRunner({"a": [5, 6, 7], "b": [8, EOS]})
    loop = make_loop(fake_redis, keys, runner)
    pubsub = await subscribe(fake_redis, keys)
    await submit(fake_redis, keys, "a", max_new_tokens=3)
    await submit(fake_redis, keys, "b", [20, 21])
    await loop.run(burst=True)
    batches = await received(pubsub)

    assert runner.steps == [{"a": 3, "b": 2}, {"a": 1, "b": 1}, {"a": 1}]
    assert len(batches) == len(runner.steps)  # one message per step, not per token
    assert all(b.worker_id == "w1" for b in batches)
    a, b = entries_of(batches, "a"), entries_of(batches, "b")
    detok = protocol.DetokParams(api_id="api-1")
    assert [(e.epoch, e.seq, e.token_ids, e.prompt_tokens) for e in a] == [
        (1, 0, [5], 3),
        (1, 1, [6], 3),
        (1, 2, [7], 3),
    ]
    assert [e.detok for e in a] == [detok, None, None]
    assert [e.finish for e in a] == [None, None, protocol.FinishReason(type="length", length=3)]
    assert [(e.seq, e.token_ids, e.prompt_tokens) for e in b] == [(0, [8], 2), (1, [EOS], 2)]
    assert b[-1].finish == protocol.FinishReason(type="stop", matched=EOS)

    assert await fake_redis.lrange(keys.ids("a"), 0, -1) == [b"5", b"6", b"7"]
    state = await request_state.get(fake_redis, keys, "a")
    assert state["status"] == "finished" and state["worker"] == "w1" and state["epoch"] == "1"
    assert state["completion_tokens"] == "3"
    assert await num_pending(fake_redis, keys) == 0
    assert await fake_redis.xlen(keys.request_stream) == 0


async def test_a_job_is_acked_only_in_the_step_that_finishes_it(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    loop = make_loop(fake_redis, keys, ScriptedRunner())
    pubsub = await subscribe(fake_redis, keys)
    await submit(fake_redis, keys, "short", max_new_tokens=2, ignore_eos=True)
    await submit(fake_redis, keys, "long", max_new_tokens=4, ignore_eos=True)
    pending = []
    for _ in range(4):
        await loop.run_once()
        pending.append(await num_pending(fake_redis, keys))
    assert pending == [2, 1, 1, 0]
    finals = [e for b in await received(pubsub) for e in b.entries if e.finish]
    assert [e.rid for e in finals] == ["short", "long"]
    await loop.aclose()


async def run_until_finished(loop: SchedulerLoop, rid: str, pubsub: Any) -> list[Any]:
    entries: list[protocol.TokenEntry] = []
    for _ in range(20):
        await loop.run_once()
        entries += entries_of(await received(pubsub), rid)
        if entries and entries[-1].finish:
            return entries
    raise AssertionError(f"{rid} did not finish: {entries}")


@pytest.mark.parametrize("broadcast", [True, False])
async def test_abort_mid_generation_stops_the_request_and_frees_blocks(
    fake_redis: aioredis.Redis, keys: Keys, broadcast: bool
) -> None:
    loop = make_loop(fake_redis, keys, ScriptedRunner())
    pubsub = await subscribe(fake_redis, keys)
    await submit(fake_redis, keys, "a", max_new_tokens=40, ignore_eos=True)
    await submit(fake_redis, keys, "other", max_new_tokens=40, ignore_eos=True)
    for _ in range(3):
        await loop.run_once()
    pipe = fake_redis.pipeline()
    if broadcast:
        request_state.abort(pipe, keys, ["a"])  # key + control message
    else:
        pipe.set(keys.abort("a"), 1)  # the key alone: found by the per-step check
    await pipe.execute()

    entries = await run_until_finished(loop, "a", pubsub)
    assert entries[-1].finish is not None and entries[-1].finish.type == "abort"
    assert len(entries) < 10
    assert (await request_state.get(fake_redis, keys, "a"))["status"] == "aborted"
    assert await num_pending(fake_redis, keys) == 1
    key = keys.heartbeat("scheduler", "w1")
    beat = await fake_redis.hgetall(key)
    [other] = loop.core.running  # goes on, holding only its own blocks
    assert beat[b"num_running"] == b"1"
    assert int(beat[b"num_free_blocks"]) == 32 - len(other.block_table)

    pipe = fake_redis.pipeline()
    request_state.abort(pipe, keys, ["other"])
    await pipe.execute()
    await run_until_finished(loop, "other", pubsub)
    beat = await fake_redis.hgetall(key)
    assert beat[b"num_running"] == b"0" and beat[b"num_free_blocks"] == b"32"
    assert await num_pending(fake_redis, keys) == 0
    await loop.aclose()


async def test_a_job_aborted_before_it_was_read_never_runs(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    runner = ScriptedRunner()
    loop = make_loop(fake_redis, keys, runner)
    pubsub = await subscribe(fake_redis, keys)
    await submit(fake_redis, keys, "a")
    pipe = fake_redis.pipeline()
    request_state.abort(pipe, keys, ["a"])
    await pipe.execute()
    await loop.run(burst=True)
    [entry] = entries_of(await received(pubsub), "a")
    assert entry.finish is not None and entry.finish.type == "abort"
    assert entry.token_ids == [] and entry.detok is not None
    assert runner.steps == [] and await num_pending(fake_redis, keys) == 0


async def test_bad_jobs_fail_alone_and_the_loop_keeps_serving(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    runner = ScriptedRunner({"good": [5, EOS]})
    loop = make_loop(fake_redis, keys, runner)
    pubsub = await subscribe(fake_redis, keys)
    await fake_redis.xadd(keys.request_stream, {b"job": b"\xc1garbage"})
    await submit(fake_redis, keys, "oov", [5, VOCAB + 7])
    await submit(fake_redis, keys, "too-long", list(range(10, 80)))
    await submit(fake_redis, keys, "good")
    await loop.run(burst=True)
    batches = await received(pubsub)

    for rid in ("oov", "too-long"):
        [entry] = entries_of(batches, rid)
        assert entry.finish is not None and entry.token_ids == []
        assert (entry.finish.type, entry.finish.status_code) == ("abort", 400)
        assert (await request_state.get(fake_redis, keys, rid))["status"] == "aborted"
    oov_finish = entries_of(batches, "oov")[0].finish
    assert oov_finish is not None and "out of vocabulary" in (oov_finish.message or "")
    assert [e.token_ids for e in entries_of(batches, "good")] == [[5], [EOS]]
    assert all(list(step) == ["good"] for step in runner.steps)
    assert await num_pending(fake_redis, keys) == 0
    assert await fake_redis.xlen(keys.request_stream) == 0


@pytest.mark.parametrize(("core", "room"), [({"max_num_seqs": 2}, 2), ({"num_kv_blocks": 3}, 3)])
async def test_the_loop_reads_no_more_jobs_than_it_has_room_for(
    fake_redis: aioredis.Redis, keys: Keys, core: dict[str, int], room: int
) -> None:
    loop = make_loop(fake_redis, keys, ScriptedRunner(), **core)
    for i in range(6):
        await submit(fake_redis, keys, f"r{i}", max_new_tokens=2, ignore_eos=True)
    await loop.run_once()
    assert await num_pending(fake_redis, keys) == room
    await loop.run(burst=True)
    assert await num_pending(fake_redis, keys) == 0
    assert await fake_redis.xlen(keys.request_stream) == 0


async def test_heartbeat_describes_the_batch_and_expires(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    loop = make_loop(fake_redis, keys, ScriptedRunner())
    await submit(fake_redis, keys, "a", max_new_tokens=5, ignore_eos=True)
    await loop.run_once()
    key = keys.heartbeat("scheduler", "w1")
    beat = await fake_redis.hgetall(key)
    assert beat[b"num_running"] == b"1" and beat[b"num_waiting"] == b"0"
    assert beat[b"num_total_blocks"] == b"32" and beat[b"num_free_blocks"] == b"31"
    assert float(beat[b"updated_at"]) > 0
    assert 0 < await fake_redis.ttl(key) <= 10
    await loop.aclose()


async def test_a_failed_step_transaction_is_sent_again_without_gaps(
    fake_redis: aioredis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = ScriptedRunner({"a": [5, 6, 7, 8]})
    loop = make_loop(fake_redis, keys, runner)
    pubsub = await subscribe(fake_redis, keys)
    await submit(fake_redis, keys, "a", max_new_tokens=4)
    transactions = itertools.count()
    real_pipeline = fake_redis.pipeline

    def flaky_pipeline(transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = real_pipeline(transaction=transaction, shard_hint=shard_hint)
        if transaction and next(transactions) == 1:  # the second step's transaction

            async def fail(*_args: Any, **_kwargs: Any) -> Any:
                raise RedisConnectionError("connection lost")

            pipe.execute = fail  # type: ignore[method-assign]
        return pipe

    monkeypatch.setattr(fake_redis, "pipeline", flaky_pipeline)
    await loop.run(burst=True)
    entries = entries_of(await received(pubsub), "a")
    assert [(e.seq, e.token_ids) for e in entries] == [(0, [5]), (1, [6, 7]), (3, [8])]
    assert await fake_redis.lrange(keys.ids("a"), 0, -1) == [b"5", b"6", b"7", b"8"]
    assert await num_pending(fake_redis, keys) == 0


async def test_a_prompt_sharing_a_prefix_reports_cached_tokens(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    runner = ScriptedRunner()
    loop = make_loop(fake_redis, keys, runner)  # block_size 4
    pubsub = await subscribe(fake_redis, keys)
    prompt = list(range(10, 20))
    await submit(fake_redis, keys, "first", prompt, max_new_tokens=2, ignore_eos=True)
    await loop.run(burst=True)
    await submit(fake_redis, keys, "again", [*prompt, 30], max_new_tokens=2, ignore_eos=True)
    await loop.run(burst=True)
    batches = await received(pubsub)

    assert [e.cached_tokens for e in entries_of(batches, "first")] == [0, 0]
    assert [e.cached_tokens for e in entries_of(batches, "again")] == [8, 8]  # 2 full blocks
    assert runner.steps[-2:] == [{"again": 3}, {"again": 1}]
    state = await request_state.get(fake_redis, keys, "again")
    assert state["cached_tokens"] == "8"


async def test_a_long_prompt_is_prefilled_in_chunks_beside_a_running_stream(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    runner = ScriptedRunner()
    loop = make_loop(fake_redis, keys, runner, max_num_batched_tokens=8)
    pubsub = await subscribe(fake_redis, keys)
    await submit(fake_redis, keys, "stream", max_new_tokens=6, ignore_eos=True)
    await loop.run_once()
    await submit(fake_redis, keys, "long", list(range(10, 30)), max_new_tokens=2)
    await loop.run(burst=True)
    batches = await received(pubsub)

    assert runner.steps[1:5] == [
        {"stream": 1, "long": 7},
        {"stream": 1, "long": 7},
        {"stream": 1, "long": 6},  # long's last chunk samples its first token
        {"stream": 1, "long": 1},
    ]
    # A step publishes only what it sampled: nothing for long's first two chunks.
    assert [len(b.entries) for b in batches] == [1, 1, 1, 2, 2, 1]
    assert [e.seq for e in entries_of(batches, "long")] == [0, 1]
    assert [e.seq for e in entries_of(batches, "stream")] == list(range(6))

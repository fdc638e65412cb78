"""The scheduler loop under the fleet's control plane (fakeredis, scripted runner): pause in
each mode and continue, a prefix cache flush, weight updates all at once and rolling, and
the priority bands of the request streams."""

from __future__ import annotations

import redis.asyncio as aioredis

from shared import fleet_control, protocol, request_stream
from shared.fleet_control import Weights
from shared.keys import SCHEDULER_GROUP, Keys
from tests.support.scheduler_loop import (
    ScriptedRunner,
    entries_of,
    make_loop,
    received,
    submit,
    subscribe,
)
from workers.scheduler.loop import SchedulerLoop

SCRIPT = [5, 6, 7, 8, 9, 10]


class ReloadingRunner(ScriptedRunner):
    """A scripted runner whose `reload` switches scripts (or fails for a path "bad")."""

    def __init__(self, scripts: dict[str, list[int]]) -> None:
        super().__init__(scripts)
        self.loaded: list[str] = []

    def reload(self, model_path: str) -> None:
        if model_path == "bad":
            raise ValueError("no checkpoint at bad")
        self.loaded.append(model_path)
        self.scripts = {rid: [t + 10 for t in script] for rid, script in self.scripts.items()}


async def run(loop: SchedulerLoop, times: int) -> None:
    for _ in range(times):
        await loop.run_once()


def tokens(batches: list[protocol.TokenBatch], rid: str) -> list[int]:
    return [t for e in entries_of(batches, rid) for t in e.token_ids]


def finish(batches: list[protocol.TokenBatch], rid: str) -> protocol.FinishReason | None:
    return next((e.finish for e in entries_of(batches, rid) if e.finish), None)


async def beat_field(r: aioredis.Redis, keys: Keys, field: str, worker: str = "w1") -> str:
    value = await r.hget(keys.heartbeat("scheduler", worker), field)  # type: ignore[misc]
    return value.decode() if value else ""


async def test_pause_abort_ends_running_requests_and_new_ones_wait_for_continue(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    loop = make_loop(fake_redis, keys, ScriptedRunner({"a": SCRIPT, "b": SCRIPT}))
    pubsub = await subscribe(fake_redis, keys)
    await submit(fake_redis, keys, "a", max_new_tokens=6)
    await run(loop, 2)
    await fleet_control.pause(fake_redis, keys, "abort")
    await run(loop, 2)
    await submit(fake_redis, keys, "b", max_new_tokens=2)
    await run(loop, 3)
    batches = await received(pubsub)
    reason = finish(batches, "a")
    assert reason is not None and reason.type == "abort" and "paused" in (reason.message or "")
    assert not entries_of(batches, "b")  # accepted, waiting in the stream
    assert await beat_field(fake_redis, keys, "state") == "paused"

    await fleet_control.resume(fake_redis, keys)
    await loop.run(burst=True)
    batches = await received(pubsub)
    assert tokens(batches, "b") == SCRIPT[:2]
    assert await beat_field(fake_redis, keys, "state") == "ready"


async def test_pause_retract_frees_the_kv_and_the_request_finishes_exactly_later(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    runner = ScriptedRunner({"a": SCRIPT})
    loop = make_loop(fake_redis, keys, runner, enable_prefix_caching=False)
    pubsub = await subscribe(fake_redis, keys)
    await submit(fake_redis, keys, "a", max_new_tokens=6)
    await run(loop, 2)
    await fleet_control.pause(fake_redis, keys, "retract")
    await run(loop, 2)
    bm = loop.core.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and len(loop.core.waiting) == 1
    num_steps = len(runner.steps)
    await run(loop, 3)
    assert len(runner.steps) == num_steps  # nothing runs while paused

    await fleet_control.resume(fake_redis, keys)
    await loop.run(burst=True)
    batches = await received(pubsub)
    assert tokens(batches, "a") == SCRIPT
    assert finish(batches, "a") == protocol.FinishReason(type="length", length=6)
    # The retracted request recomputed its prompt and the tokens it had (no prefix cache).
    assert runner.steps[num_steps] == {"a": 3 + 2}


async def test_pause_in_place_keeps_the_kv_and_resumes_where_it_was(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    runner = ScriptedRunner({"a": SCRIPT})
    loop = make_loop(fake_redis, keys, runner)
    pubsub = await subscribe(fake_redis, keys)
    await submit(fake_redis, keys, "a", max_new_tokens=6)
    await run(loop, 2)
    await fleet_control.pause(fake_redis, keys, "in_place")
    await run(loop, 3)
    num_steps = len(runner.steps)
    bm = loop.core.block_manager
    assert bm.num_free_blocks < bm.num_total_blocks and len(loop.core.running) == 1

    await fleet_control.resume(fake_redis, keys)
    await loop.run(burst=True)
    assert tokens(await received(pubsub), "a") == SCRIPT
    assert runner.steps[num_steps] == {"a": 1}  # a decode step: nothing recomputed


async def test_a_scheduler_that_starts_while_the_fleet_is_paused_takes_no_job(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    await fake_redis.set(keys.pause, "in_place")  # the broadcast went out before it started
    runner = ScriptedRunner()
    loop = make_loop(fake_redis, keys, runner)
    await submit(fake_redis, keys, "a", max_new_tokens=2)
    await run(loop, 3)
    assert runner.steps == [] and loop.core.is_idle
    await fake_redis.delete(keys.pause)  # a missed ContinueGeneration: the next beat reads it
    loop._last_heartbeat = 0.0
    await run(loop, 3)
    assert runner.steps


async def test_flush_cache_forgets_every_cached_prefix(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    loop = make_loop(fake_redis, keys, ScriptedRunner())
    await submit(fake_redis, keys, "a", list(range(10, 22)), max_new_tokens=2, ignore_eos=True)
    await loop.run(burst=True)
    assert loop.core.block_manager.cached
    await run(loop, 1)  # subscribed again (a burst run ends by unsubscribing)
    await fleet_control.flush_cache(fake_redis, keys)
    await run(loop, 1)
    assert not loop.core.block_manager.cached


async def test_an_update_drains_reloads_reports_and_stamps_the_new_version(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    runner = ReloadingRunner({"a": SCRIPT, "b": SCRIPT})
    loop = make_loop(fake_redis, keys, runner)
    pubsub = await subscribe(fake_redis, keys)
    await submit(fake_redis, keys, "a", max_new_tokens=3)
    await run(loop, 1)
    await fleet_control.set_target(fake_redis, keys, Weights("/new", "v2"))
    await submit(fake_redis, keys, "b", max_new_tokens=2)
    await loop.run(burst=True)
    batches = await received(pubsub)
    # "a" finished on the old weights before the load; "b" waited and ran on the new ones.
    assert tokens(batches, "a") == SCRIPT[:3] and tokens(batches, "b") == [15, 16]
    assert [e.weight_version for e in entries_of(batches, "a") if e.finish] == ["default"]
    assert [e.weight_version for e in entries_of(batches, "b") if e.finish] == ["v2"]
    assert runner.loaded == ["/new"] and loop.control.loaded == Weights("/new", "v2")
    assert await fleet_control.results(fake_redis, keys, "v2") == {"w1": "ok"}
    assert await beat_field(fake_redis, keys, "weight_version") == "v2"
    assert await fake_redis.hget(keys.state("b"), "weight_version") == b"v2"  # type: ignore[misc]


async def test_a_failed_load_keeps_the_old_weights_and_says_why(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    runner = ReloadingRunner({"a": SCRIPT})
    loop = make_loop(fake_redis, keys, runner)
    await fleet_control.set_target(fake_redis, keys, Weights("bad", "v2"))
    await submit(fake_redis, keys, "a", max_new_tokens=2)
    await loop.run(burst=True)
    results = await fleet_control.results(fake_redis, keys, "v2")
    assert "no checkpoint at bad" in results["w1"]
    assert loop.control.loaded.weight_version == "default" and not runner.loaded
    assert loop.control.pending_update() is None  # not tried again


async def test_a_rolling_update_loads_on_one_scheduler_at_a_time(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    runners = [ReloadingRunner({}), ReloadingRunner({})]
    loops = [make_loop(fake_redis, keys, runners[i], worker_id=f"w{i}") for i in (0, 1)]
    await fleet_control.set_target(fake_redis, keys, Weights("/new", "v2", "rolling"))
    states: set[tuple[str, str]] = set()
    for _ in range(40):
        for loop in loops:
            loop._last_heartbeat = 0.0  # beat (and ask for the turn) every iteration
            await loop.run_once()
        states.add((loops[0].steering.state(False), loops[1].steering.state(False)))
        if all(loop.control.loaded.weight_version == "v2" for loop in loops):
            break
    for loop in loops:  # the beat after the load reports it
        loop._last_heartbeat = 0.0
        await loop.run_once()
    assert [r.loaded for r in runners] == [["/new"], ["/new"]]
    assert ("updating", "updating") not in states
    assert await fleet_control.results(fake_redis, keys, "v2") == {"w0": "ok", "w1": "ok"}
    assert not await fake_redis.exists(keys.weights_turn)


async def test_schedulers_take_the_highest_priority_band_first(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    runner = ScriptedRunner()
    loop = make_loop(fake_redis, keys, runner, max_num_seqs=1)
    for rid, priority in (("low", -5), ("normal", 0), ("high", 3)):
        job = protocol.GenerateJob(rid=rid, input_ids=[10, 11], priority=priority,
                                   sampling=protocol.SamplingParams(max_new_tokens=1),
                                   detok=protocol.DetokParams(api_id="api-1"))  # fmt: skip
        pipe = fake_redis.pipeline()
        request_stream.submit(pipe, keys, job)
        await pipe.execute()
    assert [await fake_redis.xlen(s) for s in keys.request_streams] == [1, 1, 1]
    await loop.run(burst=True)
    order = [next(iter(step)) for step in runner.steps]
    assert order == ["high", "normal", "low"]
    # Each band's entry was acked in its own stream.
    assert [await fake_redis.xlen(s) for s in keys.request_streams] == [0, 0, 0]


async def test_a_busy_read_takes_the_bands_in_order_up_to_its_count_in_one_call(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    await fake_redis.xadd(keys.request_stream_of("high"), {"x": "1"})  # a stream, no group
    assert await request_stream.read(fake_redis, keys, "w1", 2, block_ms=None) == []
    assert await fake_redis.xinfo_groups(keys.request_stream_of("high"))  # made again
    await fake_redis.delete(*keys.request_streams)
    await request_stream.ensure_group(fake_redis, keys)
    for rid, priority in (("low", -5), ("n1", 0), ("n2", 0), ("high", 3)):
        job = protocol.GenerateJob(rid=rid, input_ids=[10], priority=priority,
                                   sampling=protocol.SamplingParams(max_new_tokens=1),
                                   detok=protocol.DetokParams(api_id="api-1"))  # fmt: skip
        pipe = fake_redis.pipeline()
        request_stream.submit(pipe, keys, job)
        await pipe.execute()
    first = await request_stream.read(fake_redis, keys, "w1", 2, block_ms=None)
    rest = await request_stream.read(fake_redis, keys, "w1", 8, block_ms=None)
    assert [job.rid for _, job in first if job] == ["high", "n1"]
    assert [job.rid for _, job in rest if job] == ["n2", "low"]
    assert [ref.startswith(b"low/") for ref, _ in rest] == [False, True]
    assert await request_stream.read(fake_redis, keys, "w1", 8, block_ms=None) == []


async def test_a_dead_schedulers_job_is_reclaimed_from_its_band(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    job = protocol.GenerateJob(rid="a", input_ids=[10, 11], priority=1,
                               sampling=protocol.SamplingParams(max_new_tokens=2),
                               detok=protocol.DetokParams(api_id="api-1"))  # fmt: skip
    pipe = fake_redis.pipeline()
    request_stream.submit(pipe, keys, job)
    await pipe.execute()
    await request_stream.ensure_group(fake_redis, keys)
    high = keys.request_stream_of("high")
    resp = await fake_redis.xreadgroup(SCHEDULER_GROUP, "dead", {high: ">"}, count=1)
    entry_id = resp[0][1][0][0]
    await fake_redis.xclaim(high, SCHEDULER_GROUP, "dead", 0, [entry_id], idle=60_000)
    loop = make_loop(fake_redis, keys, ScriptedRunner({"a": [5, 6]}))
    pubsub = await subscribe(fake_redis, keys)
    await loop.run(burst=True)
    assert tokens(await received(pubsub), "a") == [5, 6]
    assert (await fake_redis.xpending(high, SCHEDULER_GROUP))["pending"] == 0

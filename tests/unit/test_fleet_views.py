"""The fleet views (api/fleet.py) on fakeredis, what `redserve status` prints of them, and
what `redserve up` says while a scheduler loads."""

from __future__ import annotations

import redis.asyncio as aioredis

from api import fleet
from redserve.startup import StartupReport
from redserve.status import render
from shared import heartbeat, request_stream
from shared.heartbeat import Beat, DetokenizerBeat, SchedulerBeat
from shared.keys import SCHEDULER_GROUP, Keys


def sched(state: str = "ready", progress: str = "", free: int = 48) -> SchedulerBeat:
    return SchedulerBeat(num_running=2, num_waiting=1, num_free_blocks=free, num_total_blocks=64,
                         state=state, progress=progress, updated_at=100.0)  # fmt: skip


VIEW = fleet.FleetView(
    schedulers={"s-b": sched("loading", "timing kernels", free=0), "s-a": sched()},
    detokenizers={"d-a": DetokenizerBeat(shards="0,1", num_states=3, updated_at=99.0)},
    apis={"api-1": Beat(updated_at=100.0)},
    backlog=fleet.Backlog(waiting=4, pending=2),
)


async def test_the_backlog_is_what_waits_and_what_runs(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    assert await fleet.read_backlog(fake_redis, keys) == fleet.Backlog(0, 0)  # no stream yet
    await request_stream.ensure_group(fake_redis, keys)
    for n in range(3):
        await fake_redis.xadd(keys.request_stream, {"job": str(n)})
    await fake_redis.xreadgroup(SCHEDULER_GROUP, "s-a", {keys.request_stream: ">"}, count=1)
    assert await fleet.read_backlog(fake_redis, keys) == fleet.Backlog(waiting=2, pending=1)


async def test_read_fleet_sees_only_live_beats(fake_redis: aioredis.Redis, keys: Keys) -> None:
    async with fake_redis.pipeline(transaction=False) as pipe:
        heartbeat.beat(pipe, keys, "s-a", sched())
        heartbeat.beat(pipe, keys, "s-b", sched("loading"))
        heartbeat.beat(pipe, keys, "d-a", DetokenizerBeat(shards="1"), heartbeat.DETOKENIZER)
        heartbeat.beat(pipe, keys, "api-1", Beat(), heartbeat.API)
        await pipe.execute()
    await fake_redis.delete(keys.heartbeat(heartbeat.SCHEDULER, "s-b"))  # expired
    view = await fleet.read_fleet(fake_redis, keys)
    assert set(view.schedulers) == {"s-a"} and view.ready_schedulers == ["s-a"]
    assert view.detokenizers["d-a"].shards == "1" and set(view.apis) == {"api-1"}


def test_describe_and_load_list_each_worker() -> None:
    described = fleet.describe(VIEW)
    assert [w["id"] for w in described["scheduler"]] == ["s-a", "s-b"]
    assert described["scheduler"][0]["load"]["token_usage"] == 0.25
    assert described["scheduler"][1]["progress"] == "timing kernels"
    assert described["detokenizer"][0]["shards"] == [0, 1]
    assert described["request_stream"] == {"waiting": 4, "pending": 2}
    load = fleet.scheduler_load(VIEW, block_size=16)
    assert [(x["worker"], x["num_reqs"], x["num_tokens"]) for x in load] == [
        ("s-a", 3, 16 * 16), ("s-b", 3, 64 * 16)
    ]  # fmt: skip


def test_status_prints_a_table_per_tier() -> None:
    lines = render(VIEW, "rs", now=110.0)
    assert lines[0] == "fleet 'rs': 1 of 2 schedulers ready"
    header = next(line for line in lines if line.startswith("SCHEDULER"))
    assert header.split() == ["SCHEDULER", "STATE", "RUNNING", "QUEUED", "KV", "USED", "TOK/S",
                              "WEIGHTS", "BEAT", "PROGRESS"]  # fmt: skip
    row_a = next(line for line in lines if line.startswith("s-a "))
    assert row_a.split()[:5] == ["s-a", "ready", "2", "1", "25.0%"]
    assert "10s ago" in row_a
    assert next(line for line in lines if line.startswith("s-b ")).endswith("timing kernels")
    assert next(line for line in lines if line.startswith("d-a ")).split()[:3] == [
        "d-a", "0,1", "3"
    ]  # fmt: skip
    assert lines[-1] == "request stream: 4 waiting, 2 running"


def test_status_says_none_for_an_empty_tier() -> None:
    empty = fleet.FleetView({}, {}, {}, fleet.Backlog())
    lines = render(empty, "rs", now=0.0)
    assert lines[0] == "fleet 'rs': 0 of 0 schedulers ready"
    assert lines[2:4] == ["SCHEDULER", "  (none)"]


def test_up_says_each_change_of_a_loading_scheduler_once() -> None:
    report = StartupReport(started=0.0)
    assert report.lines({"s-a": sched("loading", "loading model weights")}, now=1.0) == [
        "scheduler s-a loading: loading model weights (1 s)"
    ]
    assert report.lines({"s-a": sched("loading", "loading model weights")}, now=3.0) == []
    assert report.lines({"s-a": sched("loading", "timing kernels")}, now=9.0) == [
        "scheduler s-a loading: timing kernels (9 s)"
    ]
    assert report.lines({"s-a": sched("ready")}, now=12.0) == ["scheduler s-a ready (12 s)"]

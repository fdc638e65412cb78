"""The fleet as Redis shows it now: the last beat of every live worker of each tier and the
request stream's backlog. One read, `read_fleet`, serves the fleet gauges of `/metrics`,
`/get_server_info`, `/get_load` and `redserve status`; a worker that stopped beating is
simply not in it (its beat key expired, or it deleted it on a clean stop)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared import heartbeat
from shared.heartbeat import SERVING_STATES, Beat, DetokenizerBeat, SchedulerBeat
from shared.keys import SCHEDULER_GROUP, Keys


@dataclass(frozen=True)
class Backlog:
    """The request streams (one per priority band, group `schedulers`): `waiting` jobs not
    yet delivered to any scheduler (XINFO GROUPS' lag; where Redis cannot tell, a stream's
    length less its pending ones: finished jobs are deleted), `pending` delivered and not
    finished yet."""

    waiting: int = 0
    pending: int = 0


@dataclass(frozen=True)
class FleetView:
    schedulers: dict[str, SchedulerBeat]
    detokenizers: dict[str, DetokenizerBeat]
    apis: dict[str, Beat]
    backlog: Backlog

    @property
    def ready_schedulers(self) -> list[str]:
        """The schedulers with a model to serve with (ready or paused)."""
        return sorted(w for w, b in self.schedulers.items() if b.state in SERVING_STATES)


async def read_fleet(r: aioredis.Redis, keys: Keys) -> FleetView:
    """Every live worker's last beat and the backlog (a few round trips)."""
    return FleetView(
        schedulers=await heartbeat.live_beats(r, keys, heartbeat.SCHEDULER, SchedulerBeat),
        detokenizers=await heartbeat.live_beats(r, keys, heartbeat.DETOKENIZER, DetokenizerBeat),
        apis=await heartbeat.live_beats(r, keys, heartbeat.API, Beat),
        backlog=await read_backlog(r, keys),
    )


async def read_backlog(r: aioredis.Redis, keys: Keys) -> Backlog:
    """The request streams' backlog (every priority band's, summed); zeros before any."""
    waiting = pending = 0
    for stream in keys.request_streams:
        band = await _stream_backlog(r, stream)
        waiting, pending = waiting + band.waiting, pending + band.pending
    return Backlog(waiting=waiting, pending=pending)


async def _stream_backlog(r: aioredis.Redis, stream: str) -> Backlog:
    try:
        groups = await r.xinfo_groups(stream)
        length = int(await r.xlen(stream))
    except ResponseError:  # no such key: nothing was ever submitted to it
        return Backlog()
    for group in groups:
        name = group["name"]
        if (name.decode() if isinstance(name, bytes) else name) != SCHEDULER_GROUP:
            continue
        pending = int(group["pending"])
        lag = group.get("lag")  # Redis >= 7, and None where it cannot be computed
        waiting = int(lag) if lag is not None else max(0, length - pending)
        return Backlog(waiting=waiting, pending=pending)
    return Backlog(waiting=length)  # no scheduler read it yet: every entry waits


def token_usage(beat: SchedulerBeat) -> float:
    """The used fraction of a scheduler's KV cache (0 while it has none yet)."""
    if beat.num_total_blocks <= 0:
        return 0.0
    return 1.0 - beat.num_free_blocks / beat.num_total_blocks


def scheduler_load(view: FleetView, block_size: int) -> list[dict[str, Any]]:
    """SGLang's /get_load, one entry per live scheduler (its `dp_rank` is its place in id
    order): requests held (running + waiting), waiting ones, KV tokens in use."""
    return [
        {
            "dp_rank": rank,
            "worker": worker_id,
            "state": beat.state,
            "num_reqs": beat.num_running + beat.num_waiting,
            "num_waiting_reqs": beat.num_waiting,
            "num_tokens": (beat.num_total_blocks - beat.num_free_blocks) * block_size,
            "token_usage": round(token_usage(beat), 4),
        }
        for rank, (worker_id, beat) in enumerate(sorted(view.schedulers.items()))
    ]


def describe(view: FleetView) -> dict[str, Any]:
    """The live workers of each tier and the backlog, as JSON (for /get_server_info and
    `redserve status --json`)."""
    return {
        "scheduler": [_scheduler(w, b) for w, b in sorted(view.schedulers.items())],
        "detokenizer": [_detokenizer(w, b) for w, b in sorted(view.detokenizers.items())],
        "api": [{"id": w, "updated_at": b.updated_at} for w, b in sorted(view.apis.items())],
        "request_stream": {"waiting": view.backlog.waiting, "pending": view.backlog.pending},
    }


def _scheduler(worker_id: str, beat: SchedulerBeat) -> dict[str, Any]:
    return {
        "id": worker_id,
        "state": beat.state,
        "progress": beat.progress,
        "load": {
            "num_running_reqs": beat.num_running,
            "num_queue_reqs": beat.num_waiting,
            "token_usage": round(token_usage(beat), 4),
            "gen_throughput": round(beat.gen_throughput, 2),
        },
        "model_path": beat.model_path,
        "weight_version": beat.weight_version,
        "updated_at": beat.updated_at,
    }


def _detokenizer(worker_id: str, beat: DetokenizerBeat) -> dict[str, Any]:
    return {
        "id": worker_id,
        "shards": [int(s) for s in beat.shards.split(",") if s],
        "num_states": beat.num_states,
        "num_batches": beat.num_batches,
        "num_entries": beat.num_entries,
        "updated_at": beat.updated_at,
    }

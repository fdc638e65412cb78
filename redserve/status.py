"""`redserve status [--json]`: the fleet in a terminal, read from Redis directly (what an api
replica's /get_server_info lists under `workers`): the live workers of each tier with their
state and load, and the request stream's backlog. Exit 0 when Redis answered, 1 when not."""

from __future__ import annotations

import asyncio
import json
import sys
import time

from api import fleet
from shared.config import Settings
from shared.heartbeat import BeatT, DetokenizerBeat, SchedulerBeat
from shared.redis_conn import REDIS_FAILURES, connect

READ_TIMEOUT_S = 5.0


def run(settings: Settings, as_json: bool = False) -> int:
    if not settings.redis_url:
        sys.stderr.write("redserve status needs --redis-url (or REDSERVE_REDIS_URL)\n")
        return 2
    try:
        view = asyncio.run(_read(settings))
    except REDIS_FAILURES as e:  # TimeoutError is an OSError
        sys.stderr.write(f"Redis at {settings.redis_url} did not answer: {e!r}\n")
        return 1
    if as_json:
        sys.stdout.write(json.dumps(fleet.describe(view), indent=2) + "\n")
    else:
        sys.stdout.write("\n".join(render(view, settings.key_prefix)) + "\n")
    return 0


async def _read(settings: Settings) -> fleet.FleetView:
    r = connect(settings.redis_url, settings.redis_cluster)
    try:
        async with asyncio.timeout(READ_TIMEOUT_S):
            return await fleet.read_fleet(r, settings.redis_keys())
    finally:
        await r.aclose()


def render(view: fleet.FleetView, prefix: str, now: float | None = None) -> list[str]:
    """The lines `redserve status` prints: one table per tier, then the backlog."""
    now = time.time() if now is None else now
    ready = len(view.ready_schedulers)
    backlog = view.backlog
    return [
        f"fleet {prefix!r}: {ready} of {len(view.schedulers)} schedulers ready",
        "",
        *table(SCHEDULER_COLUMNS, [_scheduler_row(w, b, now) for w, b in _by_id(view.schedulers)]),
        "",
        *table(DETOKENIZER_COLUMNS, [_detok_row(w, b, now) for w, b in _by_id(view.detokenizers)]),
        "",
        *table(["API", "BEAT"], [[w, _age(now, b.updated_at)] for w, b in _by_id(view.apis)]),
        "",
        f"request stream: {backlog.waiting} waiting, {backlog.pending} running",
    ]


SCHEDULER_COLUMNS = ["SCHEDULER", "STATE", "RUNNING", "QUEUED", "KV USED", "TOK/S", "WEIGHTS",
                     "BEAT", "PROGRESS"]  # fmt: skip
DETOKENIZER_COLUMNS = ["DETOKENIZER", "SHARDS", "STATES", "BATCHES", "ENTRIES", "BEAT"]


def _scheduler_row(worker_id: str, beat: SchedulerBeat, now: float) -> list[str]:
    return [
        worker_id,
        beat.state,
        str(beat.num_running),
        str(beat.num_waiting),
        f"{fleet.token_usage(beat):.1%}",
        f"{beat.gen_throughput:.1f}",
        beat.weight_version or "-",
        _age(now, beat.updated_at),
        beat.progress,
    ]


def _detok_row(worker_id: str, beat: DetokenizerBeat, now: float) -> list[str]:
    counts = [str(n) for n in (beat.num_states, beat.num_batches, beat.num_entries)]
    return [worker_id, beat.shards or "-", *counts, _age(now, beat.updated_at)]


def _by_id(beats: dict[str, BeatT]) -> list[tuple[str, BeatT]]:
    return sorted(beats.items())


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns two spaces apart (the last one unpadded); "(none)" if no rows."""
    if not rows:
        return [header[0], "  (none)"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


def _age(now: float, at: float) -> str:
    return f"{max(0.0, now - at):.0f}s ago" if at else "-"

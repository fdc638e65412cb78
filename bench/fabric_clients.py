"""bench/fabric.py's clients: C closed-loop streaming clients (`/v1/completions`, random
32-token prompts, `ignore_eos`), spread over the api replicas and over `procs` processes so
the clients themselves are not the first thing to saturate. They ramp up over `ramp_s`, then
the window of `duration` seconds is measured: the text events that arrived in it (TTFT for
a first event, else the gap since the one before: ITL) and the requests that finished in it.
The clients arrive evenly over the ramp (`ramp_s`), each one's first request at its arrival."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

RAMP_S = 3.0  # the default: how long the clients take to arrive
SETTLE_S = 1.0  # after the ramp, before the window opens
MAX_SAMPLES = 200_000  # latencies each client process sends back at most


class Meter(Protocol):
    def start(self) -> None: ...
    def poll(self) -> None: ...


@dataclass
class ClientReport:
    wall_s: float = 0.0
    events: int = 0  # text events in the window
    tokens: int = 0  # events x the tokens per event of the finished requests
    requests: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    client_cores: float = 0.0
    samples: dict[str, list[float]] = field(default_factory=lambda: {"ttft": [], "itl": []})

    def pct(self, name: str, q: float) -> float:
        values = sorted(self.samples[name])
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(len(values) * q / 100))]


def run_clients(
    urls: list[str],
    clients: int,
    duration: float,
    output_len: int,
    procs: int,
    meter: Meter | None = None,
    ramp_s: float = RAMP_S,
) -> ClientReport:
    procs = max(1, min(procs, clients))
    ctx = multiprocessing.get_context("spawn")
    queue: multiprocessing.Queue[dict[str, Any]] = ctx.Queue()
    start_at = time.time() + 2.0  # the processes' start-up
    window = (start_at + ramp_s + SETTLE_S, start_at + ramp_s + SETTLE_S + duration)
    workers = [
        ctx.Process(target=_client_process,
                    args=(urls, list(range(i, clients, procs)), window, output_len, start_at,
                          ramp_s / clients, queue))  # fmt: skip
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    _meter_window(meter, window)
    parts = [queue.get(timeout=duration + 120) for _ in workers]
    for w in workers:
        w.join(30)
    return _merge(parts, duration)


def _meter_window(meter: Meter | None, window: tuple[float, float]) -> None:
    if meter is None:
        return
    time.sleep(max(0.0, window[0] - time.time()))
    meter.start()
    while time.time() < window[1]:
        meter.poll()
        time.sleep(min(1.0, max(0.0, window[1] - time.time())))


def _merge(parts: list[dict[str, Any]], duration: float) -> ClientReport:
    report = ClientReport(wall_s=duration)
    tokens = events_of_finished = 0
    for part in parts:
        report.events += part["events"]
        report.requests += part["requests"]
        report.errors += part["errors"]
        for kind, n in part["error_kinds"].items():
            report.error_kinds[kind] = report.error_kinds.get(kind, 0) + n
        report.client_cores += part["cpu_s"] / duration
        tokens += part["finished_tokens"]
        events_of_finished += part["finished_events"]
        for name in report.samples:
            report.samples[name] += part[name]
    # Tokens per text event as the finished requests had them (1 when none finished yet).
    per_event = tokens / events_of_finished if events_of_finished else 1.0
    report.tokens = round(report.events * per_event)
    return report


def _client_process(
    urls: list[str],
    ids: list[int],
    window: tuple[float, float],
    output_len: int,
    start_at: float,
    gap_s: float,
    queue: multiprocessing.Queue[dict[str, Any]],
) -> None:
    stats = asyncio.run(_clients(urls, ids, window, output_len, start_at, gap_s))
    for name in ("ttft", "itl"):
        if len(stats[name]) > MAX_SAMPLES:
            stats[name] = random.sample(stats[name], MAX_SAMPLES)
    queue.put(stats)


async def _clients(
    urls: list[str], ids: list[int], window: tuple[float, float], output_len: int,
    start_at: float, gap_s: float,
) -> dict[str, Any]:  # fmt: skip
    stats: dict[str, Any] = dict(events=0, requests=0, errors=0, finished_tokens=0,
                                 finished_events=0, ttft=[], itl=[], error_kinds={})  # fmt: skip
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [
            asyncio.create_task(_one_client(session, urls[i % len(urls)], window, output_len,
                                            start_at + gap_s * i, stats))  # fmt: skip
            for i in ids
        ]
        await asyncio.sleep(max(0.0, window[0] - time.time()))
        cpu_at_start = time.process_time()  # this process's own cost, in the window
        await asyncio.sleep(max(0.0, window[1] - time.time()))
        stats["cpu_s"] = time.process_time() - cpu_at_start
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return stats


async def _one_client(
    session: aiohttp.ClientSession, url: str, window: tuple[float, float], output_len: int,
    start_at: float, stats: dict[str, Any],
) -> None:  # fmt: skip
    await asyncio.sleep(max(0.0, start_at - time.time()))
    rng = random.Random()
    while time.time() < window[1]:
        body = {
            "model": "default", "prompt": [rng.randrange(1000, 30000) for _ in range(32)],
            "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        try:
            await _one_request(session, url, body, window, stats)
        except (aiohttp.ClientError, OSError, json.JSONDecodeError) as e:
            _error(stats, type(e).__name__)
            await asyncio.sleep(0.1)


async def _one_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any],
    window: tuple[float, float], stats: dict[str, Any],
) -> None:  # fmt: skip
    sent = time.time()
    num_events = tokens = 0
    last = 0.0
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            _error(stats, f"HTTP {resp.status}")
            await resp.read()
            await asyncio.sleep(float(resp.headers.get("retry-after", 0.1)))
            return
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            if b'"text":"' in line and b'"text":""' not in line:
                now = time.time()
                num_events += 1
                if window[0] <= now <= window[1]:  # latencies of what arrived in the window
                    stats["events"] += 1
                    stats["itl" if last else "ttft"].append(now - (last or sent))
                last = now
            elif b'"usage":{' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    if window[0] <= time.time() <= window[1] and num_events:
        stats["requests"] += 1
        stats["finished_tokens"] += tokens
        stats["finished_events"] += num_events


def _error(stats: dict[str, Any], kind: str) -> None:
    stats["errors"] += 1
    stats["error_kinds"][kind] = stats["error_kinds"].get(kind, 0) + 1

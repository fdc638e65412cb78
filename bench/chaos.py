"""Chaos run: 2 api + 2 schedulers + 2 detokenizers under steady streaming load while a random
tier process is killed (kill -9) every 20-40 s and started again.

    .venv/bin/python bench/chaos.py --minutes 10

Each stream is a greedy /v1/completions request (mixed lengths) whose text is checked against
the same request run before the chaos starts. A stream whose connection breaks (its api
replica died) re-attaches on the other replica with GET /v1/requests/{rid}/stream and
Last-Event-ID, as a standard SSE client would. Prints requests sent / finished / failed,
tokens lost / duplicated against the references (a token diff of the texts), hung streams, and
the time from a kill to an affected stream's next event (p50, p99).
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import random
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

# The repository instead of bench/ (whose kernels.py would shadow the `kernels` package).
sys.path[0] = str(Path(__file__).resolve().parents[1])

from shared.config import SchedulerSettings, Settings  # noqa: E402
from shared.embedded_redis import EmbeddedRedis  # noqa: E402
from shared.keys import shard_of  # noqa: E402
from shared.model_files import resolve_model  # noqa: E402
from tests.support.fleet import Fleet  # noqa: E402

APIS = ("api-a", "api-b")
SCHEDULERS = ("sched-a", "sched-b")
DETOKENIZERS = ("detok-a", "detok-b")
TIER_OF = {**dict.fromkeys(APIS, "api"), **dict.fromkeys(SCHEDULERS, "scheduler"),
           **dict.fromkeys(DETOKENIZERS, "detokenizer")}  # fmt: skip
PROMPTS = [
    "The history of the printing press begins",
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "def quicksort(items):",
    "The three laws of thermodynamics are",
    "Once upon a time, in a city under the sea,",
]
LENGTHS = (16, 32, 64, 96)
NUM_SHARDS = 2
STREAM_GIVE_UP_S = 180.0  # a stream with no event for this long counts as hung


@dataclass
class Stream:
    rid: str
    prompt: str
    max_tokens: int
    api: str
    events: list[tuple[float, str]] = field(default_factory=list)  # (time, text delta)
    finish: str | None = None
    error: str | None = None
    reattaches: int = 0
    hung: bool = False


@dataclass
class Kill:
    at: float
    name: str
    affected: list[str]  # rids


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def body(prompt: str, max_tokens: int, rid: str) -> dict[str, Any]:
    return {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "rid": rid}  # fmt: skip


async def references(client: httpx.AsyncClient, fleet: Fleet) -> dict[tuple[str, int], str]:
    out = {}
    for prompt in PROMPTS:
        for n in LENGTHS:
            rid = f"ref-{uuid.uuid4().hex[:8]}"
            resp = await client.post(
                fleet.url(APIS[0]) + "/v1/completions", json=body(prompt, n, rid)
            )
            resp.raise_for_status()
            out[(prompt, n)] = resp.json()["choices"][0]["text"]
    return out


async def run_stream(client: httpx.AsyncClient, fleet: Fleet, stream: Stream) -> None:
    """Stream; whenever the connection breaks, go to the other api replica: re-attach there
    with Last-Event-ID once the request was accepted, else submit it again (a rid the fleet
    already holds answers 400 "Duplicate", a re-attach to a rid it never got 404)."""
    last_id: str | None = None
    accepted = False
    deadline = time.monotonic() + STREAM_GIVE_UP_S
    while time.monotonic() < deadline:
        if accepted:
            method, payload = "GET", None
            url = fleet.url(stream.api) + f"/v1/requests/{stream.rid}/stream"
        else:
            method, url = "POST", fleet.url(stream.api) + "/v1/completions"
            payload = {**body(stream.prompt, stream.max_tokens, stream.rid), "stream": True}
        headers = {"Last-Event-ID": last_id} if last_id is not None else {}
        try:
            async with client.stream(method, url, json=payload, headers=headers) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread())[:300]
                    accepted = (method == "POST" and b"Duplicate" in text) or (
                        method == "GET" and resp.status_code != 404
                    )
                    raise httpx.HTTPError(f"{method} {resp.status_code}: {text!r}")
                accepted = True
                async for line in resp.aiter_lines():
                    deadline = time.monotonic() + STREAM_GIVE_UP_S
                    if line.startswith("id:"):
                        last_id = line[3:].strip()
                    elif line == "data: [DONE]":
                        return
                    elif line.startswith("data: "):
                        _take_event(stream, json.loads(line[6:]))
                        if stream.error:
                            return
        except (httpx.HTTPError, OSError):
            await asyncio.sleep(0.5)
            stream.api = APIS[1 - APIS.index(stream.api)]
            stream.reattaches += accepted
            continue
        if stream.finish is not None:
            return
    stream.hung = True


def _take_event(stream: Stream, event: dict[str, Any]) -> None:
    if "error" in event:
        stream.error = str(event["error"].get("message"))
        return
    for choice in event.get("choices", []):
        if choice.get("text"):
            stream.events.append((time.monotonic(), choice["text"]))
        if choice.get("finish_reason"):
            stream.finish = choice["finish_reason"]


async def load(client: httpx.AsyncClient, fleet: Fleet, until: float, streams: list[Stream],
               rng: random.Random) -> None:  # fmt: skip
    async def worker(i: int) -> None:
        while time.monotonic() < until:
            s = Stream(f"chaos-{uuid.uuid4().hex[:10]}", rng.choice(PROMPTS), rng.choice(LENGTHS),
                       APIS[i % 2])  # fmt: skip
            streams.append(s)
            await run_stream(client, fleet, s)

    await asyncio.gather(*(worker(i) for i in range(8)))


def affected_by(fleet: Fleet, name: str, live: list[Stream]) -> list[str]:
    r = fleet.redis()
    tier = TIER_OF[name]
    if tier == "api":
        return [s.rid for s in live if s.api == name]
    if tier == "scheduler":
        return [s.rid for s in live if r.hget(fleet.keys.state(s.rid), "worker") == name]
    leases = {sh: r.get(fleet.keys.shard_lease(sh)) for sh in range(NUM_SHARDS)}
    return [s.rid for s in live if leases[shard_of(s.rid, NUM_SHARDS)] == name]


async def chaos(fleet: Fleet, until: float, streams: list[Stream], kills: list[Kill],
                rng: random.Random) -> None:  # fmt: skip
    while True:
        await asyncio.sleep(rng.uniform(20, 40))
        if time.monotonic() >= until:
            return
        name = rng.choice(list(TIER_OF))
        live = [s for s in streams if s.finish is None and not s.hung]
        kills.append(Kill(time.monotonic(), name, affected_by(fleet, name, live)))
        say(f"[{time.strftime('%H:%M:%S')}] kill -9 {name} ({len(kills[-1].affected)} "
              f"streams affected)")  # fmt: skip
        fleet.kill(name)
        fleet.start(name, TIER_OF[name], wait=False)


def token_diff(tokenizer: Any, reference: str, got: str) -> tuple[int, int]:
    """(tokens lost, tokens duplicated or wrong) of `got` against `reference`."""
    ref, out = tokenizer.encode(reference), tokenizer.encode(got)
    lost = extra = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, ref, out, autojunk=False).get_opcodes():
        if op in ("delete", "replace"):
            lost += i2 - i1
        if op in ("insert", "replace"):
            extra += j2 - j1
    return lost, extra


def kill_delays(kills: list[Kill], by_rid: dict[str, Stream]) -> list[float]:
    delays = []
    for kill in kills:
        for rid in kill.affected:
            after = [t for t, _ in by_rid[rid].events if t > kill.at]
            if after:
                delays.append(after[0] - kill.at)
    return delays


def _pct(values: list[float], q: int) -> float:
    if len(values) > 1:
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1]
    return values[0] if values else float("nan")


def report(args: argparse.Namespace, streams: list[Stream], kills: list[Kill],
           refs: dict[tuple[str, int], str], tokenizer: Any) -> str:  # fmt: skip
    finished = [s for s in streams if s.finish and not s.error]
    failed = [s for s in streams if s.error]
    hung = [s for s in streams if s.hung]
    lost = dup = 0
    for s in finished:
        a, b = token_diff(
            tokenizer, refs[(s.prompt, s.max_tokens)], "".join(t for _, t in s.events)
        )
        lost, dup = lost + a, dup + b
    delays = kill_delays(kills, {s.rid: s for s in streams})
    worst = max(delays, default=float("nan"))
    kinds = {
        t: sum(TIER_OF[k.name] == t for k in kills) for t in ("api", "scheduler", "detokenizer")
    }
    rows = [
        ("minutes", f"{args.minutes}"),
        ("kills (api / scheduler / detokenizer)",
         f"{len(kills)} ({kinds['api']} / {kinds['scheduler']} / {kinds['detokenizer']})"),
        ("requests sent / finished / failed / hung",
         f"{len(streams)} / {len(finished)} / {len(failed)} / {len(hung)}"),
        ("streams that re-attached", f"{sum(s.reattaches > 0 for s in streams)}"),
        ("tokens lost / duplicated or wrong (vs greedy references)", f"{lost} / {dup}"),
        ("kill → affected stream's next event, p50 / p99 / max (s)",
         f"{_pct(delays, 50):.1f} / {_pct(delays, 99):.1f} / {worst:.1f} (n={len(delays)})"),
    ]  # fmt: skip
    lines = ["| what | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    for s in failed[:5]:
        lines.append(f"\nfailed {s.rid}: {s.error}")
    for s in hung[:5]:
        lines.append(f"\nhung {s.rid} ({s.prompt!r}, {s.max_tokens} tokens, via {s.api})")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    model = resolve_model("")
    tokenizer = AutoTokenizer.from_pretrained(model)
    server = EmbeddedRedis(appendonly=True)
    settings = Settings(redis_url=server.start(), key_prefix="chaos", model=model,
                        num_token_shards=NUM_SHARDS,
                        scheduler=SchedulerSettings(dtype="float32", kv_cache_tokens=8192,
                                                    num_threads=1))  # fmt: skip
    fleet = Fleet(server, settings, Path(tempfile.mkdtemp(prefix="chaos-logs-")))
    say(f"logs in {fleet.log_dir}")
    try:
        for name in (*DETOKENIZERS, *APIS, *SCHEDULERS):
            fleet.start(name, TIER_OF[name], wait=False)
        for name in (*DETOKENIZERS, *APIS, *SCHEDULERS):
            fleet.wait_ready(name, TIER_OF[name])
        async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=STREAM_GIVE_UP_S)) as client:
            refs = await references(client, fleet)
            say("references ready; chaos starts")
            until = time.monotonic() + args.minutes * 60
            streams: list[Stream] = []
            kills: list[Kill] = []
            await asyncio.gather(load(client, fleet, until, streams, rng),
                                 chaos(fleet, until, streams, kills, rng))  # fmt: skip
        say(f"\n`bench/chaos.py --minutes {args.minutes} --seed {args.seed}`, "
            f"{time.strftime('%Y-%m-%d')}\n")  # fmt: skip
        say(report(args, streams, kills, refs, tokenizer))
    finally:
        fleet.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(main(parser.parse_args()))

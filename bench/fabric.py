"""The Redis fabric with the model taken out: where do one Redis, one detokenizer and one api
replica saturate?

Per configuration (N null schedulers, K detokenizers, M api replicas, C clients) it starts a
private redis-server and the tiers (`redserve scheduler --engine null`: the real loop,
batching and Redis traffic, fixed-time steps), then C closed-loop streaming clients
(`/v1/completions`, spread over the api replicas, in --client-procs processes) run for
--duration seconds after a warm-up. It prints: generated tokens/s (the schedulers' counters)
and delivered tokens/s (at the clients), requests/s, the fabric's added TTFT and ITL over the
null step (p50, p99), the cores each process used (Redis from INFO cpu), peak memory (Redis'
used_memory, the api's RSS per open stream), and what saturated first.

With --cluster each configuration runs a second time on a local 3-node Redis Cluster
(--stream-shards 6, sharded pub/sub), its Redis figures summed over the nodes.

With --real it also serves the real model (one torch scheduler) at 16 and 64 streams and
prints the share of each stepping iteration spent outside the model step: Redis calls and the
loop's bookkeeping (the scheduler's iteration histograms; DESIGN §6's goal: under 5%).

    python -m bench.fabric --config 1,1,1,64 --config 1,1,1,1024 --real [--cluster]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.fabric_clients import run_clients
from bench.fabric_fleet import BenchFleet, CpuMeter, bottleneck
from shared.config import ApiSettings, DetokenizerSettings, SchedulerSettings, Settings

PROMPT_TOKENS = 32


@dataclass(frozen=True)
class Config:
    schedulers: int
    detokenizers: int
    apis: int
    clients: int
    real: bool = False
    cluster: bool = False

    @classmethod
    def parse(cls, text: str) -> Config:
        n, k, m, c = (int(x) for x in text.split(","))
        return cls(n, k, m, c)

    @property
    def label(self) -> str:
        engine = "torch" if self.real else "null"
        where = " (cluster)" if self.cluster else ""
        return f"{self.schedulers}x{engine} / {self.detokenizers} detok / {self.apis} api{where}"


def _settings(cfg: Config, args: argparse.Namespace) -> Settings:
    per_scheduler = -(-cfg.clients // cfg.schedulers)
    sched: dict[str, Any] = dict(max_num_seqs=max(64, per_scheduler))
    if not cfg.real:
        tokens = per_scheduler * (PROMPT_TOKENS + args.output_len) * 2
        sched.update(engine="null", null_step_ms=args.step_ms, kv_cache_tokens=tokens,
                     max_num_batched_tokens=65536)  # fmt: skip
    return Settings(
        redis_cluster=cfg.cluster,
        stream_shards=6 if cfg.cluster else 1,
        key_prefix=f"fab{uuid.uuid4().hex[:6]}",
        model=args.model,
        num_token_shards=max(8, cfg.detokenizers),
        api=ApiSettings(),
        scheduler=SchedulerSettings(**sched),
        detokenizer=DetokenizerSettings(),
        log_level="WARNING",
    )


def run_config(cfg: Config, args: argparse.Namespace, log_root: Path) -> dict[str, Any]:
    log_dir = log_root / f"{cfg.schedulers}-{cfg.detokenizers}-{cfg.apis}-{cfg.clients}"
    log_dir.mkdir(parents=True, exist_ok=True)
    fleet = BenchFleet(_settings(cfg, args), log_dir)
    fleet.start_redis()
    try:
        for tier, count in (("scheduler", cfg.schedulers), ("detokenizer", cfg.detokenizers),
                            ("api", cfg.apis)):  # fmt: skip
            for i in range(count):
                fleet.start(f"{tier}-{i}", tier)
        fleet.wait_ready()
        return measure(fleet, cfg, args)
    finally:
        fleet.close()


def measure(fleet: BenchFleet, cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    urls = [fleet.url(n) for n in fleet.names("api")]
    metrics_urls = [fleet.url(n) + "/metrics" for n in fleet.names("scheduler")]
    run_clients(urls, min(cfg.clients, 16), args.warmup, args.output_len, 1)  # warm-up
    meter = CpuMeter({n: p.pid for n, p in fleet.procs.items()}, fleet.redis_nodes(), metrics_urls)
    rss_idle = {n: psutil_rss(p.pid) for n, p in fleet.procs.items() if n.startswith("api")}
    report = run_clients(
        urls, cfg.clients, args.duration, args.output_len, args.client_procs, meter, args.ramp_s
    )
    cores = {**meter.stop(), "clients": report.client_cores}
    wall = report.wall_s
    api_growth = [meter.peak_rss.get(n, 0) - rss for n, rss in rss_idle.items()]
    step_s = 0.0 if cfg.real else args.step_ms / 1000
    return {
        "config": cfg.label,
        "clients": cfg.clients,
        "generated tok/s": sum(s.generated for s in meter.schedulers) / wall,
        "delivered tok/s": report.tokens / wall,
        "req/s": report.requests / wall,
        "errors": _errors(report.error_kinds),
        "TTFT p50 +": report.pct("ttft", 50) - step_s,
        "TTFT p99 +": report.pct("ttft", 99) - step_s,
        "ITL p50 +": report.pct("itl", 50) - step_s,
        "ITL p99 +": report.pct("itl", 99) - step_s,
        "tokens/event": report.tokens / max(1, report.events),
        "cores": cores,
        "redis MB": meter.peak_rss.get("redis", 0) / 2**20,
        "api KB/stream": max(api_growth, default=0) / 1024 / max(1, cfg.clients // cfg.apis),
        "fabric share": max((s.fabric_share for s in meter.schedulers), default=0.0),
        "saturated": bottleneck(cores, os.cpu_count() or 1),
    }


def _errors(kinds: dict[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]))


def psutil_rss(pid: int) -> int:
    import psutil

    return int(psutil.Process(pid).memory_info().rss)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = ["config", "clients", "generated tok/s", "delivered tok/s", "req/s", "errors",
            "TTFT p50 +", "TTFT p99 +", "ITL p50 +", "ITL p99 +", "tokens/event",
            "redis MB", "api KB/stream", "fabric share", "cores", "saturated"]  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_cell(k, row[k]) for k in head) + " |" for row in rows]
    _say("\n".join(out))


def _cell(key: str, value: Any) -> str:
    if key == "cores":
        return ", ".join(f"{n} {c:.2f}" for n, c in sorted(value.items(), key=lambda kv: -kv[1]))
    if "TTFT" in key or "ITL" in key:
        return f"{value * 1000:.2f} ms"
    if key == "fabric share":
        return f"{value:.1%}"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", default=[], metavar="N,K,M,C",
                        help="null schedulers, detokenizers, api replicas, clients")  # fmt: skip
    parser.add_argument("--real", action="store_true", help="also the real model at 16, 64")
    parser.add_argument("--cluster", action="store_true", help="each also on a 3-node cluster")
    parser.add_argument("--model", default="", help="tokenizer and config (and --real's model)")
    parser.add_argument("--step-ms", type=float, default=20.0, help="the null step time")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds measured")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--client-procs", type=int, default=1)
    parser.add_argument("--ramp-s", type=float, default=3.0, help="the clients arrive over this")
    args = parser.parse_args()
    configs = [Config.parse(c) for c in args.config]
    if args.real:
        configs += [Config(1, 1, 1, c, real=True) for c in (16, 64)]
    if args.cluster:
        configs = [v for c in configs for v in (c, replace(c, cluster=True))]
    rows = []
    log_root = Path(tempfile.mkdtemp(prefix="fabric-"))
    _say(f"logs: {log_root}; {os.cpu_count()} CPUs; step {args.step_ms} ms")
    for cfg in configs:
        started = time.monotonic()
        rows.append(run_config(cfg, args, log_root))
        _say(f"# {cfg.label}, {cfg.clients} clients: {time.monotonic() - started:.0f} s")
    print_table(rows)


if __name__ == "__main__":
    main()

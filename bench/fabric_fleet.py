"""The fleet bench/fabric.py measures: a private redis-server and `redserve <tier>` processes
(schedulers, detokenizers, api replicas), each started with its own id (and port), watched
for CPU and memory by pid, and stopped by pid."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import redis

from bench.fabric_scrape import Scraped, scrape
from shared.config import Settings, child_process_env
from shared.embedded_cluster import LocalCluster
from shared.embedded_redis import EmbeddedRedis, free_port
from shared.keys import Keys

READY_TIMEOUT_S = 300


@dataclass
class BenchFleet:
    base: Settings  # what every process starts from (redis_url is filled in by start_redis)
    log_dir: Path
    server: EmbeddedRedis | LocalCluster = field(default_factory=EmbeddedRedis)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)  # name -> api port or metrics port

    def start_redis(self) -> None:
        if self.base.redis_cluster:
            self.server = LocalCluster()
        self.base.redis_url = self.server.start()

    def redis(self) -> redis.Redis:
        if self.base.redis_cluster:
            return redis.RedisCluster.from_url(self.base.redis_url, decode_responses=True)  # type: ignore[return-value]
        return redis.Redis.from_url(self.base.redis_url, decode_responses=True)

    def redis_nodes(self) -> list[redis.Redis]:
        """A client of each Redis server (one, or every node of the cluster)."""
        if isinstance(self.server, LocalCluster):
            return [redis.Redis(port=port) for port in self.server.ports]
        return [redis.Redis.from_url(self.base.redis_url)]

    @property
    def keys(self) -> Keys:
        return self.base.redis_keys()

    def start(self, name: str, tier: str) -> None:
        settings = self.base.model_copy(deep=True)
        settings.api.api_id = settings.scheduler.worker_id = name
        settings.detokenizer.worker_id = name
        if tier == "api":
            self.ports[name] = settings.api.port = free_port()
        if tier == "scheduler":
            self.ports[name] = settings.scheduler.metrics_port = free_port()
        out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "redserve.cli", tier],
            env=child_process_env(settings), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def wait_ready(self) -> None:
        """Every api answers /health and every scheduler and detokenizer beats, not loading."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        r = self.redis()
        waiting = set(self.procs)
        while waiting and time.monotonic() < deadline:
            for name in list(waiting):
                if self.procs[name].poll() is not None:
                    raise RuntimeError(f"{name} exited: see {self.log_dir}/{name}.log")
                if self._ready(r, name):
                    waiting.discard(name)
            time.sleep(0.3)
        if waiting:
            raise RuntimeError(f"not ready in {READY_TIMEOUT_S}s: {sorted(waiting)}")

    def _ready(self, r: redis.Redis, name: str) -> bool:
        tier = name.split("-")[0]
        if tier == "api":
            try:
                url = f"{self.url(name)}/health"
                with urllib.request.urlopen(url, timeout=1) as resp:
                    return bool(resp.status == 200)
            except OSError:
                return False
        beat = self.keys.heartbeat(tier, name)
        return bool(r.exists(beat)) and r.hget(beat, "state") != "loading"

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def names(self, tier: str) -> list[str]:
        return [n for n in self.procs if n.split("-")[0] == tier]

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        self.server.stop()


class CpuMeter:
    """Between `start` and `stop`: CPU seconds of each named pid and of Redis (INFO cpu), and
    the schedulers' counters (tokens generated, stepping iterations' time and its part
    outside the step); the largest resident memory each pid (and Redis' used_memory)
    reached when polled."""

    def __init__(
        self, pids: dict[str, int], nodes: list[redis.Redis], metrics_urls: list[str]
    ) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.nodes = nodes  # every Redis server: their CPU and memory are summed
        self.metrics_urls = metrics_urls
        self.cpu: dict[str, float] = {}
        self.peak_rss: dict[str, int] = {}
        self.schedulers: list[Scraped] = []  # at start, then (stop) the differences
        self._t0 = 0.0

    def _cpu_now(self) -> dict[str, float]:
        now = {n: sum(p.cpu_times()[:2]) for n, p in self.procs.items()}
        infos = [node.info("cpu") for node in self.nodes]
        now["redis"] = sum(float(i["used_cpu_sys"]) + float(i["used_cpu_user"]) for i in infos)
        return now

    def start(self) -> None:
        self.schedulers = [scrape(url) for url in self.metrics_urls]
        self.cpu, self._t0 = self._cpu_now(), time.monotonic()

    def poll(self) -> None:
        for name, proc in self.procs.items():
            self.peak_rss[name] = max(self.peak_rss.get(name, 0), proc.memory_info().rss)
        used = sum(int(node.info("memory")["used_memory"]) for node in self.nodes)
        self.peak_rss["redis"] = max(self.peak_rss.get("redis", 0), used)

    def stop(self) -> dict[str, float]:
        """Cores each process used on average (CPU seconds per wall second)."""
        wall = time.monotonic() - self._t0
        end = self._cpu_now()
        self.schedulers = [
            scrape(url) - before for url, before in zip(self.metrics_urls, self.schedulers,
                                                          strict=True)
        ]  # fmt: skip
        return {name: (end[name] - self.cpu[name]) / wall for name in end}


def bottleneck(cores: dict[str, float], num_cpus: int) -> str:
    """What saturated first: a process at (nearly) one full core (each tier's work runs on
    one event loop), else the machine's CPUs when they were nearly all busy, else nothing
    (the step time bounds the throughput)."""
    name, top = max(cores.items(), key=lambda kv: kv[1])
    if top >= 0.85:
        return f"{name} ({top:.2f} cores)"
    total = sum(cores.values())
    if total >= 0.85 * num_cpus:
        return f"the machine's {num_cpus} CPUs ({total:.2f} busy; most: {name} {top:.2f})"
    return "none: the step time bounds it"

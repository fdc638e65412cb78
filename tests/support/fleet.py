"""A fleet for fault tests: a real redis-server (AOF, restartable on its port) and named
`redserve <tier>` processes that a test can start, kill, freeze and stop by pid; a streaming
client; a tap on an api replica's output channel; and the invariants every case must leave."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from shared import protocol
from shared.config import Settings, child_process_env
from shared.embedded_redis import EmbeddedRedis, free_port
from shared.keys import SCHEDULER_GROUP, Keys
from tests.support.cluster import LocalCluster, subscribe, sync_client
from tests.support.stack import STARTUP_TIMEOUT_S

READY_TIMEOUT_S = STARTUP_TIMEOUT_S


@dataclass
class Fleet:
    server: EmbeddedRedis | LocalCluster
    settings: Settings  # what every process starts from
    log_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)  # api name -> port

    @property
    def keys(self) -> Keys:
        return self.settings.redis_keys()

    def redis(self) -> redis.Redis:
        return sync_client(self.settings, decode_responses=True)

    def url(self, api: str = "api") -> str:
        return f"http://127.0.0.1:{self.ports[api]}"

    # -- processes -------------------------------------------------------------------------
    def start(
        self,
        name: str,
        tier: str,
        wait: bool = True,
        env: dict[str, str] | None = None,
        module: list[str] | None = None,
    ) -> None:
        """Start `redserve <tier>` as `name` (its id: `name`); `env` adds REDSERVE_* values;
        `module` runs `python -m <module...>` instead (a test's own entry point for the tier)."""
        settings = self.settings.model_copy(deep=True)
        settings.api.api_id = settings.scheduler.worker_id = name
        settings.detokenizer.worker_id = settings.jobs.worker_id = name
        if tier == "api":
            self.ports[name] = settings.api.port = free_port()
        environ = {**child_process_env(settings), **(env or {})}
        out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", *(module or ["redserve.cli", tier])], env=environ, stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        if wait:
            self.wait_ready(name, tier)

    def wait_ready(self, name: str, tier: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        r = self.redis()
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {self.procs[name].returncode}\n{self.logs()}"
                )
            if tier == "api" and _healthy(self.url(name)):
                return
            # A scheduler beats "loading" while its model loads: ready once it is past that.
            beat = self.keys.heartbeat(tier, name)
            if tier != "api" and r.exists(beat) and r.hget(beat, "state") != "loading":
                return
            time.sleep(0.2)
        raise RuntimeError(f"{name} not ready in {READY_TIMEOUT_S}s\n{self.logs()}")

    def signal(self, name: str, sig: int) -> None:
        self.procs[name].send_signal(sig)

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait()

    def stop(self, name: str, timeout_s: float = 60) -> int:
        """SIGTERM `name` and wait for its exit code."""
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout_s)

    def alive(self) -> dict[str, bool]:
        return {name: proc.poll() is None for name, proc in self.procs.items()}

    def close(self) -> None:
        for name in list(self.procs):
            proc = self.procs.pop(name)
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait()
        self.server.stop()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )

    def worker_of(self, rid: str) -> str:
        """The scheduler that runs `rid` now."""
        worker = self.redis().hget(self.keys.state(rid), "worker")
        assert isinstance(worker, str), f"{rid} has no worker"
        return worker


def _healthy(url: str) -> bool:
    """The replica is alive (/live: it may be up before any scheduler is ready)."""
    try:
        with urllib.request.urlopen(url + "/live", timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


# -- clients -------------------------------------------------------------------------------
def completion(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy /v1/completions body of exactly `max_tokens` tokens."""
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return {**body, "ignore_eos": True, **extra}


def stream_events(base_url: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The JSON events of a streaming /v1/completions response, up to [DONE]."""
    with httpx.stream("POST", base_url + "/v1/completions", json={**body, "stream": True},
                      timeout=300) as resp:  # fmt: skip
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[len("data: ") :])


def no_fault_text(base_url: str, body: dict[str, Any]) -> str:
    """The text of `body` run as one non-streaming request (the reference of a case)."""
    resp = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


def stream_until(
    base_url: str, body: dict[str, Any], num_texts: int
) -> tuple[Iterator[dict[str, Any]], list[dict[str, Any]]]:
    """Start a streaming request and read it until `num_texts` events carried text."""
    events: list[dict[str, Any]] = []
    stream = stream_events(base_url, body)
    for event in stream:
        events.append(event)
        if sum(bool(c["text"]) for e in events for c in e.get("choices", [])) >= num_texts:
            break
    return stream, events


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join(c["text"] for e in events for c in e.get("choices", []))


def finishes(events: list[dict[str, Any]]) -> list[str]:
    return [
        c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")
    ]


class Tap:
    """Every TextEntry that reaches an api replica's output channel, in arrival order."""

    def __init__(self, fleet: Fleet, api: str = "api") -> None:
        self.entries: list[protocol.TextEntry] = []
        self._pubsub = subscribe(fleet.settings, fleet.keys.output_channel(api))  # bytes: msgpack
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._stop = False
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                msg = self._pubsub.get_message(timeout=0.2)
            except redis.ConnectionError:
                time.sleep(0.2)  # Redis restarting: redis-py resubscribes on the next call
                continue
            if msg and msg["type"] in ("message", "smessage"):
                self.entries += protocol.decode(msg["data"], protocol.OutputMessage).entries

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)

    def of(self, rid: str) -> list[protocol.TextEntry]:
        return [e for e in self.entries if e.rid == rid]


# -- invariants ----------------------------------------------------------------------------
def assert_invariants(fleet: Fleet, tap: Tap | None = None) -> None:
    """What every fault case must leave: no pending job, no per-request key without a TTL,
    and on the tap, per request: epochs that never go back, one finish."""
    r = fleet.redis()
    keys = fleet.keys
    for stream in keys.request_streams:
        assert r.xpending(stream, SCHEDULER_GROUP)["pending"] == 0, f"{stream} has pending jobs"
    for family in ("state", "ids", "abort", "rid", "events"):
        for key in r.scan_iter(match=f"{keys.prefix}:{family}:*", count=500):
            assert r.ttl(key) >= 0, f"{key} has no TTL"
    if tap is None:
        return
    for rid in {e.rid for e in tap.entries}:
        entries = tap.of(rid)
        epochs = [e.epoch for e in entries]
        assert epochs == sorted(epochs), f"{rid}: a stale epoch reached the api: {epochs}"
        assert sum(e.finish is not None for e in entries) <= 1, f"{rid}: two finishes"

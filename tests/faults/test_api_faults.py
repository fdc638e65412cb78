"""The api tier under real faults: two `redserve api` processes, a real scheduler and
detokenizer on a real redis-server, the real default model.

- kill -9 of the replica that streams a completion: the client re-attaches on the other
  replica with its Last-Event-ID, and the text it joins equals a run without a fault;
- SIGTERM of a replica with a stream in flight: /health is 503 at once, new requests get a
  503, the stream finishes, and the process exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from redserve.supervisor import start_tiers, stop_tiers
from shared.config import ApiSettings, SchedulerSettings, Settings, child_process_env
from shared.embedded_redis import free_port
from tests.support.stack import Stack, wait_ready

pytestmark = [pytest.mark.e2e, pytest.mark.model]

PROMPT = "Write a long story about a dragon who learns to cook."
GREEDY = {"temperature": 0, "max_tokens": 96, "ignore_eos": True}


class Replicas:
    """The stack's own api (replica a) and a second api process (replica b)."""

    def __init__(self, stack: Stack, b: subprocess.Popen[bytes], b_port: int) -> None:
        self.stack = stack
        self.b = b
        self.b_url = f"http://127.0.0.1:{b_port}"

    @property
    def a(self) -> subprocess.Popen[bytes]:
        return self.stack.procs["api"]

    @property
    def a_url(self) -> str:
        return self.stack.base_url


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the api replica exited early"
        if _healthy(url):
            return
        time.sleep(0.3)
    raise AssertionError(f"{url} did not become healthy")


@pytest.fixture(scope="module")
def replicas(redis_url: str, model_path: str, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Replicas]:  # fmt: skip
    settings = Settings(
        redis_url=redis_url,
        key_prefix=f"fault{uuid.uuid4().hex[:6]}",
        model=model_path,
        api=ApiSettings(port=free_port(), api_id="fault-a"),
        scheduler=SchedulerSettings(
            worker_id="fault-scheduler", kv_cache_tokens=8192, dtype="float32", quantization="none"
        ),  # fmt: skip
    )
    log_dir = tmp_path_factory.mktemp("fault-logs")
    stack = Stack(settings, start_tiers(settings, log_dir), log_dir)
    b_port = free_port()
    b_settings = settings.model_copy(
        update={"api": settings.api.model_copy(update={"port": b_port, "api_id": "fault-b"})}
    )
    b_log = open(Path(log_dir) / "api-b.log", "wb")  # noqa: SIM115
    b = subprocess.Popen([sys.executable, "-m", "redserve.cli", "api"],
                         env=child_process_env(b_settings), stdout=b_log,
                         stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_ready(stack)
        _wait_healthy(f"http://127.0.0.1:{b_port}", b)
        yield Replicas(stack, b, b_port)
    finally:
        stop_tiers({**stack.procs, "api-b": b})
        b_log.close()


def _events(lines: Iterator[str]) -> Iterator[tuple[int, str]]:
    """(id, data) of each SSE event of a response's lines."""
    event_id = -1
    for line in lines:
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            yield event_id, line[6:]


def _deltas(frames: list[tuple[int, str]]) -> str:
    chunks = [json.loads(d) for _i, d in frames if d != "[DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def test_kill_9_mid_stream_then_reattach_on_another_replica(replicas: Replicas) -> None:
    body = {"model": "default", "prompt": PROMPT, **GREEDY}
    reference = httpx.post(replicas.b_url + "/v1/completions", json=body, timeout=120).json()
    expected = reference["choices"][0]["text"]
    rid = f"kill-{uuid.uuid4().hex[:8]}"
    before: list[tuple[int, str]] = []
    with httpx.stream("POST", replicas.a_url + "/v1/completions",
                      json={**body, "stream": True, "rid": rid}, timeout=60) as resp:  # fmt: skip
        for frame in _events(resp.iter_lines()):
            before.append(frame)
            if len(before) >= 4:
                replicas.a.send_signal(signal.SIGKILL)  # mid-stream, no goodbye
                break
    replicas.a.wait(10)
    headers = {"Last-Event-ID": str(before[-1][0])}
    with httpx.stream("GET", f"{replicas.b_url}/v1/requests/{rid}/stream", headers=headers,
                      timeout=120) as resp:  # fmt: skip
        assert resp.status_code == 200
        after = list(_events(resp.iter_lines()))
    frames = before + after
    assert [i for i, _ in frames] == list(range(len(frames)))  # no gap, no duplicate
    assert frames[-1][1] == "[DONE]"
    assert _deltas(frames) == expected
    state = httpx.get(f"{replicas.b_url}/v1/requests/{rid}", timeout=10).json()
    assert state["status"] == "finished" and state["api_id"] == "fault-b"


def test_sigterm_drains_a_replica_then_exits_0(replicas: Replicas) -> None:
    body = {"model": "default", "prompt": PROMPT, **GREEDY, "max_tokens": 24, "stream": True}
    with httpx.stream("POST", replicas.b_url + "/v1/completions", json=body,
                      timeout=60) as resp:  # fmt: skip
        lines = resp.iter_lines()
        first = next(_events(lines))
        assert first[0] == 0
        replicas.b.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(replicas.b_url + "/health", timeout=5)
        assert health.status_code == 503  # the socket is still open: a clear 503
        new = httpx.post(replicas.b_url + "/v1/completions", json={"prompt": "hi"}, timeout=5)
        assert new.status_code == 503 and new.json()["error"]["type"] == "server_error"
        rest = list(_events(lines))
    assert rest[-1][1] == "[DONE]"  # the request in flight finished
    assert replicas.b.wait(15) == 0

"""`redserve up` (what `make serve` runs): embedded Redis, the default model, progress lines
while the scheduler loads and one when the fleet is ready, a curl answer, and one Ctrl-C stops
every process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from shared.embedded_redis import free_port
from tests.support.stack import STARTUP_TIMEOUT_S

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def _wait_health(
    port: int, proc: subprocess.Popen[bytes], timeout_s: float = STARTUP_TIMEOUT_S
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "redserve up exited early"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("redserve up did not become healthy")


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    children = [int(x) for x in out.stdout.split()]
    return children + [d for c in children for d in _descendants(c)]


def _wait_line(log: Path, text: str, timeout_s: float = 30) -> str:
    """The first line of `log` that contains `text` (redserve up's output, and its tiers')."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = [line for line in log.read_text(errors="replace").splitlines() if text in line]
        if lines:
            return lines[0]
        time.sleep(0.2)
    raise AssertionError(f"no line with {text!r} in:\n{log.read_text(errors='replace')[-3000:]}")


# Alone, and on an embedded 3-node Redis Cluster (its three redis-servers stop too).
@pytest.mark.parametrize("flags", [[], ["--redis-cluster", "--stream-shards", "3"]],
                         ids=["redis", "cluster"])  # fmt: skip
def test_redserve_up_answers_curl_and_stops_on_ctrl_c(tmp_path: Path, flags: list[str]) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDSERVE_")}
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "redserve.cli", "up", "--port", str(port), *flags],
            env=env,
            start_new_session=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_health(port, proc)
        # It said how the scheduler's loading went, then that the fleet is ready.
        assert "redserve.supervisor: scheduler " in _wait_line(log, " loading: ")
        assert f":{port}" in _wait_line(log, "redserve is ready")
        children = _descendants(proc.pid)
        # 1 or 3 redis-servers + api + scheduler + detokenizer
        assert len(children) >= (6 if flags else 4)
        payload = json.dumps(
            {
                "text": "The capital of France is",
                "sampling_params": {"temperature": 0, "max_new_tokens": 8},
            }
        )
        out = subprocess.run(
            ["curl", "-sf", f"http://127.0.0.1:{port}/generate", "-d", payload],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert json.loads(out.stdout)["text"].strip()
        # Ctrl-C in a terminal signals the whole foreground process group.
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 0
        time.sleep(0.2)
        alive = [c for c in children if os.path.exists(f"/proc/{c}")]
        assert not alive, f"left running: {alive}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

"""Metrics, readiness and fleet views on real processes (one api, one scheduler, one
detokenizer on a real redis-server, the real model): /health is not 200 until the scheduler
has loaded (it says why meanwhile), /metrics counters move with real requests and the fleet
gauges carry the scheduler's `worker` label, `redserve status` shows the fleet, and a worker
that stops (cleanly, or killed: its beat expires) drops out of every view."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.config import SchedulerSettings, Settings
from shared.embedded_redis import EmbeddedRedis, free_port
from shared.keys import HEARTBEAT_TTL_S
from tests.support.fleet import Fleet, completion

pytestmark = [pytest.mark.e2e, pytest.mark.model]

METRICS_PORT = free_port()
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def fleet(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    server = EmbeddedRedis()
    settings = Settings(
        redis_url=server.start(),
        key_prefix=f"m{uuid.uuid4().hex[:6]}",
        model=model_path,
        scheduler=SchedulerSettings(
            dtype="float32", quantization="none", kv_cache_tokens=4096, num_threads=1
        ),
    )
    fleet = Fleet(server, settings, tmp_path_factory.mktemp("metrics-logs"))
    try:
        fleet.start("api", "api")  # alive (/live) before any scheduler runs
        fleet.start("detok", "detokenizer")
        yield fleet
    finally:
        fleet.close()


def scrape(url: str) -> Samples:
    resp = httpx.get(url + "/metrics", timeout=10)
    assert resp.status_code == 200
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    return sum(hits)


def workers(samples: Samples, name: str) -> set[str]:
    return {dict(ls)["worker"] for n, ls in samples if n == name}


# Every /health answer (status, body) from the scheduler's start until it was ready.
HEALTH_ANSWERS: list[tuple[int, str]] = []


@pytest.fixture(scope="module")
def ready(fleet: Fleet) -> Fleet:
    """The fleet once its scheduler, started now, is ready (HEALTH_ANSWERS on the way)."""
    env = {"REDSERVE_SCHEDULER__METRICS_PORT": str(METRICS_PORT)}
    fleet.start("sched", "scheduler", wait=False, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and fleet.alive()["sched"]:
        resp = httpx.get(fleet.url() + "/health", timeout=5)
        HEALTH_ANSWERS.append((resp.status_code, resp.text))
        if resp.status_code == 200:
            break
        time.sleep(0.1)
    return fleet


def test_health_is_not_200_until_the_scheduler_is_ready(ready: Fleet) -> None:
    answers = HEALTH_ANSWERS
    assert answers[-1][0] == 200, ready.logs()
    before = answers[:-1]
    assert before and all(code == 503 for code, _ in before)
    assert any("sched is loading" in text for _, text in before), before[-3:]
    assert httpx.get(ready.url() + "/live", timeout=5).status_code == 200


def test_metrics_move_with_real_requests_and_show_the_workers(ready: Fleet) -> None:
    url = ready.url()
    before = scrape(url)
    for prompt in ("The capital of France is", "Water boils at", "Three colors:"):
        resp = httpx.post(url + "/v1/completions", json=completion(prompt, 4), timeout=120)
        assert resp.status_code == 200, resp.text
    after = scrape(url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("redserve:num_requests_total", finish_reason="length") == 3
    assert moved("redserve:generation_tokens_total") == 12
    assert moved("redserve:prompt_tokens_total") > 3
    assert moved("redserve:time_to_first_token_seconds_count") == 3
    assert moved("redserve:e2e_request_latency_seconds_count") == 3
    assert moved("redserve:inter_token_latency_seconds_count") >= 3
    assert value(after, "redserve:redeliveries_total") == 0
    assert workers(after, "redserve:num_running_reqs") == {"sched"}
    assert workers(after, "redserve:token_usage") == {"sched"}
    assert workers(after, "redserve:detokenizer_num_states") == {"detok"}
    assert value(after, "redserve:num_workers", kind="scheduler", state="ready") == 1
    assert value(after, "redserve:request_stream_pending") == 0
    own = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5)
    assert own.status_code == 200 and 'redserve:step_time_seconds_count{worker="sched"}' in own.text


def test_fleet_views_list_the_live_workers(ready: Fleet) -> None:
    load = httpx.get(ready.url() + "/get_load", timeout=5).json()
    assert [(x["worker"], x["state"]) for x in load] == [("sched", "ready")]
    info = httpx.get(ready.url() + "/get_server_info", timeout=5).json()["workers"]
    assert {t: [w["id"] for w in info[t]] for t in ("scheduler", "detokenizer", "api")} == {
        "scheduler": ["sched"], "detokenizer": ["detok"], "api": ["api"]
    }  # fmt: skip
    settings = ready.settings
    out = subprocess.run(
        [sys.executable, "-m", "redserve.cli", "status", "--redis-url", settings.redis_url,
         "--key-prefix", settings.key_prefix],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert out.startswith(f"fleet '{settings.key_prefix}': 1 of 1 schedulers ready")
    assert any(line.split()[:2] == ["sched", "ready"] for line in out.splitlines())


def test_stopped_and_killed_workers_drop_out(ready: Fleet) -> None:
    url = ready.url()
    assert ready.stop("sched") == 0  # a clean stop deletes its beat at once
    samples = scrape(url)
    assert workers(samples, "redserve:num_running_reqs") == set()
    health = httpx.get(url + "/health", timeout=5)
    assert health.status_code == 503
    assert health.json()["error"]["message"] == "No scheduler is running."
    ready.kill("detok")  # kill -9: its beat expires HEARTBEAT_TTL_S later
    deadline = time.monotonic() + HEARTBEAT_TTL_S + 5
    while workers(scrape(url), "redserve:detokenizer_num_states") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert workers(scrape(url), "redserve:detokenizer_num_states") == set()
    assert httpx.get(url + "/get_load", timeout=5).json() == []

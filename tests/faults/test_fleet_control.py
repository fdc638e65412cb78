"""Fleet-wide control on real processes: two api replicas, two schedulers, one detokenizer.
Generation is paused from one replica while requests stream from and arrive at the other,
in each mode, then continued: greedy text equals the unpaused run; `abort` ends the
in-flight request with finish_reason abort; requests sent while paused wait and finish."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support.fleet import (
    Fleet,
    assert_invariants,
    completion,
    finishes,
    no_fault_text,
    stream_until,
    text_of,
)

pytestmark = [pytest.mark.faults, pytest.mark.model]

PROMPT = "A short history of the bicycle:"
HELD_PROMPT = "The three primary colors are"
NUM_TOKENS = 64
SCHEDULERS = ("sched-a", "sched-b")


@pytest.fixture(scope="module")
def stack(fleet: Fleet) -> Fleet:
    fleet.start("detok", "detokenizer")
    for name in SCHEDULERS:
        fleet.start(name, "scheduler", wait=False)
    for name in SCHEDULERS:
        fleet.wait_ready(name, "scheduler")
    for name in ("api-a", "api-b"):
        fleet.start(name, "api")
    return fleet


@pytest.fixture(scope="module")
def references(stack: Fleet) -> dict[str, str]:
    """The unpaused greedy texts of the two requests every case sends."""
    return {
        prompt: no_fault_text(stack.url("api-b"), completion(prompt, NUM_TOKENS))
        for prompt in (PROMPT, HELD_PROMPT)
    }


def post(stack: Fleet, api: str, path: str, body: dict[str, Any] | None = None) -> Any:
    resp = httpx.post(stack.url(api) + path, json=body or {}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def beats(stack: Fleet) -> dict[str, dict[str, str]]:
    r = stack.redis()
    return {name: r.hgetall(stack.keys.heartbeat("scheduler", name)) for name in SCHEDULERS}


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def all_paused(stack: Fleet) -> bool:
    return all(b.get("state") == "paused" for b in beats(stack).values())


def held_request(stack: Fleet, pool: concurrent.futures.Executor) -> Any:
    """A request sent to api-b while paused: accepted, it waits (its state stays queued)."""
    body = completion(HELD_PROMPT, NUM_TOKENS, rid=f"held-{time.monotonic_ns()}")
    future = pool.submit(httpx.post, stack.url("api-b") + "/v1/completions", json=body,
                         timeout=120)  # fmt: skip
    r = stack.redis()
    wait_for("the held request's state", lambda: r.exists(stack.keys.state(body["rid"])) == 1)
    time.sleep(1.0)  # time enough for a scheduler to take it, were it not paused
    assert r.hget(stack.keys.state(body["rid"]), "status") == "queued"
    assert not future.done()
    return future


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_then_continue_gives_the_unpaused_text(
    stack: Fleet, references: dict[str, str], mode: str
) -> None:
    stream, events = stream_until(stack.url("api-b"), completion(PROMPT, NUM_TOKENS), 2)
    assert post(stack, "api-a", "/pause_generation", {"mode": mode})["status"] == "ok"
    wait_for("every scheduler to pause", lambda: all_paused(stack))
    blocks = {n: (int(b["num_free_blocks"]), int(b["num_total_blocks"]))
              for n, b in beats(stack).items()}  # fmt: skip
    holding = [name for name, (free, total) in blocks.items() if free < total]
    # retract frees the KV of the paused request; in_place keeps it.
    assert len(holding) == (0 if mode == "retract" else 1), blocks
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = held_request(stack, pool)
        post(stack, "api-a", "/continue_generation")
        events += list(stream)
        resp = held.result()
    assert text_of(events) == references[PROMPT] and finishes(events) == ["length"]
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["text"] == references[HELD_PROMPT]
    wait_for("every scheduler to serve", lambda: all(
        b.get("state") == "ready" for b in beats(stack).values()))  # fmt: skip
    assert_invariants(stack)


def test_pause_abort_ends_in_flight_requests_and_later_ones_run_after_continue(
    stack: Fleet, references: dict[str, str]
) -> None:
    stream, events = stream_until(stack.url("api-b"), completion(PROMPT, NUM_TOKENS), 2)
    post(stack, "api-a", "/pause_generation", {"mode": "abort"})
    events += list(stream)  # ends while paused
    assert finishes(events) == ["abort"]
    assert references[PROMPT].startswith(text_of(events))
    wait_for("every scheduler to pause", lambda: all_paused(stack))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = held_request(stack, pool)
        post(stack, "api-b", "/continue_generation")
        resp = held.result()
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["text"] == references[HELD_PROMPT]
    assert_invariants(stack)


def test_a_bad_pause_mode_is_a_400_and_changes_nothing(stack: Fleet) -> None:
    resp = httpx.post(stack.url("api-a") + "/pause_generation", json={"mode": "freeze"})
    assert resp.status_code == 400 and "mode" in resp.text
    assert not stack.redis().exists(stack.keys.pause)


def test_flush_cache_reaches_every_scheduler(stack: Fleet) -> None:
    resp = httpx.post(stack.url("api-a") + "/flush_cache", timeout=30)
    assert resp.status_code == 200 and "flushed" in resp.text.lower()
    logs = {name: (stack.log_dir / f"{name}.log") for name in SCHEDULERS}
    wait_for("the flush in every scheduler's log", lambda: all(
        "prefix cache flushed" in path.read_text() for path in logs.values()))  # fmt: skip


# -- weights under load ------------------------------------------------------------------------
def update_weights(stack: Fleet, api: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(stack.url(api) + "/update_weights_from_disk", json=body, timeout=600)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


def generate(stack: Fleet, api: str, prompt: str) -> dict[str, Any]:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    resp = httpx.post(stack.url(api) + "/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def test_an_update_under_load_finishes_every_stream_and_records_versions(
    stack: Fleet, references: dict[str, str]
) -> None:
    streams = [stream_until(stack.url(api), completion(PROMPT, NUM_TOKENS), 1)
               for api in ("api-a", "api-b")]  # fmt: skip
    answer = update_weights(stack, "api-a", {"model_path": stack.settings.model,
                                             "weight_version": "v2"})  # fmt: skip
    assert answer["success"] is True and answer["weight_version"] == "v2", answer
    for stream, events in streams:
        events += list(stream)
        # The same checkpoint again: greedy text does not change across the switch.
        assert text_of(events) == references[PROMPT] and finishes(events) == ["length"]
    assert {b["weight_version"] for b in beats(stack).values()} == {"v2"}
    for api in ("api-a", "api-b"):
        info = httpx.get(stack.url(api) + "/get_model_info", timeout=10).json()
        assert info["weight_version"] == "v2"
        assert generate(stack, api, HELD_PROMPT)["meta_info"]["weight_version"] == "v2"
    assert_invariants(stack)


def test_a_rolling_update_keeps_serving_while_each_scheduler_loads(stack: Fleet) -> None:
    seen: set[tuple[str, ...]] = set()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        update = pool.submit(update_weights, stack, "api-b", {
            "model_path": stack.settings.model, "weight_version": "v3", "mode": "rolling"})
        served = []
        while not update.done():
            seen.add(tuple(sorted(b.get("state", "") for b in beats(stack).values())))
            served.append(generate(stack, "api-a", HELD_PROMPT))
        answer = update.result()
    assert answer["success"], answer
    # One scheduler at a time: never both updating; the other served meanwhile.
    assert ("updating", "updating") not in seen and ("ready", "updating") in seen
    assert served and all(out["meta_info"]["finish_reason"]["type"] == "length"
                          for out in served)  # fmt: skip
    assert {b["weight_version"] for b in beats(stack).values()} == {"v3"}


def test_a_failed_load_keeps_the_old_weights_and_says_why(stack: Fleet) -> None:
    before = httpx.get(stack.url("api-a") + "/get_model_info", timeout=10).json()
    answer = update_weights(stack, "api-a", {"model_path": "/no/such/model",
                                             "weight_version": "broken"})  # fmt: skip
    assert answer["success"] is False and "/no/such/model" in answer["message"]
    after = httpx.get(stack.url("api-b") + "/get_model_info", timeout=10).json()
    assert after["weight_version"] == before["weight_version"] != "broken"
    assert generate(stack, "api-b", HELD_PROMPT)["meta_info"]["weight_version"] == (
        before["weight_version"]
    )

"""POST /update_weights_from_disk on the ASGI app over fakeredis, against stand-in schedulers
that beat and load (or fail to load) whatever the fleet's target becomes: success, a failure
that restores the previous target, a timeout, bad bodies, the gate that holds new requests
on every replica during an `all` update (not a `rolling` one), and the weight_version that
meta_info and /get_model_info report."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

from shared import fleet_control, heartbeat, protocol
from shared.config import Settings
from shared.fleet_control import Weights
from shared.keys import Keys
from tests.support.app import running_app, with_api
from tests.support.backend import FakeBackend

STARTED = "default"
TIMEOUT_S = 4.0


class FakeSchedulers:
    """Schedulers that beat, and load the fleet's target when it changes: each answers new
    weights as `answers` says ("ok", an error, or None: never), going back to weights it
    served before always works. Loads wait while `loads` is clear."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, ids: list[str]) -> None:
        self.redis, self.keys = redis, keys
        self.serving = {w: Weights("started", STARTED) for w in ids}
        self.answers: dict[str, str | None] = dict.fromkeys(ids, "ok")
        self.served = {STARTED}
        self.loads = asyncio.Event()
        self.loads.set()

    async def run(self) -> None:
        seen: Any = ...
        while True:
            await self._beat()
            target = await fleet_control.get_target(self.redis, self.keys)
            if target != seen and self.loads.is_set():
                seen = target
                await self._load(target or Weights("started", STARTED))
            await asyncio.sleep(0.02)

    async def _beat(self) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker, weights in self.serving.items():
                fields = heartbeat.SchedulerBeat(0, 0, 8, 8, model_path=weights.model_path,
                                                 weight_version=weights.weight_version)  # fmt: skip
                heartbeat.beat(pipe, self.keys, worker, fields)
            await pipe.execute()

    async def _load(self, target: Weights) -> None:
        version = target.weight_version
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker, weights in self.serving.items():
                if weights.weight_version == version:
                    continue
                answer = "ok" if version in self.served else self.answers[worker]
                if answer == "ok":
                    self.serving[worker] = target
                if answer is not None:
                    fleet_control.report(pipe, self.keys, version, worker, answer)
            await pipe.execute()
        self.served |= {w.weight_version for w in self.serving.values()}


@pytest.fixture(autouse=True)
def ready_scheduler() -> None:
    """No stand-in scheduler beats here but the FakeSchedulers (which answer updates)."""


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return with_api(settings, update_weights_timeout_s=TIMEOUT_S)


@pytest.fixture
async def fleet(fake_redis: aioredis.Redis, keys: Keys) -> AsyncIterator[FakeSchedulers]:
    schedulers = FakeSchedulers(fake_redis, keys, ["sched-a", "sched-b"])
    task = asyncio.create_task(schedulers.run())
    await asyncio.sleep(0.05)  # the first beats
    yield schedulers
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def stamp_versions(backend: FakeBackend, version: Callable[[], str]) -> None:
    """The back end's finish entries carry the weight version, as the schedulers' do."""
    make_entry = backend._entry

    def entry(job: protocol.GenerateJob, start: int) -> protocol.TextEntry:
        out = make_entry(job, start)
        if out.finish is not None:
            out.weight_version = version()
        return out

    backend._entry = entry  # type: ignore[method-assign]


async def update(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    resp = await client.post("/update_weights_from_disk", json=body)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


async def generate(client: httpx.AsyncClient, rid: str) -> dict[str, Any]:
    body = {"text": "Hi", "rid": rid, "sampling_params": {"max_new_tokens": 4}}
    resp = await client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


async def test_update_switches_the_fleet_and_outputs_name_their_weights(
    client: httpx.AsyncClient, fleet: FakeSchedulers, backend: FakeBackend
) -> None:
    stamp_versions(backend, lambda: fleet.serving["sched-a"].weight_version)
    before = await generate(client, "before")
    assert before["meta_info"]["weight_version"] == STARTED
    info = (await client.get("/get_model_info")).json()
    assert info["weight_version"] == STARTED
    out = await update(client, model_path="/ckpt/v1", weight_version="v1")
    assert out["success"] is True, out
    assert out["weight_version"] == "v1" and "2 schedulers" in out["message"]
    assert {w.weight_version for w in fleet.serving.values()} == {"v1"}
    info = (await client.get("/get_model_info")).json()
    assert (info["model_path"], info["weight_version"]) == ("/ckpt/v1", "v1")
    after = await generate(client, "after")
    assert after["meta_info"]["weight_version"] == "v1"
    # Without a version: a new, unique one each time.
    first, second = [await update(client, model_path="/ckpt/v2") for _ in range(2)]
    assert first["success"] and second["success"]
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", first["weight_version"])
    assert first["weight_version"] != second["weight_version"]


@pytest.mark.parametrize("had_target", [True, False])
async def test_a_failed_load_restores_the_previous_target(
    client: httpx.AsyncClient, fleet: FakeSchedulers, backend: FakeBackend, had_target: bool
) -> None:
    if had_target:
        assert (await update(client, model_path="/ckpt/v1", weight_version="v1"))["success"]
    fleet.answers["sched-b"] = "ValueError: hidden_size 32 (loaded: 64)"
    out = await update(client, model_path="/ckpt/narrow", weight_version="v2")
    assert out["success"] is False
    assert "sched-b: ValueError: hidden_size 32 (loaded: 64)" in out["message"]
    assert "sched-a" not in out["message"]
    back = "v1" if had_target else STARTED
    assert f"Rolled back to weight_version {back}" in out["message"]
    info = (await client.get("/get_model_info")).json()
    assert info["weight_version"] == back
    assert info["model_path"] == ("/ckpt/v1" if had_target else info["tokenizer_path"])
    async with asyncio.timeout(5):  # sched-a, which had switched, goes back
        while fleet.serving["sched-a"].weight_version != back:
            await asyncio.sleep(0.02)
    assert (await generate(client, "after"))["meta_info"]["finish_reason"] is not None


async def test_a_version_names_one_set_of_weights(
    client: httpx.AsyncClient, fleet: FakeSchedulers
) -> None:
    assert (await update(client, model_path="/ckpt/v1", weight_version="v1"))["success"]
    again = await update(client, model_path="/ckpt/v1", weight_version="v1")
    assert again["success"] is True  # already served: at once
    other = await update(client, model_path="/ckpt/other", weight_version="v1")
    assert other["success"] is False and "v1 already names /ckpt/v1" in other["message"]


async def test_an_update_from_another_replica_supersedes(
    client: httpx.AsyncClient,
    fleet: FakeSchedulers,
    settings: Settings,
    fake_redis: aioredis.Redis,
    tokenizer: Any,
    keys: Keys,
) -> None:
    other_settings = with_api(settings, api_id="api-other")
    async with running_app(other_settings, fake_redis, tokenizer) as (_app, other):
        fleet.loads.clear()
        first = asyncio.create_task(update(client, model_path="/ckpt/v1", weight_version="v1"))
        async with asyncio.timeout(5):
            while await fleet_control.get_target(fake_redis, keys) is None:
                await asyncio.sleep(0.01)
        second = asyncio.create_task(update(other, model_path="/ckpt/v2", weight_version="v2"))
        out = await first
        assert out["success"] is False and "Superseded by weight_version v2" in out["message"]
        fleet.loads.set()
        assert (await second)["success"] is True
        assert {w.weight_version for w in fleet.serving.values()} == {"v2"}


async def test_a_scheduler_that_never_answers_times_out(
    client: httpx.AsyncClient, fleet: FakeSchedulers, fake_redis: aioredis.Redis, keys: Keys
) -> None:
    fleet.answers["sched-b"] = None
    out = await update(client, model_path="/ckpt/slow", weight_version="slow")
    assert out["success"] is False
    assert f"timed out after {TIMEOUT_S:g}s waiting for sched-b" in out["message"]
    assert await fleet_control.get_target(fake_redis, keys) is None  # rolled back


async def test_no_scheduler_no_update(client: httpx.AsyncClient) -> None:
    out = await update(client, model_path="/ckpt/v1")
    assert out["success"] is False and "No scheduler is serving" in out["message"]
    assert (await client.get("/get_model_info")).json()["weight_version"] == STARTED


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, "model_path"),
        ({"model_path": "  "}, "model_path must be a non-empty string"),
        ({"model_path": 7}, "model_path"),
        ({"model_path": "/m", "mode": "sideways"}, "mode: Input should be 'all' or 'rolling'"),
        ({"model_path": "/m", "weight_version": "default"}, "names the weights"),
        ({"model_path": "/m", "weight_version": "v 1"}, "weight_version"),
        ({"model_path": "/m", "load_format": "pt"}, "load_format 'pt' is not supported"),
    ],
)
async def test_bad_bodies_get_a_400(
    client: httpx.AsyncClient, body: dict[str, Any], expected: str
) -> None:
    resp = await client.post("/update_weights_from_disk", json=body)
    assert resp.status_code == 400
    assert expected in resp.json()["error"]["message"]


async def test_new_requests_wait_on_every_replica_during_an_all_update(
    app: FastAPI,
    client: httpx.AsyncClient,
    fleet: FakeSchedulers,
    backend: FakeBackend,
    settings: Settings,
    fake_redis: aioredis.Redis,
    tokenizer: Any,
    keys: Keys,
) -> None:
    other_settings = with_api(settings, api_id="api-other")
    async with running_app(other_settings, fake_redis, tokenizer) as (other_app, other):
        fleet.loads.clear()  # the schedulers take their time
        updating = asyncio.create_task(update(client, model_path="/ckpt/v1", weight_version="v1"))
        gates = [a.state.manager.weights.gate for a in (app, other_app)]
        async with asyncio.timeout(5):  # both replicas closed their gate
            while not all(g.writers for g in gates):
                await asyncio.sleep(0.01)
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 4}}
        waiting = [
            asyncio.create_task(c.post("/generate", json={**body, "rid": rid}))
            for c, rid in ((client, "here"), (other, "there"))
        ]
        async with asyncio.timeout(5):
            while not all(g.waiting for g in gates):
                await asyncio.sleep(0.01)
        assert await fake_redis.xlen(keys.request_stream) == 0  # nothing submitted
        fleet.loads.set()
        assert (await updating)["success"] is True
        assert [(await w).status_code for w in waiting] == [200, 200]
        assert all(g.writers == 0 for g in gates)


async def test_a_rolling_update_lets_requests_through(
    app: FastAPI,
    client: httpx.AsyncClient,
    fleet: FakeSchedulers,
    backend: FakeBackend,
    fake_redis: aioredis.Redis,
    keys: Keys,
) -> None:
    fleet.loads.clear()
    updating = asyncio.create_task(
        update(client, model_path="/ckpt/v1", weight_version="v1", mode="rolling")
    )
    async with asyncio.timeout(5):  # the update is under way
        while await fleet_control.get_target(fake_redis, keys) is None:
            await asyncio.sleep(0.01)
    out = await generate(client, "during")
    assert out["meta_info"]["finish_reason"] is not None
    assert app.state.manager.weights.gate.writers == 0
    fleet.loads.set()
    assert (await updating)["success"] is True


async def test_abort_all_requests_ends_this_replicas_requests_first(
    client: httpx.AsyncClient,
    fleet: FakeSchedulers,
    backend: FakeBackend,
    fake_redis: aioredis.Redis,
    keys: Keys,
) -> None:
    backend.hold = True  # the request would run for ever
    body = {"text": "Hi", "rid": "long", "sampling_params": {"max_new_tokens": 4}}
    waiting = asyncio.create_task(client.post("/generate", json=body))
    await backend.wait_jobs(1)
    out = await update(client, model_path="/ckpt/v1", abort_all_requests=True)
    assert out["success"] is True
    assert await fake_redis.exists(keys.abort("long"))
    assert (await waiting).json()["meta_info"]["finish_reason"]["type"] == "abort"

"""App wiring: lifespan with Redis down (503s, quickly), another stream shard count than the
fleet's (no start), `main`, and the served name."""

from __future__ import annotations

import signal
import time
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

import api.__main__ as api_main
from api.app import create_app
from api.model import served_name
from shared.config import ApiSettings, Settings
from shared.embedded_redis import free_port
from shared.request_stream import LayoutMismatch
from tests.support.app import running_app


async def test_an_api_with_another_stream_shard_count_than_the_fleet_s_does_not_start(
    app: FastAPI, settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any
) -> None:
    other = settings.model_copy(update={"stream_shards": 3})  # `app` started with 1
    with pytest.raises(LayoutMismatch, match="runs 1 request stream shard"):
        async with running_app(other, fake_redis, tokenizer):
            pass


async def test_redis_down_answers_503_quickly(settings: Settings, tokenizer: Any) -> None:
    dead = aioredis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=1)
    app = create_app(settings, redis=dead, tokenizer=tokenizer)
    started = time.monotonic()
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            health = await client.get("/health")
            native = await client.post("/generate", json={"text": "hi"})
            oai = await client.post("/v1/completions", json={"prompt": "hi"})
            abort = await client.post("/abort_request", json={"rid": "x"})
        assert app.state.manager.rid_to_state == {}
    assert time.monotonic() - started < 10
    assert health.status_code == 503
    assert native.status_code == 503 and set(native.json()["error"]) == {"message"}
    assert oai.status_code == 503
    assert oai.json()["error"]["type"] == "server_error"
    assert abort.status_code == 503
    await dead.aclose()


async def test_not_started_is_503(settings: Settings, tokenizer: Any, fake_redis: Any) -> None:
    app = create_app(settings, redis=fake_redis, tokenizer=tokenizer)  # lifespan not run
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        resp = await client.post("/generate", json={"text": "hi"})
    assert resp.status_code == 503


async def test_lifespan_needs_a_redis_url(settings: Settings, tokenizer: Any) -> None:
    app = create_app(settings.model_copy(update={"redis_url": ""}), tokenizer=tokenizer)
    with pytest.raises(RuntimeError, match="Redis URL"):
        async with app.router.lifespan_context(app):
            pass


def test_main_runs_uvicorn(monkeypatch: pytest.MonkeyPatch, model_path: str) -> None:
    seen: dict[str, Any] = {}

    def fake_run(server: Any, sockets: Any = None) -> None:
        seen.update(server=server)

    monkeypatch.setattr(api_main.DrainingServer, "run", fake_run)
    monkeypatch.setattr(api_main, "configure_logging", lambda level, name: seen.update(log=name))
    monkeypatch.setattr(api_main.signal, "signal", lambda sig, handler: seen.update({sig: handler}))
    settings = Settings(model=model_path, api=ApiSettings(host="0.0.0.0", port=1234))
    api_main.main(settings)
    server = seen["server"]
    assert isinstance(server, api_main.DrainingServer) and isinstance(server.app, FastAPI)
    assert (server.config.host, server.config.port, seen["log"]) == ("0.0.0.0", 1234, "api")
    assert server.config.timeout_graceful_shutdown == api_main.GRACEFUL_SHUTDOWN_S
    assert server.drain_s == api_main.DRAIN_S
    assert signal.SIGTERM in seen


def test_served_name(model_path: str) -> None:
    assert served_name(Settings(model="org/name")) == "org/name"
    assert served_name(Settings(model=model_path, api=ApiSettings(served_model_name="s"))) == "s"
    assert served_name(Settings(model="")) == "SmolLM2-135M-Instruct.Q4_1"


async def test_openapi_schema(client: httpx.AsyncClient) -> None:
    resp = await client.get("/openapi.json")
    assert resp.status_code == 200
    paths = resp.json()["paths"]
    for path in ("/generate", "/abort_request", "/health", "/get_model_info", "/v1/models"):
        assert path in paths
    assert "/v1/completions" in paths and "/v1/chat/completions" in paths


async def test_curl_style_form_content_type_is_read_as_json(client: Any, backend: Any) -> None:
    resp = await client.post(
        "/generate",
        content=b'{"text": "hi", "sampling_params": {"max_new_tokens": 2}}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert resp.status_code == 200, resp.text

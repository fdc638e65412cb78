"""/tokenize, /detokenize, GET /v1/requests/{rid} (from any replica), /get_server_info and
/v1/models/{model}."""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis
import httpx
import pytest
import redis.asyncio as aioredis

from api.routes.native import redact_url
from shared.config import Settings
from tests.support.app import running_app, with_api
from tests.support.backend import FakeBackend


async def test_tokenize(client: httpx.AsyncClient, tokenizer: Any) -> None:
    out = (await client.post("/tokenize", json={"prompt": "Hello world"})).json()
    ids = tokenizer.encode("Hello world")
    assert out == {"tokens": ids, "count": len(ids), "max_model_len": 8192}
    out = (await client.post("/v1/tokenize", json={"prompt": ["a", "bb c"]})).json()
    assert out["tokens"] == tokenizer(["a", "bb c"])["input_ids"]
    assert out["count"] == [len(x) for x in out["tokens"]]
    messages = [{"role": "user", "content": "hi"}]
    out = (await client.post("/tokenize", json={"messages": messages})).json()
    assert (
        out["tokens"]
        == tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    )
    resp = await client.post("/tokenize", json={})
    assert resp.status_code == 400


async def test_detokenize(client: httpx.AsyncClient, tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world")
    assert (await client.post("/detokenize", json={"tokens": ids})).json() == {
        "text": "Hello world"
    }
    out = (await client.post("/v1/detokenize", json={"tokens": [ids, ids[:1]]})).json()
    assert out == {"text": ["Hello world", tokenizer.decode(ids[:1])]}
    resp = await client.post("/detokenize", json={"tokens": [1, 10**9]})
    assert resp.status_code == 400 and "out of vocabulary" in resp.json()["error"]["message"]


async def test_request_state_from_any_replica(
    client: httpx.AsyncClient,
    backend: FakeBackend,
    settings: Settings,
    fake_server: fakeredis.FakeServer,
    tokenizer: Any,
) -> None:
    backend.hold = True
    waiting = asyncio.create_task(client.post("/generate", json={"text": "hi", "rid": "look"}))
    await backend.wait_jobs(1)
    other_redis = fakeredis.FakeAsyncRedis(server=fake_server)
    async with running_app(with_api(settings, api_id="api-2"), other_redis, tokenizer) as (
        _app,
        other,
    ):
        live = (await other.get("/v1/requests/look")).json()
        assert live["status"] == "queued" and live["api_id"] == "api-test"
        assert live["running_here"] is False and live["finish_reason"] is None
        assert live["prompt_tokens"] == len(tokenizer.encode("hi"))
        await client.post("/abort_request", json={"rid": "look"})
        await waiting
        backend.hold = False
        await client.post(
            "/generate", json={"text": "x", "rid": "done", "sampling_params": {"max_new_tokens": 2}}
        )
        done = (await other.get("/v1/requests/done")).json()
        assert done["status"] == "finished"
        assert done["finish_reason"] == {"type": "length", "length": 2}
        assert done["completion_tokens"] == 2 and isinstance(done["finished_at"], float)
        missing = await other.get("/v1/requests/nope")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "request_not_found"
    await other_redis.aclose()


async def test_server_info_redacts_secrets(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any
) -> None:
    conf = with_api(settings, api_keys=["sekrit"]).model_copy(
        update={"redis_url": "redis://user:pw@host:6379/0"}
    )
    async with running_app(conf, fake_redis, tokenizer) as (_app, client):
        resp = await client.get("/get_server_info", headers={"authorization": "Bearer sekrit"})
    info = resp.json()
    assert resp.status_code == 200
    assert "sekrit" not in resp.text and ":pw@" not in resp.text
    assert info["redis_url"] == "redis://user:***@host:6379/0"
    assert info["api"]["api_keys"] == "<1 keys>"
    assert info["context_length"] == 8192 and info["num_running_requests"] == 0


@pytest.mark.parametrize(
    ("url", "expected"),
    [("", ""), ("redis://h:1/0", "redis://h:1/0"), ("redis://:p@h/0", "redis://:***@h/0")],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


async def test_model_by_name(client: httpx.AsyncClient) -> None:
    resp = await client.get("/v1/models/other-model")
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert error["code"] == "model_not_found" and error["type"] == "not_found_error"

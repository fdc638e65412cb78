"""Embeddings: /encode (SGLang) and /v1/embeddings (OpenAI) submit prefill-only embedding jobs
and return the engine's embedding from the final entry, in each API's shape."""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from shared import protocol
from tests.support.app import API_ID
from tests.support.backend import FakeBackend, fake_embedding


async def test_encode_single_and_batch(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any, app: FastAPI
) -> None:
    out = (await client.post("/encode", json={"text": "hello world", "rid": "e1"})).json()
    ids = tokenizer.encode("hello world")
    assert out["embedding"] == pytest.approx(fake_embedding(ids))
    meta = out["meta_info"]
    assert meta["id"] == "e1" and meta["prompt_tokens"] == len(ids)
    assert meta["completion_tokens"] == 0
    (job,) = backend.jobs
    assert job.embed and job.sampling.max_new_tokens == 0 and job.input_ids == ids
    outs = (await client.post("/encode", json={"input_ids": [[5, 6], [7]]})).json()
    assert [o["embedding"] for o in outs] == [
        pytest.approx(fake_embedding(x)) for x in ([5, 6], [7])
    ]
    assert app.state.manager.rid_to_state == {}


async def test_openai_embeddings(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any, app: FastAPI
) -> None:
    texts = ["first", "the second one"]
    out = (await client.post("/v1/embeddings", json={"input": texts, "model": "m"})).json()
    assert out["object"] == "list" and out["model"] == app.state.manager.model.served_model_name
    assert [d["index"] for d in out["data"]] == [0, 1]
    assert all(d["object"] == "embedding" for d in out["data"])
    ids = [tokenizer.encode(t) for t in texts]
    assert [d["embedding"] for d in out["data"]] == [pytest.approx(fake_embedding(x)) for x in ids]
    tokens = sum(len(x) for x in ids)
    assert out["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    b64 = (
        await client.post("/v1/embeddings", json={"input": "first", "encoding_format": "base64"})
    ).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    floats = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert list(floats) == pytest.approx(fake_embedding(ids[0]), abs=1e-6)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input": "x", "dimensions": 4}, "dimensions"),
        ({"input": []}, "input must not be empty"),
        ({"input": ""}, "prompt must not be empty"),
        ({"input": [[1, 99999]]}, "out of vocabulary"),
        ({"input": [["only one"]]}, "input"),
    ],
)
async def test_embedding_errors(client: httpx.AsyncClient, body: Any, needle: str) -> None:
    resp = await client.post("/v1/embeddings", json=body)
    assert resp.status_code == 400
    assert needle in resp.json()["error"]["message"]


async def test_openai_client_embeddings(app: FastAPI, backend: FakeBackend) -> None:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    async with openai.AsyncOpenAI(
        api_key="x", base_url="http://test/v1", http_client=http, max_retries=0
    ) as oai:
        floats = await oai.embeddings.create(model="m", input=["a b", "c"], encoding_format="float")
        default = await oai.embeddings.create(model="m", input="a b")  # base64 by default
    assert len(floats.data) == 2 and len(floats.data[0].embedding) == 8
    assert default.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-6)


async def test_missing_embedding_is_a_server_error(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    backend.hold = True
    waiting = asyncio.create_task(client.post("/encode", json={"text": "x", "rid": "noemb"}))
    await backend.wait_jobs(1)
    finish = protocol.FinishReason(type="length", length=0)
    entry = protocol.TextEntry(
        rid="noemb",
        epoch=1,
        seq=0,
        text="",
        token_ids=[],
        prompt_tokens=1,
        completion_tokens=0,
        finish=finish,
    )
    await backend.publish(API_ID, [entry])
    resp = await waiting
    assert resp.status_code == 500
    assert "no embedding" in resp.json()["error"]["message"]

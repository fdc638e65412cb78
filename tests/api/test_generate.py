"""Native /generate through ASGI against a fake back end: shapes, batching, streaming."""

from __future__ import annotations

import json
from typing import Any

import httpx
import redis.asyncio as aioredis
from fastapi import FastAPI

from shared import request_state
from shared.keys import Keys
from tests.support.app import API_ID, sse_events
from tests.support.backend import EOS_ID, FakeBackend


def manager(app: FastAPI) -> Any:
    return app.state.manager


async def test_generate_text(
    client: httpx.AsyncClient,
    backend: FakeBackend,
    tokenizer: Any,
    app: FastAPI,
    fake_redis: aioredis.Redis,
    keys: Keys,
) -> None:
    body = {"text": "What is 2+2?", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    resp = await client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    ids = tokenizer.encode(backend.reply)[:8]
    assert out["text"] == tokenizer.decode(ids)
    assert out["output_ids"] == ids
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == len(tokenizer.encode("What is 2+2?"))
    assert meta["completion_tokens"] == 8
    assert meta["cached_tokens"] == 0
    assert meta["e2e_latency"] >= 0
    (job,) = backend.jobs
    assert job.rid == meta["id"]
    assert job.input_ids == tokenizer.encode("What is 2+2?")
    assert (job.sampling.temperature, job.sampling.top_k, job.sampling.max_new_tokens) == (0, 1, 8)
    assert job.detok.api_id == API_ID
    state = await request_state.get(fake_redis, keys, job.rid)
    assert state["api_id"] == API_ID and state["prompt_tokens"] == str(len(job.input_ids))
    assert manager(app).rid_to_state == {}


async def test_generate_input_ids_rid_and_stop(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    body = {
        "input_ids": [1, 2, 3, 4],
        "rid": "my-rid",
        "sampling_params": {
            "max_new_tokens": 100,
            "stop": ".",
            "stop_token_ids": [7],
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "seed": 42,
        },
    }
    resp = await client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    meta = resp.json()["meta_info"]
    assert meta["id"] == "my-rid"
    assert meta["finish_reason"] == {"type": "stop", "matched": EOS_ID}
    (job,) = backend.jobs
    assert job.input_ids == [1, 2, 3, 4]
    assert job.sampling.stop == ["."] and job.detok.stop == ["."]
    assert job.sampling.stop_token_ids == [7] and job.sampling.seed == 42
    assert job.detok.skip_special_tokens is False and job.detok.no_stop_trim is True


async def test_generate_defaults(client: httpx.AsyncClient, backend: FakeBackend) -> None:
    resp = await client.post("/generate", json={"text": "Hi"})
    assert resp.status_code == 200, resp.text
    (job,) = backend.jobs
    s = job.sampling
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k) == (128, 1.0, 1.0, -1)
    assert s.stop == [] and s.ignore_eos is False and s.seed is None


async def test_generate_batch(
    client: httpx.AsyncClient, backend: FakeBackend, app: FastAPI
) -> None:
    body = {
        "text": ["Hello", "Tell me a story"],
        "rid": "b",
        "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 5}],
    }
    resp = await client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    outs = resp.json()
    assert isinstance(outs, list) and len(outs) == 2
    assert [o["meta_info"]["id"] for o in outs] == ["b_0", "b_1"]
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [3, 5]
    assert {j.rid: j.sampling.max_new_tokens for j in backend.jobs} == {"b_0": 3, "b_1": 5}
    assert manager(app).rid_to_state == {}


async def test_generate_batch_input_ids(client: httpx.AsyncClient, backend: FakeBackend) -> None:
    resp = await client.post("/generate", json={"input_ids": [[5, 6], [7]]})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()) == 2
    assert sorted(j.input_ids for j in backend.jobs) == [[5, 6], [7]]


async def test_generate_stream(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any, app: FastAPI
) -> None:
    body = {"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 9}}
    resp = await client.post("/generate", json=body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2
    texts = [c["text"] for c in chunks]
    for prev, cur in zip(texts, texts[1:], strict=False):
        assert cur.startswith(prev)  # cumulative, like SGLang's default
    ids = tokenizer.encode(backend.reply)[:9]
    assert chunks[-1]["text"] == tokenizer.decode(ids)
    assert chunks[-1]["output_ids"] == ids
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 9}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert manager(app).rid_to_state == {}


async def test_generate_batch_stream(client: httpx.AsyncClient, backend: FakeBackend) -> None:
    body = {"text": ["a", "b"], "stream": True, "sampling_params": {"max_new_tokens": 4}}
    resp = await client.post("/generate", json=body)
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["index"] for c in chunks} == {0, 1}
    finals = [c for c in chunks if c["meta_info"]["finish_reason"] is not None]
    assert sorted(c["index"] for c in finals) == [0, 1]


async def test_model_info_and_health(client: httpx.AsyncClient, model_path: str) -> None:
    resp = await client.get("/health")
    assert resp.status_code == 200
    info = (await client.get("/get_model_info")).json()
    assert info["model_path"] == model_path and info["tokenizer_path"] == model_path
    assert info["is_generation"] is True
    assert info["context_length"] == 8192 and info["vocab_size"] == 49152

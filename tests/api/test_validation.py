"""Hostile and invalid input: always a 4xx with the right body shape, never a 500, and nothing
reaches the request stream."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from shared.config import Settings
from shared.keys import Keys
from tests.support.backend import FakeBackend

CTX = 8192
MSG = [{"role": "user", "content": "hi"}]

# (path, raw JSON body or object, expected substring of the message)
CASES: list[tuple[str, Any, str]] = [
    ("/generate", '{"text": "hi", "sampling_params": {"temperature": NaN}}', "finite"),
    ("/generate", '{"text": "hi", "sampling_params": {"temperature": Infinity}}', "finite"),
    ("/generate", '{"text": "hi", "sampling_params": {"top_p": -Infinity}}', "finite"),
    ("/generate", '{"text": "hi", "sampling_params": {"temperature": 1e400}}', "finite"),
    ("/generate", '{"text": "hi", "sampling_params": {"temperature": "nan"}}', "finite"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -0.5}}, "temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**30}}, "context"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": CTX}}, "context"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 0}}, "top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"seed": 2**70}}, "seed"),
    ("/generate", {"text": "hi", "sampling_params": {"frequency_penalty": 3}}, "[-2, 2]"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_regex": "a+"}}, "not supported"),
    ("/generate", {"text": "hi", "sampling_params": {"min_p": 1.5}}, "min_p must be in [0, 1]"),
    ("/generate", {"text": "hi", "sampling_params": {"presence_penalty": -3}}, "[-2, 2]"),
    ("/generate", {"text": "hi", "sampling_params": {"repetition_penalty": 0}}, "(0, 2]"),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}},
        "min_new_tokens must be in [0, max_new_tokens(4)], got 9.",
    ),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"a": 1}}}, "token ids"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": ["x" * 300]}}, "1 to 256"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": -5}}, "top_k must be -1"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 0}}, "n must be at least 1"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": -5}, "-1"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "[-100, 100]"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 20, "max_tokens": 3}, "min_tokens"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 3}, "dimensions"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": [""]}}, "Stop strings"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": ["x"] * 17}}, "stop sequences"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [10**9]}}, "vocabulary"),
    ("/generate", {"text": "hi", "sampling_params": [{}, {}]}, "batch size"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs"),
    ("/generate", {"text": "hi", "image_data": "x.png"}, "image_data"),
    ("/generate", {"input_ids": [1, 49152]}, "out of vocabulary"),
    ("/generate", {"input_ids": [-1]}, "out of vocabulary"),
    ("/generate", {"input_ids": [10**30]}, "out of vocabulary"),
    ("/generate", {"input_ids": [1] * CTX}, "context length"),
    ("/generate", {"input_ids": []}, "empty"),
    ("/generate", {"text": ""}, "empty"),
    ("/generate", {"text": []}, "empty"),
    ("/generate", {"text": ["ok", ""]}, "empty"),
    ("/generate", {"text": "hi", "input_ids": [1]}, "Only one"),
    ("/generate", {}, "Either text, input_ids or input_embeds"),
    ("/generate", {"text": 5}, "text"),
    ("/generate", {"text": "hi", "rid": ["a", "b"]}, "rid"),
    ("/generate", {"text": ["a", "b"], "rid": ["x", "x"]}, "Duplicate request ID detected: x"),
    ("/generate", {"text": "hi", "rid": ""}, "rid"),
    ("/generate", '{"text": "\\ud800"}', "surrogate"),
    ("/generate", '{"text": "hi", "rid": "\\udfff"}', "rid"),
    ("/generate", '{"text": "hi", "sampling_params": {"stop": "\\ud800"}}', "surrogate"),
    ("/generate", '{"text": "hi",', "Invalid JSON"),
    ("/generate", "[1, 2", "Invalid JSON"),
    ("/generate", '{"input_ids": [' + "9" * 5000 + "]}", ""),
    ("/generate", {"text": "x" * (CTX * 32 + 1)}, "characters"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "finite"),
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**30}, "context"),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, "n must be ≤ 16"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs must be in [0, 20]"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, "vocabulary"),
    ("/v1/completions", {"prompt": ["a", 3]}, "prompt.1"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", '{"prompt": "\\ud800x"}', "surrogate"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 10**30}, "context"),
    ("/v1/chat/completions", {"messages": MSG, "top_p": NotImplemented}, "top_p"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, "`logprobs` must be"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        "type",
    ),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "surrogate"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "x"}], "seed": NaN}',
        "seed",
    ),
]


def _content(body: Any) -> str:
    if isinstance(body, str):
        return body
    return json.dumps(body, default=lambda _: "not-json")


@pytest.mark.parametrize(("path", "body", "needle"), CASES)
async def test_rejected(
    client: httpx.AsyncClient,
    fake_redis: aioredis.Redis,
    keys: Keys,
    path: str,
    body: Any,
    needle: str,
) -> None:
    resp = await client.post(
        path, content=_content(body), headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert needle in error["message"]
    if path.startswith("/v1/"):
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
    else:
        assert set(error) == {"message"}
    assert await fake_redis.xlen(keys.request_stream) == 0


async def test_not_json_content_type(client: httpx.AsyncClient) -> None:
    resp = await client.post("/generate", content=b"hello", headers={"content-type": "text/plain"})
    assert resp.status_code == 400
    assert "error" in resp.json()


async def test_duplicate_of_running_rid(
    client: httpx.AsyncClient, backend: FakeBackend, fake_redis: aioredis.Redis, keys: Keys
) -> None:
    backend.hold = True
    first = asyncio.create_task(client.post("/generate", json={"text": "hi", "rid": "dup"}))
    await backend.wait_jobs(1)
    resp = await client.post("/v1/completions", json={"prompt": "hi", "rid": "dup"})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "Duplicate request ID detected: dup"
    assert await fake_redis.xlen(keys.request_stream) == 1
    await client.post("/abort_request", json={"rid": "dup"})
    assert (await first).json()["meta_info"]["finish_reason"]["type"] == "abort"


async def test_unknown_route_has_error_body(client: httpx.AsyncClient) -> None:
    resp = await client.get("/nope")
    assert resp.status_code == 404 and "message" in resp.json()["error"]


async def test_huge_body_is_413(
    client: httpx.AsyncClient, fake_redis: aioredis.Redis, keys: Keys, settings: Settings
) -> None:
    body = b'{"text": "' + b"x" * settings.api.max_body_bytes + b'"}'
    resp = await client.post(
        "/generate", content=body, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 413
    assert await fake_redis.xlen(keys.request_stream) == 0

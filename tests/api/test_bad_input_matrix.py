"""Every row of the bad-input matrix (reliability.md §5) as a test: the status and message are
as specified, the process stays up (/health answers, a normal request still works), and
nothing was written to the job stream."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

from shared.config import Settings
from shared.keys import Keys
from tests.support.app import running_app, with_api
from tests.support.backend import FakeBackend

CTX = 8192
JSON = {"content-type": "application/json"}
MSG = [{"role": "user", "content": "hi"}]


@dataclass
class Row:
    name: str
    path: str
    body: Any  # an object (sent as JSON) or the raw bytes/str
    status: int
    needle: str  # part of the error message
    param: str | None = None  # the OpenAI `param` that must be named
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))


MATRIX = [
    Row("malformed json", "/v1/completions", '{"prompt": "hi",', 400, "Invalid JSON body"),
    Row("malformed json native", "/generate", "[1, 2", 400, "Invalid JSON body"),
    Row("wrong type", "/v1/completions", {"prompt": 123}, 400, "prompt", param="prompt"),
    Row(
        "max_tokens -5",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": -5},
        400,
        "max_tokens must be ≥ 1",
        param="max_tokens",
    ),
    Row(
        "max_tokens 0",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 0},
        400,
        "max_tokens must be ≥ 1",
        param="max_tokens",
    ),
    Row(
        "max_tokens 10**30",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 10**30},
        400,
        f"This model's maximum context length is {CTX} tokens. However, you requested",
    ),
    Row(
        "max_new_tokens 10**30 native",
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 10**30}},
        400,
        f"Requested token count exceeds the model's maximum context length of {CTX}",
    ),
    Row(
        "5000-digit integer",
        "/v1/completions",
        '{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}",
        400,
        "too many digits",
    ),
    Row(
        "temperature NaN",
        "/v1/completions",
        '{"prompt": "hi", "temperature": NaN}',
        400,
        "temperature must be a finite number",
        param="temperature",
    ),
    Row(
        "temperature Infinity",
        "/v1/completions",
        '{"prompt": "hi", "temperature": Infinity}',
        400,
        "temperature must be a finite number",
        param="temperature",
    ),
    Row(
        "temperature 1e400",
        "/v1/completions",
        '{"prompt": "hi", "temperature": 1e400}',
        400,
        "temperature must be a finite number",
        param="temperature",
    ),
    Row(
        "temperature NaN native",
        "/generate",
        '{"text": "hi", "sampling_params": {"temperature": -Infinity}}',
        400,
        "sampling_params.temperature must be a finite number",
    ),
    Row(
        "temperature 'nan' string",
        "/v1/completions",
        {"prompt": "hi", "temperature": "nan"},
        400,
        "temperature must be a finite number",
        param="temperature",
    ),
    Row(
        "NaN in an untyped field",
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": [NaN]}}',
        400,
        "chat_template_kwargs.a.0 must be a finite number",
    ),
    Row(
        "NaN in an unknown field",
        "/v1/completions",
        '{"prompt": "hi", "foo": {"b": NaN}}',
        400,
        "foo.b must be a finite number",
    ),
    Row("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
    Row(
        "lone surrogate",
        "/v1/completions",
        '{"prompt": "\\ud800"}',
        400,
        "lone surrogate",
        param="prompt",
    ),
    Row(
        "lone surrogate in messages",
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "a\\udfffb"}]}',
        400,
        "lone surrogate",
        param="messages.0.content",
    ),
    Row(
        "token id out of vocab",
        "/v1/completions",
        {"prompt": [1, 49152]},
        400,
        "Token id 49152 is out of vocabulary",
        param="input_ids",
    ),
    Row(
        "negative token id",
        "/generate",
        {"input_ids": [5, -1]},
        400,
        "Token id -1 is out of vocabulary",
    ),
    Row(
        "logit_bias key out of vocab",
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {"99999": 1}},
        400,
        "Token id 99999 is out of vocabulary",
        param="logit_bias",
    ),
    Row(
        "stop_token_ids out of vocab",
        "/v1/chat/completions",
        {"messages": MSG, "stop_token_ids": [10**6]},
        400,
        "out of vocabulary",
        param="stop_token_ids",
    ),
    Row(
        "token_ids_logprob out of vocab",
        "/generate",
        {"text": "hi", "return_logprob": True, "token_ids_logprob": [60000]},
        400,
        "Token id 60000 is out of vocabulary",
    ),
    Row(
        "empty prompt",
        "/v1/completions",
        {"prompt": ""},
        400,
        "prompt must not be empty",
        param="prompt",
    ),
    Row("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt must not be empty"),
    Row(
        "empty messages",
        "/v1/chat/completions",
        {"messages": []},
        400,
        "messages must not be empty",
        param="messages",
    ),
    Row("empty text native", "/generate", {"text": ""}, 400, "The input cannot be empty"),
    Row(
        "10 MB prompt",
        "/v1/completions",
        {"prompt": "x" * 10_000_000},
        413,
        "larger than the limit",
    ),
    Row("deeply nested json", "/v1/completions", "[" * 100_000, 400, "Invalid JSON body"),
    Row(
        "10k stop strings",
        "/v1/completions",
        {"prompt": "hi", "stop": ["s"] * 10_000},
        400,
        "At most 16 stop sequences are allowed",
        param="stop",
    ),
    Row(
        "n 1000000",
        "/v1/completions",
        {"prompt": "hi", "n": 1_000_000},
        400,
        "n must be ≤ 16",
        param="n",
    ),
    Row(
        "n 1000000 native",
        "/generate",
        {"text": "hi", "sampling_params": {"n": 1_000_000}},
        400,
        "n must be ≤ 16",
    ),
    Row(
        "top_logprobs cap",
        "/v1/chat/completions",
        {"messages": MSG, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs must be in [0, 20]",
        param="top_logprobs",
    ),
    Row(
        "text/plain not json",
        "/v1/completions",
        "prompt=hi",
        400,
        "Invalid JSON body",
        headers={"content-type": "text/plain"},
    ),
    Row(
        "multipart",
        "/v1/completions",
        b"--x\r\n\r\nhi\r\n--x--",
        415,
        "Unsupported Media Type",
        headers={"content-type": "multipart/form-data; boundary=x"},
    ),
    Row(
        "xml",
        "/generate",
        "<text>hi</text>",
        415,
        "Unsupported Media Type",
        headers={"content-type": "application/xml"},
    ),
]


def _content(body: Any) -> bytes:
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode("utf-8", "surrogatepass")
    return json.dumps(body).encode()


async def _assert_still_serving(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).status_code == 200
    ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("row", MATRIX, ids=[r.name for r in MATRIX])
async def test_matrix_row(
    row: Row,
    client: httpx.AsyncClient,
    backend: FakeBackend,
    fake_redis: aioredis.Redis,
    keys: Keys,
    app: FastAPI,
) -> None:
    resp = await client.post(row.path, content=_content(row.body), headers=row.headers)
    assert resp.status_code == row.status, resp.text
    error = resp.json()["error"]
    assert row.needle in error["message"]
    if row.path.startswith("/v1/"):
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        if row.param is not None:
            assert error["param"] == row.param
    else:
        assert set(error) == {"message"}
    assert await fake_redis.xlen(keys.request_stream) == 0
    assert app.state.manager.rid_to_state == {}
    await _assert_still_serving(client)


async def test_unknown_field_is_ignored_and_logged(
    client: httpx.AsyncClient, backend: FakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="api.schemas.common"):
        resp = await client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "foo": {"x": 1}}
        )
    assert resp.status_code == 200, resp.text
    assert "ignoring unknown fields of CompletionRequest: 'foo'" in caplog.text
    (job,) = backend.jobs
    assert "foo" not in json.dumps(job.sampling.__struct_fields__)


@pytest.fixture
async def auth_client(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any
) -> AsyncIterator[httpx.AsyncClient]:
    async with running_app(
        with_api(settings, api_keys=["k-one", "k-two"]), fake_redis, tokenizer
    ) as (_app, client):
        yield client


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": "k-one"},
        {"authorization": "Basic k-one"},
    ],
    ids=["missing", "wrong", "no scheme", "wrong scheme"],
)
async def test_matrix_missing_or_wrong_api_key(
    auth_client: httpx.AsyncClient,
    fake_redis: aioredis.Redis,
    keys: Keys,
    headers: dict[str, str],
) -> None:
    resp = await auth_client.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
    assert resp.status_code == 401
    assert resp.headers["www-authenticate"] == "Bearer"
    assert resp.json() == {
        "error": {
            "message": "Missing or invalid API key. Send it as 'Authorization: Bearer <key>'.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    assert await fake_redis.xlen(keys.request_stream) == 0
    assert (await auth_client.get("/health")).status_code == 200

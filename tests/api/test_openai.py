"""OpenAI-compatible routes through ASGI: shapes, streaming, usage, chat template, and the
official `openai` client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from tests.support.app import sse_events
from tests.support.backend import FakeBackend

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
]


def reply(tokenizer: Any, backend: FakeBackend, n: int) -> str:
    return str(tokenizer.decode(tokenizer.encode(backend.reply)[:n]))


async def test_completion(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any, app: FastAPI
) -> None:
    resp = await client.post("/v1/completions", json={"model": "x", "prompt": "Say hi"})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
    assert isinstance(out["created"], int)
    assert out["model"] == app.state.manager.model.served_model_name
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["text"] == reply(tokenizer, backend, 16)  # max_tokens defaults to 16
    assert choice["finish_reason"] == "length"
    prompt_tokens = len(tokenizer.encode("Say hi"))
    assert out["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 16,
        "total_tokens": prompt_tokens + 16,
    }
    assert backend.jobs[0].sampling.max_new_tokens == 16


async def test_completion_batch_prompts(client: httpx.AsyncClient, backend: FakeBackend) -> None:
    for prompt in (["a", "b"], [[1, 2], [3]]):
        resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
        assert resp.status_code == 200, resp.text
        choices = resp.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1]
        assert resp.json()["usage"]["completion_tokens"] == 6
    resp = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
    assert len(resp.json()["choices"]) == 1
    assert backend.jobs[-1].input_ids == [5, 6, 7]


async def test_completion_stream(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any
) -> None:
    body = {
        "prompt": "Say hi",
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *content, usage = chunks
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in content) == reply(tokenizer, backend, 7)
    assert [c["choices"][0]["finish_reason"] for c in content][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 7


async def test_chat(client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any) -> None:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 100}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    (choice,) = out["choices"]
    assert choice["message"] == {"role": "assistant", "content": reply(tokenizer, backend, 100)}
    assert choice["finish_reason"] == "stop"
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert backend.jobs[0].input_ids == expected
    assert out["usage"]["prompt_tokens"] == len(expected)


async def test_chat_default_max_tokens_fills_context(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    resp = await client.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert resp.status_code == 200, resp.text
    job = backend.jobs[0]
    assert job.sampling.max_new_tokens == 8192 - len(job.input_ids)


async def test_chat_content_parts(client: httpx.AsyncClient, backend: FakeBackend) -> None:
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text


async def test_chat_stream(client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    first, *content, usage = [json.loads(e) for e in events[:-1]]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert text == reply(tokenizer, backend, 5)
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


async def test_models(client: httpx.AsyncClient, app: FastAPI) -> None:
    name = app.state.manager.model.served_model_name
    out = (await client.get("/v1/models")).json()
    assert out["object"] == "list"
    assert [m["id"] for m in out["data"]] == [name]
    assert out["data"][0]["max_model_len"] == 8192
    assert (await client.get(f"/v1/models/{name}")).json()["id"] == name
    resp = await client.get("/v1/models/nope")
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"


@pytest.fixture
async def oai(app: FastAPI) -> AsyncIterator[openai.AsyncOpenAI]:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    async with openai.AsyncOpenAI(
        api_key="unused", base_url="http://test/v1", http_client=http, max_retries=0
    ) as c:
        yield c


async def test_openai_client_completions(
    oai: openai.AsyncOpenAI, backend: FakeBackend, tokenizer: Any
) -> None:
    out = await oai.completions.create(model="m", prompt="Say hi", max_tokens=6, temperature=0)
    assert out.choices[0].text == reply(tokenizer, backend, 6)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 6
    stream = await oai.completions.create(
        model="m",
        prompt="Say hi",
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, usage = [], None
    async for chunk in stream:
        texts += [c.text for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(texts) == reply(tokenizer, backend, 6)
    assert usage is not None and usage.completion_tokens == 6


async def test_openai_client_chat(
    oai: openai.AsyncOpenAI, backend: FakeBackend, tokenizer: Any
) -> None:
    out = await oai.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_completion_tokens=8,
        seed=1,  # type: ignore[arg-type]
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == reply(tokenizer, backend, 8)
    assert backend.jobs[0].sampling.seed == 1
    stream = await oai.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=8,
        stream=True,  # type: ignore[arg-type]
    )
    parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(parts) == reply(tokenizer, backend, 8)


async def test_openai_client_errors(oai: openai.AsyncOpenAI, backend: FakeBackend) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await oai.completions.create(model="m", prompt="x", max_tokens=10**9)
    assert "maximum context length" in err.value.message
    with pytest.raises(openai.BadRequestError):
        await oai.chat.completions.create(model="m", messages=MESSAGES, n=10**6)  # type: ignore[arg-type]
    assert backend.jobs == []

"""Logprobs plumbing: the request reaches the engine as a LogprobRequest; the engine's values
(here the fake back end's) come back in SGLang's `(logprob, token_id, text|None)` format on
/generate, and in OpenAI's completion and chat shapes on /v1, streamed or not."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from shared import protocol
from tests.support.app import API_ID, sse_events
from tests.support.backend import FakeBackend, fake_logprob, fake_top_ids

PROMPT = "What is 2+2?"


def text_of(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id]))


def triple(tokenizer: Any | None, pos: int, token_id: int) -> list[Any]:
    shown = text_of(tokenizer, token_id) if tokenizer is not None else None
    return [fake_logprob(pos, token_id), token_id, shown]


async def test_generate_logprobs_sglang_format(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any
) -> None:
    body = {
        "text": PROMPT,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "token_ids_logprob": [5, 7],
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 4},
    }
    out = (await client.post("/generate", json=body)).json()
    assert backend.jobs[0].logprobs == protocol.LogprobRequest(0, 2, [5, 7])
    meta, ids = out["meta_info"], out["output_ids"]
    assert meta["output_token_logprobs"] == [triple(tokenizer, p, t) for p, t in enumerate(ids)]
    assert meta["output_top_logprobs"] == [
        [triple(tokenizer, p, top) for top in fake_top_ids(p, t, 2)] for p, t in enumerate(ids)
    ]
    assert meta["output_token_ids_logprobs"] == [
        [triple(tokenizer, p, 5), triple(tokenizer, p, 7)] for p in range(len(ids))
    ]
    prompt = tokenizer.encode(PROMPT)
    inputs = meta["input_token_logprobs"]
    assert inputs[0] == [None, prompt[0], text_of(tokenizer, prompt[0])]  # nothing predicts it
    assert inputs[1:] == [triple(tokenizer, p, t) for p, t in enumerate(prompt) if p > 0]
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 2
    assert meta["input_token_ids_logprobs"][0] is None
    assert meta["input_token_ids_logprobs"][1] == [triple(tokenizer, 1, 5), triple(tokenizer, 1, 7)]


async def test_generate_logprob_options(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any
) -> None:
    prompt = tokenizer.encode(PROMPT)
    body = {
        "text": PROMPT,
        "return_logprob": True,
        "logprob_start_len": 3,
        "sampling_params": {"max_new_tokens": 3},
    }
    meta = (await client.post("/generate", json=body)).json()["meta_info"]
    assert meta["input_token_logprobs"] == [
        triple(None, p, t) for p, t in enumerate(prompt) if p >= 3
    ]
    assert all(text is None for _lp, _id, text in meta["output_token_logprobs"])
    assert "output_top_logprobs" not in meta and "output_token_ids_logprobs" not in meta
    meta = (await client.post("/generate", json={**body, "logprob_start_len": -1})).json()
    assert meta["meta_info"]["input_token_logprobs"] == []
    plain = (await client.post("/generate", json={"text": PROMPT})).json()["meta_info"]
    assert not any("logprobs" in key for key in plain)
    assert backend.jobs[-1].logprobs is None
    batch = {
        "text": ["a", "b"],
        "return_logprob": [True, False],
        "sampling_params": {"max_new_tokens": 2},
    }
    outs = (await client.post("/generate", json=batch)).json()
    assert len(outs[0]["meta_info"]["output_token_logprobs"]) == 2
    assert "output_token_logprobs" not in outs[1]["meta_info"]


async def test_completion_logprobs(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 5, "logprobs": 2}
    choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    ids = tokenizer.encode(backend.reply)[:5]
    lp = choice["logprobs"]
    tokens = [text_of(tokenizer, t) for t in ids]
    assert lp["tokens"] == tokens
    assert lp["token_logprobs"] == [fake_logprob(p, t) for p, t in enumerate(ids)]
    assert lp["text_offset"] == [sum(len(x) for x in tokens[:i]) for i in range(5)]
    for p, (t, top) in enumerate(zip(ids, lp["top_logprobs"], strict=True)):
        expected = {text_of(tokenizer, t): fake_logprob(p, t)}
        expected.update({text_of(tokenizer, x): fake_logprob(p, x) for x in fake_top_ids(p, t, 2)})
        assert top == expected
    stream = await client.post("/v1/completions", json={**body, "stream": True})
    parts = [json.loads(e)["choices"][0]["logprobs"] for e in sse_events(stream.text)[:-1]]
    parts = [p for p in parts if p]
    assert [t for p in parts for t in p["tokens"]] == tokens
    assert [o for p in parts for o in p["text_offset"]] == lp["text_offset"]


async def test_chat_logprobs(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any
) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 2,
    }
    choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
    ids = tokenizer.encode(backend.reply)[:4]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [text_of(tokenizer, t) for t in ids]
    assert [c["logprob"] for c in content] == [fake_logprob(p, t) for p, t in enumerate(ids)]
    assert all(c["bytes"] == list(c["token"].encode()) for c in content)
    assert [len(c["top_logprobs"]) for c in content] == [2] * 4
    assert content[1]["top_logprobs"][0]["logprob"] == fake_logprob(
        1, fake_top_ids(1, ids[1], 2)[0]
    )
    no = (
        await client.post(
            "/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None}
        )
    ).json()
    assert no["choices"][0]["logprobs"] is None


@pytest.fixture
async def oai(app: FastAPI) -> Any:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    async with openai.AsyncOpenAI(
        api_key="x", base_url="http://test/v1", http_client=http, max_retries=0
    ) as c:
        yield c


async def test_openai_client_reads_logprobs(oai: openai.AsyncOpenAI, backend: FakeBackend) -> None:
    chat = await oai.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=1,
    )
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 1
    comp = await oai.completions.create(model="m", prompt="hi", max_tokens=3, logprobs=1)
    assert comp.choices[0].logprobs is not None
    assert len(comp.choices[0].logprobs.tokens or []) == 3


async def test_non_finite_engine_values_stay_json(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    backend.hold = True
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "rid": "inf"}
    waiting = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    await backend.wait_jobs(1)
    lp = protocol.Logprobs(token_logprobs=[float("-inf"), float("nan")])
    entry = protocol.TextEntry(
        rid="inf",
        epoch=1,
        seq=0,
        text="ab",
        token_ids=[10, 11],
        prompt_tokens=3,
        completion_tokens=2,
        output_logprobs=lp,
        finish=protocol.FinishReason(type="length", length=2),
    )
    await backend.publish(API_ID, [entry])
    resp = await waiting
    assert resp.status_code == 200, resp.text
    assert [c["logprob"] for c in resp.json()["choices"][0]["logprobs"]["content"]] == [-9999.0] * 2

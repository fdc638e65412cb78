"""Streaming: batch items' chunks interleave as they become ready, each tagged with its index;
cumulative (SGLang's default) and incremental (--incremental-streaming-output) chunks give the
same final text, ids and logprobs; outputs never copy what is cumulative; OpenAI usage in
streams (include_usage, continuous_usage_stats)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from api import sse
from api.req_state import GenerateReq, ReqState
from shared import protocol
from shared.config import Settings
from tests.support.app import running_app, sse_events, with_api
from tests.support.backend import FakeBackend

TEXTS = ["Hello", "Tell me a story", "Why is the sky blue?"]


def chunks_of(resp: httpx.Response) -> list[dict[str, Any]]:
    assert resp.status_code == 200, resp.text
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def reply(tokenizer: Any, backend: FakeBackend, n: int) -> str:
    return str(tokenizer.decode(tokenizer.encode(backend.reply)[:n]))


async def test_batch_stream_interleaves_tagged_chunks(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any
) -> None:
    backend.chunk, backend.step_delay = 1, 0.005
    lengths = [3, 12, 7]
    body = {
        "text": TEXTS,
        "stream": True,
        "sampling_params": [{"max_new_tokens": n} for n in lengths],
    }
    chunks = chunks_of(await client.post("/generate", json=body))
    order = [c["index"] for c in chunks]
    assert set(order) == {0, 1, 2}
    # Interleaved: some item's chunks are separated by another item's chunk.
    assert any(
        order[i] == order[k] != order[j]
        for i in range(len(order))
        for j in range(i, len(order))
        for k in range(j, len(order))
    )
    finals = [i for i, c in enumerate(chunks) if c["meta_info"]["finish_reason"] is not None]
    assert [chunks[i]["index"] for i in finals] == [0, 2, 1]  # as each became ready
    assert finals[0] < len(chunks) - 5  # the short one did not wait for the others
    for index, n in enumerate(lengths):
        last = [c for c in chunks if c["index"] == index][-1]
        assert last["text"] == reply(tokenizer, backend, n)
        assert last["meta_info"]["completion_tokens"] == n


async def _stream_both_ways(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any, body: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    out = []
    for incremental in (False, True):
        conf = with_api(settings, incremental_streaming_output=incremental)
        async with running_app(conf, fake_redis, tokenizer) as (app, client):
            out.append(chunks_of(await client.post("/generate", json=body)))
            assert app.state.manager.rid_to_state == {}
    return out[0], out[1]


def _by_index(chunks: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for c in chunks:
        out.setdefault(c.get("index", 0), []).append(c)
    return out


async def test_cumulative_and_incremental_reconstruct_the_same(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any, backend: FakeBackend
) -> None:
    backend.step_delay = 0.002
    body = {
        "text": TEXTS,
        "stream": True,
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 11},
    }
    cumulative, incremental = await _stream_both_ways(settings, fake_redis, tokenizer, body)
    expected = reply(tokenizer, backend, 11)
    cum, inc = _by_index(cumulative), _by_index(incremental)
    assert set(cum) == set(inc) == {0, 1, 2}
    for index in cum:
        final = cum[index][-1]
        parts = inc[index]
        assert len(parts) > 2
        assert final["text"] == "".join(c["text"] for c in parts) == expected
        assert final["output_ids"] == [i for c in parts for i in c["output_ids"]]
        for name in ("output_token_logprobs", "output_top_logprobs"):
            sliced = [x for c in parts for x in c["meta_info"][name]]
            assert final["meta_info"][name] == sliced
            assert len(sliced) == 11
        texts = cum[index]
        for prev, cur in zip(texts, texts[1:], strict=False):
            assert cur["text"].startswith(prev["text"])  # cumulative
        assert all(not c["text"].startswith(expected[:8]) for c in parts[1:])  # deltas


def test_outputs_do_not_copy_cumulative_data() -> None:
    req = GenerateReq(
        rid="r",
        prompt=[1],
        sampling=protocol.SamplingParams(),
        max_new_tokens=None,
        stream=True,
        incremental=True,
    )
    state = ReqState(obj=req, index=0, prompt_tokens=1)
    deltas = []
    for seq in range(2000):
        entry = protocol.TextEntry(
            rid="r",
            epoch=1,
            seq=seq,
            text=f"{seq % 10}",
            token_ids=[seq],
            prompt_tokens=1,
            completion_tokens=seq + 1,
        )
        assert state.accept(entry)
        out = state.take_output()
        assert out.ids is state.output_ids  # a view by offsets, not a copy
        assert (out.start, out.end) == (seq, seq + 1)
        deltas.append(out.delta)
    assert state.text == ""  # incremental: the cumulative text is never built
    assert "".join(deltas) == "".join(f"{i % 10}" for i in range(2000))


async def test_completion_stream_usage_options(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    body = {
        "prompt": ["a", "b"],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = chunks_of(await client.post("/v1/completions", json=body))
    *content, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12
    seen = [c["usage"]["completion_tokens"] for c in content]
    assert seen == sorted(seen) and all(c["usage"] is not None for c in content)
    assert {c["choices"][0]["index"] for c in content} == {0, 1}


async def test_chat_stream_with_n_opens_each_choice(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any
) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "n": 2,
        "max_tokens": 5,
        "stream": True,
    }
    chunks = chunks_of(await client.post("/v1/chat/completions", json=body))
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": ""}
    ] * 2
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]
    for index in (0, 1):
        text = "".join(
            c["choices"][0]["delta"].get("content", "")
            for c in chunks[2:]
            if c["choices"][0]["index"] == index
        )
        assert text == reply(tokenizer, backend, 5)
    assert all("usage" not in c or c["usage"] is None for c in chunks)


@pytest.mark.parametrize(
    ("asgi", "watched"),
    [({"version": "3.0", "spec_version": "2.3"}, True), ({"version": "3.0"}, True),
     ({"version": "3.0", "spec_version": "2.4"}, False), ({"spec_version": "x"}, False)],
)  # fmt: skip
def test_the_disconnect_poll_is_left_to_starlette_only_below_asgi_2_4(
    asgi: dict[str, str], watched: bool
) -> None:
    class Request:
        scope = {"type": "http", "asgi": asgi}

    assert sse.server_watches_disconnect(Request()) is watched
    assert sse.server_watches_disconnect(object()) is False  # no scope: poll

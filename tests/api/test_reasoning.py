"""--reasoning-parser on the chat route (fake back end): a thinking model's <think> block
comes back as reasoning_content, the answer alone as content, streamed and not."""

from __future__ import annotations

import json

import httpx
import pytest

from shared.config import Settings
from tests.support.backend import FakeBackend

THOUGHT = "<think>\nTwo and two make four.\n</think>\n\nThe answer is 4."
BODY = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 100}


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={"api": settings.api.model_copy(update={"reasoning_parser": "qwen3"})}
    )


async def test_the_thinking_goes_to_reasoning_content(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    backend.reply = THOUGHT
    message = (await client.post("/v1/chat/completions", json=BODY)).json()["choices"][0]
    assert message["message"]["reasoning_content"] == "Two and two make four."
    assert message["message"]["content"] == "The answer is 4."
    kept = (await client.post("/v1/chat/completions",
                              json={**BODY, "separate_reasoning": False})).json()  # fmt: skip
    assert kept["choices"][0]["message"] == {"role": "assistant", "content": THOUGHT}


async def test_a_stream_sends_reasoning_then_content(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    backend.reply = THOUGHT
    resp = await client.post("/v1/chat/completions", json={**BODY, "stream": True})
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in resp.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert reasoning.strip() == "Two and two make four." and content == "The answer is 4."
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any(d.get("reasoning_content") for d in deltas[first_content:])


async def test_an_answer_without_thinking_is_all_content(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    backend.reply = "Just four."
    message = (await client.post("/v1/chat/completions", json=BODY)).json()["choices"][0]
    assert message["message"] == {"role": "assistant", "content": "Just four."}

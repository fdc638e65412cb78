"""`echo` on /v1/completions (fake back end): the prompt leads the text, streamed or not,
and with logprobs the prompt's tokens lead the logprobs (the first with none)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.support.backend import FakeBackend

BODY = {"prompt": "The sea is", "max_tokens": 4, "echo": True}


def _chunks(resp: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:])["choices"][0] for line in resp.text.splitlines()
            if line.startswith("data: {")]  # fmt: skip


async def test_echo_streamed_equals_echo_whole(
    client: httpx.AsyncClient, backend: FakeBackend, tokenizer: Any
) -> None:
    whole = (await client.post("/v1/completions", json={**BODY, "logprobs": 1})).json()
    streamed = _chunks(await client.post("/v1/completions",
                                         json={**BODY, "logprobs": 1, "stream": True}))
    choice = whole["choices"][0]
    assert choice["text"].startswith("The sea is") and len(choice["text"]) > len("The sea is")
    assert "".join(c["text"] for c in streamed) == choice["text"]
    assert streamed[0]["text"].startswith("The sea is")
    joined = {k: [x for c in streamed for x in c["logprobs"][k]]
              for k in ("tokens", "token_logprobs", "text_offset")}  # fmt: skip
    assert joined == {k: choice["logprobs"][k] for k in joined}
    num_prompt = len(tokenizer("The sea is")["input_ids"])
    assert len(choice["logprobs"]["tokens"]) == num_prompt + 4
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["text_offset"][num_prompt] == len("The sea is")


async def test_echo_with_max_tokens_0_is_the_prompt_alone(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    resp = await client.post("/v1/completions", json={**BODY, "max_tokens": 0})
    assert resp.status_code == 200, resp.text
    assert backend.jobs[-1].sampling.max_new_tokens == 0
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert resp.status_code == 400  # without echo there is nothing to return

"""Must-shows of the end-to-end issue against the real processes, Redis and model."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import openai
import pytest

from tests.support.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.model]

PROMPTS = [
    "The capital of Germany is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three colors:",
    "Once upon a time, in a small village,",
    "The quick brown fox",
    "Question: What is 2 + 3?\nAnswer:",
    "Paris is a city in",
    "The best way to learn Python is",
    "Here is a short poem about autumn:",
    "My favourite food is",
    "In 1969, astronauts",
    "import numpy as np\n",
    "The three primary colors are",
    "Dear friend,",
    "Water boils at",
]


def _greedy(max_new_tokens: int = 24) -> dict[str, object]:
    return {"temperature": 0, "max_new_tokens": max_new_tokens}


def _sse_events(lines: list[str]) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def test_tiers_are_separate_processes_sharing_only_redis(stack: Stack) -> None:
    pids = {tier: p.pid for tier, p in stack.procs.items()}
    assert len(set(pids.values())) == 4 and os.getpid() not in pids.values()  # with jobs
    assert all(p.poll() is None for p in stack.procs.values())
    resp = httpx.post(
        stack.base_url + "/generate",
        json={"text": "Hello, my name is", "sampling_params": _greedy(8)},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["text"] and len(body["output_ids"]) == body["meta_info"]["completion_tokens"]
    assert body["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    # The request's durable state lives in Redis, written by the tiers.
    state = stack.redis().hgetall(stack.keys.state(body["meta_info"]["id"]))
    assert state["status"] == "finished" and state["worker"] == "e2e-scheduler"


def test_chat_knows_the_capital_of_france(stack: Stack) -> None:
    resp = httpx.post(
        stack.base_url + "/v1/chat/completions",
        json={
            "model": "default",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
            "max_tokens": 32,
        },
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] > 0


async def test_sixteen_concurrent_requests_equal_their_sequential_results(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:

        async def run(prompt: str) -> list[int]:
            resp = await client.post(
                "/generate", json={"text": prompt, "sampling_params": _greedy()}
            )
            assert resp.status_code == 200, resp.text
            ids: list[int] = resp.json()["output_ids"]
            return ids

        sequential = [await run(p) for p in PROMPTS]
        concurrent = await asyncio.gather(*(run(p) for p in PROMPTS))
    assert concurrent == sequential


def test_streamed_deltas_equal_the_non_streamed_text(stack: Stack) -> None:
    body = {
        "model": "default",
        "prompt": "Tell me about the ocean.",
        "temperature": 0,
        "max_tokens": 40,
    }
    whole = httpx.post(stack.base_url + "/v1/completions", json=body, timeout=60).json()
    with httpx.stream(
        "POST", stack.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as resp:
        events = _sse_events(list(resp.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert streamed == whole["choices"][0]["text"]
    assert len(chunks) > 3  # it really streamed


def test_native_stream_ends_with_done_and_full_text(stack: Stack) -> None:
    payload = {"text": "Count to five:", "sampling_params": _greedy(20)}
    whole = httpx.post(stack.base_url + "/generate", json=payload, timeout=60).json()
    with httpx.stream(
        "POST", stack.base_url + "/generate", json={**payload, "stream": True}, timeout=60
    ) as resp:
        events = _sse_events(list(resp.iter_lines()))
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]


def test_multibyte_characters_never_arrive_broken(stack: Stack) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stack.settings.model)
    # Greedy SmolLM2 answers this in Japanese; byte-level BPE splits those characters.
    messages = [{"role": "user", "content": "Write the word 'Japan' in Japanese: 日本"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    payload = {"text": prompt, "stream": True, "sampling_params": _greedy(30)}
    with httpx.stream("POST", stack.base_url + "/generate", json=payload, timeout=60) as r:
        events = _sse_events(list(r.iter_lines()))
    chunks = [json.loads(e) for e in events[:-1]]
    final = chunks[-1]
    split = [t for t in final["output_ids"] if "\ufffd" in tok.decode([t])]
    assert split, "no character of this answer spans several tokens; pick another prompt"
    assert any(ord(ch) > 0x7FF for ch in final["text"]), final["text"]
    # Cumulative text: a broken character in any delta would show up in some chunk.
    assert all("\ufffd" not in c["text"] for c in chunks if not c["meta_info"]["finish_reason"])
    assert final["text"] == tok.decode(final["output_ids"], skip_special_tokens=True)


def test_client_disconnect_mid_stream_aborts_and_frees_kv(stack: Stack) -> None:
    rid = f"disconnect-{time.time_ns()}"
    payload = {
        "text": "Write a very long story about a dragon.",
        "rid": rid,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True},
    }
    with httpx.stream("POST", stack.base_url + "/generate", json=payload, timeout=60) as resp:
        for n, _line in enumerate(resp.iter_lines()):
            if n >= 6:
                break
    disconnected_at = time.monotonic()
    r = stack.redis()
    beat = stack.keys.heartbeat("scheduler", stack.settings.scheduler.worker_id)
    # The stream waits orphan_grace_s for a re-attach, then is aborted.
    while time.monotonic() - disconnected_at < stack.settings.api.orphan_grace_s + 1.0:
        hb = r.hgetall(beat)
        status = r.hget(stack.keys.state(rid), "status")
        if status == "aborted" and hb and hb["num_free_blocks"] == hb["num_total_blocks"]:
            break
        time.sleep(0.02)
    assert r.hget(stack.keys.state(rid), "status") == "aborted"
    hb = r.hgetall(beat)
    assert hb["num_free_blocks"] == hb["num_total_blocks"], hb
    assert int(r.hget(stack.keys.state(rid), "completion_tokens") or 0) < 2000


def test_official_openai_client(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0)
    assert done.choices[0].text and done.usage and done.usage.completion_tokens > 0
    parts = client.completions.create(
        model=model, prompt="Hello", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(p.choices[0].text for p in parts if p.choices) == done.choices[0].text
    msgs: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "Say hi."}
    ]
    chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content
    stream = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=8, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content

"""`redserve scheduler --engine null` as a real process beside the real api and detokenizer:
its outputs are the documented function of (prompt, position), and they pass the stream
checks the real engine's pass (streamed = whole, concurrent = sequential, disconnects abort
and free the KV cache). What it cannot do (structured output) is a 400, not a hang."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from transformers import AutoConfig, AutoTokenizer

from shared.config import ApiSettings, SchedulerSettings, Settings
from shared.embedded_redis import free_port
from tests.support.stack import Stack, running_stack
from workers.scheduler.engine.null_runner import null_token, prompt_digest

pytestmark = [pytest.mark.e2e, pytest.mark.model]

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def null_stack(
    redis_url: str, model_path: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    settings = Settings(
        redis_url=redis_url,
        key_prefix=f"null{uuid.uuid4().hex[:6]}",
        model=model_path,
        files_dir=str(tmp_path_factory.mktemp("files")),
        api=ApiSettings(port=free_port(), api_id="null-api", orphan_grace_s=0.5),
        scheduler=SchedulerSettings(
            worker_id="null-scheduler", engine="null", null_step_ms=2, kv_cache_tokens=65536
        ),
    )
    with running_stack(settings, tmp_path_factory.mktemp("null-logs")) as stack:
        yield stack


def _expected(model_path: str, prompt_ids: list[int], n: int) -> list[int]:
    vocab_size = AutoConfig.from_pretrained(model_path).vocab_size
    first_id = max(AutoTokenizer.from_pretrained(model_path).all_special_ids) + 1
    digest = prompt_digest(prompt_ids)
    return [null_token(digest, i, first_id, vocab_size) for i in range(n)]


def _generate(ids: list[int], **extra: object) -> dict[str, object]:
    sampling = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return {"input_ids": ids, "sampling_params": sampling, **extra}


def test_outputs_are_the_function_of_prompt_and_position(
    null_stack: Stack, model_path: str
) -> None:
    prompt = [1000 + i for i in range(40)]
    resp = httpx.post(null_stack.base_url + "/generate", json=_generate(prompt), timeout=60)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["output_ids"] == _expected(model_path, prompt, MAX_TOKENS)
    assert body["meta_info"]["finish_reason"]["type"] == "length"
    assert body["text"]  # ordinary tokens: they decode to text


async def test_many_concurrent_streams_equal_their_sequential_results(null_stack: Stack) -> None:
    prompts = [[500 + i, 600 + 2 * i, 700 + 3 * i] * 4 for i in range(64)]
    async with httpx.AsyncClient(base_url=null_stack.base_url, timeout=120) as client:

        async def run(ids: list[int]) -> list[int]:
            resp = await client.post("/generate", json=_generate(ids))
            assert resp.status_code == 200, resp.text
            out: list[int] = resp.json()["output_ids"]
            return out

        sequential = [await run(p) for p in prompts[:8]]
        concurrent = await asyncio.gather(*(run(p) for p in prompts))
    assert concurrent[:8] == sequential
    assert len({tuple(ids) for ids in concurrent}) == len(prompts)


def test_streamed_deltas_equal_the_whole_text(null_stack: Stack) -> None:
    body = {"model": "default", "prompt": "Tell me about the ocean.", "max_tokens": MAX_TOKENS}
    url = null_stack.base_url + "/v1/completions"
    whole = httpx.post(url, json=body, timeout=60).json()
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as resp:
        lines = [ln.removeprefix("data: ") for ln in resp.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert streamed == whole["choices"][0]["text"] and len(chunks) > 3


def test_structured_output_is_refused_with_a_400(null_stack: Stack) -> None:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object"}}},
    }  # fmt: skip
    resp = httpx.post(null_stack.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert "cannot constrain" in resp.json()["error"]["message"]


def test_a_disconnected_stream_is_aborted_and_frees_the_kv_cache(null_stack: Stack) -> None:
    rid = f"null-disconnect-{time.time_ns()}"
    payload = _generate([42] * 30, rid=rid, stream=True)
    payload["sampling_params"] = {"max_new_tokens": 4000, "ignore_eos": True}
    with httpx.stream("POST", null_stack.base_url + "/generate", json=payload, timeout=60) as r:
        for n, _line in enumerate(r.iter_lines()):
            if n >= 6:
                break
    r = null_stack.redis()
    beat = null_stack.keys.heartbeat("scheduler", null_stack.settings.scheduler.worker_id)
    deadline = time.monotonic() + null_stack.settings.api.orphan_grace_s + 5
    while time.monotonic() < deadline:
        hb = r.hgetall(beat)
        aborted = r.hget(null_stack.keys.state(rid), "status") == "aborted"
        if aborted and hb and hb["num_free_blocks"] == hb["num_total_blocks"]:
            return
        time.sleep(0.02)
    raise AssertionError(f"not aborted and freed: {r.hgetall(null_stack.keys.state(rid))}")

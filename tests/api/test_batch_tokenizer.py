"""The async dynamic batch tokenizer: concurrent single-string requests share tokenizer calls
(counted), with ids identical to one-by-one tokenization; a batch request is one call; the
event loop never waits for the tokenizer."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis.asyncio as aioredis

from api.batch_tokenizer import AsyncDynamicBatchTokenizer
from shared.config import Settings
from tests.support.app import running_app
from tests.support.backend import FakeBackend

WORDS = ["apple", "river", "Mountain", "qubit", "naïve café", "東京", "emoji 🎉", "x" * 40]


class CountingTokenizer:
    """The real tokenizer, counting the calls that tokenize text."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0
        self.texts = 0

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.texts += len(text) if isinstance(text, list) else 1
        return self.inner(text, *args, **kwargs)

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        self.calls += 1
        self.texts += 1
        return list(self.inner.encode(text, *args, **kwargs))

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def prompt(i: int) -> str:
    return f"Request {i}: tell me about {WORDS[i % len(WORDS)]} number {i * 7919 % 1000}"


async def test_200_concurrent_requests_share_tokenizer_calls(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any, backend: FakeBackend
) -> None:
    counting = CountingTokenizer(tokenizer)
    async with running_app(settings, fake_redis, counting) as (app, client):
        counting.calls = counting.texts = 0
        bodies = [
            {"text": prompt(i), "rid": f"c{i}", "sampling_params": {"max_new_tokens": 1}}
            for i in range(200)
        ]
        resps = await asyncio.gather(*(client.post("/generate", json=b) for b in bodies))
        assert all(r.status_code == 200 for r in resps)
        assert counting.texts == 200
        assert counting.calls < 200, counting.calls
        assert app.state.manager.tok.batcher.num_calls == counting.calls
    jobs = {job.rid: job.input_ids for job in backend.jobs}
    assert len(jobs) == 200
    for i in range(200):
        assert jobs[f"c{i}"] == tokenizer.encode(prompt(i)), i


async def test_a_batch_request_is_one_call(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any, backend: FakeBackend
) -> None:
    counting = CountingTokenizer(tokenizer)
    async with running_app(settings, fake_redis, counting) as (_app, client):
        counting.calls = 0
        texts = [prompt(i) for i in range(50)]
        body = {"text": texts, "sampling_params": {"max_new_tokens": 1}}
        assert (await client.post("/generate", json=body)).status_code == 200
        assert counting.calls == 1
        resp = await client.post("/v1/completions", json={"prompt": texts[:5], "max_tokens": 1})
        assert resp.status_code == 200 and counting.calls == 2
    assert sorted(j.input_ids for j in backend.jobs[:50]) == sorted(tokenizer(texts)["input_ids"])


def _slow_upper(delay: float, seen: list[int]) -> Any:
    def encode(texts: list[str], kwargs: dict[str, Any]) -> list[list[int]]:
        seen.append(len(texts))
        time.sleep(delay)
        if any("bad" in t for t in texts):
            raise ValueError("cannot tokenize")
        shift = 1000 if kwargs.get("add_special_tokens") is False else 0
        return [[ord(c) + shift for c in t] for t in texts]

    return encode


async def test_gathers_while_the_tokenizer_is_busy_and_never_blocks_the_loop() -> None:
    seen: list[int] = []
    with ThreadPoolExecutor(1) as executor:
        batcher = AsyncDynamicBatchTokenizer(
            _slow_upper(0.05, seen), executor, batch_size=8, timeout_s=0.002
        )
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        tick_task = asyncio.create_task(ticker())
        texts = [f"t{i}" for i in range(20)]
        ids = await asyncio.gather(*(batcher.encode(t) for t in texts))
        tick_task.cancel()
        await batcher.close()
    assert ids == [[ord(c) for c in t] for t in texts]
    assert sum(seen) == 20 and len(seen) < 20 and max(seen) <= 8
    assert ticks >= 10  # the loop kept running while the tokenizer slept


async def test_a_lone_request_is_not_delayed() -> None:
    with ThreadPoolExecutor(1) as executor:
        batcher = AsyncDynamicBatchTokenizer(
            _slow_upper(0.0, []), executor, batch_size=8, timeout_s=5.0
        )
        started = time.monotonic()
        assert await batcher.encode("ab") == [97, 98]
        assert time.monotonic() - started < 1.0
        await batcher.close()


async def test_kwargs_groups_and_failures_stay_separate() -> None:
    seen: list[int] = []
    with ThreadPoolExecutor(1) as executor:
        batcher = AsyncDynamicBatchTokenizer(
            _slow_upper(0.01, seen), executor, batch_size=16, timeout_s=0.01
        )
        results = await asyncio.gather(
            batcher.encode("a"),
            batcher.encode("a", add_special_tokens=False),
            batcher.encode("bad one"),
            batcher.encode("b"),
            return_exceptions=True,
        )
        await batcher.close()
    assert results[0] == [97] and results[1] == [1097] and results[3] == [98]
    assert isinstance(results[2], ValueError)


async def test_runs_on_the_executor_thread() -> None:
    threads: list[str] = []

    def encode(texts: list[str], kwargs: dict[str, Any]) -> list[list[int]]:
        threads.append(threading.current_thread().name)
        return [[1] for _ in texts]

    with ThreadPoolExecutor(1, thread_name_prefix="tok") as executor:
        batcher = AsyncDynamicBatchTokenizer(encode, executor)
        await batcher.encode("x")
        await batcher.close()
    assert threads and all(t.startswith("tok") for t in threads)


@pytest.mark.parametrize("n", [1, 3])
async def test_close_cancels_waiters(n: int) -> None:
    gate = threading.Event()

    def encode(texts: list[str], kwargs: dict[str, Any]) -> list[list[int]]:
        gate.wait(2)
        return [[1] for _ in texts]

    with ThreadPoolExecutor(1) as executor:
        batcher = AsyncDynamicBatchTokenizer(encode, executor)
        waiters = [asyncio.create_task(batcher.encode(f"{i}")) for i in range(n)]
        await asyncio.sleep(0.01)
        await batcher.close()
        gate.set()
        done = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(d, asyncio.CancelledError) for d in done)

"""The Batch API on the real stack (`redserve` processes, a real redis-server, arq, the real
model in fp32) with the official `openai` client: 50 chat lines whose answers equal the same
requests sent directly (greedy), an embeddings batch, bad lines failing alone, a cancel."""

from __future__ import annotations

import io
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from openai import OpenAI
from openai.types import Batch

from tests.support.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.model]

TERMINAL = ("completed", "failed", "cancelled", "expired")
CHAT = "/v1/chat/completions"


@pytest.fixture
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)


def chat_body(i: int, max_tokens: int = 8) -> dict[str, Any]:
    question = f"In one short sentence, what is {i} plus {i % 7}?"
    return {"model": "default", "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": question}]}  # fmt: skip


def submit(client: OpenAI, endpoint: str, bodies: dict[str, Any], raw: list[str] = ()) -> Batch:  # type: ignore[assignment]
    lines = [json.dumps({"custom_id": cid, "method": "POST", "url": endpoint, "body": body})
             for cid, body in bodies.items()]  # fmt: skip
    data = "\n".join([*lines, *raw]).encode()
    uploaded = client.files.create(file=("lines.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint,  # type: ignore[arg-type]
                                 completion_window="24h")  # fmt: skip


def wait_for(client: OpenAI, batch: Batch, done: Any = None, timeout_s: float = 240) -> Batch:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch.id)
        if (done or (lambda b: b.status in TERMINAL))(batch):
            return batch
        time.sleep(0.3)
    raise AssertionError(f"batch {batch.id} stuck: {batch}")


def results(client: OpenAI, file_id: str | None) -> dict[str, Any]:
    """custom_id -> line; every custom_id appears once."""
    if file_id is None:
        return {}
    lines = [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a custom_id was written twice"
    return by_id


def test_fifty_chat_lines_equal_the_same_requests_sent_directly(client: OpenAI) -> None:
    bodies = {f"line-{i}": chat_body(i) for i in range(50)}
    batch = wait_for(client, submit(client, CHAT, bodies))
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed) == (50, 50)
    assert batch.error_file_id is None and batch.in_progress_at and batch.completed_at
    out = results(client, batch.output_file_id)
    assert set(out) == set(bodies)

    def direct(body: dict[str, Any]) -> str | None:
        return client.chat.completions.create(**body).choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        expected = dict(zip(bodies, pool.map(direct, bodies.values()), strict=True))
    for cid, line in out.items():
        response = line["response"]
        assert line["error"] is None and response["status_code"] == 200
        answer = response["body"]["choices"][0]["message"]["content"]
        assert answer == expected[cid], cid
        assert response["body"]["usage"]["completion_tokens"] <= 8


def test_an_embeddings_batch_equals_direct_embeddings(client: OpenAI) -> None:
    texts = [f"a sentence about the number {i}" for i in range(8)]
    bodies = {f"e{i}": {"model": "default", "input": t} for i, t in enumerate(texts)}
    bodies["pair"] = {"model": "default", "input": texts[:2]}
    batch = wait_for(client, submit(client, "/v1/embeddings", bodies))
    assert batch.status == "completed", batch
    out = results(client, batch.output_file_id)
    for cid, body in bodies.items():
        got = out[cid]["response"]["body"]
        want = client.embeddings.create(**body)
        assert len(got["data"]) == len(want.data)
        for g, w in zip(got["data"], want.data, strict=True):
            assert g["embedding"] == pytest.approx(w.embedding, rel=1e-4, abs=1e-5), cid


def test_bad_lines_fail_alone_into_the_error_file(client: OpenAI) -> None:
    bodies = {f"ok-{i}": chat_body(i, max_tokens=4) for i in range(4)}
    bodies["no-messages"] = {"model": "default", "messages": []}
    bodies["bad-temperature"] = {**chat_body(9), "temperature": -3}
    bodies["bad-schema"] = {**chat_body(9), "response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"type": "nope"}}}}  # fmt: skip
    batch = wait_for(client, submit(client, CHAT, bodies))
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 3)
    assert set(results(client, batch.output_file_id)) == {f"ok-{i}" for i in range(4)}
    errors = results(client, batch.error_file_id)
    assert set(errors) == {"no-messages", "bad-temperature", "bad-schema"}
    for line in errors.values():
        assert line["response"]["status_code"] == 400
        assert line["response"]["body"]["error"]["type"] == "invalid_request_error"


def test_cancel_mid_way_keeps_what_finished(client: OpenAI) -> None:
    bodies = {f"c{i}": chat_body(i, max_tokens=48) | {"ignore_eos": True} for i in range(60)}
    batch = submit(client, CHAT, bodies)
    batch = wait_for(client, batch, lambda b: b.request_counts and b.request_counts.completed)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait_for(client, batch)
    assert batch.status == "cancelled" and batch.cancelled_at, batch
    assert batch.request_counts is not None
    finished = batch.request_counts.completed
    assert 0 < finished < 60
    out = results(client, batch.output_file_id)
    assert len(out) == finished and set(out) <= set(bodies)
    listed = client.batches.list(limit=100)
    assert batch.id in {b.id for b in listed.data}

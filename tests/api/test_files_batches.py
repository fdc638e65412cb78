"""The Files and Batch APIs through ASGI on fakeredis: OpenAI's shapes and errors, uploads
bounded while they stream in, every line of a batch's input checked when it is created, the
batch queued for the jobs tier, cursor pagination, cancel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis
import redis.exceptions
from fastapi import FastAPI

from shared import batches, job_queue
from shared.config import Settings
from shared.keys import Keys
from tests.support.app import running_app, with_api

CHAT = "/v1/chat/completions"


@pytest.fixture
def settings(settings: Settings, tmp_path: Path) -> Settings:
    settings.files_dir = str(tmp_path / "files")
    return settings


def _line(custom_id: str, url: str = CHAT, **body: Any) -> dict[str, Any]:
    body = body or {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _jsonl(lines: list[Any]) -> bytes:
    return "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines).encode() + b"\n"


async def _upload(client: httpx.AsyncClient, data: bytes, purpose: str = "batch") -> Any:
    files = {"file": ("in.jsonl", data, "application/jsonl")}
    return await client.post("/v1/files", files=files, data={"purpose": purpose})


async def _create(client: httpx.AsyncClient, file_id: str, endpoint: str = CHAT) -> Any:
    body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"}
    return await client.post("/v1/batches", json=body)


def _openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def test_files_round_trip_with_the_openai_client(
    app: FastAPI, client: httpx.AsyncClient, settings: Settings
) -> None:
    oai = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=client)
    data = _jsonl([_line("a"), _line("b")])
    first = await oai.files.create(file=("a.jsonl", data), purpose="batch")
    second = await oai.files.create(file=("b.txt", b"notes"), purpose="user_data")
    assert first.bytes == len(data) and first.filename == "a.jsonl" and first.purpose == "batch"
    assert (Path(settings.files_dir) / first.id).read_bytes() == data
    assert (await oai.files.retrieve(first.id)).id == first.id
    assert (await oai.files.content(first.id)).content == data
    listed = await oai.files.list()
    assert [f.id for f in listed.data] == [second.id, first.id]  # newest first
    assert [f.id for f in (await oai.files.list(purpose="batch")).data] == [first.id]
    page = await client.get("/v1/files", params={"limit": 1, "order": "asc"})
    assert page.json()["data"][0]["id"] == first.id and page.json()["has_more"] is True
    page = await client.get("/v1/files", params={"limit": 1, "order": "asc", "after": first.id})
    assert page.json()["data"][0]["id"] == second.id and page.json()["has_more"] is False
    deleted = await oai.files.delete(first.id)
    assert deleted.deleted and deleted.id == first.id
    assert not (Path(settings.files_dir) / first.id).exists()
    with pytest.raises(openai.NotFoundError):
        await oai.files.retrieve(first.id)
    error = _openai_error(await client.get(f"/v1/files/{first.id}/content"), 404)
    assert first.id in error["message"]


async def test_upload_errors(app: FastAPI, client: httpx.AsyncClient) -> None:
    error = _openai_error(await client.post("/v1/files", json={"purpose": "batch"}), 415)
    assert "multipart/form-data" in error["message"]
    error = _openai_error(await client.post("/v1/files", data={"purpose": "batch"},
                                            files={"other": ("x", b"1")}), 400)  # fmt: skip
    assert error["param"] == "file"
    error = _openai_error(await _upload(client, b"{}", purpose="fun"), 400)
    assert error["param"] == "purpose" and "'fun'" in error["message"]
    files = {"file": ("x.jsonl", b"{}")}
    form = {"purpose": "batch", "expires_after[anchor]": "created_at",
            "expires_after[seconds]": "60"}  # fmt: skip
    error = _openai_error(await client.post("/v1/files", files=files, data=form), 400)
    assert error["param"] == "expires_after.seconds"
    form["expires_after[seconds]"] = "3600"
    made = await client.post("/v1/files", files=files, data=form)
    assert made.json()["expires_at"] == made.json()["created_at"] + 3600


async def test_an_oversize_upload_is_a_413_and_leaves_nothing(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any, keys: Keys
) -> None:
    small = with_api(settings, max_file_bytes=1000)
    async with running_app(small, fake_redis, tokenizer) as (_, client):
        error = _openai_error(await _upload(client, b"x" * 5000), 413)
        assert "1000 bytes" in error["message"]
        # Just over the limit, below the multipart envelope's allowance: the copy stops it.
        error = _openai_error(await _upload(client, b"x" * 1001), 413)
        assert (await _upload(client, b"x" * 1000)).status_code == 200
    assert await fake_redis.zcard(keys.files) == 1
    assert len(list(Path(settings.files_dir).iterdir())) == 1  # no part left behind


@pytest.mark.parametrize(
    ("lines", "where", "param"),
    [
        ([_line("a"), "{not json"], "Line 2", None),
        ([_line("a"), [1, 2]], "Line 2", None),
        ([_line("a"), _line("a")], "Line 2", "custom_id"),
        ([_line("")], "Line 1", "custom_id"),
        ([{**_line("a"), "method": "GET"}], "Line 1", "method"),
        ([_line("a", url="/v1/completions", prompt="x")], "Line 1", "url"),
        ([{**_line("a"), "body": "text"}], "Line 1", "body"),
        ([_line("a", messages=[], stream=True)], "Line 1", "body.stream"),
    ],
)
async def test_a_bad_line_is_a_400_that_names_it(
    app: FastAPI, client: httpx.AsyncClient, lines: list[Any], where: str, param: str | None
) -> None:
    uploaded = (await _upload(client, _jsonl(lines))).json()
    error = _openai_error(await _create(client, uploaded["id"]), 400)
    assert where in error["message"] and error["param"] == param
    assert (await client.get("/v1/batches")).json()["data"] == []


async def test_batch_creation_errors(app: FastAPI, client: httpx.AsyncClient) -> None:
    error = _openai_error(await _create(client, "file-nope"), 400)
    assert error["param"] == "input_file_id"
    notes = (await _upload(client, _jsonl([_line("a")]), purpose="user_data")).json()
    error = _openai_error(await _create(client, notes["id"]), 400)
    assert "purpose 'batch'" in error["message"]
    empty = (await _upload(client, b"\n\n")).json()
    assert "no requests" in _openai_error(await _create(client, empty["id"]), 400)["message"]
    good = (await _upload(client, _jsonl([_line("a")]))).json()
    error = _openai_error(await _create(client, good["id"], endpoint="/v1/moderations"), 400)
    assert error["param"] == "endpoint"
    body = {"input_file_id": good["id"], "endpoint": CHAT, "completion_window": "1h"}
    assert _openai_error(await client.post("/v1/batches", json=body), 400)["param"]


async def test_too_many_lines_is_a_400(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any
) -> None:
    async with running_app(with_api(settings, max_batch_requests=2), fake_redis, tokenizer) as (
        _,
        client,
    ):
        uploaded = (await _upload(client, _jsonl([_line(str(i)) for i in range(3)]))).json()
        error = _openai_error(await _create(client, uploaded["id"]), 400)
        assert "Line 3" in error["message"] and "at most 2" in error["message"]


async def test_a_batch_is_queued_listed_and_cancelled(
    app: FastAPI, client: httpx.AsyncClient, fake_redis: aioredis.Redis, keys: Keys
) -> None:
    uploaded = (await _upload(client, _jsonl([_line("a"), "", _line("b")]))).json()
    made = []
    for _ in range(3):
        response = await _create(client, uploaded["id"])
        assert response.status_code == 200, response.text
        made.append(response.json())
    batch = made[0]
    assert batch["object"] == "batch" and batch["status"] == "validating"
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 0}
    assert batch["expires_at"] == batch["created_at"] + 86400
    assert batch["output_file_id"] is None and batch["error_file_id"] is None
    queued = await fake_redis.zrange(keys.jobs_queue, 0, -1)
    assert {q.decode() for q in queued} == {
        job_queue.batch_job_id(keys, b["id"], 0) for b in made
    }
    newest_first = [b["id"] for b in reversed(made)]
    page = (await client.get("/v1/batches", params={"limit": 2})).json()
    assert [b["id"] for b in page["data"]] == newest_first[:2] and page["has_more"] is True
    rest = (await client.get("/v1/batches", params={"after": page["last_id"]})).json()
    assert [b["id"] for b in rest["data"]] == newest_first[2:] and rest["has_more"] is False
    cancelled = (await client.post(f"/v1/batches/{batch['id']}/cancel")).json()
    assert cancelled["status"] == "cancelling" and cancelled["cancelling_at"]
    again = await client.post(f"/v1/batches/{batch['id']}/cancel")
    assert again.status_code == 200 and again.json()["status"] == "cancelling"
    await batches.transition(fake_redis, keys, batch["id"], "cancelled")
    error = _openai_error(await client.post(f"/v1/batches/{batch['id']}/cancel"), 409)
    assert "'cancelled'" in error["message"]
    error = _openai_error(await client.get("/v1/batches/batch_nope"), 404)
    assert "batch_nope" in error["message"]
    assert _openai_error(await client.post("/v1/batches/batch_nope/cancel"), 404)


async def test_an_unwritable_store_is_a_503_not_a_500(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the store's directory should be")
    settings.files_dir = str(blocker / "files")
    async with running_app(settings, fake_redis, tokenizer) as (_, client):
        error = _openai_error(await _upload(client, b"{}\n"), 503)
        assert "Could not store the file" in error["message"]


async def test_redis_away_while_recording_an_upload_is_a_503_and_leaves_no_file(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any, monkeypatch: Any
) -> None:
    async def redis_away(*args: Any, **kwargs: Any) -> Any:
        raise redis.exceptions.ConnectionError("Connection refused")

    async with running_app(settings, fake_redis, tokenizer) as (_, client):
        monkeypatch.setattr(aioredis.client.Pipeline, "execute", redis_away)
        error = _openai_error(await _upload(client, b"{}\n"), 503)
        assert "Redis" in error["message"]
    assert list(settings.files_path().iterdir()) == []

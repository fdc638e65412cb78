"""Resumable streams (DESIGN §4.9) on fakeredis: every SSE event carries `id: N` and is logged
before it is sent; GET /v1/requests/{rid}/stream on any replica replays the log after
Last-Event-ID byte for byte and then continues live, in the original request's format, with
no gap and no duplicate, taking the request over from a live or a dead replica."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import httpx
import pytest
import redis.asyncio as aioredis

from api.event_log import decode_records
from api.renderers import make_renderer
from api.stream_spec import StreamSpec
from shared import reattach, request_state
from shared.config import Settings
from shared.keys import Keys
from tests.support.api_backend import ScriptedBackend
from tests.support.api_faults import SseClient, freeze, text_of
from tests.support.app import API_ID, running_app, sse_frames, with_api
from tests.support.backend import FakeBackend
from tests.support.waiting import wait_until

CHAT = [{"role": "user", "content": "hi"}]
OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
# kind -> (path, body, rid of the response's log); each streams 9 tokens.
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "generate": ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 9}}),
    "generate-logprobs": (
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 9}, "return_logprob": True,
         "top_logprobs_num": 2, "return_text_in_logprobs": True, "logprob_start_len": 0},
    ),  # fmt: skip
    "completion": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 9, "logprobs": 2, "stream_options": OPTIONS},
    ),
    "chat": (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 9, "logprobs": True, "top_logprobs": 1,
         "stream_options": OPTIONS},
    ),  # fmt: skip
}
KINDS = list(REQUESTS)


def request_for(kind: str, rid: str) -> tuple[str, dict[str, Any]]:
    path, body = REQUESTS[kind]
    return path, {**body, "rid": rid, "stream": True}


def route_kind(kind: str) -> str:
    return kind.split("-")[0]


def expected_text(tokenizer: Any, n: int = 9) -> str:
    from tests.support.backend import REPLY

    return str(tokenizer.decode(tokenizer.encode(REPLY)[:n], skip_special_tokens=True))


def after(raw: bytes, event_id: int) -> bytes:
    """The part of an SSE body after event `event_id`."""
    return raw[raw.index(b"id: %d\n" % (event_id + 1)) :]


@pytest.fixture
async def other(
    settings: Settings, fake_server: fakeredis.FakeServer, tokenizer: Any
) -> AsyncIterator[Any]:
    """A second replica (api-2) on the same Redis."""
    r = fakeredis.FakeAsyncRedis(server=fake_server)
    async with running_app(with_api(settings, api_id="api-2"), r, tokenizer) as pair:
        yield pair
    await r.aclose()


@pytest.mark.parametrize("kind", KINDS)
async def test_every_event_has_an_id_and_is_logged_as_sent(
    client: httpx.AsyncClient, backend: FakeBackend, fake_redis: aioredis.Redis, keys: Keys,
    kind: str,
) -> None:  # fmt: skip
    path, body = request_for(kind, "r1")
    resp = await client.post(path, json=body)
    frames = sse_frames(resp.text)
    assert [i for i, _ in frames] == list(range(len(frames)))
    assert frames[-1][1] == "[DONE]" and len(frames) >= 3
    log = decode_records(await fake_redis.lrange(keys.events("r1"), 0, -1))
    sent = [f"data: {d}\n\n".encode() for _, d in frames]
    assert await _sent(fake_redis, keys, "r1", log) == sent
    assert 0 < await fake_redis.ttl(keys.events("r1"))
    if route_kind(kind) == "generate":  # cumulative chunks are logged as their deltas
        assert all(r.compact for r in log if r.mark is not None)
        assert sum(len(r.data) for r in log) < len(resp.content)


@pytest.mark.parametrize("kind", KINDS)
async def test_replay_on_another_replica_is_byte_identical(
    client: httpx.AsyncClient, backend: FakeBackend, other: Any, kind: str
) -> None:
    path, body = request_for(kind, "r2")
    original = (await client.post(path, json=body)).content
    _app, other_client = other
    whole = await other_client.get("/v1/requests/r2/stream")
    assert whole.status_code == 200 and whole.content == original
    last = len(sse_frames(original.decode())) - 1
    for event_id in (0, last // 2, last - 1):
        tail = await other_client.get("/v1/requests/r2/stream",
                                      headers={"Last-Event-ID": str(event_id)})  # fmt: skip
        assert tail.content == after(original, event_id)
    done = await other_client.get("/v1/requests/r2/stream", headers={"Last-Event-ID": str(last)})
    assert done.status_code == 200 and done.content == b""


@pytest.mark.parametrize(
    ("path", "body", "names"),
    [
        (
            "/generate",
            {"text": ["a", "b"], "rid": "nb", "sampling_params": {"max_new_tokens": 5}},
            ["nb", "nb_0", "nb_1"],
        ),
        (
            "/v1/completions",
            {"prompt": "a", "n": 2, "rid": "cb", "max_tokens": 5},
            ["cb", "cmpl-cb", "cb-1"],
        ),
    ],
)
async def test_batch_streams_have_one_log_found_by_any_of_their_ids(
    client: httpx.AsyncClient,
    backend: FakeBackend,
    other: Any,
    path: str,
    body: dict[str, Any],
    names: list[str],
) -> None:
    original = await client.post(path, json={**body, "stream": True})
    assert original.status_code == 200, original.text
    _app, other_client = other
    for name in names:
        replay = await other_client.get(f"/v1/requests/{name}/stream")
        assert replay.content == original.content, name


async def test_unknown_rids_and_bad_headers(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    missing = await client.get("/v1/requests/nope/stream")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "request_not_found"
    assert missing.json()["error"]["type"] == "not_found_error"
    await client.post("/generate", json={"text": "hi", "rid": "plain"})
    plain = await client.get("/v1/requests/plain/stream")
    assert plain.status_code == 404 and plain.json()["error"]["code"] == "stream_not_found"
    bad = await client.get("/v1/requests/plain/stream", headers={"Last-Event-ID": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["other replica", "same replica"])
async def test_reattach_takes_a_live_stream_over(
    app: Any,
    other: Any,
    scripted: ScriptedBackend,
    fake_redis: aioredis.Redis,
    keys: Keys,
    tokenizer: Any,
    kind: str,
    where: str,
) -> None:
    """The client of a live stream leaves; the stream goes on being logged; the client comes
    back (here or elsewhere) with its Last-Event-ID, gets what it missed, then the rest."""
    other_app = other[0] if where == "other replica" else app
    other_id = other_app.state.settings.api.api_id
    path, body = request_for(kind, "live")
    first = SseClient(app).start("POST", path, body)
    await scripted.wait_job("live")
    await scripted.step("live", 2)
    opening = 1 if kind == "chat" else 0
    seen = await first.wait_events(opening + 2)
    await first.leave()
    await scripted.step("live")  # logged by the first attachment while nobody listens
    await wait_until(lambda: _log_length(fake_redis, keys, "live", opening + 3))
    last_id = seen[-1][0]
    second = SseClient(other_app).start(
        "GET", "/v1/requests/live/stream", headers={"Last-Event-ID": str(last_id)}
    )
    await wait_until(lambda: _reattached(scripted, other_id))
    assert scripted.reattaches[-1].rids == ["live"]
    assert scripted.reattaches[-1].from_seqs == [6]  # the seq after the last logged event
    await scripted.finish("live")
    await second.finished()
    frames = seen + second.frames
    assert [i for i, _ in frames] == list(range(len(frames)))  # no gap, no duplicate
    assert frames[-1][1] == "[DONE]"
    assert text_of(route_kind(kind), frames) == expected_text(tokenizer)
    _check_format(kind, frames)
    log = decode_records(await fake_redis.lrange(keys.events("live"), 0, -1))
    assert await _sent(fake_redis, keys, "live", log) == [
        f"data: {d}\n\n".encode() for _, d in frames
    ]
    assert not await fake_redis.exists(keys.abort("live"))
    state = await request_state.read(fake_redis, keys, "live")
    assert state is not None and state.api_id == other_id and state.status == "finished"
    await wait_until(lambda: _quiet(app, other_app))
    for api_id in (API_ID, other_id):
        await wait_until(lambda api_id=api_id: _not_held(fake_redis, keys, api_id, "live"))


async def test_takeover_from_a_dead_replica_resends_what_it_missed(
    app: Any,
    other: Any,
    scripted: ScriptedBackend,
    fake_redis: aioredis.Redis,
    keys: Keys,
    tokenizer: Any,
) -> None:
    path, body = request_for("completion", "dead")
    first = SseClient(app).start("POST", path, body)
    await scripted.wait_job("dead")
    await scripted.step("dead")
    seen = await first.wait_events(1)
    await freeze(app)  # kill -9: no heartbeat, nothing received any more
    assert not await fake_redis.exists(keys.heartbeat("api", API_ID))
    await scripted.step("dead")  # published to the dead replica: lost
    second = SseClient(other[0]).start(
        "GET", "/v1/requests/dead/stream", headers={"Last-Event-ID": str(seen[-1][0])}
    )
    await wait_until(lambda: _reattached(scripted, "api-2"))
    assert scripted.reattaches[-1].from_seqs == [2]  # resent from there: seq 2..4
    await scripted.finish("dead")
    await second.finished()
    frames = seen + second.frames
    assert [i for i, _ in frames] == list(range(len(frames)))
    assert text_of("completion", frames) == expected_text(tokenizer)
    assert await reattach.held_rids(fake_redis, keys, API_ID) == set()


async def test_a_reattach_within_the_grace_saves_a_dead_replicas_stream(
    app: Any,
    settings: Settings,
    fake_server: fakeredis.FakeServer,
    scripted: ScriptedBackend,
    fake_redis: aioredis.Redis,
    keys: Keys,
    tokenizer: Any,
) -> None:
    path, body = request_for("generate", "saved")
    first = SseClient(app).start("POST", path, body)
    await scripted.wait_job("saved")
    await scripted.step("saved")
    await first.wait_events(1)
    await freeze(app)
    r = fakeredis.FakeAsyncRedis(server=fake_server)
    conf = with_api(settings, api_id="api-2", orphan_grace_s=0.5)
    async with running_app(conf, r, tokenizer) as (other_app, _client):
        second = SseClient(other_app).start("GET", "/v1/requests/saved/stream")
        await wait_until(lambda: _reattached(scripted, "api-2"))
        await asyncio.sleep(1.0)  # past the grace: the reaper saw it held by api-2, a live replica
        assert not await fake_redis.exists(keys.abort("saved"))
        await scripted.finish("saved")
        await second.finished()
    assert text_of("generate", second.frames) == expected_text(tokenizer)
    await r.aclose()


def _check_format(kind: str, frames: list[tuple[int, str]]) -> None:
    """Events after the takeover look like the ones before (same format and head)."""
    chunks = [json.loads(d) for _i, d in frames if d != "[DONE]"]
    if route_kind(kind) == "generate":
        assert all(c["meta_info"]["id"] == "live" for c in chunks)
        texts = [c["text"] for c in chunks]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # cumulative
        if kind == "generate-logprobs":
            final = chunks[-1]["meta_info"]
            assert len(final["output_token_logprobs"]) == 9
            assert len(final["output_top_logprobs"]) == 9
            assert final["input_token_logprobs"] == chunks[0]["meta_info"]["input_token_logprobs"]
        return
    assert len({(c["id"], c["created"], c["model"], c["object"]) for c in chunks}) == 1
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage[-1]["completion_tokens"] == 9 and chunks[-1]["choices"] == []
    if kind == "completion":
        offsets = [o for c in chunks for ch in c["choices"] for o in ch["logprobs"]["text_offset"]]
        assert offsets == sorted(offsets) and len(offsets) == 9


async def _log_length(r: aioredis.Redis, keys: Keys, rid: str, n: int) -> bool:
    return int(await r.llen(keys.events(rid))) >= n


async def _reattached(backend: ScriptedBackend, api_id: str) -> bool:
    return any(m.api_id == api_id for m in backend.reattaches)


async def _quiet(*apps: Any) -> bool:
    return all(not a.state.manager.rid_to_state and not a.state.manager.pumps for a in apps)


async def _not_held(r: aioredis.Redis, keys: Keys, api_id: str, rid: str) -> bool:
    return rid not in await reattach.held_rids(r, keys, api_id)


async def _sent(r: aioredis.Redis, keys: Keys, rid: str, log: list[Any]) -> list[bytes]:
    """The logged events as they were sent (cumulative chunks rebuilt from their deltas)."""
    info = await request_state.read(r, keys, rid)
    assert info is not None and info.stream_spec is not None
    return make_renderer(StreamSpec.decode(info.stream_spec), lambda ids: []).expand(log)


async def test_a_request_that_finished_unseen_is_rendered_from_its_durable_state(
    app: Any, other: Any, scripted: ScriptedBackend, tokenizer: Any
) -> None:
    """The replica died, then the request finished (its last text lost with the replica, and
    the detokenizer no longer holds it): the re-attach renders the rest from rs:ids and the
    state hash."""
    scripted.resend = False
    path, body = request_for("chat", "unseen")
    first = SseClient(app).start("POST", path, body)
    await scripted.wait_job("unseen")
    await scripted.step("unseen")
    seen = await first.wait_events(2)
    await freeze(app)
    await scripted.finish("unseen")
    second = SseClient(other[0]).start(
        "GET", "/v1/requests/unseen/stream", headers={"Last-Event-ID": str(seen[-1][0])}
    )
    await second.finished()
    frames = seen + second.frames
    assert [i for i, _ in frames] == list(range(len(frames))) and frames[-1][1] == "[DONE]"
    assert text_of("chat", frames) == expected_text(tokenizer)
    usage = json.loads(frames[-2][1])["usage"]
    assert usage["completion_tokens"] == 9


async def test_a_tool_call_begun_before_a_takeover_is_not_lost(
    app: Any, other: Any, scripted: ScriptedBackend, tokenizer: Any
) -> None:
    """The first replica held a call back (half written); the replica that takes the stream
    over rebuilds that from the id log and sends the whole call at the finish."""
    scripted.ids = tokenizer.encode(
        'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    tool = {"type": "function", "function": {"name": "f"}}
    body = {"messages": CHAT, "tools": [tool], "max_tokens": 60, "rid": "tc", "stream": True}
    first = SseClient(app).start("POST", "/v1/chat/completions", body)
    await scripted.wait_job("tc")
    for step in range(5):  # 10 tokens: inside the call
        await scripted.step("tc")
        seen = await first.wait_events(1 + step + 1)
    await first.leave()
    second = SseClient(other[0]).start(
        "GET", "/v1/requests/tc/stream", headers={"Last-Event-ID": str(seen[-1][0])}
    )
    await wait_until(lambda: _reattached(scripted, "api-2"))
    await scripted.finish("tc")
    await second.finished()
    deltas = [json.loads(d)["choices"][0] for _, d in seen + second.frames
              if d != "[DONE]" and json.loads(d)["choices"]]  # fmt: skip
    content = "".join(c["delta"].get("content") or "" for c in deltas)
    calls = [call for c in deltas for call in c["delta"].get("tool_calls") or []]
    assert content.strip() == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"a": 1})
    ]
    assert deltas[-1]["finish_reason"] == "tool_calls"

"""Api replicas' heartbeats, orphans and lost messages (DESIGN §4.4, §4.9) on fakeredis: a
replica beats and deletes its beat on a clean stop; the requests of a dead replica (or left
under this replica's id by a previous process) that nobody re-attached within the grace are
aborted, while their finished results stay readable; a message that pub/sub lost is sent again
on request, or rebuilt from the id log when nobody resends it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import fakeredis
import httpx
import pytest
import redis.asyncio as aioredis

from api.gaps import REFILL_IDLE_S
from api.waiting import STALL_S
from shared import heartbeat, reattach
from shared.config import DetokenizerSettings, Settings
from shared.keys import HEARTBEAT_TTL_S, Keys
from tests.support.api_backend import ScriptedBackend
from tests.support.api_faults import SseClient, freeze, text_of
from tests.support.app import API_ID, running_app, with_api
from tests.support.backend import REPLY, fake_logprob
from tests.support.waiting import wait_until


def reply(tokenizer: Any, n: int) -> tuple[str, list[int]]:
    ids = tokenizer.encode(REPLY)[:n]
    return str(tokenizer.decode(ids, skip_special_tokens=True)), ids


async def test_a_replica_beats_and_deletes_its_beat_on_a_clean_stop(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any, keys: Keys
) -> None:
    beat = keys.heartbeat(heartbeat.API, API_ID)
    async with running_app(settings, fake_redis, tokenizer):
        await wait_until(lambda: fake_redis.exists(beat))
        assert 0 < await fake_redis.ttl(beat) <= HEARTBEAT_TTL_S
        assert await heartbeat.live_workers(fake_redis, keys, heartbeat.API) == [API_ID]
    assert not await fake_redis.exists(beat)


async def test_a_dead_replicas_orphans_are_aborted_after_the_grace(
    app: Any,
    client: httpx.AsyncClient,
    settings: Settings,
    fake_server: fakeredis.FakeServer,
    scripted: ScriptedBackend,
    fake_redis: aioredis.Redis,
    keys: Keys,
    tokenizer: Any,
) -> None:
    done = asyncio.create_task(client.post("/generate", json={"text": "hi", "rid": "o-done"}))
    await scripted.wait_job("o-done")
    await scripted.finish("o-done")
    assert (await done).status_code == 200
    stream = SseClient(app).start("POST", "/generate", {"text": "hi", "rid": "o-s", "stream": True})
    plain = asyncio.create_task(client.post("/generate", json={"text": "hi", "rid": "o-p"}))
    await scripted.wait_job("o-s")
    await scripted.wait_job("o-p")
    await scripted.step("o-s")
    await stream.wait_events(1)
    await freeze(app)  # kill -9 of the replica that holds both clients
    r = fakeredis.FakeAsyncRedis(server=fake_server)
    conf = with_api(settings, api_id="api-2", orphan_grace_s=0.3)
    started = time.monotonic()
    async with running_app(conf, r, tokenizer) as (_other_app, other):
        for rid in ("o-s", "o-p"):
            await wait_until(lambda rid=rid: fake_redis.exists(keys.abort(rid)))
        assert time.monotonic() - started >= 0.3
        for rid in ("o-s", "o-p"):
            await wait_until(lambda rid=rid: _status(other, rid, "aborted"))
        result = (await other.get("/v1/requests/o-done")).json()
        text, ids = reply(tokenizer, 128)
        assert result["status"] == "finished" and result["api_id"] == API_ID
        assert result["output_ids"] == ids and result["text"] == text
        assert "stream_spec" not in result and "attach_id" not in result
        await wait_until(lambda: _no_held(fake_redis, keys, API_ID))
    assert not await fake_redis.exists(keys.abort("o-done"))
    plain.cancel()
    await r.aclose()


async def test_leftovers_of_a_previous_process_under_the_same_id_are_reaped(
    settings: Settings, fake_redis: aioredis.Redis, tokenizer: Any, keys: Keys
) -> None:
    await fake_redis.hset(keys.state("ghost"), mapping={"status": "running", "api_id": API_ID})
    await fake_redis.hset(keys.state("gone"), mapping={"status": "finished", "api_id": API_ID})
    await fake_redis.sadd(keys.api_requests(API_ID), "ghost", "gone")
    async with running_app(with_api(settings, orphan_grace_s=0.2), fake_redis, tokenizer):
        await wait_until(lambda: fake_redis.exists(keys.abort("ghost")))
        await wait_until(lambda: _no_held(fake_redis, keys, API_ID))
    assert not await fake_redis.exists(keys.abort("gone"))  # it had finished: nothing to abort


@pytest.mark.parametrize("resend", [True, False], ids=["resent", "refilled from the id log"])
async def test_a_lost_message_is_asked_for_again(
    app: Any, scripted: ScriptedBackend, tokenizer: Any, resend: bool
) -> None:
    scripted.resend = resend
    body = {"text": "hi", "rid": "gap", "stream": True, "sampling_params": {"max_new_tokens": 9}}
    client = SseClient(app).start("POST", "/generate", body)
    await scripted.wait_job("gap")
    await scripted.step("gap")
    scripted.route["gap"] = "nowhere"  # pub/sub loses the step of seq 2..4
    await scripted.step("gap")
    scripted.route["gap"] = API_ID
    await scripted.step("gap")  # seq 4: the api sees the gap
    await wait_until(lambda: _asked(scripted, [2]))
    await scripted.finish("gap")
    await client.finished(timeout=10)
    text, ids = reply(tokenizer, 9)
    assert text_of("generate", client.frames) == text
    final = client.frames[-2][1]
    assert f'"output_ids":{ids}'.replace(" ", "") in final


async def _status(client: httpx.AsyncClient, rid: str, status: str) -> bool:
    return bool((await client.get(f"/v1/requests/{rid}")).json()["status"] == status)


async def _no_held(r: aioredis.Redis, keys: Keys, api_id: str) -> bool:
    return not await reattach.held_rids(r, keys, api_id)


async def _asked(backend: ScriptedBackend, seqs: list[int]) -> bool:
    return any(m.api_id == API_ID and m.from_seqs == seqs for m in backend.reattaches)


async def test_a_request_whose_last_messages_were_lost_finishes_from_its_durable_state(
    app: Any, scripted: ScriptedBackend, tokenizer: Any
) -> None:
    """Its shard had no detokenizer when it finished (one died just then): no later entry
    shows a gap, so the waiter notices the silence and reads rs:ids and the state hash."""
    scripted.resend = False  # nobody holds the request any more
    body = {"text": "hi", "rid": "quiet", "stream": True, "sampling_params": {"max_new_tokens": 9}}
    client = SseClient(app).start("POST", "/generate", body)
    await scripted.wait_job("quiet")
    await scripted.step("quiet")
    scripted.route["quiet"] = "nowhere"
    await scripted.finish("quiet")  # the rest, and the finish, reach nobody
    await client.finished(timeout=15)
    text, ids = reply(tokenizer, 9)
    assert text_of("generate", client.frames) == text
    final = client.frames[-2][1]
    assert f'"output_ids":{ids}'.replace(" ", "") in final


LOGPROBS_BODY = {"text": "hi", "return_logprob": True, "sampling_params": {"max_new_tokens": 4}}


async def test_a_late_finish_of_a_logprobs_request_is_waited_for(
    client: httpx.AsyncClient, scripted: ScriptedBackend
) -> None:
    """A detokenizer behind on a busy machine delivers a finish seconds after the scheduler
    wrote it. The id log has no logprobs, so the request waits for the entry rather than
    being rebuilt from the log with nulls (what the id log gives a plain request)."""
    scripted.resend = False  # a lagging detokenizer answers nothing before its backlog
    answer = asyncio.create_task(client.post("/generate", json={**LOGPROBS_BODY, "rid": "late"}))
    await scripted.wait_job("late")
    scripted.route["late"] = "nowhere"  # still in the detokenizer's backlog
    await scripted.finish("late")  # the ids and the finish are written durably
    await asyncio.sleep(STALL_S + REFILL_IDLE_S + 1.0)  # the waiter has read the id log
    assert not answer.done()
    scripted.route["late"] = API_ID
    await scripted.publish("late", scripted.entry("late", 0, scripted.total("late")))
    out = (await answer).json()
    ids = out["output_ids"]
    assert len(ids) == 4
    values = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
    assert values == [fake_logprob(p, t) for p, t in enumerate(ids)]


async def test_a_lost_finish_of_a_logprobs_request_is_rebuilt_once_overdue(
    settings: Settings, fake_redis: aioredis.Redis, scripted: ScriptedBackend, tokenizer: Any
) -> None:
    """Its entries went nowhere (the detokenizer died): past twice the detokenizer lease
    after the finish, the answer comes from the id log, its logprobs null."""
    conf = settings.model_copy(update={"detokenizer": DetokenizerSettings(lease_ttl_s=1.0)})
    scripted.resend = False
    async with running_app(conf, fake_redis, tokenizer) as (_app, client):
        body = {**LOGPROBS_BODY, "rid": "lost"}
        answer = asyncio.create_task(client.post("/generate", json=body))
        await scripted.wait_job("lost")
        scripted.route["lost"] = "nowhere"
        await scripted.finish("lost")
        out = (await asyncio.wait_for(answer, 20)).json()
    text, ids = reply(tokenizer, 4)
    assert out["output_ids"] == ids and out["text"] == text
    assert [entry[0] for entry in out["meta_info"]["output_token_logprobs"]] == [None] * 4

"""Per-request keys: state hash, id log, abort marker (an owner's fenced writes to them live in
shared.ownership).

Request ids are unique fleet-wide: the api claims `rid:{rid}` (SET NX) before it creates any
state, and releases the claim when the request ends.

The state hash's fields are `protocol.RequestState`'s: written here through `_fields` (text,
the finish reason as JSON) and decoded here by `read`. Live requests carry a long TTL;
finished ones a short one (keys.STATE_TTL_S).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import msgspec
import redis.asyncio as aioredis

from shared import protocol, pubsub
from shared.keys import ABORT_TTL_S, LIVE_STATE_TTL_S, RID_CLAIM_TTL_S, STATE_TTL_S, Keys

Pipe = aioredis.client.Pipeline


def claim(pipe: Pipe, keys: Keys, rids: Iterable[str], api_id: str) -> None:
    """Queue one SET NX per rid; a pipeline result that is not true means the rid is taken."""
    for rid in rids:
        pipe.set(keys.rid_claim(rid), api_id, nx=True, ex=RID_CLAIM_TTL_S)


def release(pipe: Pipe, keys: Keys, finished: Iterable[str], aborted: Iterable[str]) -> None:
    """Give claimed rids back: finished ones at once; aborted ones only when their abort
    marker expires (a rid reused under a live marker would be aborted by the schedulers)."""
    for rid in finished:  # one DEL each: on a cluster, rids' claims live in several slots
        pipe.delete(keys.rid_claim(rid))
    for rid in aborted:
        pipe.expire(keys.rid_claim(rid), ABORT_TTL_S)


_STATE_FIELDS = frozenset(protocol.RequestState.__struct_fields__)


def _fields(**values: str | int | float | protocol.FinishReason) -> dict[str, str | int | float]:
    """`values` as hash fields: names checked against RequestState, the finish reason JSON."""
    unknown = set(values) - _STATE_FIELDS
    assert not unknown, f"not RequestState fields: {unknown}"
    return {
        name: msgspec.json.encode(v).decode() if isinstance(v, protocol.FinishReason) else v
        for name, v in values.items()
    }


def create(pipe: Pipe, keys: Keys, rid: str, api_id: str, prompt_tokens: int) -> None:
    key = keys.state(rid)
    mapping = _fields(
        status="queued",
        api_id=api_id,
        prompt_tokens=prompt_tokens,
        completion_tokens=0,
        created_at=time.time(),
    )
    pipe.hset(key, mapping=mapping)
    pipe.expire(key, LIVE_STATE_TTL_S)


def mark_running(pipe: Pipe, keys: Keys, rid: str, worker: str, epoch: int) -> None:
    mapping = _fields(status="running", worker=worker, epoch=epoch)
    pipe.hset(keys.state(rid), mapping=mapping)


def append_ids(pipe: Pipe, keys: Keys, rid: str, token_ids: list[int]) -> None:
    """Append one step's new ids to the durable id log (same pipeline as the PUBLISH)."""
    if token_ids:
        pipe.rpush(keys.ids(rid), *token_ids)
        pipe.expire(keys.ids(rid), LIVE_STATE_TTL_S)


def read_ids(pipe: Pipe, keys: Keys, rid: str, start: int, end: int) -> None:
    """Queue the read of output ids [start, end) from the id log (fewer if it is shorter)."""
    pipe.lrange(keys.ids(rid), start, end - 1)


async def output_ids(r: aioredis.Redis, keys: Keys, rid: str) -> list[int]:
    """The request's whole id log (its output so far), [] when there is none."""
    return [int(x) for x in await r.lrange(keys.ids(rid), 0, -1)]  # type: ignore[misc]


def finish(
    pipe: Pipe,
    keys: Keys,
    rid: str,
    reason: protocol.FinishReason,
    completion_tokens: int,
    cached_tokens: int = 0,
) -> None:
    mapping = _fields(
        status="aborted" if reason.type == "abort" else "finished",
        finish_reason=reason,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
        finished_at=time.time(),
    )
    pipe.hset(keys.state(rid), mapping=mapping)
    pipe.expire(keys.state(rid), STATE_TTL_S)
    pipe.expire(keys.ids(rid), STATE_TTL_S)


def requeue(pipe: Pipe, keys: Keys, rid: str) -> None:
    """Make `rid` a queued request again (an operator retries its dead letter): its output
    and abort marker are dropped, the epoch goes on counting."""
    pipe.delete(keys.ids(rid), keys.abort(rid))
    pipe.hdel(keys.state(rid), "finish_reason", "finished_at")
    pipe.hset(keys.state(rid), mapping=_fields(status="queued", completion_tokens=0))
    pipe.expire(keys.state(rid), LIVE_STATE_TTL_S)


def abort(pipe: Pipe, keys: Keys, rids: Iterable[str]) -> None:
    """Mark `rids` aborted: the durable marker first, then the broadcast (same pipeline)."""
    rid_list = list(rids)
    for rid in rid_list:
        pipe.set(keys.abort(rid), 1, ex=ABORT_TTL_S)
    message = protocol.encode(protocol.AbortRequests(rids=rid_list))
    pubsub.publish(pipe, keys.control_channel, message)


def query_aborted(pipe: Pipe, keys: Keys, rids: list[str]) -> None:
    """Queue an EXISTS per rid; the pipeline's results say which are aborted."""
    for rid in rids:
        pipe.exists(keys.abort(rid))


async def get(r: aioredis.Redis, keys: Keys, rid: str) -> dict[str, str]:
    """The hash as stored (text), {} if there is none; `read` decodes it."""
    raw: dict[bytes, bytes] = await r.hgetall(keys.state(rid))  # type: ignore[misc]
    return {k.decode(): v.decode() for k, v in raw.items()}


async def read(r: aioredis.Redis, keys: Keys, rid: str) -> protocol.RequestState | None:
    """The request's state, decoded; None if there is none (unknown rid, or expired)."""
    return decode(await get(r, keys, rid))


def decode(stored: dict[str, str]) -> protocol.RequestState | None:
    """A state hash as stored -> RequestState (fields it does not know are ignored)."""
    if not stored:
        return None
    values: dict[str, object] = {k: v for k, v in stored.items() if k in _STATE_FIELDS}
    if "finish_reason" in values:
        values["finish_reason"] = msgspec.json.decode(stored["finish_reason"])
    return msgspec.convert(values, protocol.RequestState, strict=False)

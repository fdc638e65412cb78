"""The Redis side of resumable streams and api-replica failover (DESIGN §4.9).

- `api:{api_id}:rids`: the live rids whose client an api replica holds; a dead replica's set
  is what the others reap (abort after a grace) or re-attach.
- `events:{rid}`: a streaming response's SSE events (event id = list index), under the rid
  named by every member's `state:{rid}.stream_rid` (a batch's first rid).
- `state:{rid}` fields `stream_rid`, `stream_spec`, `attach_id`, and `api_id` on takeover.

Ownership is data, compared-and-set by Lua scripts: only the attachment named by
`attach_id` may append to a log, a takeover replaces it (naming the new replica in each
member's state in the same script; the rids move between the replicas' sets right after),
and an abort for a lost client or a dead replica is
written only where the request is still held by whoever gives up on it. A replica that was
paused, or that another one re-attached, can never write to the log again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import redis.asyncio as aioredis

from shared import protocol, pubsub
from shared.keys import ABORT_TTL_S, EVENTS_TTL_S, LIVE_STATE_TTL_S, Keys
from shared.redis_conn import eval_script

Pipe = aioredis.client.Pipeline

APPENDED, LOST, DIVERGED, GONE = 0, -1, -2, -3

# KEYS: state(log rid), events(log rid). ARGV: attach_id, first event id, ttl, records...
_APPEND = """
local owner = redis.call('HGET', KEYS[1], 'attach_id')
if not owner then return -3 end
if owner ~= ARGV[1] then return -1 end
if redis.call('LLEN', KEYS[2]) ~= tonumber(ARGV[2]) then return -2 end
for i = 4, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[3]))
return 0
"""

# KEYS: state(log rid), events(log rid), state(member)... (one slot).
# ARGV: expected attach_id, new attach_id, new api_id.
_TAKE_OVER = """
if redis.call('HGET', KEYS[1], 'attach_id') ~= ARGV[1] then return false end
redis.call('HSET', KEYS[1], 'attach_id', ARGV[2])
for i = 3, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('HSET', KEYS[i], 'api_id', ARGV[3]) end
end
return redis.call('LRANGE', KEYS[2], 0, -1)
"""

# KEYS: state(member)... (one slot). ARGV: new api_id. The members of a taken-over response
# whose keys live in another slot than its log's (a batch, on a Redis Cluster).
_MOVE_MEMBERS = """
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('HSET', KEYS[i], 'api_id', ARGV[1]) end
end
return 1
"""

# KEYS: guard state, n member states, n abort markers. ARGV: api_id, attach_id ('' = any),
# ttl (one slot). Marks the members still held by api_id (and running) aborted; returns
# their indexes, or false when the guard's attachment is not attach_id.
_ABORT_IF_HELD = """
local n = (#KEYS - 1) / 2
if ARGV[2] ~= '' and redis.call('HGET', KEYS[1], 'attach_id') ~= ARGV[2] then return false end
local out = {}
for i = 1, n do
  local state = redis.call('HMGET', KEYS[1 + i], 'api_id', 'status')
  if state[1] == ARGV[1] and state[2] ~= 'finished' and state[2] ~= 'aborted' then
    redis.call('SET', KEYS[1 + n + i], 1, 'EX', tonumber(ARGV[3]))
    out[#out + 1] = i - 1
  end
end
return out
"""


def hold(pipe: Pipe, keys: Keys, api_id: str, rids: Sequence[str]) -> None:
    """Queue: `api_id` holds the clients of `rids` (its set lives while the replica beats)."""
    if rids:
        pipe.sadd(keys.api_requests(api_id), *rids)
        pipe.expire(keys.api_requests(api_id), LIVE_STATE_TTL_S)


def drop(pipe: Pipe, keys: Keys, api_id: str, rids: Sequence[str]) -> None:
    """Queue: `api_id` no longer holds `rids` (they ended, or nobody needs them any more)."""
    if rids:
        pipe.srem(keys.api_requests(api_id), *rids)


def refresh(pipe: Pipe, keys: Keys, api_id: str) -> None:
    """Queue a TTL refresh of a live replica's set (with its heartbeat)."""
    pipe.expire(keys.api_requests(api_id), LIVE_STATE_TTL_S)


def save_stream(
    pipe: Pipe, keys: Keys, rids: Sequence[str], spec: str, attach_id: str
) -> None:
    """Queue, after request_state.create: the response's log lives under rids[0], whose state
    also gets the render spec and the attachment that may append to it."""
    stream_rid = rids[0]
    pipe.hset(keys.state(stream_rid), mapping={"stream_spec": spec, "attach_id": attach_id})
    for rid in rids:
        pipe.hset(keys.state(rid), "stream_rid", stream_rid)


async def append_events(
    r: aioredis.Redis, keys: Keys, rid: str, attach_id: str, first_id: int, records: list[bytes]
) -> int:
    """Append `records` as events first_id.. of rid's log, if `attach_id` still owns it and
    the log has exactly first_id events: APPENDED, LOST (taken over), DIVERGED (the log
    does not end there) or GONE (no state: expired, or a Redis that lost its data)."""
    async with r.pipeline(transaction=False) as pipe:
        queue_append(pipe, keys, rid, attach_id, first_id, records)
        (result,) = await pipe.execute()
    return int(result)


def queue_append(
    pipe: Pipe, keys: Keys, rid: str, attach_id: str, first_id: int, records: list[bytes]
) -> None:
    """Queue `append_events` on a pipeline (its reply: the same codes)."""
    names = [keys.state(rid), keys.events(rid)]
    eval_script(pipe, _APPEND, names, [attach_id, first_id, EVENTS_TTL_S, *records])


async def read_events(r: aioredis.Redis, keys: Keys, rid: str) -> list[bytes]:
    return list(await r.lrange(keys.events(rid), 0, -1))  # type: ignore[misc]


async def take_over(
    r: aioredis.Redis,
    keys: Keys,
    rids: Sequence[str],
    old: tuple[str, str],
    new: tuple[str, str],
) -> list[bytes] | None:
    """Move the response of `rids` (log under rids[0]) from `old` to `new` (api_id,
    attach_id) if `old`'s attachment still owns it; returns the log as of the move (no
    event can be appended by anyone else after it), or None when it moved meanwhile."""
    (old_api, old_attach), (new_api, new_attach) = old, new
    log_slot, *others = _by_slot(keys, rids[0], rids)
    names = [keys.state(rids[0]), keys.events(rids[0]), *(keys.state(rid) for rid in log_slot)]
    result = await eval_script(r, _TAKE_OVER, names, [old_attach, new_attach, new_api])
    if result is None:
        return None
    async with r.pipeline(transaction=False) as pipe:
        for members in others:
            eval_script(pipe, _MOVE_MEMBERS, [keys.state(m) for m in members], [new_api])
        pipe.srem(keys.api_requests(old_api), *rids)
        hold(pipe, keys, new_api, rids)
        await pipe.execute()
    return list(result)


def announce(
    pipe: Pipe, keys: Keys, rids: Sequence[str], api_id: str, from_seqs: Sequence[int]
) -> None:
    """Queue the Reattach broadcast: route rids' text to api_id, resend it from from_seqs."""
    msg = protocol.Reattach(rids=list(rids), api_id=api_id, from_seqs=list(from_seqs))
    pubsub.publish(pipe, keys.control_channel, protocol.encode(msg))


async def abort_if_held(
    r: aioredis.Redis,
    keys: Keys,
    rids: Sequence[str],
    api_id: str,
    attach: tuple[str, str] | None = None,
) -> list[str]:
    """Abort those of `rids` that `api_id` still holds (and, with attach=(log rid,
    attach_id), only while that attachment owns the response): the durable markers in one
    script, then the broadcast. Returns the rids aborted."""
    if not rids:
        return []
    guard, attach_id = (attach[0], attach[1]) if attach else (rids[0], "")
    aborted: list[str] = []
    for i, members in enumerate(_by_slot(keys, guard, rids)):
        names = [keys.state(guard if i == 0 else members[0])]
        names += [keys.state(rid) for rid in members] + [keys.abort(rid) for rid in members]
        args = [api_id, attach_id if i == 0 else "", ABORT_TTL_S]
        indexes = await eval_script(r, _ABORT_IF_HELD, names, args)
        if indexes is None:  # the response moved on: nothing of it is ours to abort
            return []
        aborted += [members[int(j)] for j in indexes]
    if aborted:
        message = protocol.encode(protocol.AbortRequests(rids=aborted))
        await pubsub.publish(r, keys.control_channel, message)
    return aborted


def _by_slot(keys: Keys, first: str, rids: Sequence[str]) -> list[list[str]]:
    """`rids` grouped by their keys' hash tag, the group of `first`'s first (maybe empty):
    one script per group, as a Redis Cluster requires. One group when there is one shard."""
    groups: dict[int, list[str]] = {keys.shard(first): []}
    for rid in rids:
        groups.setdefault(keys.shard(rid), []).append(rid)
    return list(groups.values())


async def held_rids(r: aioredis.Redis, keys: Keys, api_id: str) -> set[str]:
    members: Iterable[bytes | str] = await r.smembers(keys.api_requests(api_id))  # type: ignore[misc]
    return {m.decode() if isinstance(m, bytes) else m for m in members}


async def holders(r: aioredis.Redis, keys: Keys) -> list[str]:
    """The api ids that have a set of held rids (SCAN: live and dead replicas alike)."""
    head, tail = keys.api_requests("*").split("*")
    found = [k async for k in r.scan_iter(match=keys.api_requests("*"), count=1000)]
    names = [k.decode() if isinstance(k, bytes) else k for k in found]
    return [name[len(head) : len(name) - len(tail)] for name in names]


async def attach_id_of(r: aioredis.Redis, keys: Keys, stream_rid: str) -> str | None:
    value = await r.hget(keys.state(stream_rid), "attach_id")  # type: ignore[misc]
    return value.decode() if isinstance(value, bytes) else value


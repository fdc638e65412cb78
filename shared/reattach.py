"""The Redis side of resumable streams and api-replica failover (DESIGN §4.9).

- `api:{api_id}:rids`: the live rids whose client an api replica holds; a dead replica's set
  is what the others reap (abort after a grace) or re-attach.
- `events:{rid}`: a streaming response's SSE events (event id = list index), under the rid
  named by every member's `state:{rid}.stream_rid` (a batch's first rid).
- `state:{rid}` fields `stream_rid`, `stream_spec`, `attach_id`, and `api_id` on takeover.

Ownership is data, compared-and-set by Lua scripts: only the attachment named by
`attach_id` may append to a log, a takeover replaces it (moving the rids between the
replicas' sets in the same script), and an abort for a lost client or a dead replica is
written only where the request is still held by whoever gives up on it. A replica that was
paused, or that another one re-attached, can never write to the log again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import redis.asyncio as aioredis

from shared import protocol
from shared.keys import ABORT_TTL_S, EVENTS_TTL_S, LIVE_STATE_TTL_S, Keys

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

# KEYS: state(log rid), events(log rid), held(old api), held(new api), state(member)...
# ARGV: expected attach_id, new attach_id, new api_id, ttl, rid of each member...
_TAKE_OVER = """
if redis.call('HGET', KEYS[1], 'attach_id') ~= ARGV[1] then return false end
redis.call('HSET', KEYS[1], 'attach_id', ARGV[2])
for i = 5, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('HSET', KEYS[i], 'api_id', ARGV[3])
    redis.call('SREM', KEYS[3], ARGV[i])
    redis.call('SADD', KEYS[4], ARGV[i])
  end
end
redis.call('EXPIRE', KEYS[4], tonumber(ARGV[4]))
return redis.call('LRANGE', KEYS[2], 0, -1)
"""

# KEYS: guard state, n member states, n abort markers. ARGV: api_id, attach_id ('' = any),
# ttl. Marks the members still held by api_id (and running) aborted; returns their indexes.
_ABORT_IF_HELD = """
local n = (#KEYS - 1) / 2
if ARGV[2] ~= '' and redis.call('HGET', KEYS[1], 'attach_id') ~= ARGV[2] then return {} end
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
        await queue_append(pipe, keys, rid, attach_id, first_id, records)
        (result,) = await pipe.execute()
    return int(result)


async def queue_append(
    pipe: Pipe, keys: Keys, rid: str, attach_id: str, first_id: int, records: list[bytes]
) -> None:
    """Queue `append_events` on a pipeline (its reply: the same codes)."""
    script = pipe.register_script(_APPEND)
    args: list[bytes | str | int] = [attach_id, first_id, EVENTS_TTL_S, *records]
    await script(keys=[keys.state(rid), keys.events(rid)], args=args, client=pipe)


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
    script = r.register_script(_TAKE_OVER)
    stream_rid = rids[0]
    names = [keys.state(stream_rid), keys.events(stream_rid)]
    names += [keys.api_requests(old_api), keys.api_requests(new_api)]
    names += [keys.state(rid) for rid in rids]
    args: list[str | int] = [old_attach, new_attach, new_api, LIVE_STATE_TTL_S, *rids]
    result = await script(keys=names, args=args)
    return None if result is None else list(result)


def announce(
    pipe: Pipe, keys: Keys, rids: Sequence[str], api_id: str, from_seqs: Sequence[int]
) -> None:
    """Queue the Reattach broadcast: route rids' text to api_id, resend it from from_seqs."""
    msg = protocol.Reattach(rids=list(rids), api_id=api_id, from_seqs=list(from_seqs))
    pipe.publish(keys.control_channel, protocol.encode(msg))


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
    names = [keys.state(guard), *(keys.state(rid) for rid in rids)]
    names += [keys.abort(rid) for rid in rids]
    script = r.register_script(_ABORT_IF_HELD)
    indexes = await script(keys=names, args=[api_id, attach_id, ABORT_TTL_S])
    aborted = [rids[int(i)] for i in indexes]
    if aborted:
        message = protocol.encode(protocol.AbortRequests(rids=aborted))
        await r.publish(keys.control_channel, message)
    return aborted


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


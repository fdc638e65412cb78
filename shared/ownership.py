"""Who runs a request: the owner epoch and the scripts that fence every write of an owner.

Redis does not fence owners: XACK takes no consumer, XCLAIM moves an entry away from a live
but paused worker (DESIGN §4.2). So a scheduler OWNS a job only after `own` bumped the
epoch in `state:{rid}` while the stream entry was pending under its name, and every later
write for that request (the id log append, the PUBLISH, the finish and the XACK) happens in
`publish_step`, which checks the epoch first, in the same script. A stale owner's writes
are refused and it learns so from the reply.

Appends are also fenced by position: an entry's ids go to `ids:{rid}` from its `seq` on, and
those already there are skipped, so a step sent again (its reply was lost) adds nothing twice.

Live owners renew their pending entries (`renew`: XCLAIM to themselves, JUSTID) with every
heartbeat, so only the entries of a dead (or frozen) owner ever become idle enough for
XAUTOCLAIM (request_stream.reclaim), whose min-idle time is above the heartbeat TTL.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec
import redis.asyncio as aioredis

from shared import protocol
from shared.keys import LIVE_STATE_TTL_S, SCHEDULER_GROUP, STATE_TTL_S, Keys
from shared.redis_conn import eval_script, is_cluster
from shared.request_stream import locate

Pipe = aioredis.client.Pipeline

# KEYS: stream, state, ids, abort marker. ARGV: group, me, entry id, live TTL.
# -> false when the entry is not pending under `me` (someone else took it), else
# {epoch, deliveries, aborted (0|1), api_id or "", status, ids...}.
_OWN = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)[1]
if not p or p[2] ~= ARGV[2] then return false end
local epoch = redis.call('HINCRBY', KEYS[2], 'epoch', 1)
local status = redis.call('HGET', KEYS[2], 'status') or ''
if status ~= 'finished' and status ~= 'aborted' then status = 'running' end
redis.call('HSET', KEYS[2], 'status', status, 'worker', ARGV[2])
if redis.call('TTL', KEYS[2]) < 0 then redis.call('EXPIRE', KEYS[2], ARGV[4]) end
local api_id = redis.call('HGET', KEYS[2], 'api_id') or ''
local out = {epoch, p[4], redis.call('EXISTS', KEYS[4]), api_id, status}
for _, id in ipairs(redis.call('LRANGE', KEYS[3], 0, -1)) do out[#out + 1] = id end
return out
"""

# KEYS: per entry its stream, state and ids keys.
# ARGV: group, live TTL, finished TTL, number of entries, then per entry
#   epoch, seq, entry id, finish JSON or "", status, completion, cached, finished_at,
#   weight version, number of ids, ids...; then the number of batches and per batch
#   channel, payload, number of its entries, their (1-based) entry indices.
# -> {stale entry indices (1-based)..., 0, unpublished batch indices (1-based)...}
_PUBLISH_STEP = """
local group, live_ttl, done_ttl = ARGV[1], ARGV[2], ARGV[3]
local n, a = tonumber(ARGV[4]), 5
local ok, out = {}, {}
for i = 1, n do
  local stream, state, ids = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local epoch, seq, entry, finish = ARGV[a], tonumber(ARGV[a + 1]), ARGV[a + 2], ARGV[a + 3]
  local nids = tonumber(ARGV[a + 9])
  local len = redis.call('LLEN', ids)
  ok[i] = redis.call('HGET', state, 'epoch') == epoch and len >= seq
  if ok[i] then
    if len < seq + nids then  -- a resent step may find some of its ids there already
      redis.call('RPUSH', ids, unpack(ARGV, a + 10 + len - seq, a + 9 + nids))
    end
    redis.call('EXPIRE', ids, live_ttl)
    if finish ~= '' then
      redis.call('HSET', state, 'status', ARGV[a + 4], 'finish_reason', finish,
        'completion_tokens', ARGV[a + 5], 'cached_tokens', ARGV[a + 6],
        'finished_at', ARGV[a + 7], 'weight_version', ARGV[a + 8])
      redis.call('EXPIRE', state, done_ttl)
      redis.call('EXPIRE', ids, done_ttl)
      redis.call('XACK', stream, group, entry)
      redis.call('XDEL', stream, entry)
    end
  else
    out[#out + 1] = i
  end
  a = a + 10 + nids
end
out[#out + 1] = 0
local nb = tonumber(ARGV[a])
a = a + 1
for b = 1, nb do
  local members, all = tonumber(ARGV[a + 2]), true
  for m = 1, members do all = all and ok[tonumber(ARGV[a + 2 + m])] end
  if all then redis.call('PUBLISH', ARGV[a], ARGV[a + 1]) else out[#out + 1] = b end
  a = a + 3 + members
end
return out
"""

# KEYS: stream. ARGV: group, me, ids... -> the (1-based) indices of the ids no longer
# pending under `me`.
_RENEW = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)[1]
  if p and p[2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = i - 2
  end
end
return lost
"""

# KEYS: stream. ARGV: group, me, idle ms, ids... Marks `me`'s entries idle for `idle ms`
# (so the next XAUTOCLAIM of another scheduler takes them) without counting a delivery.
_HAND_OVER = """
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)[1]
  if p and p[2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3],
      'RETRYCOUNT', math.max(0, p[4] - 1), 'JUSTID')
  end
end
return 1
"""


@dataclass(frozen=True)
class Owned:
    """What `own` found when it took a job: the new epoch and where the request stands."""

    epoch: int
    deliveries: int
    aborted: bool
    api_id: str  # "" when the state has none
    status: str  # running, or finished/aborted when someone already ended it
    ids: list[int]  # the output generated so far (the id log)


def own(pipe: Pipe, keys: Keys, me: str, entry_ref: bytes, rid: str) -> None:
    """Queue the ownership bump of `rid`'s job; decode its reply with `owned`."""
    stream, entry_id = locate(keys, entry_ref)
    script_keys = [stream, keys.state(rid), keys.ids(rid), keys.abort(rid)]
    eval_script(pipe, _OWN, script_keys, [SCHEDULER_GROUP, me, entry_id, LIVE_STATE_TTL_S])


def owned(reply: list[bytes | int] | None) -> Owned | None:
    """`own`'s reply; None when the job is no longer pending under this scheduler."""
    if not reply:
        return None
    epoch, deliveries, aborted, api_id, status, *ids = reply
    return Owned(
        epoch=int(epoch),
        deliveries=int(deliveries),
        aborted=bool(int(aborted)),
        api_id=_text(api_id),
        status=_text(status),
        ids=[int(i) for i in ids],
    )


@dataclass
class StepEntry:
    """One request's writes in a step: the entry it publishes and, if it ends, its state."""

    entry: protocol.TokenEntry
    entry_id: bytes
    completion_tokens: int
    finished_at: float = 0.0


@dataclass(frozen=True)
class StepPlan:
    """How `publish_step` queued a step: one script per stream shard, and whether the
    scripts publish the batches themselves."""

    groups: list[list[int]]  # per queued script, the indices of its entries
    publishes: bool
    num_batches: int


def publish_step(
    pipe: Pipe,
    keys: Keys,
    entries: Sequence[StepEntry],
    batches: Sequence[tuple[str, bytes, list[int]]],
) -> StepPlan:
    """Queue the step's fenced writes: per entry its appends (and finish + ack), then each
    (channel, payload, entry indices) batch, published only if all its entries are current.
    One script per stream shard (its keys share a slot); the scripts publish the batches
    only when there is one script on one Redis, else the caller publishes what
    `step_result` says after them. Decode the replies with `step_result`."""
    groups: dict[int, list[int]] = {}
    for i, step in enumerate(entries):
        groups.setdefault(keys.shard(step.entry.rid), []).append(i)
    publishes = len(groups) == 1 and not is_cluster(pipe)
    for members in groups.values():
        _queue_step(pipe, keys, [entries[i] for i in members], batches if publishes else [])
    return StepPlan(list(groups.values()), publishes, len(batches))


def _queue_step(
    pipe: Pipe,
    keys: Keys,
    entries: Sequence[StepEntry],
    batches: Sequence[tuple[str, bytes, list[int]]],
) -> None:
    script_keys: list[str] = []
    args: list[str | bytes | int | float] = [SCHEDULER_GROUP, LIVE_STATE_TTL_S, STATE_TTL_S]
    args.append(len(entries))
    for step in entries:
        e = step.entry
        stream, entry_id = locate(keys, step.entry_id)
        script_keys += [stream, keys.state(e.rid), keys.ids(e.rid)]
        finish = msgspec.json.encode(e.finish).decode() if e.finish else ""
        status = "aborted" if e.finish and e.finish.type == "abort" else "finished"
        args += [e.epoch, e.seq, entry_id, finish, status, step.completion_tokens]
        args += [e.cached_tokens, step.finished_at, e.weight_version or ""]
        args += [len(e.token_ids), *e.token_ids]
    args.append(len(batches))
    for channel, payload, members in batches:
        args += [channel, payload, len(members), *(m + 1 for m in members)]
    eval_script(pipe, _PUBLISH_STEP, script_keys, args)


def step_result(plan: StepPlan, replies: Sequence[list[int]]) -> tuple[set[int], list[int]]:
    """(indices of stale entries, indices of batches that were not published), 0-based,
    from the replies of the plan's scripts."""
    stale: set[int] = set()
    unsent = list(range(plan.num_batches))
    for members, reply in zip(plan.groups, replies, strict=True):
        split = reply.index(0)
        stale |= {members[int(i) - 1] for i in reply[:split]}
        if plan.publishes:
            unsent = [int(b) - 1 for b in reply[split + 1 :]]
    return stale, unsent


def renew(pipe: Pipe, keys: Keys, me: str, entry_refs: Iterable[bytes]) -> list[list[bytes]]:
    """Queue the renewal of `me`'s pending entries: one script per stream, whose replies
    `lost_entries` decodes. Returns the refs each queued script renews (none: nothing)."""
    by_stream = _by_stream(keys, entry_refs)
    for stream, (_refs, ids) in by_stream.items():
        eval_script(pipe, _RENEW, [stream], [SCHEDULER_GROUP, me, *ids])
    return [refs for refs, _ids in by_stream.values()]


def lost_entries(renewed: list[list[bytes]], replies: Sequence[list[int]]) -> set[bytes]:
    """The refs someone else took, from `renew`'s replies."""
    return {refs[int(i) - 1] for refs, lost in zip(renewed, replies, strict=True) for i in lost}


async def hand_over(
    r: aioredis.Redis, keys: Keys, me: str, entry_refs: Iterable[bytes], idle_ms: int
) -> None:
    """Make `me`'s entries claimable at once by the next scheduler's reclaim."""
    for stream, (_refs, ids) in _by_stream(keys, entry_refs).items():
        await eval_script(r, _HAND_OVER, [stream], [SCHEDULER_GROUP, me, idle_ms, *ids])


_Grouped = dict[str, tuple[list[bytes], list[bytes]]]


def _by_stream(keys: Keys, entry_refs: Iterable[bytes]) -> _Grouped:
    """Entry refs grouped by stream: (refs, their entry ids)."""
    out: _Grouped = {}
    for entry_ref in entry_refs:
        stream, entry_id = locate(keys, entry_ref)
        refs, ids = out.setdefault(stream, ([], []))
        refs.append(entry_ref)
        ids.append(entry_id)
    return out


def _text(value: bytes | int | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

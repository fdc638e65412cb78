"""Per-API-key limits that every api replica shares: a token bucket (requests per second, up
to a burst) and a cap on requests in flight, checked and taken together by ONE Lua script.

Scripts are sent as text (EVAL, as shared.ownership does: no NOSCRIPT after a Redis restart)
and read the time from Redis (TIME), so the replicas' clocks do not matter. The bucket is a
hash (tokens, at), refilled lazily at each check. The in-flight set holds one member per
request (a slot id) scored by its expiry: the replica that holds the request renews it every
few seconds (`renew`) and removes it when the request ends (`release`); the script drops the
expired ones first, so the slots of a replica that died free themselves after
IN_FLIGHT_LEASE_S. A rejected request takes nothing: no token, no slot.

Client ids are digests of the bearer key (`client_id`), never the key itself.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from shared.keys import IN_FLIGHT_LEASE_S, Keys
from shared.redis_conn import eval_script

ANONYMOUS = "anonymous"  # the client of every request when no API keys are configured

# KEYS: bucket, in-flight set. ARGV: rate (tokens/s; 0 = no bucket), burst, max in flight
# (0 = no cap), slot id, lease (s).
# -> {1} | {0, "concurrency", retry after (s)} | {0, "rate", retry after (s)}
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local cap, slot, lease = tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= cap then
    return {0, 'concurrency', '1'}
  end
end
if rate > 0 then
  local tokens = burst
  local b = redis.call('HMGET', KEYS[1], 'tokens', 'at')
  if b[1] and b[2] then
    tokens = math.min(burst, tonumber(b[1]) + math.max(0, now - tonumber(b[2])) * rate)
  end
  if tokens < 1 then
    return {0, 'rate', tostring((1 - tokens) / rate)}
  end
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1), 'at', tostring(now))
  -- Full again by then: a bucket that expired is the same as a full one.
  redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 1)
end
if cap > 0 then
  redis.call('ZADD', KEYS[2], now + lease, slot)
  redis.call('EXPIRE', KEYS[2], math.ceil(lease) + 1)
end
return {1}
"""

# KEYS: in-flight sets. ARGV: lease (s), then one slot id per key.
# Pushes the expiry of the slots that are still there (XX: a pruned one stays gone).
_RENEW = """
local t = redis.call('TIME')
local lease = tonumber(ARGV[1])
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1000000 + lease
for i = 1, #KEYS do
  redis.call('ZADD', KEYS[i], 'XX', expiry, ARGV[i + 1])
  redis.call('EXPIRE', KEYS[i], math.ceil(lease) + 1)
end
return #KEYS
"""


def client_id(api_key: bytes) -> str:
    """The name of an API key's client in Redis keys: a digest, never the key."""
    return hashlib.sha256(b"redserve-client:" + api_key).hexdigest()[:32]


@dataclass(frozen=True)
class KeyLimits:
    """One API key's limits (0 = off)."""

    rate: float = 0.0  # tokens (requests) per second
    burst: int = 0  # bucket size; 0 = one second's worth, at least 1
    max_in_flight: int = 0

    @property
    def enabled(self) -> bool:
        return self.rate > 0 or self.max_in_flight > 0

    @property
    def bucket_size(self) -> int:
        return self.burst or max(1, math.ceil(self.rate))


@dataclass(frozen=True)
class Verdict:
    admitted: bool
    reason: str = ""  # "rate" or "concurrency" when refused
    retry_after_s: float = 0.0  # until a token or a slot may be free


async def acquire(
    r: aioredis.Redis, keys: Keys, client: str, slot: str, limits: KeyLimits,
    lease_s: float = IN_FLIGHT_LEASE_S,
) -> Verdict:  # fmt: skip
    """Take a token and an in-flight slot named `slot` for `client`, or neither."""
    args = [str(v) for v in (limits.rate, limits.bucket_size, limits.max_in_flight, slot, lease_s)]
    reply = await r.eval(_ACQUIRE, 2, keys.rate_limit(client), keys.in_flight(client), *args)  # type: ignore[misc]
    return decode(reply)


def decode(reply: Any) -> Verdict:
    """The script's reply as a Verdict."""
    if int(reply[0]) == 1:
        return Verdict(True)
    reason, retry = (v.decode() if isinstance(v, bytes) else str(v) for v in reply[1:3])
    return Verdict(False, reason, float(retry))


def release(pipe: aioredis.client.Pipeline, keys: Keys, slots: dict[str, str]) -> None:
    """Queue the removal of in-flight slots (slot id -> client)."""
    for slot, client in slots.items():
        pipe.zrem(keys.in_flight(client), slot)


async def renew(
    r: aioredis.Redis, keys: Keys, slots: dict[str, str], lease_s: float = IN_FLIGHT_LEASE_S
) -> None:
    """Push the expiry of held slots (slot id -> client) to lease_s from now: one script
    per API key (each key's sets share a hash tag; a Redis Cluster keeps them apart)."""
    by_client: dict[str, list[str]] = {}
    for slot, client in slots.items():
        by_client.setdefault(client, []).append(slot)
    if not by_client:
        return
    async with r.pipeline(transaction=False) as pipe:
        for client, held in by_client.items():
            names = [keys.in_flight(client)] * len(held)
            eval_script(pipe, _RENEW, names, [str(lease_s), *held])
        await pipe.execute()

"""shared.limits's one Lua script on a real redis-server: the token bucket (burst, refill,
Retry-After), the in-flight cap (release, renewal, expiry pruning), and that a refused
request takes nothing. Time passing is simulated by moving the stored times back."""

from __future__ import annotations

import uuid

import redis.asyncio as aioredis

from shared import limits
from shared.keys import Keys

CLIENT = limits.client_id(b"secret-key")


async def take(r: aioredis.Redis, keys: Keys, lim: limits.KeyLimits, lease_s: float = 30) -> str:
    """A slot id if admitted, else the refusal's reason."""
    slot = uuid.uuid4().hex
    verdict = await limits.acquire(r, keys, CLIENT, slot, lim, lease_s)
    return slot if verdict.admitted else verdict.reason


async def outcomes(r: aioredis.Redis, keys: Keys, lim: limits.KeyLimits, n: int) -> list[str]:
    """ "ok" or the refusal's reason, for each of `n` requests in a row."""
    return ["ok" if len(out := await take(r, keys, lim)) == 32 else out for _ in range(n)]


async def age_bucket(r: aioredis.Redis, keys: Keys, seconds: float) -> None:
    """As if `seconds` had passed since the bucket was last touched."""
    at = float(await r.hget(keys.rate_limit(CLIENT), "at"))  # type: ignore[misc,arg-type]
    await r.hset(keys.rate_limit(CLIENT), "at", str(at - seconds))  # type: ignore[misc]


async def test_a_burst_passes_then_the_rate_holds(real_redis: aioredis.Redis, keys: Keys) -> None:
    lim = limits.KeyLimits(rate=2, burst=3)
    assert await outcomes(real_redis, keys, lim, 3) == ["ok", "ok", "ok"]
    verdict = await limits.acquire(real_redis, keys, CLIENT, "x", lim)
    assert not verdict.admitted and verdict.reason == "rate"
    assert 0 < verdict.retry_after_s <= 0.5  # one token at 2/s
    await age_bucket(real_redis, keys, 1.0)  # two tokens come back
    assert await outcomes(real_redis, keys, lim, 3) == ["ok", "ok", "rate"]


async def test_the_bucket_never_holds_more_than_the_burst(
    real_redis: aioredis.Redis, keys: Keys
) -> None:
    lim = limits.KeyLimits(rate=5, burst=2)
    await take(real_redis, keys, lim)
    await age_bucket(real_redis, keys, 3600)
    assert await outcomes(real_redis, keys, lim, 3) == ["ok", "ok", "rate"]
    bucket = keys.rate_limit(CLIENT)
    assert 0 < await real_redis.ttl(bucket) <= 2  # full again by then: it may go


async def test_the_default_burst_is_one_second_of_tokens(
    real_redis: aioredis.Redis, keys: Keys
) -> None:
    assert limits.KeyLimits(rate=2.5).bucket_size == 3
    assert limits.KeyLimits(rate=0.2).bucket_size == 1
    lim = limits.KeyLimits(rate=0.2)
    assert len(await take(real_redis, keys, lim)) == 32
    verdict = await limits.acquire(real_redis, keys, CLIENT, "x", lim)
    assert verdict.reason == "rate" and 4.9 < verdict.retry_after_s <= 5


async def test_the_in_flight_cap_and_release(real_redis: aioredis.Redis, keys: Keys) -> None:
    lim = limits.KeyLimits(max_in_flight=2)
    first, second = await take(real_redis, keys, lim), await take(real_redis, keys, lim)
    assert await take(real_redis, keys, lim) == "concurrency"
    async with real_redis.pipeline(transaction=False) as pipe:
        limits.release(pipe, keys, {first: CLIENT})
        await pipe.execute()
    third = await take(real_redis, keys, lim)
    assert len(third) == 32
    members = {m.decode() for m in await real_redis.zrange(keys.in_flight(CLIENT), 0, -1)}
    assert members == {second, third}


async def test_expired_slots_are_pruned_and_renewal_keeps_live_ones(
    real_redis: aioredis.Redis, keys: Keys
) -> None:
    lim = limits.KeyLimits(max_in_flight=2)
    dead = await take(real_redis, keys, lim, lease_s=30)  # its replica died: never renewed
    live = await take(real_redis, keys, lim, lease_s=30)
    in_flight = keys.in_flight(CLIENT)
    await real_redis.zadd(in_flight, {dead: 1.0, live: 1.0}, xx=True)  # both leases ran out
    await limits.renew(real_redis, keys, {live: CLIENT}, lease_s=30)  # the live one renews
    assert len(await take(real_redis, keys, lim)) == 32  # the dead one's slot was freed
    members = {m.decode() for m in await real_redis.zrange(in_flight, 0, -1)}
    assert dead not in members and live in members and len(members) == 2
    assert await take(real_redis, keys, lim) == "concurrency"
    # A renewal never brings back a slot that is gone.
    await limits.renew(real_redis, keys, {dead: CLIENT})
    assert await real_redis.zscore(in_flight, dead) is None
    assert 0 < await real_redis.ttl(in_flight) <= 31


async def test_a_refused_request_takes_neither_token_nor_slot(
    real_redis: aioredis.Redis, keys: Keys
) -> None:
    lim = limits.KeyLimits(rate=1, burst=2, max_in_flight=1)
    slot = await take(real_redis, keys, lim)
    tokens = await real_redis.hget(keys.rate_limit(CLIENT), "tokens")
    assert await take(real_redis, keys, lim) == "concurrency"
    assert await real_redis.hget(keys.rate_limit(CLIENT), "tokens") == tokens
    async with real_redis.pipeline(transaction=False) as pipe:
        limits.release(pipe, keys, {slot: CLIENT})
        await pipe.execute()
    await take(real_redis, keys, lim)  # the second token
    async with real_redis.pipeline(transaction=False) as pipe:
        limits.release(pipe, keys, {k.decode(): CLIENT for k in await real_redis.zrange(
            keys.in_flight(CLIENT), 0, -1)})  # fmt: skip
        await pipe.execute()
    assert await take(real_redis, keys, lim) == "rate"
    assert await real_redis.zcard(keys.in_flight(CLIENT)) == 0


async def test_clients_are_apart_and_named_by_digest(
    real_redis: aioredis.Redis, keys: Keys
) -> None:
    lim = limits.KeyLimits(rate=1, burst=1)
    other = limits.client_id(b"another-key")
    assert other != CLIENT and "key" not in CLIENT and len(CLIENT) == 32
    assert (await limits.acquire(real_redis, keys, CLIENT, "a", lim)).admitted
    assert not (await limits.acquire(real_redis, keys, CLIENT, "b", lim)).admitted
    assert (await limits.acquire(real_redis, keys, other, "c", lim)).admitted


async def test_limits_off_touch_nothing(real_redis: aioredis.Redis, keys: Keys) -> None:
    lim = limits.KeyLimits(max_in_flight=0, rate=0)
    for _ in range(5):
        assert (await limits.acquire(real_redis, keys, CLIENT, "s", lim)).admitted
    assert not await real_redis.exists(keys.rate_limit(CLIENT), keys.in_flight(CLIENT))


async def test_the_script_survives_a_script_flush(real_redis: aioredis.Redis, keys: Keys) -> None:
    """EVAL with the text: a restarted Redis (no cached scripts) answers as before."""
    await real_redis.script_flush()
    assert (await limits.acquire(real_redis, keys, CLIENT, "s", limits.KeyLimits(rate=1))).admitted

"""Token-shard leases: which detokenizer serves which `tok:{shard}` channel, with no config.

Each shard is owned through `lease:tok:{shard}` (SET NX PX, value = the detokenizer's id).
Every tick (about lease_ttl_s / 3) a detokenizer renews the leases it still holds
(compare-and-pexpire), then balances:
- it takes free shards up to its fair share ceil(num_shards / live detokenizers), its
  configured `shards` first;
- it rescues a shard that stayed free for two ticks even above its share: a dead peer's
  heartbeat outlives its lease, so the share is too small for a while, and no shard may wait
  for that (so a killed holder's shards move once its lease expired, a lone detokenizer
  serves them all);
- once no shard is free, it gives up shards above its share while a live peer holds fewer,
  so replicas balance; not within HEARTBEAT_TTL_S of a rescue (that peer may be the dead one).
A stopping detokenizer releases its leases at once (compare-and-delete).

`plan` is the pure policy; `ShardLeases` does the Redis side.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared.keys import HEARTBEAT_TTL_S, Keys
from shared.redis_conn import eval_script

logger = logging.getLogger(__name__)

# KEYS[1]: a lease; ARGV: owner, ttl ms. Renew only while still the owner.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# KEYS[1]: a lease; ARGV[1]: owner. Delete only while still the owner.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass(frozen=True, slots=True)
class Plan:
    """One tick's changes: shards to take within the share, to rescue above it, to give up."""

    take: list[int]
    rescue: list[int]
    give: list[int]


def fair_share(num_shards: int, num_live: int) -> int:
    return math.ceil(num_shards / max(1, num_live))


def plan(
    me: str,
    holders: Mapping[int, str | None],
    live: set[str],
    preferred: list[int],
    seen_free: set[int],
    pinned: set[int],
) -> Plan:
    """What to take and give up, from who holds each shard now.

    `seen_free`: shards that were free at the last tick too (rescued even above the share);
    `pinned`: shards held by a rescue, until a dead peer's heartbeat has surely expired.
    """
    live = live | {me}
    share = fair_share(len(holders), len(live))
    order = _preference_order(sorted(holders), preferred)
    mine = [s for s in order if holders[s] == me]
    free = [s for s in order if holders[s] is None]
    room = max(0, share - len(mine))
    take = free[:room]
    rescue = [s for s in free[room:] if s in seen_free]
    held = len(mine) + len(take) + len(rescue)
    counts = {peer: 0 for peer in live - {me}}
    for holder in holders.values():
        if holder in counts:
            counts[holder] += 1
    give: list[int] = []
    # Balance only once every shard is held: a peer below its share takes free shards first.
    # and never while a rescue is pinned: a peer below its share may then be a dead one.
    if not free and not pinned and held > share and any(n < share for n in counts.values()):
        give = list(reversed(mine))[: held - share]
    return Plan(take=take, rescue=rescue, give=give)


def _preference_order(shards: list[int], preferred: Iterable[int]) -> list[int]:
    """Configured shards first (in their order), then the rest ascending."""
    first = [s for s in dict.fromkeys(preferred) if s in shards]
    return first + [s for s in shards if s not in first]


class ShardLeases:
    """The leases one detokenizer holds; `tick()` renews and rebalances them."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        worker_id: str,
        num_shards: int,
        preferred: list[int],
        ttl_s: float,
        pin_s: float = HEARTBEAT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.worker_id = worker_id
        self.num_shards = max(1, num_shards)
        self.preferred = preferred
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.pin_s = pin_s
        self._clock = clock
        self.owned: set[int] = set()
        # Shards whose lease lapsed at the last tick (even if taken again since): another
        # detokenizer may have served them meanwhile.
        self.lapsed: set[int] = set()
        self._pinned_until: dict[int, float] = {}
        self._seen_free: set[int] = set()

    @property
    def renew_every_s(self) -> float:
        return self.ttl_ms / 3000

    async def tick(self, live: set[str]) -> set[int]:
        """Renew, then balance against the `live` detokenizers; returns the shards held."""
        await self._renew_owned()
        holders = await self._holders()
        now = self._clock()
        self._pinned_until = {
            s: until for s, until in self._pinned_until.items() if until > now and s in self.owned
        }
        step = plan(
            self.worker_id, holders, live, self.preferred, self._seen_free, set(self._pinned_until)
        )
        await self._acquire(step.take)
        for shard in await self._acquire(step.rescue):
            self._pinned_until[shard] = now + self.pin_s
        await self.release(step.give)
        self._seen_free = {s for s, h in holders.items() if h is None} - self.owned
        return set(self.owned)

    async def release(self, shards: Iterable[int] | None = None) -> None:
        """Give up `shards` (default: all held) at once, where this worker still holds them."""
        chosen = sorted(self.owned if shards is None else set(shards) & self.owned)
        if not chosen:
            return
        pipe = self.redis.pipeline(transaction=False)
        for shard in chosen:
            eval_script(pipe, _RELEASE, [self.keys.shard_lease(shard)], [self.worker_id])
        await pipe.execute()
        self.owned.difference_update(chosen)
        logger.info("released shards %s", chosen)

    async def _renew_owned(self) -> None:
        shards = sorted(self.owned)
        self.lapsed = set()
        if not shards:
            return
        pipe = self.redis.pipeline(transaction=False)
        for shard in shards:
            lease = [self.keys.shard_lease(shard)]
            eval_script(pipe, _RENEW, lease, [self.worker_id, self.ttl_ms])
        for shard, renewed in zip(shards, await pipe.execute(), strict=True):
            if not renewed:
                logger.warning("lost the lease of shard %d", shard)
                self.owned.discard(shard)
                self.lapsed.add(shard)

    async def _holders(self) -> dict[int, str | None]:
        pipe = self.redis.pipeline(transaction=False)  # GETs: a cluster spreads the leases
        for shard in range(self.num_shards):
            pipe.get(self.keys.shard_lease(shard))
        values = await pipe.execute()
        return {s: _as_str(v) for s, v in enumerate(values)}

    async def _acquire(self, shards: list[int]) -> list[int]:
        """SET NX PX each shard; returns those this worker got."""
        if not shards:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for shard in shards:
            pipe.set(self.keys.shard_lease(shard), self.worker_id, nx=True, px=self.ttl_ms)
        got = [s for s, ok in zip(shards, await pipe.execute(), strict=True) if ok]
        self.owned.update(got)
        if got:
            logger.info("took shards %s", got)
        return got


def _as_str(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value

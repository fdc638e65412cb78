"""The fleet's control state in Redis: the pause key, the target weights and the rolling
update's turn, written by any api replica and read by every scheduler.

A change is written to its key FIRST, then broadcast on `ctl` (protocol.PauseGeneration,
ContinueGeneration, UpdateWeights): a scheduler that misses the broadcast (it was starting,
or its subscription dropped) reads the keys with its next heartbeat (`read` queues the reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis

from shared import protocol, pubsub
from shared.keys import WEIGHTS_RESULTS_TTL_S, Keys
from shared.redis_conn import atomic

Pipe = aioredis.client.Pipeline

# The weight version of the weights a scheduler started with.
STARTED_VERSION = "default"

PAUSE_MODES: tuple[protocol.PauseMode, ...] = ("abort", "retract", "in_place")

# KEYS: turn. ARGV: me, ttl ms. -> 1 if `me` holds the turn (taken now or renewed), else 0.
_TAKE_TURN = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] or not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

# KEYS: turn. ARGV: me. Gives the turn back if `me` holds it.
_GIVE_TURN = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


@dataclass(frozen=True)
class Weights:
    """A set of weights: where they are and the version they serve as."""

    model_path: str
    weight_version: str
    mode: str = "all"  # how the fleet switches to them: all | rolling


@dataclass(frozen=True)
class ControlState:
    pause_mode: protocol.PauseMode | None
    target: Weights | None  # None = the weights each scheduler started with


# -- writers (api) ---------------------------------------------------------------------------
async def pause(r: aioredis.Redis, keys: Keys, mode: protocol.PauseMode) -> None:
    async with atomic(r) as pipe:
        pipe.set(keys.pause, mode)
        message = protocol.encode(protocol.PauseGeneration(mode=mode))
        pubsub.publish(pipe, keys.control_channel, message)
        await pipe.execute()


async def resume(r: aioredis.Redis, keys: Keys) -> None:
    async with atomic(r) as pipe:
        pipe.delete(keys.pause)
        pubsub.publish(pipe, keys.control_channel, protocol.encode(protocol.ContinueGeneration()))
        await pipe.execute()


async def flush_cache(r: aioredis.Redis, keys: Keys) -> None:
    await pubsub.publish(r, keys.control_channel, protocol.encode(protocol.FlushCache()))


async def set_target(
    r: aioredis.Redis, keys: Keys, target: Weights | None, mode: str = "all"
) -> None:
    """Make `target` the fleet's weights (None: back to each scheduler's own, switching by
    `mode`) and tell."""
    async with atomic(r) as pipe:
        pipe.delete(keys.weights)
        if target is not None:
            fields = {"model_path": target.model_path, "weight_version": target.weight_version,
                      "mode": target.mode}  # fmt: skip
            pipe.hset(keys.weights, mapping=fields)
            msg = protocol.UpdateWeights(
                model_path=target.model_path,
                weight_version=target.weight_version,
                mode=cast(Any, target.mode),
            )
        else:
            msg = protocol.UpdateWeights(model_path="", weight_version="", mode=cast(Any, mode))
        pubsub.publish(pipe, keys.control_channel, protocol.encode(msg))
        await pipe.execute()


async def get_target(r: aioredis.Redis, keys: Keys) -> Weights | None:
    return _weights(await r.hgetall(keys.weights))  # type: ignore[misc]


# -- readers (schedulers) --------------------------------------------------------------------
def read(pipe: Pipe, keys: Keys) -> None:
    """Queue the reads of the control state; decode the two replies with `decode`."""
    pipe.get(keys.pause)
    pipe.hgetall(keys.weights)


def decode(pause_reply: Any, weights_reply: Any) -> ControlState:
    mode = _text(pause_reply) if pause_reply else None
    pause_mode = cast(protocol.PauseMode, mode) if mode in PAUSE_MODES else None
    return ControlState(pause_mode, _weights(weights_reply))


def target_of(msg: protocol.UpdateWeights) -> Weights | None:
    """The target an UpdateWeights broadcast announces (an empty one: the started weights)."""
    if not msg.model_path:
        return None
    return Weights(msg.model_path, msg.weight_version, msg.mode)


def take_turn(pipe: Pipe, keys: Keys, me: str, ttl_ms: int) -> None:
    """Queue taking (or renewing) the rolling update's turn; the reply is 1 if `me` has it."""
    pipe.eval(_TAKE_TURN, 1, keys.weights_turn, me, str(ttl_ms))


def give_turn(pipe: Pipe, keys: Keys, me: str) -> None:
    pipe.eval(_GIVE_TURN, 1, keys.weights_turn, me)


def report(pipe: Pipe, keys: Keys, weight_version: str, me: str, result: str) -> None:
    """Queue `me`'s result of loading `weight_version`: "ok" or why it failed."""
    key = keys.weights_results(weight_version)
    pipe.hset(key, me, result)
    pipe.expire(key, WEIGHTS_RESULTS_TTL_S)


async def results(r: aioredis.Redis, keys: Keys, weight_version: str) -> dict[str, str]:
    raw = await r.hgetall(keys.weights_results(weight_version))  # type: ignore[misc]
    return {_text(k): _text(v) for k, v in raw.items()}


def _weights(raw: dict[Any, Any] | None) -> Weights | None:
    data = {_text(k): _text(v) for k, v in (raw or {}).items()}
    if not data.get("model_path") or not data.get("weight_version"):
        return None
    return Weights(data["model_path"], data["weight_version"], data.get("mode") or "all")


def _text(value: bytes | str | int) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

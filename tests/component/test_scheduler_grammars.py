"""Structured output in the scheduler loop (fakeredis, scripted runner): a grammar that does
not compile fails its request alone with a 400, one still compiling holds back only its own
request, and a scheduler without grammars refuses constrained jobs instead of ignoring them."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import redis.asyncio as aioredis

from shared.grammars import InvalidGrammar
from shared.keys import Keys
from shared.protocol import Grammar
from tests.support.scheduler_loop import (
    EOS,
    ScriptedRunner,
    entries_of,
    make_loop,
    num_pending,
    received,
    submit,
    subscribe,
)
from workers.scheduler.grammar.constraint import Constraint


class FakeCompiler:
    """Compiles nothing: each grammar text's Future is settled by the test."""

    def __init__(self) -> None:
        self.futures: dict[str, Future[Any]] = {}

    def constraint(self, spec: Grammar, output_ids: list[int]) -> Constraint:
        return Constraint(self.futures.setdefault(spec.text, Future()), output_ids)


async def test_a_grammar_that_fails_ends_its_request_alone(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    runner = ScriptedRunner({"good": [5, EOS]})
    loop = make_loop(fake_redis, keys, runner)
    compiler = FakeCompiler()
    loop.grammars = compiler  # type: ignore[assignment]
    pubsub = await subscribe(fake_redis, keys)
    await submit(fake_redis, keys, "bad", grammar=Grammar("regex", "[a-"))
    await submit(fake_redis, keys, "good")
    await loop.run_once()
    compiler.futures["[a-"].set_exception(InvalidGrammar("Unclosed '['"))
    await loop.run(burst=True)
    batches = await received(pubsub)

    [bad] = entries_of(batches, "bad")
    assert bad.finish is not None and (bad.finish.type, bad.finish.status_code) == ("abort", 400)
    assert bad.finish.message == "Invalid grammar: Unclosed '['"
    assert [e.token_ids for e in entries_of(batches, "good")] == [[5], [EOS]]
    assert all("bad" not in step for step in runner.steps)
    assert await num_pending(fake_redis, keys) == 0


async def test_a_compiling_grammar_holds_back_only_its_own_request(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    runner = ScriptedRunner({"free": [5, EOS]})
    loop = make_loop(fake_redis, keys, runner)
    loop.grammars = FakeCompiler()  # type: ignore[assignment]
    await submit(fake_redis, keys, "slow", grammar=Grammar("json_object"))
    await submit(fake_redis, keys, "free")
    for _ in range(4):
        await loop.run_once()
    assert [list(step) for step in runner.steps] == [["free"], ["free"]]
    assert [seq.rid for seq in loop.core.waiting] == ["slow"]
    assert loop.core.num_compiling == 1 and not loop.is_drained


async def test_a_scheduler_without_grammars_refuses_constrained_jobs(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    loop = make_loop(fake_redis, keys, ScriptedRunner())
    pubsub = await subscribe(fake_redis, keys)
    await submit(fake_redis, keys, "c", grammar=Grammar("regex", "a+"))
    await loop.run(burst=True)
    [entry] = entries_of(await received(pubsub), "c")
    assert entry.finish is not None and entry.finish.status_code == 400
    assert "cannot constrain" in (entry.finish.message or "")

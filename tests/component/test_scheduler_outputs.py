"""Logprobs and embeddings on the wire: the scheduler loop puts what the runner computed into
TokenEntries (on fakeredis), the detokenizer core passes it on to TextEntries."""

from __future__ import annotations

import redis.asyncio as aioredis

from shared import protocol, request_stream
from shared.keys import Keys
from shared.protocol import DetokParams, LogprobRequest, Logprobs, TokenBatch, TokenEntry
from tests.support.scheduler_loop import (
    ScriptedRunner,
    entries_of,
    make_loop,
    received,
    subscribe,
)
from workers.detokenizer.core import DetokenizerCore
from workers.scheduler.core.sequence import Sequence


class OutputsRunner(ScriptedRunner):
    """Scripted tokens, plus made-up logprobs (-(index + 1) for output index) and
    embeddings, stored on the sequences the way the torch runner does."""

    def run(self, seqs: list[Sequence]) -> list[int]:
        for seq in seqs:
            lp = seq.logprobs
            if lp is not None and lp.next_input_token < seq.num_prompt_tokens:
                first = lp.next_input_token
                n = seq.num_prompt_tokens - first
                lp.add_input(first, [-0.5] * n, None, None)
            if seq.embed and seq.will_sample:
                seq.embedding = [0.6, 0.8]
        tokens = super().run(seqs)
        samplers = [seq for seq in seqs if seq.will_sample]
        for seq, token in zip(samplers, tokens, strict=True):
            if seq.logprobs is not None:
                index = seq.num_completion_tokens
                seq.logprobs.set_output(index, -(index + 1.0), ([token], [-0.1]), None)
        return tokens


async def submit(r: aioredis.Redis, keys: Keys, job: protocol.GenerateJob) -> None:
    pipe = r.pipeline()
    request_stream.submit(pipe, keys, job)
    await pipe.execute()


def job(rid: str, input_ids: list[int] | None = None, **fields: object) -> protocol.GenerateJob:
    return protocol.GenerateJob(
        rid=rid,
        input_ids=input_ids or [10, 11, 12, 13],
        detok=DetokParams(api_id="api-1"),
        **fields,  # type: ignore[arg-type]
    )


async def test_entries_carry_logprobs_aligned_with_their_tokens(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    loop = make_loop(fake_redis, keys, OutputsRunner({"lp": [5, 6, 7]}))
    pubsub = await subscribe(fake_redis, keys)
    lr = LogprobRequest(start_len=1, top_n=1)
    sampling = protocol.SamplingParams(max_new_tokens=3)
    await submit(fake_redis, keys, job("lp", sampling=sampling, logprobs=lr))
    await submit(fake_redis, keys, job("plain", sampling=sampling))
    await loop.run(burst=True)
    batches = await received(pubsub)
    entries = entries_of(batches, "lp")
    assert [e.token_ids for e in entries] == [[5], [6], [7]]
    assert [e.output_logprobs for e in entries] == [
        Logprobs([-1.0], [[5]], [[-0.1]]),
        Logprobs([-2.0], [[6]], [[-0.1]]),
        Logprobs([-3.0], [[7]], [[-0.1]]),
    ]
    # Prompt tokens 1..3 on the first entry only.
    assert entries[0].input_logprobs == Logprobs([-0.5] * 3)
    assert all(e.input_logprobs is None for e in entries[1:])
    plain = entries_of(batches, "plain")
    assert len(plain) == 3 and all(
        e.output_logprobs is None and e.input_logprobs is None for e in plain
    )


async def test_an_embedding_job_finishes_after_its_prefill_with_the_vector(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    runner = OutputsRunner()
    loop = make_loop(fake_redis, keys, runner)  # max_model_len 64
    pubsub = await subscribe(fake_redis, keys)
    await submit(
        fake_redis,
        keys,
        protocol.GenerateJob(
            rid="e",
            input_ids=list(range(64)),  # the whole context: fine for an embedding
            sampling=protocol.SamplingParams(max_new_tokens=0),
            detok=DetokParams(api_id="api-1"),
            embed=True,
        ),
    )
    await loop.run(burst=True)
    [entry] = entries_of(await received(pubsub), "e")
    assert entry.token_ids == [] and entry.embedding == [0.6, 0.8]
    assert entry.finish == protocol.FinishReason(type="length", length=0)
    assert sum(runner.steps[0].values()) == 64 and len(runner.steps) == 1


async def test_the_prefix_cache_stops_where_prompt_logprobs_begin(
    fake_redis: aioredis.Redis, keys: Keys
) -> None:
    loop = make_loop(fake_redis, keys, OutputsRunner())  # block_size 4
    pubsub = await subscribe(fake_redis, keys)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks cacheable
    sampling = protocol.SamplingParams(max_new_tokens=1)
    await submit(fake_redis, keys, job("warm", input_ids=prompt, sampling=sampling))
    await loop.run(burst=True)
    for rid, start_len in (("none", -1), ("late", 10), ("mid", 6), ("all", 0)):
        lr = LogprobRequest(start_len=start_len)
        await submit(fake_redis, keys, job(rid, input_ids=prompt, sampling=sampling, logprobs=lr))
        await loop.run(burst=True)
    batches = await received(pubsub)
    # Position p gives token p + 1's logprob: positions from start_len - 1 are computed.
    cached = {
        rid: entries_of(batches, rid)[0].cached_tokens for rid in ("none", "late", "mid", "all")
    }
    assert cached == {"none": 12, "late": 8, "mid": 4, "all": 0}
    assert all(
        len(entries_of(batches, rid)[0].input_logprobs.token_logprobs) == 13 - max(start, 1)  # type: ignore[union-attr]
        for rid, start in (("late", 10), ("mid", 6), ("all", 0))
    )


class CharTokenizer:
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True, **kw: bool) -> str:
        return "".join(chr(ord("a") + t % 26) for t in token_ids)


def test_the_detokenizer_passes_logprobs_and_embeddings_on() -> None:
    core = DetokenizerCore(CharTokenizer())
    detok = DetokParams(api_id="api-1")
    first = TokenEntry(
        rid="r",
        epoch=1,
        seq=0,
        token_ids=[1, 2],
        prompt_tokens=3,
        detok=detok,
        output_logprobs=Logprobs([-1.0, -2.0]),
        input_logprobs=Logprobs([-0.5, -0.25]),
    )
    # A resend that overlaps the first entry by one token: its first logprob goes too.
    overlap = TokenEntry(
        rid="r",
        epoch=1,
        seq=1,
        token_ids=[2, 3],
        prompt_tokens=3,
        output_logprobs=Logprobs([-2.0, -3.0], [[2], [3]], [[-2.0], [-3.0]]),
        finish=protocol.FinishReason(type="length", length=3),
    )
    [a] = core.add_batch(TokenBatch("w", [first]))["api-1"]
    [b] = core.add_batch(TokenBatch("w", [overlap]))["api-1"]
    assert (a.text, a.output_logprobs, a.input_logprobs) == (
        "bc",
        Logprobs([-1.0, -2.0]),
        Logprobs([-0.5, -0.25]),
    )
    assert (b.seq, b.token_ids, b.output_logprobs) == (2, [3], Logprobs([-3.0], [[3]], [[-3.0]]))
    embed = TokenEntry(
        rid="e",
        epoch=1,
        seq=0,
        token_ids=[],
        prompt_tokens=4,
        detok=detok,
        embedding=[0.6, 0.8],
        finish=protocol.FinishReason(type="length", length=0),
    )
    [c] = core.add_batch(TokenBatch("w", [embed]))["api-1"]
    assert c.embedding == [0.6, 0.8] and c.text == "" and c.finish is not None

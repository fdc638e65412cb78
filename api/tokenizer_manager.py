"""The api's TokenizerManager (SGLang's, over Redis): validate and tokenize requests, claim their
rids fleet-wide (SET NX `rs:rid:{rid}`), submit them (`rs:state:{rid}` + XADD `rs:req` in one
pipeline), track them in `rid_to_state`, and hand each request's outputs to its waiter.
Outputs arrive as TextBatch on `rs:out:{api_id}` through the one ResultListener; aborts go out
as `rs:abort:{rid}` + an AbortRequests broadcast on `rs:ctl`. Every accepted request ends with
exactly one terminal output (finish or abort), and its rid claim is released."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from typing import Any, Protocol, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from api.claims import RidClaims
from api.errors import BadRequest, ClientDisconnected, ServiceUnavailable
from api.logprobs import needed_token_ids
from api.model import ModelInfo
from api.req_state import GenerateReq, ReqOutput, ReqState, TextPair
from api.result_listener import ResultListener
from api.tokenization import TextTokenizer
from api.validation import build_job, check_chars
from shared import protocol, request_state, request_stream
from shared.config import Settings
from shared.keys import Keys

logger = logging.getLogger(__name__)

REDIS_TIMEOUT_S = 3.0  # a Redis round trip slower than this counts as "Redis unavailable"
HEALTH_TIMEOUT_S = 1.0
_ABORT_ATTEMPTS = 3


class Disconnectable(Protocol):
    async def is_disconnected(self) -> bool: ...


class TokenizerManager:
    def __init__(self, settings: Settings, redis: aioredis.Redis, model: ModelInfo) -> None:
        self.settings = settings
        self.redis = redis
        self.model = model
        self.keys = Keys(settings.key_prefix)
        self.api_id = settings.api.api_id
        self.rid_to_state: dict[str, ReqState] = {}
        self.listener = ResultListener(redis, self.keys.output_channel(self.api_id), self.dispatch)
        self._handlers: dict[type, Callable[[Any], None]] = {
            protocol.TextBatch: self._handle_batch_output,
        }
        self._tasks: set[asyncio.Task[None]] = set()
        self.claims = RidClaims(redis, self.keys, self.api_id, self._spawn)
        api = settings.api
        self.tok = TextTokenizer(
            model.tokenizer,
            batch_size=api.tokenizer_batch_size,
            timeout_s=api.tokenizer_batch_timeout_s,
        )

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.listener.start()

    async def close(self) -> None:
        """Abort what is still running here (best effort), then stop listening."""
        rids = list(self.rid_to_state)
        if rids:
            await self._abort_and_finish(rids, "The server is shutting down.", 503, attempts=1)
        await self.listener.stop()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=REDIS_TIMEOUT_S)
        await self.tok.close()

    async def is_healthy(self) -> bool:
        if not self.listener.subscribed:
            return False
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                return bool(await self.redis.ping())
        except (RedisError, OSError, TimeoutError):
            return False

    # -- requests --------------------------------------------------------------------------
    async def generate(
        self, reqs: Sequence[GenerateReq], request: Disconnectable | None = None
    ) -> AsyncGenerator[ReqOutput, None]:
        """Validate, tokenize and submit `reqs` (raising ApiError before anything is written);
        return their outputs: streaming requests yield every update, others only the final one
        (batches in order when not streaming). Closing the iterator early aborts the rest."""
        outputs = self._generate(list(reqs), request)
        await anext(outputs)  # runs up to the submission, so errors surface here
        return cast(AsyncGenerator[ReqOutput, None], outputs)

    async def _generate(
        self, reqs: list[GenerateReq], request: Disconnectable | None
    ) -> AsyncGenerator[ReqOutput | None, None]:
        await self._tokenize(reqs)
        jobs = [build_job(req, req.input_ids, self.model, self.api_id) for req in reqs]
        self._check_local_duplicates(reqs)
        await self.claims.claim([req.rid for req in reqs])
        # From here on the rids are claimed: every exit releases them.
        states = self._register(reqs)
        try:
            await self._submit(jobs)
        except ServiceUnavailable:
            for state in states:
                self.rid_to_state.pop(state.rid, None)
            self.claims.release_soon([s.rid for s in states], [])
            raise
        except BaseException:  # cancelled mid-submission: the job may be queued, abort it
            self._abort_soon([s.rid for s in states], "Cancelled during submission.")
            self.claims.release_soon([], [s.rid for s in states])
            raise
        try:
            yield None
            if len(states) == 1:
                async for out in self._wait_one_response(states[0], request):
                    yield out
            else:
                async for out in self._wait_batch(states, request):
                    yield out
        finally:
            unfinished = [s.rid for s in states if not s.finished]
            if unfinished:
                self._abort_soon(unfinished, "The client stopped waiting for the request.")
            done = [s.rid for s in states if s.finished and not _aborted(s)]
            self.claims.release_soon(done, [s.rid for s in states if s.rid not in done])

    async def render_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Token ids of `messages` through the tokenizer's chat template (off the event loop)."""
        check_chars(sum(len(str(m.get("content") or "")) for m in messages), self.model)
        return await self.tok.render_chat(messages, kwargs)

    # -- tokenization, claims and submission ------------------------------------------------
    async def _tokenize(self, reqs: list[GenerateReq]) -> None:
        """Set each request's input_ids: one tokenizer call for the distinct texts (a lone
        text goes through the dynamic batch tokenizer), one for the distinct pairs."""
        texts = list(dict.fromkeys(r.prompt for r in reqs if isinstance(r.prompt, str)))
        pairs = list(dict.fromkeys(r.prompt for r in reqs if isinstance(r.prompt, tuple)))
        for text in texts:
            check_chars(len(text), self.model)
        for query, doc in pairs:
            check_chars(len(query) + len(doc), self.model)
        by_text = dict(zip(texts, await self.tok.encode_batch(texts), strict=True)) if texts else {}
        by_pair: dict[TextPair, tuple[list[int], list[int]]] = {}
        if pairs:
            enc = await self.tok.encode_pairs(pairs)
            for pair, ids, types in zip(pairs, enc.input_ids, enc.token_type_ids, strict=True):
                by_pair[pair] = (ids, types)
        for req in reqs:
            if isinstance(req.prompt, str):
                req.input_ids = by_text[req.prompt]
            elif isinstance(req.prompt, tuple):
                req.input_ids, req.token_type_ids = by_pair[req.prompt]
            else:
                req.input_ids = list(req.prompt)

    def _check_local_duplicates(self, reqs: list[GenerateReq]) -> None:
        seen: set[str] = set()
        for req in reqs:
            if req.rid in self.rid_to_state or req.rid in seen:
                raise BadRequest(f"Duplicate request ID detected: {req.rid}", param="rid")
            seen.add(req.rid)

    def _register(self, reqs: list[GenerateReq]) -> list[ReqState]:
        states = [
            ReqState(obj=req, index=i, prompt_tokens=len(req.input_ids))
            for i, req in enumerate(reqs)
        ]
        # Registered before the XADD: a fast worker may answer before execute() returns.
        for state in states:
            self.rid_to_state[state.rid] = state
        return states

    async def _submit(self, jobs: list[protocol.GenerateJob]) -> None:
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                async with self.redis.pipeline(transaction=True) as pipe:
                    for job in jobs:
                        request_state.create(
                            pipe, self.keys, job.rid, self.api_id, len(job.input_ids)
                        )
                        request_stream.submit(pipe, self.keys, job)
                    await pipe.execute()
        except (RedisError, OSError, TimeoutError) as e:
            logger.error("submit failed rid=%s: %r", jobs[0].rid, e)
            raise ServiceUnavailable("The request queue (Redis) is unavailable.") from e
        for job in jobs:
            logger.info(
                "submitted rid=%s prompt_tokens=%d max_new_tokens=%d embed=%s",
                job.rid, len(job.input_ids), job.sampling.max_new_tokens, job.embed,
            )  # fmt: skip

    async def request_info(self, rid: str) -> protocol.RequestState | None:
        """The durable state of `rid` (any replica's request) from Redis; None if unknown."""
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                return await request_state.read(self.redis, self.keys, rid)
        except (RedisError, OSError, TimeoutError) as e:
            raise ServiceUnavailable("Redis is unavailable.") from e

    # -- waiting ---------------------------------------------------------------------------
    async def _wait_one_response(
        self, state: ReqState, request: Disconnectable | None
    ) -> AsyncGenerator[ReqOutput, None]:
        check_s = self.settings.api.disconnect_check_s
        last_check = time.monotonic()
        while True:
            try:
                await asyncio.wait_for(state.event.wait(), timeout=check_s)
            except TimeoutError:
                await self._check_alive(state, request)
                last_check = time.monotonic()
                continue
            state.event.clear()
            if state.finished:
                yield await self._ready(state.take_output())
                return
            if state.obj.stream:
                yield await self._ready(state.take_output())
            if time.monotonic() - last_check >= check_s:
                await self._check_alive(state, request)
                last_check = time.monotonic()

    async def _ready(self, out: ReqOutput) -> ReqOutput:
        """Decode (off the loop) the token texts that the output's logprobs will show."""
        req = out.req
        if out.logprobs is not None and (req.return_text_in_logprobs or req.openai):
            await self.tok.ensure_token_texts(needed_token_ids(out))
        return out

    async def _check_alive(self, state: ReqState, request: Disconnectable | None) -> None:
        if request is not None and await request.is_disconnected():
            logger.info("client disconnected rid=%s", state.rid)
            raise ClientDisconnected(f"Request is disconnected from the client side: {state.rid}")
        idle = time.monotonic() - state.last_time
        if idle > self.settings.api.request_timeout_s and not state.finished:
            logger.warning("no output for %.0fs rid=%s: aborting", idle, state.rid)
            message = f"No output for {idle:.0f} s; the request timed out."
            await self._abort_and_finish([state.rid], message, 504)

    async def _wait_batch(
        self, states: list[ReqState], request: Disconnectable | None
    ) -> AsyncGenerator[ReqOutput, None]:
        gens = [self._wait_one_response(s, request) for s in states]
        if not states[0].obj.stream:  # one final output each, in batch order
            tasks = [asyncio.ensure_future(_last(g)) for g in gens]
            try:
                for out in await asyncio.gather(*tasks):
                    yield out
            finally:
                for task in tasks:
                    task.cancel()
            return
        pending = {asyncio.ensure_future(anext(g)): g for g in gens}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    gen = pending.pop(task)
                    try:
                        out = task.result()
                    except StopAsyncIteration:
                        continue
                    yield out
                    pending[asyncio.ensure_future(anext(gen))] = gen
        finally:
            for task in pending:
                task.cancel()

    # -- aborts ----------------------------------------------------------------------------
    async def abort_request(
        self,
        rids: list[str],
        *,
        message: str = "Aborted by request.",
        status_code: int | None = None,
    ) -> None:
        """Write the abort to Redis (marker + broadcast), THEN end the local requests with an
        abort output. Raises ServiceUnavailable, leaving local state alone, if Redis is down."""
        await self._write_abort(rids)
        self._finish_locally(rids, message, status_code)

    async def abort_all(self) -> None:
        rids = list(self.rid_to_state)
        if rids:
            await self.abort_request(rids)

    async def _write_abort(self, rids: list[str]) -> None:
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                async with self.redis.pipeline(transaction=False) as pipe:
                    request_state.abort(pipe, self.keys, rids)
                    await pipe.execute()
        except (RedisError, OSError, TimeoutError) as e:
            raise ServiceUnavailable("Could not write the abort: Redis is unavailable.") from e
        for rid in rids:
            logger.info("abort written rid=%s", rid)

    def _finish_locally(self, rids: list[str], message: str, status_code: int | None) -> None:
        reason = protocol.FinishReason(type="abort", message=message, status_code=status_code)
        for rid in rids:
            state = self.rid_to_state.pop(rid, None)
            if state is not None and not state.finished:
                state.finish(reason)

    async def _abort_and_finish(
        self, rids: list[str], message: str, status_code: int | None = None, attempts: int = 0
    ) -> None:
        """Internal aborts (disconnects, timeouts, shutdown): retry the Redis write, then end
        the local requests even if Redis stayed unreachable (nothing else could clean them)."""
        for attempt in range(attempts or _ABORT_ATTEMPTS):
            try:
                await self._write_abort(rids)
                break
            except ServiceUnavailable:
                logger.warning("abort write failed (attempt %d) rid=%s", attempt + 1, rids[0])
                await asyncio.sleep(0.2 * 2**attempt)
        else:
            logger.error("could not write the abort of %d requests rid=%s", len(rids), rids[0])
        self._finish_locally(rids, message, status_code)

    def _abort_soon(self, rids: list[str], message: str) -> None:
        """Abort from code that must not await (finally blocks of cancelled generators)."""
        logger.info("aborting %d requests rid=%s: %s", len(rids), rids[0], message)
        if not self._spawn(self._abort_and_finish(rids, message)):
            self._finish_locally(rids, message, None)  # no loop any more: local cleanup only

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> bool:
        """Run `coro` in the background (awaited on close); False when there is no loop."""
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:
            coro.close()
            return False
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    # -- results (called by the listener) --------------------------------------------------
    def dispatch(self, msg: Any) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            logger.warning("no handler for %s on the output channel", type(msg).__name__)
            return
        handler(msg)

    def _handle_batch_output(self, batch: protocol.TextBatch) -> None:
        now = time.time()
        for entry in batch.entries:
            state = self.rid_to_state.get(entry.rid)
            if state is None or not state.accept(entry):
                continue  # not ours (finished, aborted, another replica's), stale or duplicate
            if entry.token_ids and not state.first_token_time:
                state.first_token_time = now
            state.last_time = time.monotonic()
            state.completion_tokens = max(state.completion_tokens, entry.completion_tokens)
            state.cached_tokens = entry.cached_tokens
            if entry.finish is None:
                state.event.set()
                continue
            del self.rid_to_state[entry.rid]
            state.finish(entry.finish)
            logger.info(
                "finished rid=%s reason=%s completion_tokens=%d e2e=%.3fs",
                entry.rid, entry.finish.type, state.completion_tokens, now - state.created_time,
            )  # fmt: skip


def _aborted(state: ReqState) -> bool:
    return state.finish_reason is None or state.finish_reason.type == "abort"


async def _last(gen: AsyncGenerator[ReqOutput, None]) -> ReqOutput:
    last: ReqOutput | None = None
    async for out in gen:
        last = out
    assert last is not None, "a waiter ended without a terminal output"
    return last

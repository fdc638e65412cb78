"""The api's TokenizerManager (SGLang's, over Redis): validate and tokenize requests, claim their
rids fleet-wide (SET NX `rs:rid:{rid}`), submit them (`rs:state:{rid}` + XADD `rs:req` + this
replica's held-rid set in one transaction), track them in `rid_to_state`, and hand each
request's outputs to its waiter (api.waiting). Outputs arrive as TextBatch on `rs:out:{api_id}`
through the one ResultListener (which also hears Reattach notices on `rs:ctl`); aborts go out
through api.aborts. Every accepted request ends with exactly one terminal output (finish or
abort) and its rid claim is released, unless another attachment took it over (a re-attach:
api.reattach) or the replica left it to the fleet at shutdown. Streaming responses are
pumped by api.streams; heartbeats, orphans and outages are api.liveness's."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, cast

import redis.asyncio as aioredis

from api.aborts import Aborts
from api.admission import Admission
from api.claims import RidClaims
from api.errors import BadRequest, ServiceUnavailable
from api.event_log import Appends, EventLog
from api.gaps import GapFiller
from api.handover import Handover
from api.liveness import Maintenance
from api.loop_lag import LoopLag
from api.metrics import ApiMetrics
from api.model import ModelInfo
from api.redis_errors import REDIS_ERRORS, REDIS_TIMEOUT_S, unavailable
from api.req_state import GenerateReq, ReqOutput, ReqState, TextPair
from api.result_listener import ResultListener
from api.stream_spec import StreamSetup
from api.structured import check_grammars
from api.tokenization import TextTokenizer
from api.validation import build_job, check_chars
from api.waiting import Disconnectable, wait_batch, wait_one
from api.weights import WeightUpdates
from shared import protocol, reattach, request_state, request_stream
from shared.config import Settings
from shared.redis_conn import atomic

if TYPE_CHECKING:
    from api.streams import ResponsePump

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 1.0
SHUTTING_DOWN = "The server is shutting down."


class TokenizerManager:
    def __init__(self, settings: Settings, redis: aioredis.Redis, model: ModelInfo) -> None:
        self.settings = settings
        self.redis = redis
        self.model = model
        self.keys = settings.redis_keys()
        self.api_id = settings.api.api_id
        self.rid_to_state: dict[str, ReqState] = {}
        self.metrics = ApiMetrics(model.served_model_name)
        self.listener = ResultListener(
            redis,
            self.keys.output_channel(self.api_id),
            self.dispatch,
            control_channel=self.keys.control_channel,
            on_resubscribe=self.resync,
        )
        self.handover = Handover(self)
        self.weights = WeightUpdates(self)  # weight updates, and the gate requests pass
        self._handlers: dict[type, Callable[[Any], None]] = {
            protocol.TextBatch: self._handle_batch_output,
            protocol.Reattach: self.handover.on_notice,
            protocol.UpdateWeights: self.weights.on_broadcast,
            protocol.AbortRequests: lambda msg: None,  # the engine's finish entry says it
            # For the schedulers: the api sent them (its routes log them) and holds no state.
            protocol.PauseGeneration: lambda msg: None,
            protocol.ContinueGeneration: lambda msg: None,
            protocol.FlushCache: lambda msg: None,
        }
        self._tasks: set[asyncio.Task[None]] = set()
        self.claims = RidClaims(redis, self.keys, self.api_id, self.spawn)
        self.log_appends = Appends(redis, self.keys)  # every stream's event-log appends
        self.loop_lag = LoopLag()  # how late this event loop runs: overload, not outages
        self.admission = Admission(settings.api, redis, self.keys, self.spawn, self.loop_lag)
        self.aborts = Aborts(self)
        self.gaps = GapFiller(self)
        self.maintenance = Maintenance(self)
        self.pumps: set[ResponsePump] = set()
        self.draining = False
        api = settings.api
        self.tok = TextTokenizer(model.tokenizer, batch_size=api.tokenizer_batch_size,
                                 timeout_s=api.tokenizer_batch_timeout_s)  # fmt: skip

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.listener.start()
        self.loop_lag.start()
        self.maintenance.start()
        self.admission.start()

    async def close(self) -> None:
        """Hand streams to the fleet, abort the rest (best effort), stop beating, listening."""
        self.draining = True
        await self.shed()
        await self.maintenance.stop()
        await self.admission.stop()
        await self.loop_lag.stop()
        await self.listener.stop()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=3 * REDIS_TIMEOUT_S)
        await self.tok.close()

    async def is_healthy(self) -> bool:
        if self.draining or not self.listener.subscribed:
            return False
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                return bool(await self.redis.ping())
        except REDIS_ERRORS:
            return False

    def start_drain(self) -> None:
        """SIGTERM: /health and new requests answer 503 from now on; in-flight ones go on."""
        if not self.draining:
            logger.info("draining: %d requests in flight", len(self.rid_to_state))
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> None:
        """Wait until no client here waits for a request (TimeoutError after timeout_s);
        streams whose client already left do not count: they are released at once."""
        async with asyncio.timeout(timeout_s):
            while self.num_waited_on():
                await asyncio.sleep(0.05)

    def num_waited_on(self) -> int:
        """Requests in flight with a client waiting here (streams: their attached pumps)."""
        plain = sum(1 for s in self.rid_to_state.values() if s.stream_rid is None)
        return plain + sum(1 for pump in self.pumps if not pump.detached)

    async def shed(self) -> None:
        """End what is still in flight: streams are released (left running, held by this
        replica, for a re-attach elsewhere or the reaper); other requests are aborted (503)."""
        for pump in list(self.pumps):
            await pump.release()
        rids = [rid for rid, s in self.rid_to_state.items() if not s.released]
        if rids:
            await self.aborts.abort_and_finish(rids, SHUTTING_DOWN, 503, attempts=1)

    # -- requests --------------------------------------------------------------------------
    async def generate(
        self,
        reqs: Sequence[GenerateReq],
        request: Disconnectable | None = None,
        stream: StreamSetup | None = None,
    ) -> AsyncGenerator[ReqOutput, None]:
        """Validate, tokenize and submit `reqs` (raising ApiError before anything is written);
        return their outputs: streaming requests yield every update, others only the final one
        (batches in order when not streaming). Closing the iterator early aborts the rest.
        `stream`: a streaming response's spec and attachment, written with the requests."""
        if self.draining:
            raise ServiceUnavailable(SHUTTING_DOWN)
        # 503 (fleet queue full) or 429 (the API key's limits) before any work; the ticket
        # is given back when the outputs end.
        ticket = await self.admission.admit(len(reqs))
        outputs = self.admission.guard(ticket, self._generate(list(reqs), request, stream))
        async with self.weights.reading():  # an update (mode all) waits for those inside
            await anext(outputs)  # runs up to the submission, so errors surface here
        return cast(AsyncGenerator[ReqOutput, None], outputs)

    async def _generate(
        self, reqs: list[GenerateReq], request: Disconnectable | None, stream: StreamSetup | None
    ) -> AsyncGenerator[ReqOutput | None, None]:
        await check_grammars(reqs)
        await self._tokenize(reqs)
        jobs = [build_job(req, req.input_ids, self.model, self.api_id) for req in reqs]
        self._check_local_duplicates(reqs)
        await self.claims.claim([req.rid for req in reqs])
        # From here on the rids are claimed: every exit releases them.
        states = self._register(reqs, stream)
        try:
            await self._submit(jobs, stream)
        except ServiceUnavailable:
            for state in states:
                self.rid_to_state.pop(state.rid, None)
            self.claims.release_soon([s.rid for s in states], [])
            raise
        except BaseException:  # cancelled mid-submission: the job may be queued, abort it
            self.aborts.abort_soon([s.rid for s in states], "Cancelled during submission.")
            self.claims.release_soon([], [s.rid for s in states])
            raise
        yield None
        async for out in self.outputs(states, request):
            yield out

    async def outputs(
        self, states: list[ReqState], request: Disconnectable | None = None
    ) -> AsyncGenerator[ReqOutput, None]:
        """The outputs of registered states (submitted here, or re-attached). However this
        ends, what is unfinished is aborted, and the claims are released, except for the
        states that were taken over (superseded) or left to the fleet (released)."""
        try:
            waiter = wait_one(self, states[0], request) if len(states) == 1 else None
            async for out in waiter or wait_batch(self, states, request):
                yield out
        finally:
            ours = [s for s in states if not s.superseded and not s.released]
            unfinished = [s.rid for s in ours if not s.finished]
            if unfinished:
                self.aborts.abort_soon(unfinished, "The client stopped waiting for the request.")
            done = [s.rid for s in ours if s.finished and not _aborted(s)]
            self.claims.release_soon(done, [s.rid for s in ours if s.rid not in done])
            for state in states:
                if state.superseded or state.released:
                    self.forget(state)

    def forget(self, state: ReqState) -> None:
        """Drop a state from rid_to_state if it is still the one registered there."""
        if self.rid_to_state.get(state.rid) is state:
            del self.rid_to_state[state.rid]

    def supersede(self, state: ReqState) -> None:
        """Another attachment holds the request now: its waiter here ends quietly."""
        if not state.finished and not state.superseded:
            state.superseded = True
            state.event.set()
        self.forget(state)

    def adopt(self, states: list[ReqState]) -> None:
        """Register re-attached states, superseding whatever this replica held for them."""
        if self.draining:
            raise ServiceUnavailable(SHUTTING_DOWN)
        for state in states:
            old = self.rid_to_state.get(state.rid)
            if old is not None:
                self.supersede(old)
            self.rid_to_state[state.rid] = state

    def event_log(self, rid: str, attach_id: str, next_id: int = 0) -> EventLog:
        return EventLog(self.redis, self.keys, rid, attach_id, next_id,
                        self.maintenance.redis_down, self.log_appends)  # fmt: skip

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

    def _register(self, reqs: list[GenerateReq], stream: StreamSetup | None) -> list[ReqState]:
        states = [
            ReqState(obj=req, index=i, prompt_tokens=len(req.input_ids))
            for i, req in enumerate(reqs)
        ]
        if stream is not None:
            stream.spec.fill(reqs, min(s.created_time for s in states))
            stream.states = states
            for state in states:
                state.stream_rid, state.attach_id = stream.stream_rid, stream.attach_id
        # Registered before the XADD: a fast worker may answer before execute() returns.
        for state in states:
            self.rid_to_state[state.rid] = state
        return states

    async def _submit(self, jobs: list[protocol.GenerateJob], stream: StreamSetup | None) -> None:
        rids = [job.rid for job in jobs]
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                async with atomic(self.redis) as pipe:
                    for job in jobs:
                        request_state.create(
                            pipe, self.keys, job.rid, self.api_id, len(job.input_ids)
                        )
                        request_stream.submit(pipe, self.keys, job)
                    reattach.hold(pipe, self.keys, self.api_id, rids)
                    if stream is not None:
                        spec = stream.spec.encode()
                        reattach.save_stream(pipe, self.keys, rids, spec, stream.attach_id)
                    await pipe.execute()
        except REDIS_ERRORS as e:
            logger.error("submit failed rid=%s: %r", jobs[0].rid, e)
            raise unavailable(e, "The request queue (Redis) is unavailable.") from e
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
        except REDIS_ERRORS as e:
            raise unavailable(e, "Redis is unavailable.") from e

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
        await self.aborts.abort_request(rids, message, status_code)

    async def abort_all(self) -> None:
        rids = list(self.rid_to_state)
        if rids:
            await self.abort_request(rids)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> bool:
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
        for entry in batch.entries:
            state = self.rid_to_state.get(entry.rid)
            if state is not None:  # else: not ours (finished, aborted, another replica's)
                self.apply(state, entry)

    def apply(self, state: ReqState, entry: protocol.TextEntry) -> None:
        """One entry for a registered state: wake its waiter, or end it on a finish; a gap
        asks the engine for a resend (api.gaps)."""
        now = time.time()
        state.last_time = time.monotonic()
        had, had_epoch = state.next_seq, state.epoch
        news = state.accept(entry)
        self.metrics.on_entry(state, entry, had, had_epoch, now)
        if state.held:
            self.gaps.on_gap(state)
        elif news and state.resend_at and state.next_seq > had:
            state.resend_at = 0.0  # what was asked for arrived
        if not news:
            return
        if state.next_seq > had and not state.first_token_time:
            state.first_token_time = now
        if state.finish_seen is None:
            state.event.set()
            return
        self.forget(state)
        state.finish(state.finish_seen)
        self.metrics.finished(state)
        logger.info(
            "finished rid=%s reason=%s completion_tokens=%d e2e=%.3fs",
            entry.rid, state.finish_seen.type, state.completion_tokens, now - state.created_time,
        )  # fmt: skip

    def resync(self) -> None:
        """The output channel was lost for a while: ask for every live request's text again
        from where this replica is (nothing published meanwhile reached it)."""
        self.gaps.request(list(self.rid_to_state.values()), lost=True)


def _aborted(state: ReqState) -> bool:
    return state.finish_reason is None or state.finish_reason.type == "abort"

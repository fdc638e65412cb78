"""The api replica's Prometheus metrics (GET /metrics), SGLang's names under `redserve:`.

Observed here, where outputs reach a request (`TokenizerManager.apply`, one call per entry,
and one call per finished request): time to first token, inter-token latency (the time since
the previous entry that brought tokens, divided by the tokens in this entry), end-to-end
latency, queue time (the scheduler's, from the request's first entry), token and request
counters, and redeliveries (seen as owner epochs rising: each new owner of a job bumps its
epoch, so a request first seen at epoch 3, or going from 1 to 3, was delivered twice more).
Every replica counts the requests it holds; sum them across replicas.

The fleet's gauges are read from Redis at scrape time (api.fleet) and rendered by a collector
built for that one scrape, so a worker that is gone has no series at all, never a stale one.
Requests of /health_generate (rid prefix HEALTH_CHECK_PREFIX) are not counted."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.fleet import FleetView, token_usage
from api.req_state import ReqState
from shared import protocol

PREFIX = "redserve:"
# The classic text format (what generate_latest writes here): every Prometheus reads it.
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
HEALTH_CHECK_PREFIX = "HEALTH_CHECK_"
FINISH_REASONS = ("stop", "length", "abort")

# Bucket bounds (seconds), SGLang's plus a few below its smallest for fast small models.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.06, 0.08, 0.1,
               0.2, 0.4, 0.6, 0.8, 1, 2, 4, 8)  # fmt: skip
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 100, 150, 200, 300, 500,
               1000)  # fmt: skip
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class ApiMetrics:
    """One replica's histograms and counters, in a registry of its own (several apps can
    live in one process, as in tests)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["model_name"]

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            metric = Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg)
            return metric.labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=reg).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time per output token after the first (between entries, over their tokens).",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS
        )
        self.queue_time = histogram(
            "queue_time_seconds",
            "Time from submission to the request's first scheduler step.",
            QUEUE_BUCKETS,
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens from the prefix cache.")
        self.aborted = counter("num_aborted_requests", "Requests that ended aborted.")
        self.redeliveries = counter(
            "redeliveries", "Times a job moved to another scheduler (owner epochs rising)."
        )
        requests = Counter(
            PREFIX + "num_requests",
            "Finished requests by finish reason.",
            ["model_name", "finish_reason"],
            registry=reg,
        )
        self.requests = {r: requests.labels(model_name, r) for r in FINISH_REASONS}

    def on_entry(
        self,
        state: ReqState,
        entry: protocol.TextEntry,
        had_seq: int,
        had_epoch: int,
        now: float,
    ) -> None:
        """After `state` took `entry` (it stood at `had_seq`, `had_epoch` before)."""
        if state.rid.startswith(HEALTH_CHECK_PREFIX):
            return
        if entry.epoch > had_epoch:
            # Unknown epoch (0): a request new here starts at 1; a re-attached one, at this.
            base = had_epoch or (1 if had_seq == 0 else entry.epoch)
            if entry.epoch > base:
                self.redeliveries.inc(entry.epoch - base)
        if had_seq == 0 and entry.seq == 0 and entry.queue_time is not None:
            self.queue_time.observe(max(0.0, entry.queue_time))
        new = state.next_seq - had_seq
        if new <= 0:
            return
        if had_seq == 0:
            self.ttft.observe(max(0.0, now - state.created_time))
        elif state.last_token_time:  # not for the first entry a re-attached request gets here
            self.itl.observe(max(0.0, now - state.last_token_time) / new)
        state.last_token_time = now

    def finished(self, state: ReqState) -> None:
        """`state` just ended (a finish entry, or an abort decided here)."""
        if state.rid.startswith(HEALTH_CHECK_PREFIX):
            return
        reason = state.finish_reason.type if state.finish_reason else "abort"
        self.requests[reason if reason in self.requests else "abort"].inc()
        if reason == "abort":
            self.aborted.inc()
        self.e2e.observe(max(0.0, state.finished_time - state.created_time))
        self.prompt_tokens.inc(state.prompt_tokens)
        self.generation_tokens.inc(state.completion_tokens)
        self.cached_tokens.inc(state.cached_tokens)

    def render(self, view: FleetView | None) -> bytes:
        """The text exposition: this replica's metrics, then the fleet's gauges of `view`
        (None: Redis did not answer; only `redserve:redis_up 0` then)."""
        return generate_latest(self.registry) + generate_latest(FleetCollector(view))


class FleetCollector(Collector):
    """The fleet gauges of one scrape, per live worker (label `worker`)."""

    def __init__(self, view: FleetView | None) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(PREFIX + "redis_up", "Whether Redis answered this scrape.")
        up.add_metric([], 0.0 if self.view is None else 1.0)
        yield up
        if self.view is not None:
            yield from _scheduler_gauges(self.view)
            yield from _fleet_gauges(self.view)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=labels)


def _scheduler_gauges(view: FleetView) -> Iterator[Metric]:
    running = _gauge("num_running_reqs", "Requests running on a scheduler.", ["worker"])
    queued = _gauge("num_queue_reqs", "Requests a scheduler holds waiting.", ["worker"])
    usage = _gauge("token_usage", "Used fraction of a scheduler's KV cache.", ["worker"])
    throughput = _gauge("gen_throughput", "Generated tokens per second.", ["worker"])
    for worker_id, beat in sorted(view.schedulers.items()):
        running.add_metric([worker_id], beat.num_running)
        queued.add_metric([worker_id], beat.num_waiting)
        usage.add_metric([worker_id], token_usage(beat))
        throughput.add_metric([worker_id], beat.gen_throughput)
    yield from (running, queued, usage, throughput)


def _fleet_gauges(view: FleetView) -> Iterator[Metric]:
    workers = _gauge("num_workers", "Live workers by tier and state.", ["kind", "state"])
    counts: dict[tuple[str, str], int] = {}
    for beat in view.schedulers.values():
        counts[("scheduler", beat.state)] = counts.get(("scheduler", beat.state), 0) + 1
    counts[("detokenizer", "ready")] = len(view.detokenizers)
    counts[("api", "ready")] = len(view.apis)
    for (kind, state), n in sorted(counts.items()):
        workers.add_metric([kind, state], n)
    yield workers
    states = _gauge("detokenizer_num_states", "Requests a detokenizer follows.", ["worker"])
    shards = _gauge("detokenizer_num_shards", "Token shards a detokenizer serves.", ["worker"])
    for worker_id, detok in sorted(view.detokenizers.items()):
        states.add_metric([worker_id], detok.num_states)
        shards.add_metric([worker_id], len([s for s in detok.shards.split(",") if s]))
    yield from (states, shards)
    lag = _gauge("request_stream_lag", "Jobs not yet delivered to a scheduler.", [])
    lag.add_metric([], view.backlog.waiting)
    pending = _gauge("request_stream_pending", "Jobs delivered, not finished yet.", [])
    pending.add_metric([], view.backlog.pending)
    yield from (lag, pending)

"""A scheduler's own figures: Prometheus histograms of its model steps (time, batch size) and
of its stepping iterations (wall time, and the share outside the step: Redis and bookkeeping),
served on `--metrics-port` when one is set, and its recent generation throughput, which its
heartbeat reports (`gen_throughput`, what the api's /metrics shows per worker).

The loop calls `observe_step` once per model step: a histogram observation each and a deque
append, nothing that waits."""

from __future__ import annotations

import logging
import time
from collections import deque
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

logger = logging.getLogger(__name__)

PREFIX = "redserve:"
# gen_throughput counts the tokens sampled in this many seconds before it is read.
THROUGHPUT_WINDOW_S = 10.0
PROGRESS_EVERY_S = 10.0  # a log line of throughput and batch
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class SchedulerMetrics:
    def __init__(self, worker_id: str, window_s: float = THROUGHPUT_WINDOW_S) -> None:
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["worker"]
        self.step_time = Histogram(
            PREFIX + "step_time_seconds", "Time of one model step.", labels,
            buckets=STEP_BUCKETS, registry=reg,
        ).labels(worker_id)  # fmt: skip
        self.batch_size = Histogram(
            PREFIX + "batch_size", "Sequences in one model step.", labels,
            buckets=BATCH_BUCKETS, registry=reg,
        ).labels(worker_id)  # fmt: skip
        # A stepping iteration's wall time, and the part of it spent outside the step: on
        # Redis (jobs read, the step's transaction, publishes) and the loop's bookkeeping.
        self.iteration_time = Histogram(
            PREFIX + "iteration_time_seconds", "Wall time of one loop iteration with a step.",
            labels, buckets=STEP_BUCKETS, registry=reg,
        ).labels(worker_id)  # fmt: skip
        self.fabric_time = Histogram(
            PREFIX + "iteration_fabric_seconds",
            "Time of one loop iteration with a step spent outside the step (Redis, bookkeeping).",
            labels, buckets=STEP_BUCKETS, registry=reg,
        ).labels(worker_id)  # fmt: skip
        self.generated = Counter(
            PREFIX + "scheduler_generation_tokens", "Tokens sampled by this scheduler.", labels,
            registry=reg,
        ).labels(worker_id)  # fmt: skip
        self.window_s = window_s
        self._recent: deque[tuple[float, int]] = deque()  # (monotonic time, tokens sampled)
        self._recent_sum = 0
        self._last_progress = time.monotonic()

    def observe_step(
        self, seconds: float, batch_size: int, num_sampled: int, now: float | None = None
    ) -> None:
        """One model step: how long it took, how many sequences it computed, how many of
        them sampled a token (a partial prefill chunk does not)."""
        self.step_time.observe(seconds)
        self.batch_size.observe(batch_size)
        if num_sampled:
            self.generated.inc(num_sampled)
            self._recent.append((time.monotonic() if now is None else now, num_sampled))
            self._recent_sum += num_sampled
        self._prune(time.monotonic() if now is None else now)

    def observe_iteration(self, seconds: float, fabric_seconds: float) -> None:
        """One loop iteration that ran a step: its wall time, and the part outside the step."""
        self.iteration_time.observe(seconds)
        self.fabric_time.observe(fabric_seconds)

    def gen_throughput(self, now: float | None = None) -> float:
        """Tokens sampled per second over the last `window_s`."""
        self._prune(time.monotonic() if now is None else now)
        return self._recent_sum / self.window_s

    def log_progress(self, running: int, waiting: int, free_blocks: int, total_blocks: int) -> None:
        """Every PROGRESS_EVERY_S, one log line: throughput, the queues, the free KV blocks."""
        now = time.monotonic()
        if now - self._last_progress < PROGRESS_EVERY_S:
            return
        self._last_progress = now
        throughput = self.gen_throughput(now)
        logger.info("%.1f tok/s; running=%d waiting=%d free_blocks=%d/%d",
                    throughput, running, waiting, free_blocks, total_blocks)  # fmt: skip

    def _prune(self, now: float) -> None:
        while self._recent and self._recent[0][0] <= now - self.window_s:
            self._recent_sum -= self._recent.popleft()[1]


def serve_metrics(port: int, metrics: SchedulerMetrics) -> WSGIServer:
    """Serve `metrics` in Prometheus' text format on `port` (GET /metrics, a daemon thread)."""
    server, _thread = start_http_server(port, registry=metrics.registry)
    logger.info("scheduler metrics on :%d/metrics", port)
    return server

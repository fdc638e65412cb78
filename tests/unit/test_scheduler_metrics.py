"""A scheduler's own figures (workers/scheduler/metrics.py): its step and iteration histograms
as its --metrics-port serves them, and the recent generation throughput its heartbeat reports."""

from __future__ import annotations

import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from shared.embedded_redis import free_port
from shared.keys import Keys
from tests.support.scheduler_loop import ScriptedRunner, make_loop, submit
from workers.scheduler.metrics import SchedulerMetrics, serve_metrics


def test_throughput_counts_the_tokens_of_the_last_window() -> None:
    metrics = SchedulerMetrics("s1", window_s=10.0)
    assert metrics.gen_throughput(now=0.0) == 0.0
    metrics.observe_step(0.01, batch_size=4, num_sampled=4, now=1.0)
    metrics.observe_step(0.01, batch_size=5, num_sampled=3, now=2.0)  # a partial prefill chunk
    metrics.observe_step(0.02, batch_size=1, num_sampled=0, now=3.0)
    assert metrics.gen_throughput(now=5.0) == 0.7
    assert metrics.gen_throughput(now=11.5) == 0.3  # the step at 1.0 left the window
    assert metrics.gen_throughput(now=30.0) == 0.0  # idle: nothing recent


def test_the_metrics_port_serves_the_step_histograms() -> None:
    metrics = SchedulerMetrics("s1")
    for batch in (1, 8, 8):
        metrics.observe_step(0.003, batch_size=batch, num_sampled=batch)
    port = free_port()
    server = serve_metrics(port, metrics)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    worker = ("worker", "s1")
    assert samples[("redserve:step_time_seconds_count", (worker,))] == 3
    assert samples[("redserve:batch_size_bucket", (("le", "4.0"), worker))] == 1
    assert samples[("redserve:batch_size_bucket", (("le", "8.0"), worker))] == 3
    assert samples[("redserve:scheduler_generation_tokens_total", (worker,))] == 17


async def test_the_loop_times_each_stepping_iteration_and_its_part_outside_the_step(
    fake_redis: Any, keys: Keys
) -> None:
    class SlowRunner(ScriptedRunner):
        def run(self, seqs: list[Any]) -> list[int]:
            time.sleep(0.01)  # a step that is certainly longer than the fakeredis calls
            return super().run(seqs)

    loop = make_loop(fake_redis, keys, SlowRunner())
    await submit(fake_redis, keys, "a", max_new_tokens=3)
    await loop.run(burst=True)
    iterations = loop.metrics.iteration_time.collect()[0].samples
    fabric = loop.metrics.fabric_time.collect()[0].samples
    count = {s.name: s.value for s in iterations}["redserve:iteration_time_seconds_count"]
    wall = {s.name: s.value for s in iterations}["redserve:iteration_time_seconds_sum"]
    outside = {s.name: s.value for s in fabric}["redserve:iteration_fabric_seconds_sum"]
    assert count == 3  # one per step, none for the idle iterations
    assert 0 < outside < wall - 3 * 0.01

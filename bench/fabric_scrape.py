"""Reading a scheduler's own /metrics (its --metrics-port) for bench/fabric.py."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "redserve:"


@dataclass(frozen=True)
class Scraped:
    generated: float  # tokens sampled
    iteration_s: float  # the stepping iterations' wall time
    fabric_s: float  # the part of it outside the model step

    def __sub__(self, other: Scraped) -> Scraped:
        return Scraped(self.generated - other.generated, self.iteration_s - other.iteration_s,
                       self.fabric_s - other.fabric_s)  # fmt: skip

    @property
    def fabric_share(self) -> float:
        return self.fabric_s / self.iteration_s if self.iteration_s > 0 else 0.0


def scrape(url: str) -> Scraped:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    samples = {
        s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
    }
    return Scraped(
        samples.get(f"{PREFIX}scheduler_generation_tokens_total", 0.0),
        samples.get(f"{PREFIX}iteration_time_seconds_sum", 0.0),
        samples.get(f"{PREFIX}iteration_fabric_seconds_sum", 0.0),
    )

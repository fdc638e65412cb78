"""`python -m tests.support.stalling_scheduler [--stall-after N]`: a real scheduler whose model
step hangs for good after N steps, for the watchdog's fault test.

It is the production scheduler (workers.scheduler.__main__.build_loop: settings from REDSERVE_*,
the real model, loop and Redis wiring) with one change, made here rather than behind a hidden
setting: the loop's runner is wrapped so that step N + 1 never returns, as a hung kernel or
a deadlock would. It then serves with the scheduler's own entry point (the watchdog started).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading

from shared.config import get_settings
from shared.logging_setup import configure_logging
from workers.scheduler.__main__ import build_loop, serve
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.loop import ModelRunner

logger = logging.getLogger("tests.stalling_scheduler")


class HangingRunner:
    """The real runner for `steps` steps; the next one blocks forever (holding the loop)."""

    def __init__(self, runner: ModelRunner, steps: int) -> None:
        self.runner, self.steps, self.num_steps = runner, steps, 0

    def run(self, seqs: list[Sequence]) -> list[int]:
        self.num_steps += 1
        if self.num_steps > self.steps:
            logger.warning("step %d hangs for good", self.num_steps)
            threading.Event().wait()  # never set
        return self.runner.run(seqs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stall-after", type=int, default=3, help="steps before the hang")
    args = parser.parse_args()
    settings = get_settings()
    configure_logging(settings.log_level, "scheduler")
    loop = build_loop(settings)
    loop.runner = HangingRunner(loop.runner, args.stall_after)
    asyncio.run(serve(loop))  # the scheduler's own: watchdog on


if __name__ == "__main__":
    main()

"""How long a scheduler takes from `redserve scheduler` to taking jobs, cold and warm.

    python -m bench.startup                     # default settings: a cold start, then warm ones
    python -m bench.startup --compile --runs 2  # the same with --enable-torch-compile

Each mode gets a fresh `--cache-dir`, so its first start times its kernels (and compiles)
and stores them (engine/tuning_cache.py); the later starts reuse them. The model is the
packaged GGUF converted beforehand (`resolve_model("")`), so no start pays the one-time
conversion. Prints, per start, the seconds until each milestone line of the scheduler's log
and until it serves its stream (the loop's "serving" line).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared.embedded_redis import EmbeddedRedis
from shared.model_files import resolve_model

MILESTONES = {  # a text of the scheduler's log -> the column it times
    "loaded weights": "weights",
    "kernel choices as timed at an earlier start": "kernels",
    "attention kernels": "kernels",
    "compiled decode steps": "compiled",
    "serving": "serving",
}


def start_once(
    redis_url: str, cache_dir: Path, flags: list[str], timeout_s: float
) -> dict[str, float]:
    """Starts a scheduler, returns the seconds at which each milestone's last line came, then
    stops it (by its pid)."""
    env = {**os.environ, "REDSERVE_REDIS_URL": redis_url, "REDSERVE_CACHE_DIR": str(cache_dir),
           "REDSERVE_MODEL": resolve_model(""), "REDSERVE_LOG_LEVEL": "INFO"}  # fmt: skip
    command = [sys.executable, "-m", "redserve.cli", "scheduler", *flags]
    started = time.monotonic()
    proc = subprocess.Popen(
        command, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    times: dict[str, float] = {}
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            for text, column in MILESTONES.items():
                if text in line:
                    times[column] = time.monotonic() - started
            if "serving" in times or time.monotonic() - started > timeout_s:
                break
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if "serving" not in times:
        raise RuntimeError(f"no 'serving' line within {timeout_s}s (rc {proc.returncode})")
    return times


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compile", action="store_true", help="with --enable-torch-compile")
    p.add_argument("--runs", type=int, default=3, help="starts per mode (the first is cold)")
    p.add_argument("--timeout-s", type=float, default=900)
    args = p.parse_args()
    resolve_model("")  # convert once, outside the timings
    modes: dict[str, list[str]] = {"default": []}
    if args.compile:
        modes["compiled"] = ["--enable-torch-compile"]
    server = EmbeddedRedis()
    url = server.start()
    say("| mode | start | weights loaded | kernels chosen | compiled | takes jobs |")
    say("|---|---|---:|---:|---:|---:|")
    try:
        for mode, flags in modes.items():
            with tempfile.TemporaryDirectory(prefix="redserve-startup-") as cache_dir:
                for run in range(args.runs):
                    times = start_once(url, Path(cache_dir), flags, args.timeout_s)
                    cells = [f"{times[c]:.1f} s" if c in times else "-"
                             for c in ("weights", "kernels", "compiled", "serving")]  # fmt: skip
                    say(f"| {mode} | {'cold' if run == 0 else 'warm'} | {' | '.join(cells)} |")
    finally:
        server.stop()


if __name__ == "__main__":
    main()

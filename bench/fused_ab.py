"""The fused kernels (fused_decode.c) at this tree against an earlier commit's, interleaved in
one process, so a noisy VM's swings hit both alike.

    OMP_NUM_THREADS=1 python -m bench.fused_ab --baseline ee55e6b --linear  # one core's products
    python -m bench.fused_ab --baseline ee55e6b --batch 1 16 64  # engine decode steps

`--linear`: `fused_linear` on the model's projection shapes (int4) and the LM head's (8-bit),
random weights, at 1, 4, 16 and 64 rows: microseconds, GMAC/s, and whether both builds give
the same output bit for bit. Otherwise: two engines of the default mode (`--quantization
auto`, 128-token prompts, as bench/steps.py), one on each build, their decode steps
alternating; step ms p50 and p10.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.serving import make_prompts
from bench.steps import engine, step
from shared.model_files import resolve_model
from workers.scheduler.kernels import fused_decode

CSRC = "workers/scheduler/kernels/csrc"
ROUNDS = 15
WARMUP_STEPS = 9


def sources_at(revision: str, folder: Path) -> Path:
    """fused_decode.c and what it includes, as of `revision`, written under `folder`."""
    root = Path(__file__).resolve().parent.parent
    listing = ["git", "ls-tree", "--name-only", f"{revision}:{CSRC}"]
    names = subprocess.run(listing, cwd=root, capture_output=True, text=True, check=True)
    for name in names.stdout.split():
        show = ["git", "show", f"{revision}:{CSRC}/{name}"]
        blob = subprocess.run(show, cwd=root, capture_output=True, check=True).stdout
        (folder / name).write_bytes(blob)
    return folder / "fused_decode.c"


def build_from(source: Path) -> ctypes.CDLL:
    """fused_decode.build() of `source` instead of the tree's file."""
    kept = fused_decode.SOURCE
    fused_decode.SOURCE = source
    fused_decode.build.cache_clear()
    try:
        lib = fused_decode.build()
    finally:
        fused_decode.SOURCE = kept
        fused_decode.build.cache_clear()
    if lib is None:
        raise SystemExit(f"{source} builds no fused kernel on this CPU")
    return lib


def alternate(calls: list[Callable[[], object]], reps: int) -> list[float]:
    """Median seconds a call of each of `calls`, timed in alternating rounds."""
    spent: list[list[float]] = [[] for _ in calls]
    for _ in range(ROUNDS):
        for call, times in zip(calls, spent, strict=True):
            started = time.perf_counter()
            for _ in range(reps):
                call()
            times.append((time.perf_counter() - started) / reps)
    return [statistics.median(times) for times in spent]


def linear_call(
    lib: ctypes.CDLL, tiles: fused_decode.Tiles, x: torch.Tensor, out: torch.Tensor
) -> Callable[[], object]:
    rows, k = x.shape
    scratch = torch.empty(lib.fused_linear_scratch_bytes(k, rows) + 64, dtype=torch.uint8)
    aligned = -scratch.data_ptr() % 64 + scratch.data_ptr()
    weights = (tiles.packed.data_ptr(), tiles.scales.data_ptr(), tiles.lows.data_ptr())
    return lambda: lib.fused_linear(
        *weights, tiles.bits, out.shape[1], k, x.data_ptr(), 0, rows, out.data_ptr(), aligned
    )


def linear_rows(libs: list[ctypes.CDLL]) -> list[str]:
    lines = ["| weights | n x k | rows | baseline us | this tree us | GMAC/s | speedup | same |"]
    lines.append("|---|---|---:|---:|---:|---:|---:|---|")
    torch.manual_seed(0)
    shapes = [(4, 960, 576), (4, 576, 576), (4, 3072, 576), (4, 576, 1536), (8, 49152, 576)]
    for bits, n, k in shapes:
        if bits == 4:
            scale, low = torch.rand(n, k // 32) / 100, -torch.rand(n, k // 32) / 10
            tiles = fused_decode.Tiles.int4(torch.randint(0, 16, (n, k)), scale, low)
        else:
            tiles = fused_decode.Tiles.int8(torch.randn(n, k))
        for rows in (1, 4, 16, 64):
            x = torch.randn(rows, k)
            outs = [torch.empty(rows, n) for _ in libs]
            calls = [linear_call(lib, tiles, x, out) for lib, out in zip(libs, outs, strict=True)]
            for call in calls:
                call()
            before, after = alternate(calls, max(1, 64 // rows))
            lines.append(
                f"| {bits}-bit | {n} x {k} | {rows} | {before * 1e6:.1f} | {after * 1e6:.1f} | "
                f"{n * k * rows / after / 1e9:.1f} | {before / after:.2f}x | "
                f"{torch.equal(outs[0], outs[1])} |"
            )
    return lines


def step_rows(libs: list[ctypes.CDLL], batches: list[int], steps: int) -> list[str]:
    lines = ["| decode step of | baseline p50 / p10 | this tree p50 / p10 | speedup at p50 |"]
    lines.append("|---:|---:|---:|---:|")
    model_path, build = resolve_model(""), fused_decode.build
    try:
        for batch in batches:
            prompts = make_prompts(model_path, batch, 128)
            engines = []
            for lib in libs:  # the head's FusedLinear asks build() for its library
                fused_decode.build = lambda lib=lib: lib  # type: ignore[assignment]
                runner, core = engine(model_path, "auto", prompts, WARMUP_STEPS + steps, "auto")
                if runner.fused is None:
                    raise SystemExit("the fused step does not serve here")
                runner.fused.decoder.lib = lib
                engines.append((lib, runner, core))
            spent: list[list[float]] = [[] for _ in engines]
            for i in range(WARMUP_STEPS + steps):
                for (lib, runner, core), times in zip(engines, spent, strict=True):
                    fused_decode.build = lambda lib=lib: lib  # type: ignore[assignment]
                    took = step(runner, core)
                    if i >= WARMUP_STEPS:
                        times.append(took)
            (b50, b10), (a50, a10) = [
                (statistics.median(t) * 1e3, sorted(t)[len(t) // 10] * 1e3) for t in spent
            ]
            lines.append(
                f"| {batch} | {b50:.1f} / {b10:.1f} ms | {a50:.1f} / {a10:.1f} ms | "
                f"{b50 / a50:.2f}x |"
            )
    finally:
        fused_decode.build = build
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="a git revision")
    parser.add_argument("--linear", action="store_true", help="fused_linear alone")
    parser.add_argument("--batch", type=int, nargs="+", default=[16])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fused-ab-") as folder:
        baseline = build_from(sources_at(args.baseline, Path(folder)))
    current = fused_decode.build()
    if current is None:
        raise SystemExit("this tree builds no fused kernel on this CPU")
    libs = [baseline, current]
    lines = linear_rows(libs) if args.linear else step_rows(libs, args.batch, args.steps)
    command = f"`python -m bench.fused_ab {' '.join(sys.argv[1:])}`"
    sys.stdout.write("\n".join([command, "", *lines]) + "\n")


if __name__ == "__main__":
    main()

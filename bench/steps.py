"""Decode-step time of several `--quantization` modes, interleaved step by step in one process.

    python bench/steps.py --batch 16 --modes none int4 w8a8_int8
    python bench/steps.py --batch 1 --modes none int4 --compile   # eager vs compiled
    python bench/steps.py --batch 16 --modes int4 --dtype float32 --paged-ab  # the kernel on/off
    python bench/steps.py --batch 64 --modes w8a8_int8 --kv-cache-dtypes auto bfloat16
    python bench/steps.py --batch 16 --modes int4 w8a8_int8 --w8a8-ab  # its C kernel on/off
    python bench/steps.py --batch 64 --modes w8a8_int8 --amx-ab  # the kernel's AMX tiles on/off
    python bench/steps.py --batch 16 --modes auto --fused-ab  # the fused decode step on/off

On a noisy VM two runs of the same engine can differ by 30%; alternating the modes' steps
lets them share the same noise. Each mode gets its own runner and `--batch` prompts of
--input-len tokens (as bench/engine.py), prefills them, takes --warmup decode steps, then
--steps timed decode steps per mode, one mode after another. Prints step ms p50 and p10.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import engine_core  # noqa: E402
from bench.serving import make_prompts  # noqa: E402
from shared.config import KV_CACHE_DTYPES, QUANTIZATIONS  # noqa: E402
from shared.model_files import resolve_model  # noqa: E402
from workers.scheduler.core.scheduler import Scheduler  # noqa: E402
from workers.scheduler.engine.model_runner import TorchModelRunner  # noqa: E402
from workers.scheduler.kernels.w8a8 import NO_AMX, build_kernel  # noqa: E402
from workers.scheduler.layers import quantization  # noqa: E402
from workers.scheduler.layers.attention_tuning import AttentionChoice  # noqa: E402


def engine(
    model_path: str,
    quantization: str,
    prompts: list[list[int]],
    steps: int,
    dtype: str,
    compile_max_bs: int = 0,
    kv_cache_dtype: str = "auto",
) -> tuple[TorchModelRunner, Scheduler]:
    blocks = len(prompts) * -(-(len(prompts[0]) + steps + 16) // 16)
    runner = TorchModelRunner.load(
        model_path,
        blocks,
        16,
        dtype,
        quantization=quantization,
        torch_compile_max_bs=compile_max_bs,
        kv_cache_dtype=kv_cache_dtype,
    )
    return runner, engine_core(runner, prompts, steps)


def without_w8a8_kernel() -> contextlib.AbstractContextManager[object]:
    """While loading: w8a8_int8's projections on fbgemm's path (`DynamicInt8`), as on a CPU
    the C kernel does not take."""
    return mock.patch.object(quantization, "kernel_fits", lambda weight, wide=False: False)


def without_amx_tiles() -> contextlib.AbstractContextManager[object]:
    """While loading: w8a8_int8's projections on the C kernel built without its AMX tiles."""
    return mock.patch.object(quantization, "build_kernel", lambda: build_kernel(NO_AMX))


def step(runner: TorchModelRunner, core: Scheduler) -> float:
    started = time.perf_counter()
    seqs = core.schedule()
    core.postprocess(seqs, runner.run(seqs))
    return time.perf_counter() - started


def ab_engines(
    args: argparse.Namespace, model_path: str, prompts: list[list[int]], total: int
) -> tuple[list[tuple[TorchModelRunner, Scheduler]], list[str]]:
    """The engines of --w8a8-ab, --amx-ab and --fused-ab, with their names."""
    engines: list[tuple[TorchModelRunner, Scheduler]] = []
    names: list[str] = []
    if args.w8a8_ab and "w8a8_int8" in args.modes:
        with without_w8a8_kernel():
            engines.append(engine(model_path, "w8a8_int8", prompts, total, args.dtype))
        names.append("w8a8_int8, fbgemm's path")
    if args.amx_ab and "w8a8_int8" in args.modes:
        with without_amx_tiles():
            engines.append(engine(model_path, "w8a8_int8", prompts, total, args.dtype))
        names.append("w8a8_int8, no AMX tiles")
    if args.fused_ab:
        for m in args.modes:
            runner, core = engine(model_path, m, prompts, total, args.dtype)
            runner.use_fused_step(0)
            engines.append((runner, core))
            names.append(f"{m}, torch forward for decode steps")
    return engines, names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--modes", nargs="+", choices=QUANTIZATIONS, default=list(QUANTIZATIONS))
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--compile", action="store_true", help="each mode eager and torch.compile'd (compiled.py)"
    )
    parser.add_argument(
        "--paged-ab",
        action="store_true",
        help="each mode with decode attention on torch's paths and on the paged kernel",
    )
    parser.add_argument(
        "--kv-cache-dtypes",
        nargs="+",
        choices=KV_CACHE_DTYPES,
        default=["auto"],
        help="each mode with each of these KV cache dtypes",
    )
    parser.add_argument(
        "--w8a8-ab",
        action="store_true",
        help="w8a8_int8 also with its projections on fbgemm's path instead of the C kernel",
    )
    parser.add_argument(
        "--amx-ab",
        action="store_true",
        help="w8a8_int8 also with its C kernel built without AMX tiles (CPUs with AMX-INT8)",
    )
    parser.add_argument(
        "--fused-ab",
        action="store_true",
        help="each mode also with decode steps on the torch forward, not the fused step",
    )
    args = parser.parse_args()
    if args.compile and args.paged_ab:
        parser.error("--paged-ab changes kernels after load, where compiled graphs are fixed")
    if args.kv_cache_dtypes != ["auto"] and (args.compile or args.paged_ab):
        parser.error("--kv-cache-dtypes goes alone (neither --compile nor --paged-ab)")
    model_path = resolve_model("")
    prompts = make_prompts(model_path, args.batch, args.input_len)
    total = 1 + args.warmup + args.steps  # the prefill, then decodes
    variants = [(m, 0, kv) for m in args.modes for kv in args.kv_cache_dtypes]
    if args.compile:
        variants += [(m, args.batch, "auto") for m in args.modes]
    engines = [engine(model_path, m, prompts, total, args.dtype, bs, kv) for m, bs, kv in variants]
    names = [
        f"{m}{' + torch.compile' if bs else ''}{f', kv {kv}' if kv != 'auto' else ''}"
        for m, bs, kv in variants
    ]
    if args.paged_ab:
        engines += [engine(model_path, m, prompts, total, args.dtype) for m in args.modes]
        names = [f"{m}, torch attention" for m in args.modes]
        names += [f"{m}, paged kernel" for m in args.modes]
        for i, (runner, _) in enumerate(engines):  # torch's paths as timed at load, or the kernel
            paged = i >= len(args.modes)
            runner.use_attention(AttentionChoice(True, runner.matmul_decodes, paged_decodes=paged))
    more_engines, more_names = ab_engines(args, model_path, prompts, total)
    engines += more_engines
    names += more_names
    for runner, core in engines:
        for _ in range(1 + args.warmup):
            step(runner, core)
    times: list[list[float]] = [[] for _ in engines]
    for _ in range(args.steps):
        for (runner, core), spent in zip(engines, times, strict=True):
            spent.append(step(runner, core))
    lines = [
        f"`python bench/steps.py {' '.join(sys.argv[1:])}`",
        "",
        "| mode | batch | step ms p50 | step ms p10 | tok/s at p50 |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, spent in zip(names, times, strict=True):
        p50, p10 = statistics.median(spent), sorted(spent)[len(spent) // 10]
        ms = f"{p50 * 1e3:.1f} | {p10 * 1e3:.1f}"
        lines.append(f"| {name} | {args.batch} | {ms} | {args.batch / p50:.1f} |")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

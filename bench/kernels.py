"""The CPU matmul kernels behind `--dtype` and `--quantization`, on the default model's shapes.

    python bench/kernels.py --tokens 1 4 16 64 256

Times one pass over 30 layers' projections (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536: 120 distinct weights, so they are cache-cold as in the model) for each
number of tokens per step, median of 5. Kernels: fp32 and bf16 `F.linear`; bf16 with the
weights prepacked in oneDNN's layout (what a bf16 runner uses,
workers/scheduler/layers/prepacked.py; skipped where oneDNN has no bf16); torch's
weight-only packed int8 (per channel) and int4 (groups of 32) kernels with bf16
activations (their fp32-activation paths are ~10x slower); fbgemm's dynamic int8
(activations quantized per tensor: fast, but alone 119/160 top-1 agreement with fp32 on the
real model); and `--quantization w8a8_int8`'s whole projections as the model runs them
(bf16 activations, smoothing and 16 outlier channels from a calibration input): fbgemm's
GEMM inside torch ops (`DynamicInt8`), and the C kernel (workers/scheduler/kernels/w8a8.py,
where the CPU has AVX512-VNNI or AVX2; where it has AMX-INT8 too, also built without its
AMX tiles); and the C kernel's W8A16 projection (16-bit
activations, 8-bit weights: `w8a8_int8`'s down_proj, where the CPU has AVX2).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from workers.scheduler.kernels.w8a8 import NO_AMX, build_kernel, kernel_fits  # noqa: E402
from workers.scheduler.layers.prepacked import PrepackedLinear, can_prepack  # noqa: E402
from workers.scheduler.layers.quantization import (  # noqa: E402
    INT4_GROUP_SIZE,
    DynamicInt8,
    int4_groups,
    int8_channels,
    w8a8_projection,
)

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
NUM_LAYERS = 30

Kernel = Callable[[torch.Tensor], torch.Tensor]


def _int4(weight: torch.Tensor) -> Kernel:
    packed, scales = int4_groups(weight, INT4_GROUP_SIZE)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), packed, INT4_GROUP_SIZE, scales
    )


def _int8(weight: torch.Tensor) -> Kernel:
    q, scales = int8_channels(weight)
    scales = scales.to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q, scales)


def _fbgemm_dynamic(weight: torch.Tensor) -> Kernel:
    scale = (weight.abs().amax(1) / 127).double()
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13
        warnings.simplefilter("ignore")
        zero = torch.zeros(weight.shape[0], dtype=torch.long)
        q = torch.quantize_per_channel(weight, scale, zero, 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(q, None)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)


def _w8a8(make: Callable[[torch.Tensor, torch.Tensor], nn.Module]) -> Callable[..., Kernel]:
    def build(weight: torch.Tensor) -> Kernel:
        calibration = torch.randn(64, weight.shape[1]).abs().amax(0)
        projection = make(weight.to(torch.bfloat16), calibration)
        return lambda x: projection(x.to(torch.bfloat16))

    return build


def _prepacked_bf16(weight: torch.Tensor) -> Kernel:
    dense = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    dense.weight.data = weight.to(torch.bfloat16)
    packed = PrepackedLinear(dense)
    return lambda x: packed(x.to(torch.bfloat16))


def _dense(dtype: torch.dtype) -> Callable[[torch.Tensor], Kernel]:
    def make(weight: torch.Tensor) -> Kernel:
        w = weight.to(dtype)
        return lambda x: F.linear(x.to(dtype), w)

    return make


KERNELS: dict[str, Callable[[torch.Tensor], Kernel]] = {
    "fp32 F.linear": _dense(torch.float32),
    "bf16 F.linear": _dense(torch.bfloat16),
    "bf16 prepacked (oneDNN layout)": _prepacked_bf16,
    "int8 weight-only (_weight_int8pack_mm)": _int8,
    "int4 weight-only g32 (_weight_int4pack_mm_for_cpu)": _int4,
    "fbgemm dynamic int8 (per-tensor activations)": _fbgemm_dynamic,
    "W8A8 projection: fbgemm in torch ops (DynamicInt8)": _w8a8(DynamicInt8),
    "W8A8 projection: C kernel (AVX512-VNNI or AVX2; AMX tiles where the CPU has them)": _w8a8(
        w8a8_projection
    ),
    "W8A8 projection: C kernel without AMX tiles": _w8a8(
        lambda weight, calibration: w8a8_projection(weight, calibration, build_kernel(NO_AMX))
    ),
    "W8A16 projection: C kernel (AVX2)": _w8a8(functools.partial(w8a8_projection, wide=True)),
}


def _has_amx() -> bool:
    lib = build_kernel()
    return lib is not None and bool(lib.w8a8_amx())


def time_pass(kernels: list[Kernel], inputs: list[torch.Tensor], repeats: int = 5) -> float:
    def one_pass() -> None:
        for i, kernel in enumerate(kernels):
            kernel(inputs[i % len(SHAPES)])

    one_pass()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--num-threads", type=int, default=0, help="0 = torch default")
    args = p.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for _ in range(NUM_LAYERS) for n, k in SHAPES]
    lines = [
        f"`python {' '.join(sys.argv)}` (ms per pass over {len(weights)} projections, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()})",
        "",
        "| kernel | " + " | ".join(f"{m} tok" for m in args.tokens) + " |",
        "|---|" + "---:|" * len(args.tokens),
    ]
    for name, make in KERNELS.items():
        if make is _prepacked_bf16 and not can_prepack(weights[0].to(torch.bfloat16)):
            continue
        if "C kernel" in name and not kernel_fits(weights[0], wide="W8A16" in name):
            continue
        if "without AMX" in name and not _has_amx():
            continue
        kernels = [make(w) for w in weights]
        row = []
        for m in args.tokens:
            inputs = [torch.randn(m, k) for _, k in SHAPES]
            row.append(f"{time_pass(kernels, inputs):.1f}")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
        sys.stderr.write(lines[-1] + "\n")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

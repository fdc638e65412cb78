"""The scheduler engine alone (Scheduler + TorchModelRunner; no HTTP, no Redis), beside
Hugging Face `generate()` on the same prompts.

    python bench/engine.py --dtype auto --batch 1 4 16 64 --input-len 128 --output-len 128
    python bench/engine.py --device cuda --cuda-graph-max-bs 64 --skip-hf   # CUDA graphs

Each batch size runs `batch` prompts of exactly --input-len tokens (the text of
bench/serving.py, rotated so prompts differ) for exactly --output-len tokens, greedy, EOS
ignored: one prefill step of the whole batch, then one decode step per token. HF gets the
same token ids as one batch (equal lengths: no padding), greedy, max_new_tokens =
min_new_tokens = --output-len, in the same dtype. Prints a markdown table: output tok/s
(batch * output-len / wall time), prefill s (the engine's first step; HF: time to its first
token), decode step ms p50 (HF: the rest of the wall time per token). On CUDA a step's
time includes reading its sampled tokens back, which waits for the GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.serving import make_prompts  # noqa: E402
from shared.model_files import resolve_model  # noqa: E402
from shared.protocol import SamplingParams  # noqa: E402
from workers.scheduler.core.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from workers.scheduler.core.sequence import Sequence  # noqa: E402
from workers.scheduler.engine.model_runner import DTYPES, TorchModelRunner, resolve_dtype  # noqa: E402


def engine_core(runner: TorchModelRunner, prompts: list[list[int]], output_len: int) -> Scheduler:
    """A scheduler holding `prompts`, each to decode exactly `output_len` tokens greedily, in
    one batch (also bench/steps.py's)."""
    config = SchedulerConfig(
        num_kv_blocks=runner.num_kv_blocks,
        vocab_size=runner.vocab_size,
        max_model_len=len(prompts[0]) + output_len + runner.block_size,
        block_size=runner.block_size,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=len(prompts) * len(prompts[0]),
        enable_prefix_caching=False,
        eos_token_ids=frozenset(),
    )
    core = Scheduler(config, decode_tail=lambda ids: "")
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True)
        assert core.add(Sequence(f"r{i}", list(ids), params)) is None
    return core


def run_engine(
    runner: TorchModelRunner, prompts: list[list[int]], output_len: int
) -> dict[str, float]:
    core = engine_core(runner, prompts, output_len)
    steps: list[float] = []
    started = time.perf_counter()
    while not core.is_idle:
        t = time.perf_counter()
        seqs = core.schedule()
        core.postprocess(seqs, runner.run(seqs))
        steps.append(time.perf_counter() - t)
    wall = time.perf_counter() - started
    return {
        "tok_s": len(prompts) * output_len / wall,
        "prefill_s": steps[0],
        "step_ms": statistics.median(steps[1:]) * 1000 if len(steps) > 1 else 0.0,
    }


def run_hf(model: Any, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    input_ids = torch.tensor(prompts, device=model.device)
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "do_sample": False,
        "pad_token_id": 0,
    }
    with torch.inference_mode():
        started = time.perf_counter()
        model.generate(**kwargs, max_new_tokens=1, min_new_tokens=1)
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        out = model.generate(**kwargs, max_new_tokens=output_len, min_new_tokens=output_len)
        wall = time.perf_counter() - started
    assert out.shape[1] == input_ids.shape[1] + output_len
    return {
        "tok_s": len(prompts) * output_len / wall,
        "prefill_s": prefill,
        "step_ms": (wall - prefill) / max(1, output_len - 1) * 1000,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="", help="HF folder (default: the packaged SmolLM2)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--quantization", default="none", help="none or int4 (the engine only)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--cuda-graph-max-bs", type=int, default=0, help="CUDA: decode batches graphed (0 = none)"
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-threads", type=int, default=0, help="0 = torch default")
    p.add_argument("--skip-hf", action="store_true", help="the engine only")
    args = p.parse_args()

    model_path = resolve_model(args.model)
    dtype = resolve_dtype(args.dtype, args.device)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    max_tokens = max(args.batch) * (args.input_len + args.output_len + 16)
    runner = TorchModelRunner.load(
        model_path,
        -(-max_tokens // 16),
        16,
        dtype,
        args.device,
        quantization=args.quantization,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
    )
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype])
        hf = hf.to(args.device).eval()

    warmup = make_prompts(model_path, 2, args.input_len)
    run_engine(runner, warmup, 4)  # first-call costs (allocator, oneDNN primitives)
    rows = []
    for batch in args.batch:
        prompts = make_prompts(model_path, batch, args.input_len)
        rows.append(("redserve engine", batch, run_engine(runner, prompts, args.output_len)))
        sys.stderr.write(f"engine batch {batch}: {rows[-1][2]}\n")
        if hf is not None:
            rows.append(("HF generate()", batch, run_hf(hf, prompts, args.output_len)))
            sys.stderr.write(f"HF batch {batch}: {rows[-1][2]}\n")

    command = " ".join(["python", *sys.argv])
    lines = [
        f"`{command}` ({dtype} on {args.device}, quantization {args.quantization}, "
        f"{torch.get_num_threads()} threads, {args.input_len} in / {args.output_len} out, "
        f"torch {torch.__version__}"
        + (f", CUDA graphs up to batch {args.cuda_graph_max_bs})" if runner.graphs else ")"),
        "",
        "| engine | batch | output tok/s | prefill s | decode step ms p50 |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, batch, r in rows:
        lines.append(
            f"| {name} | {batch} | {r['tok_s']:.1f} | {r['prefill_s']:.3f} | {r['step_ms']:.1f} |"
        )
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""Steps with a prefill chunk through the fused C step and through the torch forward, in one
process, alternating (the default mode on the packaged GGUF):

    python -m bench.fused_prefill
    python -m bench.fused_prefill --shapes 0:128:15 512:512:0 --rounds 9

Each shape is context:chunk:decodes[:prompts]: `prompts` prompts' (default 1) chunks of
`chunk` tokens after `context` cached ones, beside `decodes` sequences decoding at position
192. Prints each path's best step, the positions the chunks' rows attend to on average, and
whether a served step of that shape takes the fused step (fused_step.MAX_MEAN_CONTEXT). A
step of more than --split-rows rows is also run as fused calls of at most that many
(`FusedStep.parts`, as a served step does where splitting was timed faster at load).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serving import make_prompts  # noqa: E402
from shared.model_files import resolve_model  # noqa: E402
from shared.protocol import SamplingParams  # noqa: E402
from workers.scheduler.core.sequence import Sequence  # noqa: E402
from workers.scheduler.engine import fused_step  # noqa: E402
from workers.scheduler.engine.model_runner import TorchModelRunner  # noqa: E402

SHAPES = (
    "0:32:0",
    "0:128:0",
    "0:128:15",
    "0:128:0:4",
    "0:256:0",
    "256:256:0",
    "0:512:0",
    "512:512:0",
    "1536:512:0",
    "1000:64:0",
    "1024:96:8",
)
DECODE_AT = 192


def step_of(prompt: list[int], shape: tuple[int, ...]) -> list[Sequence]:
    """The chunks' sequences in blocks 0.., then each decode in 13 blocks of its own."""
    context, chunk, decodes, prompts = (*shape, 1)[:4]
    seqs, first = [], 0
    for i in range(prompts):
        seq = Sequence(f"chunk-{i}", prompt[i : i + context + chunk], SamplingParams())
        seq.block_table = list(range(first, first + -(-(context + chunk) // 16)))
        seq.num_computed_tokens, seq.num_new_tokens = context, chunk
        seqs.append(seq)
        first += len(seq.block_table)
    for i in range(decodes):
        decode = Sequence(f"decode-{i}", prompt[: DECODE_AT + 1], SamplingParams())
        decode.block_table = list(range(first + 13 * i, first + 13 * (i + 1)))
        decode.num_computed_tokens, decode.num_new_tokens = DECODE_AT, 1
        seqs.append(decode)
    return seqs


def mean_context(seqs: list[Sequence]) -> float:
    """Positions the step's chunk rows attend to, on average."""
    chunks = [seq for seq in seqs if seq.num_new_tokens > 1]
    return fused_step.attended(chunks) / sum(seq.num_new_tokens for seq in chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--split-rows", type=int, default=fused_step.PREFILL_TIMED_ROWS[-1])
    args = parser.parse_args()
    shapes = [tuple(int(n) for n in shape.split(":")) for shape in args.shapes]
    seqs_of = {shape: step_of(list(range(1, 4096)), shape) for shape in shapes}
    blocks = max(max(b for seq in seqs for b in seq.block_table) + 1 for seqs in seqs_of.values())
    rows = max(sum(seq.num_new_tokens for seq in seqs) for seqs in seqs_of.values())
    model_path = resolve_model("")
    runner = TorchModelRunner.load(model_path, blocks, 16, "auto", quantization="auto")
    fused = fused_step.FusedStep.of(runner.model, runner.kv_cache, 16, rows)
    runner.use_fused_step(0)  # runner.forward: the torch forward alone
    if fused is None:
        sys.exit("the fused step does not run on this machine")
    taker = fused_step.FusedStep(fused.decoder, 16)  # whether a served step would take it
    taker.prefill_rows = rows
    split = fused_step.FusedStep(fused.decoder, 16)
    split.prefill_rows, split.split_steps = args.split_rows, True
    prompt = make_prompts(model_path, 1, 4096)[0]
    out = sys.stdout
    out.write(
        "| prompts x (context + chunk) | decodes | mean context | torch | fused | ratio | taken "
        f"| split ({args.split_rows} rows) |\n"
    )
    out.write("|---|---:|---:|---:|---:|---:|---|---:|\n")
    for shape in shapes:
        seqs = step_of(prompt, shape)
        context, chunk, decodes, prompts = (*shape, 1)[:4]
        parts = split.parts(seqs) if sum(q.num_new_tokens for q in seqs) > args.split_rows else None
        paths = {"torch": runner.forward, "fused": fused}
        if parts is not None:
            paths["split"] = functools.partial(split, parts=parts)
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(args.rounds):
            for name, forward in paths.items():
                started = time.perf_counter()
                forward(seqs)
                best[name] = min(best[name], time.perf_counter() - started)
        split_cell = f"{best['split'] * 1e3:.1f} ms" if parts else "-"
        out.write(
            f"| {prompts} x ({context} + {chunk}) | {decodes} | {mean_context(seqs):.0f} "
            f"| {best['torch'] * 1e3:.1f} ms | {best['fused'] * 1e3:.1f} ms "
            f"| {best['torch'] / best['fused']:.2f}x | {'yes' if taker.takes(seqs) else 'no'} "
            f"| {split_cell} |\n"
        )
        out.flush()


if __name__ == "__main__":
    main()

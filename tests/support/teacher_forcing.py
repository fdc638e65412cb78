"""Teacher forcing for the tolerance tests of the faster modes (bf16, int4) against the
fp32 reference on the real SmolLM2 (the engine's decode path).

Five prompts decode together, batched, for STEPS tokens along the fp32 greedy trajectory:
every mode is fed the same tokens, so each step compares the next-token predictions of the
same context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.protocol import SamplingParams
from workers.scheduler.core.scheduler import Scheduler, SchedulerConfig
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine.model_runner import TorchModelRunner

STEPS = 32
TEXTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, in a small village, there lived",
    "1, 2, 3, 4, 5,",
    "Water boils at a temperature of",
]


def teacher_forced(
    runner: TorchModelRunner, prompts: list[list[int]], forced: list[list[int]] | None
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Decode all prompts together for STEPS tokens, appending `forced` (or, if None, the
    greedy argmax); the tokens appended and each step's log-softmax rows, per prompt."""
    config = SchedulerConfig(
        num_kv_blocks=runner.num_kv_blocks,
        vocab_size=runner.vocab_size,
        max_model_len=1024,
        block_size=runner.block_size,
        max_num_batched_tokens=4096,
        eos_token_ids=frozenset(),
    )
    core = Scheduler(config, decode_tail=lambda ids: "")
    seqs = [
        Sequence(f"r{i}", ids, SamplingParams(max_new_tokens=STEPS, temperature=0))
        for i, ids in enumerate(prompts)
    ]
    for seq in seqs:
        assert core.add(seq) is None
    tokens: list[list[int]] = [[] for _ in prompts]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(STEPS):
        batch = core.schedule()
        assert len(batch) == len(seqs)
        with torch.inference_mode():
            hidden, attention = runner.forward(batch)
            logprobs = runner.model.compute_logits(hidden[attention.last_index]).log_softmax(-1)
        step_tokens = []
        for seq, row in zip(batch, logprobs, strict=True):
            i = seqs.index(seq)
            token = forced[i][step] if forced else int(row.argmax())
            tokens[i].append(token)
            rows[i].append(row)
            step_tokens.append(token)
        core.postprocess(batch, step_tokens)
    return tokens, rows


@dataclass
class Reference:
    """The fp32 runs every mode is compared with: prompts, greedy tokens, log-softmax rows."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    rows: list[list[torch.Tensor]]


def fp32_reference(model_path: str) -> Reference:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = [list(tokenizer(t)["input_ids"]) for t in TEXTS]
    fp32 = TorchModelRunner.load(model_path, 64, 16, dtype="float32")
    tokens, rows = teacher_forced(fp32, prompts, None)
    return Reference(prompts, tokens, rows)


@dataclass
class Agreement:
    top1: int
    total: int
    mean_error: float  # mean |logprob error| of the reference's greedy token
    max_error: float

    def __str__(self) -> str:
        return (
            f"top-1 {self.top1}/{self.total}, mean |logprob error| {self.mean_error:.4f}, "
            f"max {self.max_error:.3f}"
        )


def agreement(reference: Reference, runner: TorchModelRunner, alone: bool = False) -> Agreement:
    """`runner` fed the reference's tokens, scored against the reference's predictions;
    `alone`: each prompt decoded on its own (one-token steps), not batched."""
    if alone:
        rows = [
            teacher_forced(runner, [prompt], [tokens])[1][0]
            for prompt, tokens in zip(reference.prompts, reference.tokens, strict=True)
        ]
    else:
        _, rows = teacher_forced(runner, reference.prompts, reference.tokens)
    top1, errors = 0, []
    for tokens, ref, low in zip(reference.tokens, reference.rows, rows, strict=True):
        for token, ref_row, row in zip(tokens, ref, low, strict=True):
            assert row.dtype == torch.float32  # logits stay fp32
            top1 += int(row.argmax()) == token
            errors.append(abs(float(row[token]) - float(ref_row[token])))
    return Agreement(top1, len(errors), sum(errors) / len(errors), max(errors))

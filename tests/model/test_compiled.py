"""Decode steps through torch.compile (`--enable-torch-compile`) against eager, on a tiny
random-weight model: same hidden states, same greedy tokens, and the compiled graphs are
the ones that ran."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from shared.protocol import SamplingParams
from tests.support.decoding import decode_steps
from tests.support.engine import run_core
from tests.support.models import SMALL, saved_random_model
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine import kernel_choices
from workers.scheduler.engine.model_runner import TorchModelRunner
from workers.scheduler.kernels import paged_decode
from workers.scheduler.kernels.paged_decode import kernel_library
from workers.scheduler.layers.attention_tuning import AttentionChoice
from workers.scheduler.layers.prepacked import PrepackedLinear, can_prepack

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 24


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3Config

    # q/k norms: the most ops per layer of our families; contexts of up to 256 tokens.
    small = {**SMALL, "max_position_embeddings": 256}
    config = Qwen3Config(**small, head_dim=16, tie_word_embeddings=True)
    return saved_random_model(tmp_path_factory, "qwen3", config, weight_std=0.1)


@pytest.fixture(scope="module")
def runners(folder: Path) -> tuple[TorchModelRunner, TorchModelRunner]:
    eager = TorchModelRunner.load(str(folder), NUM_KV_BLOCKS, BLOCK_SIZE)
    compiled = TorchModelRunner.load(str(folder), NUM_KV_BLOCKS, BLOCK_SIZE, torch_compile_max_bs=2)
    return eager, compiled


def test_warm_up_compiles_every_batch_size_at_load(
    runners: tuple[TorchModelRunner, TorchModelRunner],
) -> None:
    eager, compiled = runners
    assert eager.compiled is None
    assert compiled.compiled is not None and compiled.compiled.max_batch == 2
    assert compiled.compiled.calls == 4  # sizes 1 and 2, two context lengths each
    assert counters["stats"]["unique_graphs"] >= 2  # the counter the other tests watch


def test_compiled_decode_steps_give_the_eager_hidden_states(
    runners: tuple[TorchModelRunner, TorchModelRunner],
) -> None:
    prompts = [[5, 9, 2, 7] * 5, [3, 1, 4, 1, 5, 9, 2, 6, 5]]  # 20 and 9 tokens
    hidden, graphs = {}, counters["stats"]["unique_graphs"]
    for name, runner in zip(("eager", "compiled"), runners, strict=True):
        # prefill eager in both; contexts cross the block boundaries at 32 and 16
        hidden[name] = decode_steps(
            runner, lambda seqs, r=runner: r.forward(seqs)[0], prompts, batch_sizes=(1, 2, 2)
        )
    torch.testing.assert_close(hidden["compiled"], hidden["eager"], rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs  # contexts of 1-3 blocks, no compile


def test_compiled_greedy_tokens_equal_eager_through_the_scheduler(
    runners: tuple[TorchModelRunner, TorchModelRunner],
) -> None:
    """Three requests of different lengths: prefills and mixed steps (eager), three
    decodes at once (eager, above the compiled sizes), then two and one (compiled)."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (14, 5, 20)]
    sampling = [
        SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (40, 24, 30)
    ]
    eager, compiled = runners
    assert compiled.compiled is not None
    before, graphs = compiled.compiled.calls, counters["stats"]["unique_graphs"]
    config = {"num_kv_blocks": NUM_KV_BLOCKS, "vocab_size": 128}
    outputs = {
        name: [seq.output_ids for seq in run_core(runner, prompts, sampling, [0, 0, 6], **config)]
        for name, runner in (("eager", eager), ("compiled", compiled))
    }
    assert outputs["compiled"] == outputs["eager"]
    assert [len(o) for o in outputs["eager"]] == [40, 24, 30]
    assert compiled.compiled.calls - before > 20
    # Every context length ran on the graphs compiled at load: nothing compiled while serving.
    assert counters["stats"]["unique_graphs"] == graphs


def test_one_graph_serves_every_batch_size_from_two(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A graph for one sequence and one, with a dynamic batch, for 2 to `max_batch` (a graph
    per size took 25-35 s each on 2 cores); every size runs compiled, as eager.
    A Llama, not the Qwen3 of the other tests: its graphs are this test's own to count."""
    from transformers import LlamaConfig

    config = LlamaConfig(**{**SMALL, "max_position_embeddings": 256})
    folder = saved_random_model(tmp_path_factory, "llama", config, weight_std=0.1)
    eager = TorchModelRunner.load(str(folder), NUM_KV_BLOCKS, BLOCK_SIZE)
    graphs = counters["stats"]["unique_graphs"]
    compiled = TorchModelRunner.load(str(folder), NUM_KV_BLOCKS, BLOCK_SIZE, torch_compile_max_bs=5)
    assert compiled.compiled is not None and compiled.compiled.calls == 10
    assert counters["stats"]["unique_graphs"] - graphs == 2
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (20, 9, 33, 4, 15)]
    hidden = {}
    with torch.compiler.set_stance("fail_on_recompile"):
        for name, runner in (("eager", eager), ("compiled", compiled)):
            step = lambda seqs, r=runner: r.forward(seqs)[0]  # noqa: E731
            hidden[name] = decode_steps(runner, step, prompts, (5, 3, 4, 2, 1))
    torch.testing.assert_close(hidden["compiled"], hidden["eager"], rtol=1e-4, atol=1e-4)
    assert compiled.compiled.calls == 10 + 20


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [("bfloat16", "auto"), ("float32", "bf16")])
@pytest.mark.parametrize("paged", [False, True])
def test_compiled_decode_keeps_the_prepacked_projections_the_kernel_and_the_bf16_cache(
    folder: Path, paged: bool, dtype: str, kv_cache_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 projections are prepacked (prepacked.py); Inductor's own lowering of that call
    wanted frozen weights and failed at load. Compiled steps must run them, and the paged
    decode kernel where chosen (a custom op to Inductor), and give the eager bf16 hidden
    states. An fp32 model over a bf16 cache (`--kv-cache-dtype bf16`): the compiled cache
    writes round as eager's do."""
    if dtype == "bfloat16" and not can_prepack(torch.zeros(1, dtype=torch.bfloat16)):
        pytest.skip("no oneDNN bf16 on this CPU")
    if paged and kernel_library() is None:
        pytest.skip("no C compiler here: the paged decode kernel is not built")
    choice = AttentionChoice(upcast_sdpa=True, matmul_decodes=True, paged_decodes=paged)
    monkeypatch.setattr(kernel_choices, "choose_attention", lambda *_: choice)
    eager, compiled = (
        TorchModelRunner.load(
            str(folder),
            NUM_KV_BLOCKS,
            BLOCK_SIZE,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            torch_compile_max_bs=max_bs,
        )
        for max_bs in (0, 1)
    )
    assert compiled.kv_cache[0][0].dtype == torch.bfloat16
    assert isinstance(compiled.model.lm_head, PrepackedLinear) is (dtype == "bfloat16")
    kernel_runs: list[int] = []
    run = paged_decode._run
    monkeypatch.setattr(paged_decode, "_run", lambda *a: kernel_runs.append(1) or run(*a))
    hidden = []
    for runner in (eager, compiled):
        kernel_runs.clear()
        seq = Sequence("r", [5, 9, 2, 7] * 5, SamplingParams(temperature=0))
        seq.block_table, seq.num_new_tokens = [0, 1, 2], 20
        runner.forward([seq])
        steps = []
        for token in range(8):
            seq.num_computed_tokens += seq.num_new_tokens
            seq.append_token(token)
            seq.num_new_tokens = 1
            steps.append(runner.forward([seq])[0].float())
        hidden.append(torch.cat(steps))
    assert compiled.compiled is not None and compiled.compiled.calls == 2 + 8
    assert len(kernel_runs) == (8 * len(compiled.model.layers) if paged else 0)
    error = (hidden[1] - hidden[0]).abs().max() / hidden[0].abs().max()
    assert error < (0.03 if dtype == "bfloat16" else 1e-4), error


def test_a_restart_with_another_cache_size_takes_the_graphs_from_disk(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KV cache's size follows the free memory at start; the graphs must not depend on
    it, or a restart compiles them all again instead of reading Inductor's disk cache."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    def start(num_kv_blocks: int) -> tuple[int, int]:
        torch._dynamo.reset()  # a fresh process, as far as dynamo knows
        hits = counters["inductor"]["fxgraph_cache_hit"]
        misses = counters["inductor"]["fxgraph_cache_miss"]
        TorchModelRunner.load(str(folder), num_kv_blocks, BLOCK_SIZE, torch_compile_max_bs=1)
        return (
            counters["inductor"]["fxgraph_cache_hit"] - hits,
            counters["inductor"]["fxgraph_cache_miss"] - misses,
        )

    first_hits, first_misses = start(NUM_KV_BLOCKS)
    assert first_misses >= 1
    hits, misses = start(NUM_KV_BLOCKS + 13)
    assert (hits, misses) == (first_hits + first_misses, 0)

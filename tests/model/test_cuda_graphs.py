"""Graphed decode steps (cuda_graphs.py) on a tiny random-weight model.

On the CPU the recorded steps are run as plain calls over the static buffers: that checks
the buckets, the padding rows and the buffers against eager steps, and that no op inside a
step reads a value back to the host (which would break a CUDA graph capture). The capture
and replay themselves run only where CUDA is (the last test; bench/device_check.sh)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shared.protocol import SamplingParams
from tests.support.decoding import decode_steps
from tests.support.engine import run_core
from tests.support.models import SMALL, saved_random_model
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine.cuda_graphs import (
    SYNCING_OPS,
    GraphedDecode,
    batch_buckets,
    bucket_for,
    context_buckets,
)
from workers.scheduler.engine.model_runner import TorchModelRunner

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 24
MAX_BATCH = 4  # buckets 1, 2, 4: 3 decodes pad to 4, a step of 5 stays eager


def test_buckets() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(1) == [1]
    assert context_buckets(2, 512) == [2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert context_buckets(2, 100) == [2, 4, 8, 16, 32, 64, 100]
    assert context_buckets(2, 2) == [2]
    assert [bucket_for(n, [1, 2, 4, 8]) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(**{**SMALL, "max_position_embeddings": 256}, tie_word_embeddings=False)
    return saved_random_model(tmp_path_factory, "llama", config, weight_std=0.1)


def record_as_call(step: Callable[[], None]) -> Callable[[], None]:
    """A step "recorded" as the step itself: run once, as `cuda_capture` runs it before
    the capture; a replay runs it again over the buffers, as a CUDA graph its kernels."""
    step()
    return step


def recorded_as_calls(runner: TorchModelRunner) -> GraphedDecode:
    graphs = runner.graphed_decode(MAX_BATCH)
    graphs.capture_all(record_as_call)
    runner.graphs = graphs
    return graphs


def test_every_bucket_is_recorded(folder: Path) -> None:
    runner = TorchModelRunner.load(str(folder), NUM_KV_BLOCKS, BLOCK_SIZE)
    assert runner.graphs is None  # CPU: nothing is recorded at load
    graphs = recorded_as_calls(runner)
    # contexts up to the model's 256 positions = 16 blocks (the cache has 24)
    assert graphs.batch_sizes == [1, 2, 4] and graphs.block_counts == [2, 4, 8, 16]
    assert len(graphs.replays) == 12
    assert runner.kv_cache[0][0].shape[1] == (NUM_KV_BLOCKS + 1) * BLOCK_SIZE  # + padding
    # The steps run while recording wrote the padding block only, and nothing that is NaN.
    owned = NUM_KV_BLOCKS * BLOCK_SIZE
    for k, v in runner.kv_cache:
        assert k[:, :owned].count_nonzero() == v[:, :owned].count_nonzero() == 0
        assert k[:, owned].count_nonzero() > 0 and k.isfinite().all() and v.isfinite().all()


def test_graphed_greedy_tokens_equal_eager_through_the_scheduler(folder: Path) -> None:
    """Five requests arriving apart: prefills and mixed steps (eager), decodes of 1-4
    sequences (graphed; 3 padded to 4) and of 5 (eager), contexts of 1 to 7 blocks; a
    cache small enough that requests are preempted and recomputed."""
    gen = torch.Generator().manual_seed(3)
    lengths = (14, 5, 33, 9, 20)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in lengths]
    sampling = [
        SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
        for n in (60, 24, 70, 40, 30)
    ]
    eager = TorchModelRunner.load(str(folder), NUM_KV_BLOCKS, BLOCK_SIZE)
    graphed = TorchModelRunner.load(str(folder), NUM_KV_BLOCKS, BLOCK_SIZE)
    graphs = recorded_as_calls(graphed)
    config: dict[str, Any] = {"num_kv_blocks": 10, "vocab_size": 128}
    arrivals = [0, 0, 6, 30, 31]
    outputs = {
        name: run_core(runner, prompts, sampling, arrivals, **config)
        for name, runner in (("eager", eager), ("graphed", graphed))
    }
    assert [s.output_ids for s in outputs["graphed"]] == [s.output_ids for s in outputs["eager"]]
    assert [len(s.output_ids) for s in outputs["eager"]] == [60, 24, 70, 40, 30]
    assert sum(s.num_preemptions for s in outputs["eager"]) > 0
    assert graphs.calls > 60


def test_graphed_steps_give_the_eager_hidden_states_and_cache(folder: Path) -> None:
    eager = TorchModelRunner.load(str(folder), NUM_KV_BLOCKS, BLOCK_SIZE)
    graphed = TorchModelRunner.load(str(folder), NUM_KV_BLOCKS, BLOCK_SIZE)
    graphs = recorded_as_calls(graphed)
    # Contexts cross the block boundaries at 16 and 32; a batch of 3 pads to the bucket of 4.
    prompts = [[5, 9, 2, 7] * 5, [3, 1, 4, 1, 5, 9, 2, 6, 5], [8] * 30]
    expected = decode_steps(
        eager, lambda seqs: eager.forward(seqs)[0].clone(), prompts, batch_sizes=(3, 1, 2)
    )
    got = decode_steps(graphed, lambda seqs: graphs(seqs)[0].clone(), prompts, (3, 1, 2))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    owned = 12 * BLOCK_SIZE  # the sequences' blocks; padding rows wrote only the padding block
    for (k, v), (k_ref, v_ref) in zip(graphed.kv_cache, eager.kv_cache, strict=True):
        torch.testing.assert_close(k[:, :owned], k_ref[:, :owned], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v[:, :owned], v_ref[:, :owned], rtol=1e-5, atol=1e-5)
        assert k[:, owned : NUM_KV_BLOCKS * BLOCK_SIZE].count_nonzero() == 0
    assert graphed.kv_cache[0][0][:, graphed.padding_block * BLOCK_SIZE].count_nonzero() > 0


class OpNames(TorchDispatchMode):
    """Records the name of every aten op that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.add(func._schema.name.removeprefix("aten::"))
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def test_no_op_of_a_recorded_step_reads_values_back_to_the_host(folder: Path) -> None:
    """A CUDA graph capture fails on an op that syncs with the host; every bucket's step
    must have none. The eager step does (the check can fail)."""
    runner = TorchModelRunner.load(str(folder), NUM_KV_BLOCKS, BLOCK_SIZE)
    graphs = runner.graphed_decode(MAX_BATCH)
    for key in graphs.buckets():
        with OpNames() as ops:
            graphs.step_function(*key)()
        assert "index_copy_" in ops.names and not ops.names & SYNCING_OPS, key
    seq = Sequence("r", [1, 2, 3], SamplingParams())
    seq.block_table, seq.num_computed_tokens, seq.num_new_tokens = [0], 2, 1
    with OpNames() as ops:
        runner.forward([seq])
    assert ops.names & SYNCING_OPS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_replay_the_eager_greedy_tokens(folder: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (14, 5, 33, 9)]
    sampling = [SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)] * 4
    runners = {
        name: TorchModelRunner.load(
            str(folder), NUM_KV_BLOCKS, BLOCK_SIZE, "float32", "cuda", cuda_graph_max_bs=max_bs
        )
        for name, max_bs in (("eager", 0), ("graphed", MAX_BATCH))
    }
    graphs = runners["graphed"].graphs
    assert runners["eager"].graphs is None and graphs is not None
    assert len(graphs.replays) == 12
    outputs = {
        name: [s.output_ids for s in run_core(runner, prompts, sampling, [0, 0, 6, 30])]
        for name, runner in runners.items()
    }
    assert outputs["graphed"] == outputs["eager"]
    assert graphs.calls > 30

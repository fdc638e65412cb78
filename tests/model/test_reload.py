"""`TorchModelRunner.reload` on tiny random-weight checkpoints: after a reload the runner's
greedy tokens are those of a runner loaded from the new checkpoint, on the same KV cache
tensors; a checkpoint that is missing, incomplete or of another shape raises and leaves the
old weights serving exactly as before; quantized runners (whose int4 copies are rebuilt and
swapped in) keep the kernel routes timed at load."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.protocol import SamplingParams
from tests.support.engine import BLOCK_SIZE, run_core
from tests.support.models import SMALL, random_hf_model
from tests.support.routing import route_every_size
from workers.scheduler.engine.model_runner import TorchModelRunner
from workers.scheduler.engine.reload import ReloadError
from workers.scheduler.layers.attention_tuning import AttentionChoice
from workers.scheduler.layers.tiered import TieredLinear
from workers.scheduler.model.llama import Attention

NUM_KV_BLOCKS = 16
PROMPTS = [[5, 9, 2, 7, 11, 3, 8], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


def _checkpoint(root: Path, name: str, seed: int, **overrides: Any) -> Path:
    """A tiny Llama whose weights differ from seed to seed."""
    from transformers import LlamaConfig

    model = random_hf_model(LlamaConfig(**{**SMALL, **overrides}), weight_std=0.1)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    folder = root / name
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reload")
    return {
        "first": _checkpoint(root, "first", seed=1),
        "second": _checkpoint(root, "second", seed=2),
        "narrow": _checkpoint(root, "narrow", seed=3, hidden_size=32),
    }


def _greedy(runner: TorchModelRunner) -> list[list[int]]:
    seqs = run_core(runner, PROMPTS, [GREEDY] * len(PROMPTS), num_kv_blocks=NUM_KV_BLOCKS)
    return [seq.output_ids for seq in seqs]


def _attention_choice(runner: TorchModelRunner) -> AttentionChoice:
    """The attention kernels `runner` took at load (timed: another load may take others)."""
    attention = next(m for m in runner.model.modules() if isinstance(m, Attention))
    return AttentionChoice(attention.upcast_sdpa, runner.matmul_decodes, runner.paged_decodes,
                           runner.matmul_prefill_max_context)  # fmt: skip


def _cache_addresses(runner: TorchModelRunner) -> list[int]:
    return [t.data_ptr() for layer in runner.kv_cache for t in layer]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reload_serves_the_new_checkpoint_on_the_same_cache(
    folders: dict[str, Path], dtype: str
) -> None:
    """fp32 weights are copied in place; bf16 ones on CPU may be prepacked for oneDNN,
    then the model is rebuilt and swapped in: the same tokens either way."""
    runner = TorchModelRunner.load(str(folders["first"]), NUM_KV_BLOCKS, BLOCK_SIZE, dtype)
    before, cache = _greedy(runner), _cache_addresses(runner)
    weight = runner.model.embed_tokens.weight
    fresh = TorchModelRunner.load(str(folders["second"]), NUM_KV_BLOCKS, BLOCK_SIZE, dtype)
    fresh.use_attention(_attention_choice(runner))  # timed apart: either may win in bf16
    runner.reload(str(folders["second"]))
    after = _greedy(runner)
    assert after == _greedy(fresh)
    assert after != before  # other weights, other tokens
    assert _cache_addresses(runner) == cache
    assert runner.model_path == str(folders["second"])
    if dtype == "float32":  # written in place: compiled steps and CUDA graphs stay valid
        assert runner.model.embed_tokens.weight is weight
    runner.reload(str(folders["first"]))  # and back
    assert _greedy(runner) == before


@pytest.mark.parametrize("bad", ["narrow", "missing", "no_weights"])
def test_a_failed_reload_keeps_the_old_weights(
    folders: dict[str, Path], tmp_path: Path, bad: str
) -> None:
    runner = TorchModelRunner.load(str(folders["first"]), NUM_KV_BLOCKS, BLOCK_SIZE)
    before = _greedy(runner)
    path, expected = {
        "narrow": (folders["narrow"], r"hidden_size 32 \(loaded: 64\)"),
        "missing": (tmp_path / "nowhere", "no model at"),
        "no_weights": (tmp_path / "config_only", "no .safetensors files"),
    }[bad]
    if bad == "no_weights":
        path.mkdir()
        shutil.copy(folders["first"] / "config.json", path)
    with pytest.raises((ReloadError, FileNotFoundError), match=expected):
        runner.reload(str(path))
    assert _greedy(runner) == before
    assert runner.model_path == str(folders["first"])


def test_quantized_runner_reloads_with_its_routes(folders: dict[str, Path]) -> None:
    """int4 copies cannot be written in place: they are rebuilt from the new checkpoint and
    swapped in, with the routes timed at load; tokens then follow a fresh int4 runner's on
    the same routes."""
    runner = TorchModelRunner.load(
        str(folders["first"]), NUM_KV_BLOCKS, BLOCK_SIZE, quantization="int4"
    )
    routes = [m.route for m in runner.model.modules() if isinstance(m, TieredLinear)]
    assert routes
    old_model = runner.model
    runner.reload(str(folders["second"]))
    assert runner.model is not old_model
    assert [m.route for m in runner.model.modules() if isinstance(m, TieredLinear)] == routes
    fresh = TorchModelRunner.load(
        str(folders["second"]), NUM_KV_BLOCKS, BLOCK_SIZE, quantization="int4"
    )
    for model in (runner.model, fresh.model):
        route_every_size(model, "int4")
    assert _greedy(runner) == _greedy(fresh)
    with pytest.raises(ReloadError, match="hidden_size"):
        runner.reload(str(folders["narrow"]))
    assert _greedy(runner) == _greedy(fresh)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graphed_cuda_runner_replays_the_new_weights(folders: dict[str, Path]) -> None:
    """On CUDA the new weights go into the recorded graphs' own tensors: the graphs replay
    them without being recorded again."""
    runner, fresh = (
        TorchModelRunner.load(
            str(folders[name]), NUM_KV_BLOCKS, BLOCK_SIZE, "float32", "cuda", cuda_graph_max_bs=4
        )
        for name in ("first", "second")
    )
    graphs = runner.graphs
    assert graphs is not None
    runner.reload(str(folders["second"]))
    calls = graphs.calls
    assert _greedy(runner) == _greedy(fresh)
    assert runner.graphs is graphs and graphs.calls > calls

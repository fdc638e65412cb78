"""The kernel choices timed at load are kept on disk (engine/tuning_cache.py): a second start
with the same key takes them without timing anything; a changed key times again."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaConfig

from tests.support.models import SMALL, saved_random_model
from workers.scheduler.engine import kernel_choices, tuning_cache
from workers.scheduler.engine.model_runner import TorchModelRunner
from workers.scheduler.kernels import fused_decode
from workers.scheduler.layers.tiered import TieredLinear


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_random_model(tmp_path_factory, "tuned", LlamaConfig(**SMALL), weight_std=0.05)


class Timings:
    """Counts the timing passes at load (projections' routes, attention)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.routes = self.attention = 0
        tune, choose = kernel_choices.tune_routes, kernel_choices.choose_attention

        def counted_tune(*args: Any, **kwargs: Any) -> Any:
            self.routes += 1
            return tune(*args, **kwargs)

        def counted_choose(*args: Any, **kwargs: Any) -> Any:
            self.attention += 1
            return choose(*args, **kwargs)

        monkeypatch.setattr(kernel_choices, "tune_routes", counted_tune)
        monkeypatch.setattr(kernel_choices, "choose_attention", counted_choose)


def load(folder: Path, tuning_dir: Path | None) -> TorchModelRunner:
    return TorchModelRunner.load(
        str(folder), 8, 16, dtype="float32", quantization="int4", tuning_dir=tuning_dir
    )


def routes(runner: TorchModelRunner) -> list[list[str]]:
    return [m.route for m in runner.model.modules() if isinstance(m, TieredLinear)]


def test_a_second_start_takes_the_stored_choices_without_timing(
    tiny_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    timings = Timings(monkeypatch)
    first = load(tiny_folder, tmp_path)
    assert (timings.routes, timings.attention) == (1, 1)
    assert len(list((tmp_path / "tuning").glob("*.json"))) == 1
    # What the first start timed, made recognizable: every route through the dense weights.
    for module in first.model.modules():
        if isinstance(module, TieredLinear):
            module.route = ["dense"] * len(module.route)
    key = kernel_choices.choices_key(first)
    cache = tuning_cache.TuningCache(tmp_path / "tuning")
    stored = cache.load(key)
    assert stored is not None
    stored["routes"] = {name: ["dense"] * len(r) for name, r in stored["routes"].items()}
    stored["fused_step"] = 0 if first.fused is not None else 8  # the other way round
    assert type(stored["fused_split_steps"]) is bool
    stored["fused_prefill_rows"], stored["fused_split_steps"] = 16, True
    cache.save(key, stored)

    second = load(tiny_folder, tmp_path)
    assert (timings.routes, timings.attention) == (1, 1)  # nothing timed again
    assert routes(second) == routes(first)
    assert second.matmul_decodes == first.matmul_decodes
    fused_limit = 8 if first.fused is None and fused_decode.available() else None
    assert (second.fused and second.fused.max_batch) == fused_limit
    assert (second.fused and second.fused.prefill_rows) == (fused_limit and 16)
    assert (second.fused and second.fused.split_steps) == (fused_limit and True)


def test_a_changed_key_times_again_and_keeps_both(
    tiny_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    timings = Timings(monkeypatch)
    load(tiny_folder, tmp_path)
    monkeypatch.setattr(tuning_cache, "cpu_identity", lambda: "another CPU | avx2 | AVX2")
    load(tiny_folder, tmp_path)
    assert timings.routes == 2
    assert len(list((tmp_path / "tuning").glob("*.json"))) == 2
    load(tiny_folder, tmp_path)  # that CPU's choices are stored now
    assert timings.routes == 2


def test_a_changed_checkpoint_or_setting_is_another_key(tiny_folder: Path, tmp_path: Path) -> None:
    runner = load(tiny_folder, None)
    key = kernel_choices.choices_key(runner)
    runner.block_size = 32
    assert kernel_choices.choices_key(runner) != key
    runner.block_size = 16
    weights = next(tiny_folder.glob("*.safetensors"))
    stat = weights.stat()
    weights.touch()  # another modification time: the checkpoint may have changed
    try:
        assert kernel_choices.choices_key(runner) != key
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert kernel_choices.choices_key(runner) == key


def test_a_record_that_does_not_fit_the_model_is_timed_over(
    tiny_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    timings = Timings(monkeypatch)
    first = load(tiny_folder, tmp_path)
    cache = tuning_cache.TuningCache(tmp_path / "tuning")
    key = kernel_choices.choices_key(first)
    cache.save(key, {"routes": {"w8a8 x1": ["w8a8"] * 8}, "attention": None})
    load(tiny_folder, tmp_path)
    assert timings.routes == 2  # timed again, and stored over the bad record
    stored = cache.load(key)
    assert stored is not None and "w8a8 x1" not in stored["routes"]
    del stored["fused_split_steps"]  # a record of an earlier version
    cache.save(key, stored)
    load(tiny_folder, tmp_path)
    assert timings.routes == 3
    cache.path(key).write_text("{not json")
    load(tiny_folder, tmp_path)
    assert timings.routes == 4


def test_a_start_waits_for_another_timing_the_same_key_and_takes_its_record(
    tiny_folder: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    timings = Timings(monkeypatch)
    first = load(tiny_folder, tmp_path)
    cache = tuning_cache.TuningCache(tmp_path / "tuning")
    key = kernel_choices.choices_key(first)
    record = cache.load(key)
    cache.path(key).unlink()
    holding, release = threading.Event(), threading.Event()

    def another_start_timing() -> None:  # a lock of its own, as another process holds one
        with cache.timing_alone(key):
            holding.set()
            release.wait(120)
            assert record is not None
            cache.save(key, record)

    other = threading.Thread(target=another_start_timing)
    other.start()
    assert holding.wait(30)
    started: list[TorchModelRunner] = []
    caplog.set_level(logging.INFO, logger=tuning_cache.__name__)
    loader = threading.Thread(target=lambda: started.append(load(tiny_folder, tmp_path)))
    loader.start()
    deadline = time.monotonic() + 120
    while "timing these kernels: waiting" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    release.set()  # the other start stores its record only now
    other.join(60)
    loader.join(120)
    assert "timing these kernels: waiting" in caplog.text
    assert started and timings.routes == 1  # it took the other start's record
    assert routes(started[0]) == routes(first)

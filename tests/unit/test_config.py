"""`redserve up` hands its settings to the tiers through the environment: a round trip."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from redserve.cli import build_parser, main, settings_from_args
from shared.config import ApiSettings, SchedulerSettings, Settings, child_process_env


def test_child_process_env_round_trips_every_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(
        redis_url="redis://127.0.0.1:1/0",
        model="/models/x",
        api=ApiSettings(port=31234, api_keys=["k1", "k2"], served_model_name="m"),
        scheduler=SchedulerSettings(
            worker_id="w",
            dtype="float32",
            quantization="int4",
            max_num_seqs=7,
            enable_torch_compile=True,
            torch_compile_max_bs=4,
            disable_cuda_graph=True,
            cuda_graph_max_bs=8,
        ),
    )
    for key, value in child_process_env(settings).items():
        if key.startswith("REDSERVE_"):
            monkeypatch.setenv(key, value)
    assert Settings() == settings


def test_quantization_flag_maps_onto_settings_and_rejects_unknown_methods(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    args = parser.parse_args(["up", "--quantization", "int4"])
    assert settings_from_args(args).scheduler.quantization == "int4"
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["up", "--quantization", "int3"])
    assert exit_info.value.code == 2
    assert "choose from 'auto', 'none', 'int4'" in capsys.readouterr().err


def test_torch_compile_flags_map_onto_settings() -> None:
    parser = build_parser()
    default = settings_from_args(parser.parse_args(["scheduler"])).scheduler
    assert not default.enable_torch_compile
    args = parser.parse_args(["up", "--enable-torch-compile", "--torch-compile-max-bs", "4"])
    scheduler = settings_from_args(args).scheduler
    assert scheduler.enable_torch_compile and scheduler.torch_compile_max_bs == 4


def test_cuda_graph_flags_map_onto_settings_and_cap_the_recorded_batches() -> None:
    parser = build_parser()
    default = settings_from_args(parser.parse_args(["scheduler"])).scheduler
    assert not default.disable_cuda_graph and default.cuda_graph_batches() == 64
    args = parser.parse_args(["up", "--cuda-graph-max-bs", "16", "--max-num-seqs", "8"])
    assert settings_from_args(args).scheduler.cuda_graph_batches() == 8  # no larger batch
    args = parser.parse_args(["up", "--cuda-graph-max-bs", "16"])
    assert settings_from_args(args).scheduler.cuda_graph_batches() == 16
    args = parser.parse_args(["up", "--disable-cuda-graph"])
    assert settings_from_args(args).scheduler.cuda_graph_batches() == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["scheduler", "--enable-torch-compile", "--torch-compile-max-bs", "0"],
            "--torch-compile-max-bs 0",
        ),
        (["scheduler", "--kv-memory-fraction", "1.5"], "--kv-memory-fraction 1.5"),
        (["scheduler", "--max-num-seqs", "0"], "--max-num-seqs 0"),
        (["scheduler", "--cuda-graph-max-bs", "0"], "--cuda-graph-max-bs 0"),
        (["api", "--port", "70000"], "--port 70000"),
        (["up", "--port", "70000"], "--port 70000"),
    ],
)
def test_a_flag_out_of_range_is_refused_by_name(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """As SGLang's launcher refuses bad arguments: exit 2 with the flag named, instead of
    compiling nothing (max bs 0) or failing later inside a tier."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "unrecognized arguments" not in err


def test_a_variable_out_of_range_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("REDSERVE_SCHEDULER__BLOCK_SIZE", "0")
    with pytest.raises(SystemExit) as exit_info:
        main(["scheduler"])
    assert exit_info.value.code == 2
    assert "REDSERVE_SCHEDULER__BLOCK_SIZE='0'" in capsys.readouterr().err
    monkeypatch.setenv("REDSERVE_SCHEDULER__BLOCK_SIZE", "32")
    assert settings_from_args(build_parser().parse_args(["scheduler"])).scheduler.block_size == 32


def test_settings_set_in_code_are_checked_too() -> None:
    scheduler = SchedulerSettings()
    with pytest.raises(ValidationError):
        scheduler.idle_block_ms = 0  # XREADGROUP BLOCK 0 would wait forever

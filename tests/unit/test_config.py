"""`redserve up` hands its settings to the tiers through the environment: a round trip."""

from __future__ import annotations

import pytest

from redserve.cli import build_parser, settings_from_args
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
    assert "choose from 'none', 'int4'" in capsys.readouterr().err


def test_torch_compile_flags_map_onto_settings() -> None:
    parser = build_parser()
    default = settings_from_args(parser.parse_args(["scheduler"])).scheduler
    assert not default.enable_torch_compile
    args = parser.parse_args(["up", "--enable-torch-compile", "--torch-compile-max-bs", "4"])
    scheduler = settings_from_args(args).scheduler
    assert scheduler.enable_torch_compile and scheduler.torch_compile_max_bs == 4

"""`redserve`'s flags: each tier's subcommand takes only its own tier's flags, every help text
shows the default that `Settings` really has, and flags win over the environment."""

from __future__ import annotations

import argparse

import pytest
from pydantic import BaseModel

from redserve.cli import FLAGS, Flag, _tier_main, build_parser, main, settings_from_args
from redserve.supervisor import up
from shared.config import DetokenizerSettings, Settings

TIERS = ("api", "scheduler", "detokenizer", "jobs")

# The top-level settings each tier reads (nested ones belong to the tier of their section).
TOP_LEVEL = {
    "api": {
        "model",
        "redis_url",
        "redis_cluster",
        "stream_shards",
        "key_prefix",
        "cache_dir",
        "context_length",
        "log_level",
        "files_dir",
    },
    "scheduler": {
        "model",
        "redis_url",
        "redis_cluster",
        "stream_shards",
        "key_prefix",
        "num_token_shards",
        "cache_dir",
        "context_length",
        "log_level",
    },
    "detokenizer": {
        "model",
        "redis_url",
        "redis_cluster",
        "stream_shards",
        "key_prefix",
        "num_token_shards",
        "cache_dir",
        "log_level",
    },
    # The jobs tier answers lines through an api app of its own: the api settings that shape
    # an answer are its flags too.
    "jobs": {
        "model",
        "redis_url",
        "redis_cluster",
        "stream_shards",
        "key_prefix",
        "cache_dir",
        "context_length",
        "log_level",
        "files_dir",
        "api.served_model_name",
        "api.tool_call_parser",
        "api.reasoning_parser",
        "api.max_batch_requests",
    },
}
# `health` needs Redis for the scheduler's heartbeat and the api's port for GET /health.
HEALTH = {"redis_url", "key_prefix", "api.port"}

# Defaults that are no one literal (a default_factory, or None that stands for something else):
# a new one must be added here, with the words its help text uses.
DESCRIBED_DEFAULTS = {
    "api.api_id": "host name + random suffix",
    "scheduler.worker_id": "host name + random suffix",
    "detokenizer.worker_id": "host name + random suffix",
    "jobs.worker_id": "host name + random suffix",
    "api.served_model_name": "the model's file or folder name",
    "api.api_keys": "none: no authentication",
    "detokenizer.shards": "a fair share",
}


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub: argparse.ArgumentParser = subparsers.choices[command]
    return sub


def _accepted_paths(command: str) -> set[str]:
    by_name = {f.name: f.path for f in FLAGS}
    options = {o for a in _subparser(command)._actions for o in a.option_strings}
    return {by_name[o] for o in options if o in by_name}


def _expected_paths(tier: str) -> set[str]:
    return TOP_LEVEL[tier] | {f.path for f in FLAGS if f.path.startswith(f"{tier}.")}


def _argv(flag: Flag) -> list[str]:
    if flag.switch:
        return [flag.name]
    return [flag.name, flag.choices[-1] if flag.choices else "1"]


def _default_of(path: str) -> object:
    model: type[BaseModel] = Settings
    *parents, leaf = path.split(".")
    for name in parents:
        annotation = model.model_fields[name].annotation
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
        model = annotation
    field = model.model_fields[leaf]
    return None if field.default_factory is not None else field.default


@pytest.mark.parametrize("tier", TIERS)
def test_each_tier_takes_its_own_flags_and_the_top_level_ones_it_reads(tier: str) -> None:
    assert _accepted_paths(tier) == _expected_paths(tier)


def test_up_takes_every_flag_and_health_only_what_it_checks() -> None:
    assert _accepted_paths("up") == {f.path for f in FLAGS}
    assert _accepted_paths("health") == HEALTH


@pytest.mark.parametrize("tier", TIERS)
def test_a_tier_refuses_another_tiers_flag(tier: str, capsys: pytest.CaptureFixture[str]) -> None:
    foreign = [f for f in FLAGS if "." in f.path and f.path not in _expected_paths(tier)]
    assert foreign
    for flag in foreign:
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args([tier, *_argv(flag)])
        assert exit_info.value.code == 2, flag.name
        assert "unrecognized arguments" in capsys.readouterr().err, flag.name


@pytest.mark.parametrize("tier", TIERS)
def test_a_tier_parses_each_of_its_own_flags(tier: str) -> None:
    for flag in FLAGS:
        if flag.path in _expected_paths(tier):
            build_parser().parse_args([tier, *_argv(flag)])


@pytest.mark.parametrize("flag", FLAGS, ids=[f.name for f in FLAGS])
def test_each_flags_help_ends_with_the_settings_default(flag: Flag) -> None:
    action = next(a for a in _subparser("up")._actions if flag.name in a.option_strings)
    default = _default_of(flag.path)
    if flag.path in DESCRIBED_DEFAULTS:
        assert default is None  # a factory or None: nothing literal to show
        expected = DESCRIBED_DEFAULTS[flag.path]
    elif isinstance(default, bool):
        expected = str(default).lower()
    elif default == "":
        expected = '""'
    else:
        assert default is not None, f"{flag.path}: add it to DESCRIBED_DEFAULTS"
        expected = str(default)
    assert action.help is not None
    assert action.help.endswith(f"(default: {expected})"), action.help


def test_the_compile_limit_shows_the_default_it_has() -> None:
    assert Settings().scheduler.torch_compile_max_bs == 32
    assert "(default: 32)" in _subparser("scheduler").format_help()


@pytest.mark.parametrize("command", [*TIERS, "up", "health"])
def test_every_help_renders(command: str) -> None:
    assert "default:" in _subparser(command).format_help()


def test_every_detokenizer_setting_has_a_flag() -> None:
    paths = {f.path for f in FLAGS}
    assert {f"detokenizer.{n}" for n in DetokenizerSettings.model_fields} <= paths


def test_the_detokenizer_flags_map_onto_settings() -> None:
    args = build_parser().parse_args(
        ["detokenizer", "--shard", "0", "--shard", "2", "--max-states", "10"]
        + ["--num-token-shards", "4"]
    )
    settings = settings_from_args(args)
    assert settings.detokenizer.shards == [0, 2]
    assert settings.detokenizer.max_states == 10
    assert settings.num_token_shards == 4
    default = settings_from_args(build_parser().parse_args(["detokenizer"]))
    fresh = DetokenizerSettings(worker_id=default.detokenizer.worker_id)  # random per process
    assert default.detokenizer == fresh


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["detokenizer", "--max-states", "0"], "--max-states 0"),
        (["detokenizer", "--shard", "x"], "--shard: invalid int value"),
        (["scheduler", "--num-token-shards", "0"], "--num-token-shards 0"),
    ],
)
def test_bad_detokenizer_values_are_refused_by_name(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_flags_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDSERVE_API__PORT", "31000")
    monkeypatch.setenv("REDSERVE_DETOKENIZER__MAX_STATES", "5")
    monkeypatch.setenv("REDSERVE_DETOKENIZER__SHARDS", "[1]")
    parser = build_parser()
    assert settings_from_args(parser.parse_args(["api"])).api.port == 31000
    assert settings_from_args(parser.parse_args(["api", "--port", "32000"])).api.port == 32000
    detok = settings_from_args(parser.parse_args(["detokenizer"])).detokenizer
    assert detok.max_states == 5 and detok.shards == [1]
    args = parser.parse_args(["detokenizer", "--max-states", "7", "--shard", "3"])
    detok = settings_from_args(args).detokenizer
    assert detok.max_states == 7 and detok.shards == [3]  # the flag replaces the list
    # A flag of another tier, set through its variable, still reaches Settings (`up` relies on it).
    monkeypatch.setenv("REDSERVE_SCHEDULER__MAX_NUM_SEQS", "3")
    assert settings_from_args(parser.parse_args(["api"])).scheduler.max_num_seqs == 3


def test_compose_style_health_checks_parse() -> None:
    args = build_parser().parse_args(["health", "api", "--port", "30000"])
    assert args.tier == "api" and settings_from_args(args).api.port == 30000
    with pytest.raises(SystemExit):
        build_parser().parse_args(["health", "scheduler", "--model", "x"])


def test_up_runs_the_supervisor() -> None:
    assert _tier_main("up") is up

"""compose.yaml only runs real `redserve` subcommands, and every tier is there."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from redserve.cli import build_parser
from shared.config import Settings

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"


def _services() -> dict[str, dict[str, object]]:
    services: dict[str, dict[str, object]] = yaml.safe_load(COMPOSE.read_text())["services"]
    return services


def test_every_tier_is_a_service() -> None:
    assert {"redis", "api", "scheduler", "detokenizer"} <= set(_services())


@pytest.mark.parametrize("name", ["api", "scheduler", "detokenizer"])
def test_service_commands_are_redserve_subcommands(name: str) -> None:
    service = _services()[name]
    commands = [service["command"]]
    health = service.get("healthcheck")
    if isinstance(health, dict):
        commands.append(health["test"][1:])  # drop "CMD"
    for cmd in commands:
        assert isinstance(cmd, list) and cmd[0] == "redserve", cmd
        build_parser().parse_args(cmd[1:])  # exits (SystemExit) on an unknown subcommand/flag


def test_dependents_wait_for_healthy_redis_and_scheduler_reserves_a_gpu() -> None:
    services = _services()
    for name in ("api", "scheduler", "detokenizer"):
        depends = services[name]["depends_on"]
        assert isinstance(depends, dict)
        assert depends["redis"]["condition"] == "service_healthy"
    devices = services["scheduler"]["deploy"]["resources"]["reservations"]["devices"]  # type: ignore[index]
    assert devices[0]["capabilities"] == ["gpu"]


def test_planned_stops_get_more_time_than_the_scheduler_drains() -> None:
    drain_s = Settings().scheduler.drain_s
    for name in ("api", "scheduler"):
        grace = str(_services()[name]["stop_grace_period"])
        assert grace.endswith("s") and float(grace[:-1]) > drain_s, name

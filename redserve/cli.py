"""`redserve up | api | scheduler | detokenizer | jobs | health | dlq | status`: flags map onto
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
from typing import Any

from pydantic import ValidationError

from redserve.flags import (
    DLQ_FLAGS,
    FLAGS,
    HEALTH_FLAGS,
    STATUS_FLAGS,
    Flag,
    default_text,
    flag_tier,
    tier_flags,
)
from shared.config import Settings
from shared.logging_setup import configure_logging

logger = logging.getLogger(__name__)

_EPILOG = "Every flag has a REDSERVE_* environment variable too (README: Settings); flags win."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="redserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command, flags, help_text in [
        ("up", list(FLAGS), "embedded Redis (unless --redis-url) + every tier, one machine"),
        ("api", tier_flags("api"), "the HTTP tier (TokenizerManager)"),
        ("scheduler", tier_flags("scheduler"), "a scheduler worker (model + continuous batching)"),
        ("detokenizer", tier_flags("detokenizer"), "a detokenizer worker (token ids -> text)"),
        ("jobs", tier_flags("jobs"), "a jobs worker (arq: Batch API batches, maintenance)"),
    ]:
        tier_parser = sub.add_parser(command, help=help_text, description=help_text, epilog=_EPILOG)
        _add_groups(tier_parser, flags)
    health_help = "exit 0 when this host's tier is alive (for compose healthchecks)"
    health = sub.add_parser("health", help=health_help, description=health_help, epilog=_EPILOG)
    health.add_argument("tier", choices=["api", "scheduler", "jobs"], help="the tier to check")
    _add_groups(health, [f for f in FLAGS if f.name in HEALTH_FLAGS])
    dlq_help = "list, retry (requeue) or purge the jobs given up on after too many deliveries"
    dlq = sub.add_parser("dlq", help=dlq_help, description=dlq_help, epilog=_EPILOG)
    dlq.add_argument("action", choices=["list", "retry", "purge"])
    dlq.add_argument("rid", nargs="?", help="the request to requeue (retry only)")
    _add_groups(dlq, [f for f in FLAGS if f.name in DLQ_FLAGS])
    status_help = "the fleet's live workers (state, load, weights) and backlog, from Redis"
    status = sub.add_parser("status", help=status_help, description=status_help, epilog=_EPILOG)
    status.add_argument("--json", action="store_true", help="print JSON (as /get_server_info)")
    _add_groups(status, [f for f in FLAGS if f.name in STATUS_FLAGS])
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
    if command == "jobs":
        from workers.jobs import main as jobs_main

        return jobs_main
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

"""`redserve up | api | scheduler | detokenizer`: flags map onto shared.config.Settings.

`up` runs everything on one machine as separate OS processes that share nothing but Redis.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from shared.config import KV_CACHE_DTYPES, QUANTIZATIONS, Settings
from shared.logging_setup import configure_logging

logger = logging.getLogger(__name__)

# flag -> (path in Settings, type, help); `list` flags repeat, `bool` flags take no value, a
# tuple is the flag's choices.
_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--model": ("model", str, "HF folder, .gguf file or hub id (default: packaged SmolLM2)"),
    "--redis-url": ("redis_url", str, "use this Redis instead of an embedded one"),
    "--key-prefix": ("key_prefix", str, "prefix of every Redis key"),
    "--cache-dir": ("cache_dir", str, "where converted GGUF weights are cached"),
    "--context-length": ("context_length", int, "max prompt + output tokens"),
    "--log-level": ("log_level", str, "DEBUG, INFO, WARNING"),
    "--host": ("api.host", str, "api bind address"),
    "--port": ("api.port", int, "api port (default 30000)"),
    "--api-id": ("api.api_id", str, "name of this api replica"),
    "--served-model-name": ("api.served_model_name", str, "model name shown on /v1"),
    "--api-key": ("api.api_keys", list, "require this Bearer key (repeat for several)"),
    "--max-body-bytes": ("api.max_body_bytes", int, "larger request bodies get a 413"),
    "--incremental-streaming-output": (
        "api.incremental_streaming_output",
        bool,
        "/generate streams deltas instead of cumulative text",
    ),
    "--device": ("scheduler.device", str, "cpu or cuda"),
    "--dtype": ("scheduler.dtype", str, "auto, float32, bfloat16 or float16"),
    "--quantization": (
        "scheduler.quantization",
        QUANTIZATIONS,
        "int4: small CPU steps read int4 weights; w8a8_int8: also int8 x int8 where faster",
    ),
    "--enable-torch-compile": (
        "scheduler.enable_torch_compile",
        bool,
        "small decode steps run a torch.compile'd forward (compiled at start; needs g++)",
    ),
    "--torch-compile-max-bs": (
        "scheduler.torch_compile_max_bs",
        int,
        "largest decode batch that runs compiled (default 1; each size compiles apart)",
    ),
    "--disable-cuda-graph": (
        "scheduler.disable_cuda_graph",
        bool,
        "CUDA: decode steps run eager instead of replaying CUDA graphs",
    ),
    "--cuda-graph-max-bs": (
        "scheduler.cuda_graph_max_bs",
        int,
        "CUDA: largest decode batch that replays a CUDA graph (default 64)",
    ),
    "--kv-cache-dtype": (
        "scheduler.kv_cache_dtype",
        KV_CACHE_DTYPES,
        "auto (the model's dtype) or bfloat16: a bf16 cache under an fp32 model",
    ),
    "--kv-memory-fraction": (
        "scheduler.kv_memory_fraction",
        float,
        "share of the free memory the KV cache takes (default 0.3)",
    ),
    "--kv-cache-tokens": ("scheduler.kv_cache_tokens", int, "cap on the KV cache, in tokens"),
    "--max-num-seqs": ("scheduler.max_num_seqs", int, "max requests in one batch"),
    "--max-num-batched-tokens": ("scheduler.max_num_batched_tokens", int, "token budget"),
    "--worker-id": ("scheduler.worker_id", str, "name of this scheduler replica"),
    "--num-threads": ("scheduler.num_threads", int, "torch threads (0 = default)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="redserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in [
        ("up", "embedded Redis (unless --redis-url) + api + scheduler + detokenizer"),
        ("api", "the HTTP tier (TokenizerManager)"),
        ("scheduler", "a scheduler worker (model + continuous batching)"),
        ("detokenizer", "a detokenizer worker"),
    ]:
        _add_flags(sub.add_parser(name, help=help_text))
    health = sub.add_parser("health", help="exit 0 when this host's tier is alive (for compose)")
    health.add_argument("tier", choices=["api", "scheduler"])
    _add_flags(health)
    return parser


def _add_flags(parser: argparse.ArgumentParser) -> None:
    for flag, (_path, typ, flag_help) in _FLAGS.items():
        if typ is list:
            parser.add_argument(flag, action="append", default=None, help=flag_help)
        elif typ is bool:
            parser.add_argument(flag, action="store_true", default=None, help=flag_help)
        elif isinstance(typ, tuple):
            parser.add_argument(flag, choices=typ, default=None, help=flag_help)
        else:
            parser.add_argument(flag, type=typ, default=None, help=flag_help)


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
    for flag, (path, _typ, _help) in _FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            try:
                _set_path(settings, path, value)
            except ValidationError as e:
                raise SettingsError(f"{flag} {value}: {e.errors()[0]['msg']}") from None
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
        from workers.detokenizer import main as detokenizer_main

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
    _tier_main(args.command)(settings)


if __name__ == "__main__":
    main()

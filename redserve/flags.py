"""The command line's flags: one `Flag` per setting it can set (FLAGS), which tier takes each,
and each setting's default as the help texts show it (read from `Settings`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from shared.config import KV_CACHE_DTYPES, QUANTIZATIONS, Settings

TIERS = ("api", "scheduler", "detokenizer", "jobs")


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
    Flag("--redis-cluster", "redis_cluster", "the Redis URL names a node of a Redis Cluster",
         switch=True),  # fmt: skip
    Flag("--stream-shards", "stream_shards", "request streams a request goes to by rid", int),
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
    Flag(
        "--files-dir",
        "files_dir",
        "the file store the api and jobs tiers share (Files/Batch API); empty = {cache dir}/files",
        metavar="DIR",
    ),
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
    Flag("--max-file-bytes", "api.max_file_bytes", "larger file uploads get a 413", int),
    Flag(
        "--max-batch-requests",
        "api.max_batch_requests",
        "most lines in a batch's input file (more: a 400 at creation)",
        int,
    ),
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
    Flag("--tool-call-parser", "api.tool_call_parser", "how the model writes tool calls",
         choices=("hermes", "llama3")),  # fmt: skip
    Flag("--reasoning-parser", "api.reasoning_parser", "<think> blocks go to reasoning_content",
         choices=("", "qwen3", "deepseek-r1")),  # fmt: skip
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
        "--redis-outage-s",
        "api.redis_outage_s",
        "requests in flight end with a 503 once Redis is unreachable this long",
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
    Flag("--engine", "scheduler.engine",
         "torch, or null: no model, for fabric tests and benchmarks (engine/null_runner.py)",
         choices=("torch", "null")),  # fmt: skip
    Flag("--null-step-ms", "scheduler.null_step_ms",
         "the null engine's step time", float, metavar="MS"),  # fmt: skip
    Flag("--device", "scheduler.device", "cpu or cuda"),
    Flag("--dtype", "scheduler.dtype", "auto, float32, bfloat16 or float16"),
    Flag(
        "--quantization",
        "scheduler.quantization",
        "CPU: int4 or w8a8_int8 projections for the step sizes where they are faster; "
        "auto: int4 for a GGUF stored in 4 bits, else none",
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
        "auto (the model's dtype; bf16 under --quantization auto on a quantized GGUF), "
        "bfloat16 (bf16) or float32",
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
    Flag("--grammar-backend", "scheduler.grammar_backend",
         "JSON schemas and regexes through xgrammar or llguidance",
         choices=("xgrammar", "llguidance")),  # fmt: skip
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
    # jobs.*
    Flag("--jobs-id", "jobs.worker_id", "name of this jobs worker", metavar="ID"),
    Flag("--max-batches", "jobs.max_batches", "batches one jobs worker runs at once", int),
    Flag(
        "--max-lines-in-flight",
        "jobs.max_lines_in_flight",
        "lines of one batch in the fleet at once",
        int,
    ),
    Flag(
        "--batch-priority",
        "jobs.priority",
        "priority of batch lines (below 0: after interactive requests)",
        int,
    ),
)

# Which tiers read each top-level setting (nested ones belong to their section's tier).
_TOP_LEVEL_TIERS: dict[str, tuple[str, ...]] = {
    "model": TIERS,
    "redis_url": TIERS,
    "key_prefix": TIERS,
    "redis_cluster": TIERS,
    "stream_shards": TIERS,
    "num_token_shards": ("scheduler", "detokenizer"),
    "cache_dir": TIERS,
    "context_length": ("api", "scheduler", "jobs"),
    "log_level": TIERS,
    "files_dir": ("api", "jobs"),
}

# The jobs tier answers batch lines through an api app of its own: the api settings that
# shape an answer are its flags too.
JOBS_API_FLAGS = (
    "--served-model-name",
    "--tool-call-parser",
    "--reasoning-parser",
    "--max-batch-requests",
)

# `health` checks this host's api (GET on api.port) or scheduler (a heartbeat key in Redis).
HEALTH_FLAGS = ("--redis-url", "--key-prefix", "--port")

# `dlq` reads and writes the dead-letter and request streams.
DLQ_FLAGS = ("--redis-url", "--key-prefix")

# `status` reads the workers' heartbeats and the request stream.
STATUS_FLAGS = ("--redis-url", "--key-prefix")

# Defaults that are not one literal value: what a default_factory (or None) stands for.
_DERIVED_DEFAULTS: dict[str, str] = {
    "api.api_id": "host name + random suffix",
    "scheduler.worker_id": "host name + random suffix",
    "detokenizer.worker_id": "host name + random suffix",
    "jobs.worker_id": "host name + random suffix",
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
        if flag_tier(f) == tier
        or (flag_tier(f) is None and tier in _TOP_LEVEL_TIERS[f.path])
        or (tier == "jobs" and f.name in JOBS_API_FLAGS)
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

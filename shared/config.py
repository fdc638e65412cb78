"""One `Settings` for every process (env prefix `REDSERVE_`, nested with `__`).

This is the only module that reads the environment. CLI flags map onto these fields, each
tier's subcommand taking its own section's flags and the top-level ones it reads (redserve/cli.py).
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.keys import HEARTBEAT_TTL_S, Keys


def _default_instance_id() -> str:
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


class _Checked(BaseModel):
    """Values are checked as they are set too: CLI flags are applied field by field."""

    model_config = ConfigDict(validate_assignment=True)


class ApiSettings(_Checked):
    host: str = "127.0.0.1"
    port: int = Field(default=30000, ge=0, le=65535)
    # Identifies this api replica: the detokenizer routes text to `out:{api_id}`.
    api_id: str = Field(default_factory=_default_instance_id)
    served_model_name: str | None = None
    # How long an idle waiter sleeps before it checks whether the client went away.
    disconnect_check_s: float = Field(default=0.5, gt=0)
    # A request that has seen no output for this long fails with a 504 instead of hanging.
    request_timeout_s: float = Field(default=600.0, gt=0)
    # Bearer keys accepted on every route but /health; empty = no authentication.
    api_keys: list[str] = Field(default_factory=list)
    # Request bodies above this many bytes get a 413 while they are still being received.
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1)
    # Streaming /generate chunks carry only what is new (SGLang's --incremental-streaming-output)
    # instead of the cumulative text, ids and logprobs.
    incremental_streaming_output: bool = False
    # Caps on parallel sampling (`n`) and on top logprobs per position.
    max_n: int = Field(default=16, ge=1)
    max_top_logprobs: int = Field(default=20, ge=0)
    # Dynamic batch tokenizer: concurrent single-text requests share one tokenizer call of at
    # most this many texts, gathered for at most this long once a second one is waiting.
    tokenizer_batch_size: int = Field(default=32, ge=1)
    tokenizer_batch_timeout_s: float = Field(default=0.002, ge=0)
    # A streaming request whose client went away (or whose replica died) keeps running this
    # long for a re-attach (GET /v1/requests/{rid}/stream on any replica), then is aborted.
    orphan_grace_s: float = Field(default=30.0, ge=0)
    # Admission (api.admission): at most this many requests accepted but not yet running on
    # any scheduler, fleet-wide (SGLang's --max-queued-requests); above it a 503. 0 = no bound.
    max_queued_requests: int = Field(default=0, ge=0)
    # Per API key, shared by every replica through Redis (shared.limits): a token bucket of
    # rate_limit_rps requests per second holding at most rate_limit_burst (0 = one second's
    # worth, at least 1), and at most max_concurrent_requests_per_key requests in flight;
    # beyond either a 429. 0 = off.
    rate_limit_rps: float = Field(default=0.0, ge=0)
    rate_limit_burst: int = Field(default=0, ge=0)
    max_concurrent_requests_per_key: int = Field(default=0, ge=0)
    # The soft watchdog (SGLang's --soft-watchdog-timeout): a request with no output for this
    # long is logged with its rid, age, tokens so far and where it waits, once per period. Log
    # only. 0 = off.
    soft_watchdog_s: float = Field(default=300.0, ge=0)
    # Redis unreachable this long (the beat or the result subscription): every request in
    # flight on this replica ends with a 503 rather than hang. A shorter outage is ridden out.
    redis_outage_s: float = Field(default=5.0, gt=0)
    # /health_generate answers 503 when its one-token request through the fleet takes longer
    # (SGLang's HEALTH_CHECK_TIMEOUT).
    health_generate_timeout_s: float = Field(default=20.0, gt=0)
    # How a model writes tool calls (SGLang's --tool-call-parser): `hermes` (<tool_call>
    # JSON </tool_call>, also what a chat template without tools is taught) or `llama3`.
    tool_call_parser: Literal["hermes", "llama3"] = "hermes"
    # Thinking models (SGLang's --reasoning-parser): <think>...</think> goes to the answer's
    # `reasoning_content` (`qwen3`: an optional block; `deepseek-r1`: the output starts in
    # one). "" = off.
    reasoning_parser: Literal["", "qwen3", "deepseek-r1"] = ""
    # Files API uploads above this many bytes get a 413 (OpenAI's batch input limit); a
    # batch's input file holds at most max_batch_requests lines.
    max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1)
    max_batch_requests: int = Field(default=50_000, ge=1)
    # POST /update_weights_from_disk waits this long for every scheduler's result, then
    # answers success false naming who did not answer (and the fleet goes back).
    update_weights_timeout_s: float = Field(default=600.0, gt=0)


Quantization = Literal["auto", "none", "int4", "w8a8_int8"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
# SGLang's --kv-cache-dtype names ("bf16" = "bfloat16"), and "float32" for the exact cache;
# "auto": the model's dtype, bf16 under `--quantization auto` on a quantized GGUF
# (workers/scheduler/engine/dtypes.py).
KvCacheDtype = Literal["auto", "bfloat16", "bf16", "float32"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)


class SchedulerSettings(_Checked):
    worker_id: str = Field(default_factory=_default_instance_id)
    # "null" is a test and benchmark tool: the same loop, batching and Redis traffic with
    # no forward; each step sleeps null_step_ms and yields tokens that are a deterministic
    # function of (prompt, position) (engine/null_runner.py). Batch cap: max_num_seqs.
    engine: Literal["torch", "null"] = "torch"
    null_step_ms: float = Field(default=20.0, ge=0)
    # Structured output: xgrammar for every grammar, or llguidance for JSON schemas and
    # regexes (cheaper masks inside bounded strings; EBNF and tool calls stay on xgrammar).
    grammar_backend: Literal["xgrammar", "llguidance"] = "xgrammar"
    device: str = "cpu"
    # "auto": bfloat16 on CUDA and on CPUs with AVX512-BF16/AMX, else float32 (the exact
    # reference, matching HF fp32 greedy outputs token for token).
    dtype: str = "auto"
    # CPU only. "int4": int4 copies of the decoder's projections and an int8 LM head beside
    # the dense weights; each step size takes whichever kernel was timed fastest at load, so
    # small decode steps read fewer bytes. "w8a8_int8": the same plus int8 x int8 (activations
    # quantized per token, outlier channels calibrated at load) as one more kernel to time.
    # A request's tokens can then depend on its batch. Measured: bench/README.md. "auto":
    # int4 for the projections a GGUF stores in 4 bits or fewer, else (and on CUDA) none
    # (layers/auto_quantization.py); "none" with dtype float32 is the exact reference.
    quantization: Quantization = "auto"
    # SGLang's flags and default max bs: decode steps of up to torch_compile_max_bs
    # sequences run a torch.compile'd forward, compiled at start (a graph for one sequence and
    # a dynamic batch beside it, one more per range where the quantized kernels change) so no
    # request waits on the compiler. Off by default: it costs minutes of start-up, needs g++,
    # and Inductor's float sums can flip a greedy near-tie against eager (the exact reference).
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = Field(default=32, ge=1)
    # SGLang's flags: on CUDA, decode steps of up to cuda_graph_max_bs sequences (and at most
    # max_num_seqs) replay CUDA graphs recorded at start, which removes the per-op launch
    # cost; on by default there, as in SGLang and vLLM. No effect on CPU.
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = Field(default=64, ge=1)
    # "bfloat16" stores K/V in bf16 under an fp32 model: half the cache's memory and half
    # what decode attention reads per step, for rounding K/V to bf16 (not exact, so opt-in:
    # fp32 with "auto" stays the reference).
    kv_cache_dtype: KvCacheDtype = "auto"
    block_size: int = Field(default=16, ge=1)
    # The KV cache takes kv_memory_fraction of the memory available once the weights are
    # loaded (CPU: RAM within the cgroup limit; CUDA: free GPU memory), capped at
    # num_kv_blocks blocks, or else at kv_cache_tokens tokens (0 = no cap).
    kv_memory_fraction: float = Field(default=0.3, ge=0, le=1)
    num_kv_blocks: int = Field(default=0, ge=0)
    kv_cache_tokens: int = Field(default=0, ge=0)
    # Reuse the KV blocks of prompt prefixes seen before (block hashing, LRU eviction).
    enable_prefix_caching: bool = True
    max_num_seqs: int = Field(default=64, ge=1)
    # Tokens computed in one step, decodes and prefill chunks together: a running stream
    # waits at most one such step for its next token while long prompts are prefilled.
    # Larger budgets prefill arrivals in fewer, larger chunks, which cost less per token;
    # smaller ones bound a running stream's wait more tightly (2048 vs 512: bench/README.md).
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    # Background sequences (priority < 0: the low band, where batch lines go) sit out each
    # step in which an interactive sequence prefills, so batches do not delay first tokens.
    background_yields: bool = True
    num_threads: int = Field(default=0, ge=0)  # 0 = torch default
    # Block for new jobs at most this long when idle.
    idle_block_ms: int = Field(default=50, ge=1)
    # Every reclaim_every_s a scheduler takes over jobs pending this long (at least
    # reclaim_min_idle_s) with a dead owner (no heartbeat): they resume from their id log.
    reclaim_every_s: float = Field(default=2.0, gt=0)
    reclaim_min_idle_s: float = Field(default=12.0, gt=HEARTBEAT_TTL_S)
    # A job delivered more than this many times goes to the dead-letter stream, its client
    # gets an error.
    max_deliveries: int = Field(default=3, ge=1)
    # On SIGTERM: stop reading jobs, finish running requests for up to drain_s, then hand
    # the rest to another scheduler at once.
    drain_s: float = Field(default=30.0, ge=0)
    # SGLang's --watchdog-timeout: a loop that makes no progress this long (a step or a Redis
    # call hung) dumps every thread's stack and exits non-zero, so its jobs are reclaimed and
    # a supervisor restarts it. 0 = off.
    watchdog_s: float = Field(default=300.0, ge=0)
    # A port to serve this scheduler's own Prometheus metrics on (step time, batch size
    # histograms; GET /metrics); 0 = none. The fleet's figures are on every api's /metrics.
    metrics_port: int = Field(default=0, ge=0, le=65535)

    def cuda_graph_batches(self) -> int:
        """The largest decode batch to record CUDA graphs for (0 = none): no batch is
        larger than max_num_seqs."""
        return 0 if self.disable_cuda_graph else min(self.cuda_graph_max_bs, self.max_num_seqs)


class DetokenizerSettings(_Checked):
    worker_id: str = Field(default_factory=_default_instance_id)
    # Shards of the token channel this replica prefers; empty = a fair share. Each shard is
    # held under a lease that expires lease_ttl_s after its holder stopped renewing it.
    shards: list[int] = Field(default_factory=list)
    lease_ttl_s: float = Field(default=5.0, gt=0)
    # Live per-request decode states kept at most (least recently used evicted beyond).
    max_states: int = Field(default=65536, ge=1)


class JobsSettings(_Checked):
    worker_id: str = Field(default_factory=_default_instance_id)
    # Batches one jobs worker runs at once, and lines of one batch in flight at once.
    max_batches: int = Field(default=4, ge=1)
    max_lines_in_flight: int = Field(default=16, ge=1)
    # The priority of batch lines: below 0 they go to the low band, after interactive work.
    priority: int = -1


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="REDSERVE_", env_nested_delimiter="__", extra="ignore", validate_assignment=True
    )

    # Empty = `redserve up` starts a private redis-server; single tiers require it.
    redis_url: str = ""
    # redis_url names one node of a Redis Cluster (or Valkey cluster): the tiers find the
    # others, use sharded pub/sub (Redis 7+) and spread requests over stream_shards slots.
    redis_cluster: bool = False
    # Request streams (one per priority band each) a request goes to by its rid; every
    # process of a fleet must agree. On a cluster: a few per primary node.
    stream_shards: int = Field(default=1, ge=1, le=1024)
    key_prefix: str = "rs"
    # Number of `tok:{shard}` channels; each request is routed to one by its rid.
    num_token_shards: int = Field(default=1, ge=1)
    # A Hugging Face folder, a .gguf file, or a hub id; empty = the packaged SmolLM2 GGUF.
    model: str = ""
    # Converted GGUF weights, the kernel choices timed at load and compiled graphs (kept
    # between starts, keyed by what they depend on: engine/tuning_cache.py); empty =
    # ~/.cache/redserve.
    cache_dir: str = ""
    context_length: int = Field(default=0, ge=0)  # 0 = the model's max_position_embeddings
    log_level: str = "INFO"
    # The file store shared by the api and jobs tiers (uploads, batch outputs); empty =
    # {cache_dir}/files.
    files_dir: str = ""

    api: ApiSettings = Field(default_factory=ApiSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    detokenizer: DetokenizerSettings = Field(default_factory=DetokenizerSettings)
    jobs: JobsSettings = Field(default_factory=JobsSettings)

    def redis_keys(self) -> Keys:
        """The fleet's key names (prefix and stream shards)."""
        return Keys(self.key_prefix, self.stream_shards)

    def files_path(self) -> Path:
        """The file store's directory."""
        if self.files_dir:
            return Path(self.files_dir)
        base = Path(self.cache_dir) if self.cache_dir else Path.home() / ".cache" / "redserve"
        return base / "files"


def child_process_env(settings: Settings) -> dict[str, str]:
    """This process's environment plus `settings` as REDSERVE_* variables (nested fields
    joined with `__`): how `redserve up` hands its settings to the tiers it starts."""
    env = dict(os.environ)

    def walk(prefix: str, data: dict[str, Any]) -> None:
        for name, value in data.items():
            key = f"{prefix}{name.upper()}"
            if isinstance(value, dict):
                walk(key + "__", value)
            elif value is not None:
                env[key] = json.dumps(value) if isinstance(value, list) else str(value)

    walk("REDSERVE_", settings.model_dump())
    return env


@lru_cache
def get_settings() -> Settings:
    return Settings()


def use_inductor_cache(folder: Path) -> None:
    """Points Inductor's on-disk cache (compiled graphs, C++ builds) at `folder`. Inductor
    takes its directory from the environment only, and torch already wrote its default
    there on import, so this one is set, not defaulted."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)

"""One `Settings` for every process (env prefix `REDSERVE_`, nested with `__`).

This is the only module that reads the environment. CLI flags map onto these fields
(see `redserve --help`).
"""

from __future__ import annotations

import socket
import uuid
from functools import lru_cache

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_instance_id() -> str:
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


class ApiSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = 30000
    # Identifies this api replica: the detokenizer routes text to `out:{api_id}`.
    api_id: str = Field(default_factory=_default_instance_id)
    served_model_name: str | None = None
    # How long an idle waiter sleeps before it checks whether the client went away.
    disconnect_check_s: float = 0.5
    # A request that has seen no output for this long fails with a 504 instead of hanging.
    request_timeout_s: float = 600.0


class SchedulerSettings(BaseModel):
    worker_id: str = Field(default_factory=_default_instance_id)
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    # Total KV cache blocks; 0 = size from kv_cache_tokens.
    num_kv_blocks: int = 0
    kv_cache_tokens: int = 16384
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    num_threads: int = 0  # 0 = torch default
    # Block for new jobs at most this long when idle.
    idle_block_ms: int = 50


class DetokenizerSettings(BaseModel):
    # Shards of the token channel this replica subscribes to; empty = all.
    shards: list[int] = Field(default_factory=list)
    # Live per-request decode states kept at most (least recently used evicted beyond).
    max_states: int = 65536


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="REDSERVE_", env_nested_delimiter="__", extra="ignore"
    )

    # Empty = `redserve up` starts a private redis-server; single tiers require it.
    redis_url: str = ""
    key_prefix: str = "rs"
    # Number of `tok:{shard}` channels; each request is routed to one by its rid.
    num_token_shards: int = 1
    # A Hugging Face folder, a .gguf file, or a hub id; empty = the packaged SmolLM2 GGUF.
    model: str = ""
    cache_dir: str = ""  # where converted GGUF weights are kept; empty = ~/.cache/redserve
    context_length: int = 0  # 0 = the model's max_position_embeddings
    log_level: str = "INFO"

    api: ApiSettings = Field(default_factory=ApiSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    detokenizer: DetokenizerSettings = Field(default_factory=DetokenizerSettings)


@lru_cache
def get_settings() -> Settings:
    return Settings()

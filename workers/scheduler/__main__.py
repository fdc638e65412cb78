"""`python -m workers.scheduler` (or `redserve scheduler`): one scheduler worker.

Wires settings → model files → tokenizer (eos ids, stop-string tails) → model runner (torch,
or the null engine: a test and benchmark tool, engine/null_runner.py) →
core → loop (beating "loading" with a progress text meanwhile: loading.py), then serves until
SIGINT/SIGTERM: it drains, hands the rest over and exits 0. With --metrics-port it serves its
own Prometheus metrics (metrics.py) there.
Redis outages are waited out. An unexpected exception is logged and exits non-zero, so the
supervisor restarts us; our unacked jobs stay pending for another scheduler to reclaim.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer

from shared.config import Settings, get_settings
from shared.logging_setup import configure_logging
from shared.model_files import default_cache_dir, resolve_model
from shared.redis_conn import connect
from shared.request_stream import LayoutMismatch
from workers.scheduler.core.scheduler import Scheduler, SchedulerConfig
from workers.scheduler.engine.model_runner import TorchModelRunner
from workers.scheduler.engine.null_runner import NullModelRunner
from workers.scheduler.grammar.compiler import GrammarCompiler
from workers.scheduler.loading import LoadingBeat
from workers.scheduler.loop import SchedulerLoop
from workers.scheduler.metrics import serve_metrics
from workers.scheduler.watchdog import start_watchdog

logger = logging.getLogger("workers.scheduler")


def main(settings: Settings) -> None:
    configure_logging(settings.log_level, "scheduler")
    try:
        with _loading_beat(settings):
            loop = build_loop(settings)
        asyncio.run(serve(loop))
    except KeyboardInterrupt:  # a Ctrl-C while the model was still loading
        logger.info("interrupted")
    except LayoutMismatch as e:  # a configuration error: no traceback
        logger.error("%s", e)
        sys.exit(2)
    except Exception:
        logger.exception("scheduler failed")
        sys.exit(1)


def build_loop(settings: Settings) -> SchedulerLoop:
    if not settings.redis_url:
        raise ValueError("a scheduler needs REDSERVE_REDIS_URL (or --redis-url)")
    sched = settings.scheduler
    logger.info("resolving model %s", settings.model or "(packaged default)")
    model_path = resolve_model(settings.model, settings.cache_dir)
    logger.info("loading tokenizer from %s", model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    runner: TorchModelRunner | NullModelRunner
    grammars: GrammarCompiler | None = None  # the null engine cannot constrain: a 400
    if sched.engine == "null":
        runner = null_runner(settings, model_path, tokenizer)
        vocab_size, max_positions = runner.vocab_size, runner.max_positions
    else:
        runner = torch_runner(settings, model_path)
        vocab_size = runner.model.args.vocab_size
        max_positions = runner.model.args.max_position_embeddings
        grammars = GrammarCompiler(tokenizer, vocab_size, backend=sched.grammar_backend)
    config = SchedulerConfig(
        num_kv_blocks=runner.num_kv_blocks,
        vocab_size=vocab_size,
        max_model_len=min(settings.context_length or max_positions, max_positions),
        block_size=sched.block_size,
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        enable_prefix_caching=sched.enable_prefix_caching,
        background_yields=sched.background_yields,
        eos_token_ids=eos_token_ids(tokenizer.eos_token_id, model_path),
    )
    runner.eos_token_ids = config.eos_token_ids  # masked until min_new_tokens
    core = Scheduler(config, decode_tail=lambda ids: str(tokenizer.decode(ids)))
    logger.info(
        "ready: context %d tokens, eos ids %s", core.max_model_len, sorted(config.eos_token_ids)
    )
    redis = connect(settings.redis_url, settings.redis_cluster)
    keys = settings.redis_keys()
    return SchedulerLoop(redis, keys, settings, core, runner, model_path, grammars)


def torch_runner(settings: Settings, model_path: str) -> TorchModelRunner:
    sched = settings.scheduler
    # An explicit size caps the KV cache; the memory fraction bounds it in any case.
    max_blocks = sched.num_kv_blocks or -(-sched.kv_cache_tokens // sched.block_size)
    logger.info("loading model weights (%s on %s)", sched.dtype, sched.device)
    runner = TorchModelRunner.load(
        model_path,
        max_blocks,
        sched.block_size,
        sched.dtype,
        sched.device,
        sched.num_threads,
        kv_memory_fraction=sched.kv_memory_fraction,
        quantization=sched.quantization,
        kv_cache_dtype=sched.kv_cache_dtype,
        torch_compile_max_bs=sched.torch_compile_max_bs if sched.enable_torch_compile else 0,
        cuda_graph_max_bs=sched.cuda_graph_batches(),
        tuning_dir=Path(settings.cache_dir) if settings.cache_dir else default_cache_dir(),
    )
    runner.cache_dir = settings.cache_dir  # where a reloaded .gguf is converted to
    return runner


def null_runner(settings: Settings, model_path: str, tokenizer: Any) -> NullModelRunner:
    """No weights: the model's config for its vocabulary and context, the tokenizer for
    which ids are special (never emitted, so the text decodes as words)."""
    sched = settings.scheduler
    config = AutoConfig.from_pretrained(model_path)
    max_positions = int(config.max_position_embeddings)
    # No memory to bound: room for a full batch of full-length requests unless capped.
    tokens = sched.kv_cache_tokens or sched.max_num_seqs * max_positions
    runner = NullModelRunner(
        vocab_size=int(config.vocab_size),
        num_kv_blocks=sched.num_kv_blocks or -(-tokens // sched.block_size),
        block_size=sched.block_size,
        step_s=sched.null_step_ms / 1000,
        first_token_id=max(tokenizer.all_special_ids, default=-1) + 1,
        hidden_size=int(config.hidden_size),
        max_positions=max_positions,
    )
    logger.info("null engine: %.1f ms steps, %d KV blocks, no model (a test and benchmark "
                "tool)", sched.null_step_ms, runner.num_kv_blocks)  # fmt: skip
    return runner


def eos_token_ids(tokenizer_eos: int | None, model_path: str) -> frozenset[int]:
    """The tokenizer's eos plus generation_config.json's (an id or a list of ids)."""
    ids: set[int] = set() if tokenizer_eos is None else {tokenizer_eos}
    path = Path(model_path) / "generation_config.json"
    if path.is_file():
        eos: Any = json.loads(path.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return frozenset(ids)


def _loading_beat(settings: Settings) -> contextlib.AbstractContextManager[object]:
    """Beats "loading" with a progress text until the loop exists (loading.py)."""
    if not settings.redis_url:
        return contextlib.nullcontext()  # build_loop refuses to run anyway
    keys = settings.redis_keys()
    return LoadingBeat(
        settings.redis_url, keys, settings.scheduler.worker_id, cluster=settings.redis_cluster
    )


async def serve(loop: SchedulerLoop) -> None:
    if loop.settings.scheduler.metrics_port:
        serve_metrics(loop.settings.scheduler.metrics_port, loop.metrics)
    running = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        running.add_signal_handler(sig, loop.stop)
    watchdog = start_watchdog(loop, loop.settings)
    try:
        await loop.run()
    finally:
        if watchdog is not None:
            watchdog.stop()
        await loop.redis.aclose()
    logger.info("stopped")


if __name__ == "__main__":
    main(get_settings())

"""`python -m workers.detokenizer` (or `redserve detokenizer`): one detokenizer worker.

Loads the tokenizer, then runs one DetokenizerLoop until SIGINT/SIGTERM, which releases its
shard leases at once (a peer takes them over) and exits 0. Redis outages are waited out with
backoff; any other fatal error is logged and exits non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import cast

from shared.config import Settings, get_settings
from shared.logging_setup import configure_logging
from shared.model_files import resolve_model
from shared.redis_conn import connect
from workers.detokenizer.core import Tokenizer
from workers.detokenizer.loop import DetokenizerLoop

logger = logging.getLogger("workers.detokenizer")


def load_tokenizer(settings: Settings) -> Tokenizer:
    from transformers import AutoTokenizer

    path = resolve_model(settings.model, settings.cache_dir)
    # transformers' decode() is typed for batches too; a list of ids gives a str.
    return cast(Tokenizer, AutoTokenizer.from_pretrained(path))


async def serve(settings: Settings, tokenizer: Tokenizer) -> None:
    """Run one DetokenizerLoop until SIGINT/SIGTERM, then hand its shards over."""
    redis = connect(settings.redis_url, settings.redis_cluster)
    loop = DetokenizerLoop(redis, settings.redis_keys(), settings, tokenizer)
    event_loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        event_loop.add_signal_handler(sig, loop.stop)
    try:
        await loop.run()
    finally:
        await loop.shutdown()
        await redis.aclose()
    logger.info("detokenizer stopped")


def main(settings: Settings) -> None:
    configure_logging(settings.log_level, "detokenizer")
    if not settings.redis_url:
        logger.error("the detokenizer needs a Redis: set REDSERVE_REDIS_URL or --redis-url")
        sys.exit(2)
    try:
        tokenizer = load_tokenizer(settings)
        asyncio.run(serve(settings, tokenizer))
    except Exception:
        logger.exception("detokenizer failed")
        sys.exit(1)


if __name__ == "__main__":
    main(get_settings())

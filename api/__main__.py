"""`python -m api`: one api replica under uvicorn."""

from __future__ import annotations

import signal
import sys
from types import FrameType

import uvicorn

from api.app import create_app
from shared.config import Settings, get_settings
from shared.logging_setup import configure_logging

# On SIGTERM, in-flight requests get this long to finish; then they are cancelled, which
# aborts them in Redis, and the lifespan shutdown runs (well inside compose's 10 s grace).
GRACEFUL_SHUTDOWN_S = 5


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    sys.exit(0)


def main(settings: Settings) -> None:
    configure_logging(settings.log_level, "api")
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown: make that a clean exit 0.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    signal.signal(signal.SIGINT, _exit_cleanly)
    uvicorn.run(
        create_app(settings),
        host=settings.api.host,
        port=settings.api.port,
        log_config=None,  # keep configure_logging's setup; uvicorn's loggers propagate to it
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


if __name__ == "__main__":
    main(get_settings())

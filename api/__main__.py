"""`python -m api`: one api replica under uvicorn, with a drain step on SIGTERM (api.drain)."""

from __future__ import annotations

import signal
import sys
from types import FrameType

import uvicorn

from api.app import create_app
from api.drain import DrainingServer
from shared.config import Settings, get_settings
from shared.logging_setup import configure_logging

# On SIGTERM: up to DRAIN_S for the requests in flight (health and new requests 503 meanwhile),
# then streams are released and the rest aborted; uvicorn then gets GRACEFUL_SHUTDOWN_S for
# the connections and the lifespan shutdown runs: inside compose's 45 s stop_grace_period.
DRAIN_S = 30.0
GRACEFUL_SHUTDOWN_S = 2


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    sys.exit(0)


def main(settings: Settings) -> None:
    configure_logging(settings.log_level, "api")
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown: make that a clean exit 0.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    signal.signal(signal.SIGINT, _exit_cleanly)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.api.host,
        port=settings.api.port,
        log_config=None,  # keep configure_logging's setup; uvicorn's loggers propagate to it
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    DrainingServer(config, app, DRAIN_S).run()


if __name__ == "__main__":
    main(get_settings())

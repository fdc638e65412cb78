"""configure_logging(): the only logging configuration in the project."""

from __future__ import annotations

import logging


def configure_logging(level: str, process_name: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {process_name} %(levelname)s %(name)s: %(message)s",
        force=True,
    )

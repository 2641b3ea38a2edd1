"""One logger for the library. Rank 0 logs at INFO; other ranks log warnings and errors,
prefixed with their rank so a multi-rank log stays readable."""

from __future__ import annotations

import logging
import sys

from fsdpkit import dist

LOGGER_NAME = "fsdpkit"


def get_logger(name: str | None = None) -> logging.Logger:
    return logging.getLogger(LOGGER_NAME if name is None else f"{LOGGER_NAME}.{name}")


def setup_logging(level: str = "INFO") -> None:
    """Configure the fsdpkit logger for this rank (idempotent)."""
    logger = logging.getLogger(LOGGER_NAME)
    r = dist.rank()
    logger.setLevel(level if r == 0 else "WARNING")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[%(asctime)s rank{r} %(levelname)s] %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    logger.propagate = False

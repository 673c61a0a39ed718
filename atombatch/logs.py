"""The engine's structured logger: one JSON event name per thing that happens (DESIGN §5)."""

from __future__ import annotations

import logging

import structlog


def logger(name: str = "atombatch") -> structlog.stdlib.BoundLogger:
    """A structlog logger over the stdlib logger `name`: JSON events, stdlib levels."""
    return structlog.wrap_logger(  # type: ignore[no-any-return]
        logging.getLogger(name),
        wrapper_class=structlog.stdlib.BoundLogger,
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.processors.add_log_level,
            structlog.processors.JSONRenderer(),
        ],
    )


log = logger()

"""The engine's structured logger: one JSON event name per thing that happens (DESIGN §5)."""

from __future__ import annotations

import logging

import structlog

log = structlog.wrap_logger(
    logging.getLogger("atombatch"),
    wrapper_class=structlog.stdlib.BoundLogger,
    processors=[
        structlog.stdlib.filter_by_level,
        structlog.processors.add_log_level,
        structlog.processors.JSONRenderer(),
    ],
)

"""One logging setup for the library, the server, the engine core, the Ray replicas and PD.

Every atombatch logger is `logger(name)`: a structlog logger over the stdlib logger `name` that
emits one event per thing that happens (`request.admitted`, `pd.peer_dropped`, ...) with its
fields, rendered in one of two formats:

- `json`: one JSON object per line (`event`, `level`, `timestamp` and the event's fields), what a
  log collector reads;
- `console`: `timestamp [level] event  key=value ...`, what a person at a terminal reads (in
  colour when the stream is a terminal).

The format is `configure(format=...)`'s, else the environment variable `ATOMBATCH_LOG_FORMAT`
(`json` or `console`), else `console` when standard error is a terminal and `json` when it is
not (a service's log is a file or a pipe). The programs (`python -m atombatch.serve`,
`atombatch.serve.ray`, their replicas and producers, the engine core process) call `setup`, which
also routes the stdlib records of other libraries (uvicorn's access and error logs) through the
same renderer, so one stream holds one format. An embedder keeps its own logging handlers:
atombatch's records arrive there already rendered, as the message of a stdlib record.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any, Literal, TextIO

import structlog

from atombatch.errors import ConfigError

Format = Literal["json", "console"]
FORMATS: tuple[Format, ...] = ("json", "console")
ENV = "ATOMBATCH_LOG_FORMAT"
LEVELS = ("critical", "error", "warning", "info", "debug")

_chosen: Format | None = None      # configure()'s choice; None: the environment or the terminal
_renderers: dict[tuple[Format, bool], Any] = {}


def check_format(value: str, source: str = "format") -> Format:
    """`value` as a log format; `ConfigError` naming `source` when it is none of `FORMATS`."""
    if value not in FORMATS:
        raise ConfigError(f"{source}={value!r} is not a log format: use one of "
                          f"{', '.join(FORMATS)}")
    return value  # type: ignore[return-value]


def default_format(stream: TextIO | None = None) -> Format:
    """`ATOMBATCH_LOG_FORMAT` when set, else console on a terminal and JSON otherwise."""
    env = os.environ.get(ENV)
    if env:
        return check_format(env.strip().lower(), ENV)
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return "console" if isatty is not None and isatty() else "json"


def current_format() -> Format:
    """The format events are rendered in now."""
    return _chosen if _chosen is not None else default_format()


def configure(format: str | None = None) -> Format:
    """Choose the format of every atombatch event from now on (None: back to the default)."""
    global _chosen
    _chosen = None if format is None else check_format(format)
    return current_format()


def _renderer(format: Format) -> Any:
    colors = format == "console" and _stderr_is_terminal()
    key = (format, colors)
    if key not in _renderers:
        _renderers[key] = (structlog.processors.JSONRenderer() if format == "json" else
                           structlog.dev.ConsoleRenderer(
                               colors=colors, sort_keys=False,
                               # no locals in a log (rich would print them: keys, prompts)
                               exception_formatter=structlog.dev.plain_traceback))
    return _renderers[key]


def _stderr_is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty is not None and isatty())


def _render(logger: Any, method: str, event: MutableMapping[str, Any]) -> str:
    """The last processor of every atombatch logger: the format chosen when the event happens.
    JSON carries a traceback as the string `exception`; the console renderer prints it itself."""
    format = current_format()
    if format == "json":
        event = structlog.processors.format_exc_info(logger, method, event)
    return _renderer(format)(logger, method, event)  # type: ignore[no-any-return]


_timestamp = structlog.processors.TimeStamper(fmt="iso", utc=True)


def logger(name: str = "atombatch") -> structlog.stdlib.BoundLogger:
    """A structlog logger over the stdlib logger `name`: events in the chosen format, stdlib levels."""
    return structlog.wrap_logger(  # type: ignore[no-any-return]
        logging.getLogger(name),
        wrapper_class=structlog.stdlib.BoundLogger,
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.processors.add_log_level,
            _timestamp,
            _render,
        ],
    )


class Formatter(logging.Formatter):
    """The stdlib side of `setup`: atombatch's records are rendered already; another library's
    record becomes an event (`event` its message, `logger` its name) in the same format."""

    def format(self, record: logging.LogRecord) -> str:
        if record.name == "atombatch" or record.name.startswith("atombatch."):
            return record.getMessage()
        event: MutableMapping[str, Any] = {"event": record.getMessage(), "logger": record.name,
                                 "level": record.levelname.lower()}
        event = _timestamp(None, record.levelname.lower(), event)
        if record.exc_info:
            event["exc_info"] = record.exc_info
        return _render(None, record.levelname.lower(), event)


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The root handler `setup` installs (and replaces on a second call)."""


def setup(level: str = "info", format: str | None = None, stream: TextIO | None = None) -> Format:
    """The logging of a program: `format` (None: `default_format`) for atombatch's events and,
    through one root handler on `stream` (standard error by default), for every other library's
    records, at `level`. Returns the format chosen.

    When the root logger already has handlers that `setup` did not install (an embedder's, a test
    runner's), they stay, with their level, and receive atombatch's events rendered in `format`.
    """
    if level not in LEVELS:
        raise ConfigError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    chosen = configure(format if format is not None else default_format(stream))
    root = logging.getLogger()
    if all(isinstance(h, _Handler) for h in root.handlers):
        for old in list(root.handlers):
            root.removeHandler(old)
        handler = _Handler(sys.stderr if stream is None else stream)
        handler.setFormatter(Formatter())
        root.addHandler(handler)
        root.setLevel(level.upper())
    return chosen


def add_arguments(parser: Any) -> None:
    """`--log-level` and `--log-format` on a program's argparse parser."""
    parser.add_argument("--log-level", default="info", choices=LEVELS)
    parser.add_argument("--log-format", choices=FORMATS, default=None,
                        help=f"json: one JSON object per line; console: for a terminal "
                        f"(default: ${ENV}, else console on a terminal and json otherwise)")


log = logger()
_stdlib_log = logging.getLogger("atombatch")


def enabled(level: int) -> bool:
    """Whether `log` renders events at `level` (a stdlib level): a check that costs far less than
    the event a hot path would otherwise build and filter."""
    return _stdlib_log.isEnabledFor(level)

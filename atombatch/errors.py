"""Every exception atombatch raises. One base class; each also inherits the matching built-in."""

from __future__ import annotations

from typing import ClassVar


class AtomBatchError(Exception):
    """Base class of every error raised by atombatch.

    Besides its message it carries data a server answers with, never parsed from the text:
    `http_status` (per class), `param` (the request field at fault, when one is) and `limit`
    (the bound that was broken, when there is one).
    """

    http_status: ClassVar[int] = 500

    def __init__(self, message: str = "", *, param: str | None = None,
                 limit: int | float | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.limit = limit


class ConfigError(AtomBatchError, ValueError):
    """An artifact, model spec or Batcher option breaks a configuration rule."""


class RequestError(AtomBatchError, ValueError):
    """A single request is invalid or failed; other requests are unaffected."""

    http_status = 400


class CapacityError(AtomBatchError, RuntimeError):
    """A pool, lane table or queue has no room for what was asked."""

    http_status = 429


class StateError(AtomBatchError, RuntimeError):
    """An illegal state transition was requested (a bug in the caller, never silent)."""


class KVTransferError(RequestError):
    """A KV transfer failed: producer error, garbled or missing data, disconnect, timeout."""


class TransientDeviceError(AtomBatchError, RuntimeError):
    """Raised by a runtime when a device call failed without effect and may be repeated as is.

    A runtime raises it (or an exception whose class derives from it) only when the call wrote
    nothing that a repeat with the same inputs would not overwrite identically, e.g. a timeout
    before the graph ran or a recovered link reset. The engine then repeats that one device call
    once; any other exception, or a second failure, fails the step's requests (docs/rules.md).
    """


class UnavailableError(RequestError):
    """The engine cannot take requests now: it is not started, is shutting down, or its core
    process exited. Nothing of the request was queued; another server (or a later try) may
    serve it. `http_status` is what a server answers (503)."""

    http_status = 503

"""Connection limits for the HTTP server: a cap on open connections and a header-read timeout.

uvicorn bounds many things itself and `uvicorn_config` sets them: `limit_concurrency` (requests
in flight past which it answers 503), `timeout_keep_alive` (idle time between requests),
`h11_max_incomplete_event_size` (bytes of an incomplete request head, for h11; the httptools
protocol counts them itself and answers 431) and `backlog`. Two things it
does not bound are added by `GuardedHttpToolsProtocol` (or `GuardedH11Protocol` without
httptools), subclasses of its protocols:

- **Open connections.** A client that opens connections and sends nothing holds a file descriptor
  each. Past `max_connections` (by default derived from the process's descriptor limit, leaving
  room for the engine and for a burst of accepts), the connection that has waited longest for a
  request head is closed to make room for the new one; if every connection is inside a request,
  the new one is answered 503 and closed. Half-open connections therefore never lock out a new
  client: they are the first to go.
- **Header-read timeout.** A connection must deliver a complete request head within
  `header_timeout` seconds of connecting (or of its previous response): a slow-loris client that
  trickles header bytes is closed when it runs out.

The request body is bounded by the app (`create_app(max_body_bytes=..., body_timeout=...)`), which
reads it as it streams in and answers 413 at the limit before buffering more.
docs/security.md lists every bound with its default.
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any, ClassVar

import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    _HAS_HTTPTOOLS = True
except ImportError:  # httptools is optional: h11 then
    HttpToolsProtocol = H11Protocol  # type: ignore[misc,assignment]
    _HAS_HTTPTOOLS = False

from atombatch.errors import ConfigError

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# a larger estimated response (logprobs x n x tokens) answers 400 before the request is queued
DEFAULT_MAX_RESPONSE_BYTES = 32 * 1024 * 1024
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n"
            b"connection: close\r\ncontent-length: 29\r\n\r\ntoo many connections to serve")


class ServerLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one client may cost the HTTP server (docs/security.md)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger body answers 413 as it streams in
    body_timeout: float = 30.0          # seconds to receive a whole request body, else 408
    header_timeout: float = 10.0        # seconds to deliver a complete request head
    keep_alive_timeout: int = 5         # idle seconds between requests on one connection
    max_header_bytes: int = 16 * 1024   # bytes of an incomplete request head
    max_connections: int | None = None  # open connections; None: from the descriptor limit
    limit_concurrency: int | None = None  # requests in flight (uvicorn 503); None: max_connections
    backlog: int | None = None          # listen backlog = accept burst; None: from the fd limit

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_header_bytes", "max_connections",
                     "limit_concurrency", "backlog"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value} must be >= 1")
        for name in ("body_timeout", "header_timeout", "keep_alive_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{name}={value} must be > 0 seconds")

    def resolved(self) -> ServerLimits:
        """These limits with the descriptor-derived defaults filled in.

        With a soft descriptor limit of N, the accept burst (`backlog`) is N/16 (16..2048) and
        `max_connections` leaves two bursts and 32 descriptors for the engine and logs: 1024
        descriptors give 864 connections.
        """
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            soft = 65536
        backlog = self.backlog or min(2048, max(16, soft // 16))
        max_connections = self.max_connections or max(16, soft - 2 * backlog - 32)
        if max_connections + 2 * backlog + 32 > soft:
            raise ConfigError(f"max_connections={max_connections} with backlog={backlog} does not "
                              f"fit the descriptor limit {soft} (needs max_connections + "
                              "2 x backlog + 32); raise `ulimit -n` or lower them")
        concurrency = self.limit_concurrency or max_connections + 1
        return msgspec.structs.replace(self, max_connections=max_connections, backlog=backlog,
                                       limit_concurrency=concurrency)


class _Guards:
    """The connection cap and the header-read timeout, for either of uvicorn's HTTP protocols
    (module docstring). Mixed in before the protocol class; relies on its `cycle`,
    `connections`, `transport` and `loop`."""

    limits: ClassVar[ServerLimits] = ServerLimits().resolved()
    cycle: Any
    connections: Any
    transport: Any
    loop: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self.waiting_since = 0.0  # when this connection started waiting for a request head
        self.head_bytes = 0       # bytes received while waiting for the current head

    # -- state --------------------------------------------------------------------------------------
    @property
    def waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self.waiting_since = self.loop.time()
        self.head_bytes = 0
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.waiting_for_head and not self.transport.is_closing():
            self.transport.close()

    # -- uvicorn hooks ------------------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()
        cap = self.limits.max_connections
        assert cap is not None
        if len(self.connections) <= cap:
            return
        idle = [c for c in self.connections if c is not self and isinstance(c, _Guards)
                and c.waiting_for_head and not c.transport.is_closing()]
        if idle:
            victim = min(idle, key=lambda c: c.waiting_since)
            victim._disarm()
            victim.transport.close()
            self.connections.discard(victim)
        else:
            self._disarm()
            transport.write(_REFUSED)
            transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing() and self.waiting_for_head:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]


class GuardedH11Protocol(_Guards, H11Protocol):
    """uvicorn's h11 protocol plus the guards (h11 bounds the head's bytes itself)."""

    def handle_events(self) -> None:
        super().handle_events()
        if not self.waiting_for_head:
            self._disarm()


class GuardedHttpToolsProtocol(_Guards, HttpToolsProtocol):
    """uvicorn's httptools (llhttp) protocol plus the guards, and the bound on a request head's
    bytes that h11 has built in (`max_header_bytes`: past it, 431 and the connection closes).
    The bytes are counted per read while a head is incomplete, so one read beyond the bound is
    the most a head can cost."""

    def data_received(self, data: bytes) -> None:
        waiting = self.waiting_for_head
        super().data_received(data)
        if not waiting or self.transport.is_closing():
            return
        if not self.waiting_for_head:   # the head completed in this read
            self._disarm()
            return
        self.head_bytes += len(data)
        if self.head_bytes > self.limits.max_header_bytes:
            self._disarm()
            self.transport.write(_HEAD_TOO_LARGE)
            self.transport.close()


_HEAD_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain\r\n"
                   b"connection: close\r\ncontent-length: 24\r\n\r\nrequest head is too large")


def guarded_protocol(limits: ServerLimits, http: str = "auto") -> type[_Guards]:
    """The guarded protocol class bound to `limits` (resolved): httptools where it is installed
    (`http="auto"`, uvicorn's own default: a C parser, several times cheaper per streamed event
    than h11), else h11."""
    base: type[_Guards]
    if http == "h11" or (http == "auto" and not _HAS_HTTPTOOLS):
        base = GuardedH11Protocol
    else:
        base = GuardedHttpToolsProtocol
    return type(base.__name__, (base,), {"limits": limits.resolved()})


def uvicorn_config(app: Any, limits: ServerLimits | None = None, http: str = "auto",
                   **kwargs: Any) -> Any:
    """A `uvicorn.Config` serving `app` with `limits` (host, port, log_level... in `kwargs`);
    `http`: "auto" (httptools where installed), "httptools" or "h11"."""
    import uvicorn

    resolved = (limits or ServerLimits()).resolved()
    assert resolved.backlog is not None
    kwargs.setdefault("ws", "none")
    return uvicorn.Config(
        app, http=guarded_protocol(resolved, http),  # type: ignore[arg-type]
        limit_concurrency=resolved.limit_concurrency,
        timeout_keep_alive=resolved.keep_alive_timeout, backlog=resolved.backlog,
        h11_max_incomplete_event_size=resolved.max_header_bytes, **kwargs)

"""The server's streaming write path: a lean SSE response and pre-encoded plain chunks.

`SSEResponse` is an ASGI response for `text/event-stream` bodies that does per event only what
the stream needs: it sends the response start through the app's middleware (which must know the
response started) and every body event straight to the HTTP server's own `send` (captured by
`App` in the scope), without Starlette's per-event wrappers or an anyio task group. A chunk that
ends in `data: [DONE]` (the stream generators give the last choice's final event, the usage and
[DONE] as one) ends the body in the same write. A watcher task
reads `receive`; on `http.disconnect` it cancels the streaming task, and the response closes its
body and calls `abandon()` on each generation (the request is aborted) whatever ended it.

`PlainChunk` holds one choice's chunk encoded around its two variable parts (the text and the
ids): `chunk(text, ids)` returns exactly the bytes msgspec gives for the whole Struct (the
template is cut from such an encoding), for the common chunk that carries nothing else.

`DirectWriter` lets a plain token's event skip the streaming task altogether: the response binds
it to the connection once the response has started, and `write(event)` frames the event as an
HTTP/1.1 chunk and hands it to the connection's transport at once, from the callback that
delivered the token (no task wakeup, no awaits, no ASGI message). It only binds to uvicorn's
httptools connection (whose state it reads: started, chunked, not complete, not disconnected,
writes not paused) and is `ready()` only while all of that holds; otherwise, or unbound, the
event takes the task path. The bytes on the wire are the same either way (tested).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any, Protocol

import msgspec
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

RAW_SEND = "atombatch.raw_send"   # scope key: the HTTP server's own send (set by `App`)
SSE_DONE = b"data: [DONE]\n\n"   # a stream's last event; a chunk ending in it ends the body

_ENCODE = msgspec.json.Encoder().encode
_TEXT_MARK = "@@atombatch-plain-text@@"
_IDS_MARK = 7_654_321_987_654_321


class App(Starlette):
    """Starlette, keeping the server's `send` in the scope for `SSEResponse`'s body events."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[RAW_SEND] = send
        await super().__call__(scope, receive, send)


_HTTPTOOLS_CYCLE = "uvicorn.protocols.http.httptools_impl"


class DirectWriter:
    """Write a streaming response's body events to its connection directly (module docstring)."""

    __slots__ = ("_cycle", "events")

    def __init__(self) -> None:
        self._cycle: Any = None
        self.events = 0                  # events written directly (for tests and stats)

    def bind(self, send: Any) -> bool:
        """Bind to the connection behind the HTTP server's own `send`; False if it is not one
        this writer understands (the events then all take the task path)."""
        cycle: Any = getattr(send, "__self__", None)
        if type(cycle).__module__ != _HTTPTOOLS_CYCLE or \
                not all(hasattr(cycle, name) for name in (
                    "transport", "flow", "disconnected", "response_started",
                    "response_complete", "chunked_encoding")) or \
                not hasattr(cycle.flow, "write_paused"):
            return False
        self._cycle = cycle
        return True

    def unbind(self) -> None:
        self._cycle = None

    def ready(self) -> bool:
        """`write` would go out now: bound, the response started chunked and is not over, the
        peer is there and the transport takes writes."""
        cycle = self._cycle
        return cycle is not None and cycle.response_started and \
            cycle.chunked_encoding is True and not cycle.response_complete and \
            not cycle.disconnected and not cycle.flow.write_paused and \
            not cycle.transport.is_closing()

    def write(self, event: bytes) -> None:
        """One body event as one HTTP/1.1 chunk (call only when `ready()`)."""
        self._cycle.transport.write(b"%x\r\n%b\r\n" % (len(event), event))
        self.events += 1

    def lane(self, template: PlainChunk) -> tuple[Callable[[], bool],
                                                  Callable[[str, int], None]] | None:
        """`(ready, put)` for a stream whose response has started and whose every later event
        is `template`'s chunk of one token: `ready()` is `self.ready()` less what cannot change
        once the response has started chunked, and `put(text, token)` writes
        `template(text, [token])` as one HTTP/1.1 chunk (call only when `ready()`). The per-token
        path of a plain stream, in as few calls as it takes; None if not `ready()` now."""
        if not self.ready():
            return None
        cycle, writer = self._cycle, self
        flow, transport = cycle.flow, cycle.transport
        closing, send = transport.is_closing, transport.write
        head, mid, tail = template.head, template.mid, template.tail
        encode = _ENCODE

        def ready() -> bool:
            return writer._cycle is cycle and not cycle.response_complete and \
                not cycle.disconnected and not flow.write_paused and not closing()

        def put(text: str, token: int) -> None:
            event = b"%b%b%b[%d]%b" % (head, encode(text), mid, token, tail)
            send(b"%x\r\n%b\r\n" % (len(event), event))
            writer.events += 1

        return ready, put


class _Abandonable(Protocol):
    def abandon(self) -> None: ...


class SSEResponse(Response):
    """Stream `content` (SSE event bytes) as `text/event-stream` (see the module docstring)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], generations: Iterable[_Abandonable],
                 headers: Mapping[str, str] | None = None,
                 writer: DirectWriter | None = None) -> None:
        self.body_iterator = content
        self.generations = list(generations)
        self.writer = writer
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.ensure_future(watch())
        raw = scope.get(RAW_SEND, send)
        try:
            try:
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                if self.writer is not None:
                    self.writer.bind(raw)
                async for chunk in self.body_iterator:
                    if chunk.endswith(SSE_DONE):  # the last events and the body's end: one write
                        await raw({"type": "http.response.body", "body": chunk,
                                   "more_body": False})
                        break
                    await raw({"type": "http.response.body", "body": chunk, "more_body": True})
                else:
                    await raw({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                if self.writer is not None:
                    self.writer.unbind()
                watcher.cancel()
                for generation in self.generations:
                    generation.abandon()
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
        except asyncio.CancelledError:
            if not gone or task.uncancel() > 0:
                raise


class PlainChunk:
    """One choice's plain chunk as bytes around its text and ids (see the module docstring)."""

    __slots__ = ("head", "mid", "tail")

    def __init__(self, head: bytes, mid: bytes, tail: bytes) -> None:
        self.head, self.mid, self.tail = head, mid, tail

    @classmethod
    def cut(cls, encode: Any) -> PlainChunk | None:
        """The template of `encode(text, ids)` (the whole event's bytes); None if the markers
        cannot be found exactly once (the caller then encodes every chunk)."""
        sample = encode(_TEXT_MARK, [_IDS_MARK])
        head, *rest = sample.split(_ENCODE(_TEXT_MARK))
        if len(rest) != 1:
            return None
        mid, *tail = rest[0].split(_ENCODE([_IDS_MARK]))
        if len(tail) != 1 or _ENCODE(_TEXT_MARK) in head:
            return None
        return cls(head, mid, tail[0])

    def __call__(self, text: str, ids: list[int]) -> bytes:
        return b"".join((self.head, _ENCODE(text), self.mid, _ENCODE(ids), self.tail))

"""A load generator's side of a streamed completion, cheap enough not to be what is measured.

The benchmark clients (`bench overlap`, `bench http`) write each HTTP/1.1 request by hand on its
own socket, read every socket from one epoll loop, and count SSE events and generated tokens by
scanning bytes, never parsing JSON: a few microseconds of CPU per token, where an HTTP client
library that parses every event costs about as much as the server's whole front (~60 us).

`Stream` is one response as it arrives: `feed(data, now)` takes the next bytes and counts
`data:` events, `token_ids` entries (or, for a server that sends no ids, one token per event with
non-empty text), the last `finish_reason`, an error status or event, and `[DONE]`.
`closed_loop` runs many requests with a fixed number in flight, each with its own deadline.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable
from typing import Any

DATA = b"data: "
DONE = b"data: [DONE]"
TOKEN_IDS = b'"token_ids":['
ERROR = b'{"error"'
_FINISH = b'"finish_reason":"'
_EMPTY_TEXT = b'"text":""'
_TEXT = b'"text":"'


def http_request(host: str, port: int, path: str, body: bytes) -> bytes:
    """A POST of a JSON body that asks for an event stream (the connection closes after it)."""
    return (b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
            b"Accept: text/event-stream\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
            % (path.encode(), host.encode(), port, len(body))) + body


class Stream:
    """One streamed completion's bytes (see the module docstring)."""

    __slots__ = ("ended", "error", "events", "finish_reason", "finished", "first", "sent",
                 "status", "tail", "timed_out", "tokens")

    def __init__(self) -> None:
        self.status = 0
        self.events = 0                      # data events carrying tokens
        self.tokens = 0
        self.finished = False                # [DONE] seen
        self.timed_out = False               # cut by the client's deadline
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.sent = 0.0                      # perf_counter when the request went out
        self.first = 0.0                     # perf_counter of the read with its first token
        self.ended = 0.0                     # perf_counter at [DONE], error or close
        self.tail = b""

    def feed(self, data: bytes, now: float) -> bool:
        """Take the next bytes; True once the stream is over."""
        buf = self.tail + data if self.tail else data
        if not self.status:
            if len(buf) < 12:
                self.tail = buf
                return False
            self.status = int(buf[9:12]) if buf.startswith(b"HTTP/1.") else -1
            if self.status != 200:
                self.error = f"HTTP {self.status}: " + buf[:300].decode(errors="replace")
        end = buf.rfind(b"\n\n")  # complete SSE events end before it; chunk framing sits between
        if end < 0:
            self.tail = buf
            return False
        self.tail = buf[end + 2:]
        events = buf.count(DATA, 0, end)
        at = buf.find(TOKEN_IDS, 0, end)
        if at < 0 and events:  # a server that sends no ids: one token per event with text
            self.tokens += buf.count(_TEXT, 0, end) - buf.count(_EMPTY_TEXT, 0, end)
        while at >= 0:
            start = at + len(TOKEN_IDS)
            close = buf.find(b"]", start, end)
            if close > start:
                self.tokens += buf.count(b",", start, close) + 1
            at = buf.find(TOKEN_IDS, close, end)
        if self.tokens and not self.first:
            self.first = now
        finish = buf.rfind(_FINISH, 0, end)
        if finish >= 0:
            start = finish + len(_FINISH)
            self.finish_reason = buf[start:buf.find(b'"', start, end)].decode(errors="replace")
        error = buf.find(ERROR, 0, end)
        if error >= 0 and self.error is None:
            self.error = "error event: " + buf[error:error + 300].decode(errors="replace")
        if buf.endswith(DONE, 0, end):
            self.finished = True
            events -= 1
        self.events += events
        if self.finished:
            self.ended = now
        return self.finished

    def closed(self, now: float) -> None:
        if not self.finished and self.error is None:
            self.error = "connection closed before [DONE]"
        self.ended = now


def closed_loop(host: str, port: int, path: str, bodies: list[bytes], concurrency: int,
                timeout: float, tokens_each: int | None = None, max_nap: float = 0.25,
                unknown_nap: float = 0.002,
                on_end: Callable[[int, Stream], None] | None = None) -> list[Stream]:
    """Send `bodies` with `concurrency` in flight (a new one as soon as one ends), each on its
    own connection, and read every stream to `[DONE]`. A stream that has not ended `timeout`
    seconds after its send is cut (`timed_out`). Returns one `Stream` per body, in order.

    Reads cost far more CPU than scanning the bytes they return, so streams that already have
    their first token are read in batches: with `tokens_each` (every request generates exactly
    that many, `ignore_eos`), a stream with `left` tokens to come at its rate so far cannot end
    within `left / rate`, so the loop reads the running streams again after half the shortest
    such time (at most `max_nap`; `unknown_nap` while some stream's rate is not known yet), and
    the end times stay exact to a small share of each stream's duration. Streams still waiting
    for their first token are watched on their own epoll without napping, so first-token times
    are exact. Without `tokens_each` every stream is read as soon as it has data. `on_end(index,
    stream)` is called as each stream ends (progress reports).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    streams = [Stream() for _ in bodies]
    live: dict[int, tuple[socket.socket, int]] = {}
    next_index = 0
    with select.epoll() as fresh, select.epoll() as running:
        watching: dict[int, Any] = {}      # fd -> the epoll it is registered with

        def start() -> None:
            nonlocal next_index
            index, next_index = next_index, next_index + 1
            stream = streams[index]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stream.sent = time.perf_counter()
            try:
                sock.connect((host, port))
                sock.sendall(http_request(host, port, path, bodies[index]))
            except OSError as exc:
                stream.error = f"connect/send: {exc}"
                stream.ended = time.perf_counter()
                sock.close()
                if on_end is not None:
                    on_end(index, stream)
                return
            sock.setblocking(False)
            fresh.register(sock.fileno(), select.EPOLLIN)
            watching[sock.fileno()] = fresh
            live[sock.fileno()] = (sock, index)

        def end(fd: int) -> None:
            sock, index = live.pop(fd)
            watching.pop(fd).unregister(fd)
            sock.close()
            if on_end is not None:
                on_end(index, streams[index])

        def read(fd: int, now: float) -> None:
            sock, index = live[fd]
            stream = streams[index]
            try:
                data = sock.recv(1 << 20)
            except BlockingIOError:
                return
            except OSError as exc:
                stream.error = f"recv: {exc}"
                data = b""
            if not data:
                stream.closed(now)
            elif not stream.feed(data, now):
                if tokens_each is not None and stream.first and watching[fd] is fresh:
                    fresh.unregister(fd)    # running now: read in batches
                    running.register(fd, select.EPOLLIN)
                    watching[fd] = running
                return
            end(fd)

        def nap(now: float) -> float:
            if tokens_each is None:
                return 0.0
            shortest = max_nap
            for fd, (_, index) in live.items():
                stream = streams[index]
                if watching[fd] is not running:
                    continue
                if stream.tokens < 2 or now <= stream.first:
                    return unknown_nap
                rate = (stream.tokens - 1) / (now - stream.first)
                shortest = min(shortest, (tokens_each - stream.tokens) / rate / 2)
            return max(0.0, shortest)

        try:
            read_at = time.perf_counter()
            while live or next_index < len(bodies):
                while next_index < len(bodies) and len(live) < concurrency:
                    start()
                if not live:
                    continue
                now = time.perf_counter()
                oldest = min(streams[i].sent for _, i in live.values())
                wait = min(1.0, oldest + timeout - now,
                           read_at - now if running_count(watching, running) else 1.0)
                for fd, _ in fresh.poll(max(0.0, wait)):
                    read(fd, time.perf_counter())
                now = time.perf_counter()
                if now >= read_at or tokens_each is None:
                    for fd, _ in running.poll(0):
                        read(fd, now)
                    read_at = now + nap(now)
                for fd, (_, index) in list(live.items()):
                    stream = streams[index]
                    if now - stream.sent >= timeout:
                        stream.error = f"no [DONE] within {timeout:g} s"
                        stream.timed_out = True
                        stream.ended = now
                        end(fd)
        finally:
            for sock, _ in live.values():
                sock.close()
    return streams


def running_count(watching: dict[int, Any], running: Any) -> int:
    return sum(1 for poller in watching.values() if poller is running)

"""What crosses from the ingress to a replica: the forwarded request and the response's start
(msgspec Structs; Ray pickles them by module name)."""

from __future__ import annotations

import msgspec


class ForwardedRequest(msgspec.Struct, frozen=True):
    """One HTTP request as the ingress received it, plus what the router needs."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    digests: tuple[bytes, ...] = ()      # leading-block digests of the prompt (may be empty)
    request_id: str = ""                 # for logs and the router's in-flight count


class ResponseStart(msgspec.Struct, frozen=True):
    """The first part of a forwarded response; body chunks (bytes) follow."""

    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str                         # which replica answered (tests, logs)

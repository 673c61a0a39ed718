"""`--api-key`: Bearer authentication on the OpenAI routes, as vLLM's `--api-key` does.

Every request whose path starts with `/v1` must carry `Authorization: Bearer <key>`; anything else
answers 401 with an OpenAI error body (and `WWW-Authenticate: Bearer`) before the body is read or
anything is parsed. The comparison is constant-time (`hmac.compare_digest` on bytes), so the
time to refuse says nothing about how much of a guessed key was right. `/health`, `/metrics`,
`/version` and the tokenizer routes stay open (as in vLLM: probes and scrapers carry no key).
Several keys may be given (any one is accepted), for key rotation.

The key is a shared secret, sent in clear over plain HTTP: docs/security.md says what else an
exposed server needs (TLS in front of it).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import msgspec
from starlette.types import ASGIApp, Receive, Scope, Send

from atombatch.errors import ConfigError
from atombatch.serve.protocol import ErrorBody, ErrorResponse

PROTECTED_PREFIX = "/v1"
MAX_KEY_BYTES = 4096           # a longer key is refused at startup, a longer header at once

_UNAUTHORIZED = msgspec.json.encode(ErrorResponse(ErrorBody(
    message="missing or invalid API key: send 'Authorization: Bearer <key>'",
    type="invalid_request_error", code="invalid_api_key")))


class BearerAuth:
    """ASGI middleware answering 401 on `/v1/*` without one of `keys` as a Bearer token."""

    def __init__(self, app: ASGIApp, keys: Sequence[str]) -> None:
        if not keys:
            raise ConfigError("--api-key: give at least one key")
        self.app = app
        self.expected: list[bytes] = []
        for key in keys:
            raw = key.encode()
            if not key or len(raw) > MAX_KEY_BYTES or key != key.strip():
                raise ConfigError(f"--api-key: a key must be 1..{MAX_KEY_BYTES} bytes without "
                                  "surrounding whitespace")
            self.expected.append(b"Bearer " + raw)

    def authorized(self, header: bytes | None) -> bool:
        if header is None or len(header) > MAX_KEY_BYTES + 16:
            return False
        ok = False
        for expected in self.expected:  # every key is compared: no early exit to time
            ok |= hmac.compare_digest(header, expected)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _protected(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        header = next((value for name, value in scope.get("headers", ())
                       if name == b"authorization"), None)
        if self.authorized(header):
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})


def _protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")

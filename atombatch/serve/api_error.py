"""`ApiError`: an error the server answers with OpenAI's error body (its own module so that
route modules below the app, such as atombatch/serve/responses.py, can raise it)."""

from __future__ import annotations

from atombatch.serve.protocol import ErrorBody, ErrorResponse


class ApiError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(ErrorBody(message=message, type=type, param=param, code=code))
        self.headers = headers

"""The ASGI app: OpenAI-compatible completions over an `AsyncBatcher`, on Starlette.

One app serves one artifact. Every generation request is validated (msgspec Structs, then the
engine's own `validate`) before anything is queued, so a bad request costs the engine nothing and
never disturbs another request. A valid one is submitted to the `AsyncBatcher` and its outputs are
sent as they come: one SSE chunk per generated token when streaming, one JSON body otherwise.

A client that goes away aborts its request at once: Starlette cancels a streaming body when
the server reports `http.disconnect` (and the body is closed in a `finally` in any case); a
non-streaming request races its collection against a disconnect watcher. The abort frees the
request's lane and blocks before the next engine step.

Statuses: 400 bad JSON or a value the engine rejects (over-long prompt, token id outside the vocab,
temperature, top_p, max_tokens, ...); 404 unknown model or path; 413 body too large; 422 a body
that does not match the schema (unknown field, wrong type, missing field); 429 queue full (with
`Retry-After`); 503 shutting down. Every error body is `{"error": {message, type, param, code}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, TypeVar

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from atombatch.aio import AsyncBatcher
from atombatch.engine import Batcher
from atombatch.errors import CapacityError, RequestError
from atombatch.serve.limits import DEFAULT_MAX_BODY_BYTES
from atombatch.serve.metrics import ServerMetrics
from atombatch.serve.protocol import (
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatCompletionRequest,
    ChatDelta,
    ChatResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
)
from atombatch.serve.tokens import Codec, Decoder, HFCodec, IdCodec
from atombatch.structs import RequestOutput, SamplingParams

T = TypeVar("T")

_ENCODER = msgspec.json.Encoder()
_DONE = b"data: [DONE]\n\n"


class ApiError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(ErrorBody(message=message, type=type, param=param, code=code))
        self.headers = headers


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_ENCODER.encode(obj), status_code=status, headers=headers,
                    media_type="application/json")


def _sse(obj: Any) -> bytes:
    return b"data: " + _ENCODER.encode(obj) + b"\n\n"


class _SSEResponse(StreamingResponse):
    """A `StreamingResponse` that always closes its body and its request (a disconnect aborts)."""

    def __init__(self, content: AsyncIterator[bytes], generation: _Generation) -> None:
        super().__init__(content, media_type="text/event-stream", headers=_SSE_HEADERS)
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            self.generation.abandon()


class _Generation:
    """One accepted request: its engine id, its output iterator and its timing for the metrics."""

    def __init__(self, server: _Server, request_id: str, prompt_len: int,
                 outputs: AsyncIterator[RequestOutput], accepted: float) -> None:
        self.server = server
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.outputs = outputs
        self.accepted = accepted
        self.decoder: Decoder = server.codec.decoder()
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.started = False                 # run() began (it then does its own accounting)
        self.abandoned = False

    def abandon(self) -> None:
        """Abort the request unless it finished (a no-op after run() has cleaned up)."""
        if self.finish_reason is None and not self.abandoned:
            self.abandoned = True
            self.server.ab.abort(self.request_id)
            if not self.started:  # hung up before the first byte of the body
                self.server.metrics.finished.labels("disconnect").inc()

    async def run(self) -> AsyncGenerator[tuple[list[int], str, RequestOutput], None]:
        """Yield (new ids, new text, output) per engine output; abort unless it finished."""
        metrics = self.server.metrics
        self.started = True
        metrics.in_flight.inc()
        last = self.accepted
        try:
            async for out in self.outputs:
                new = list(out.new_token_ids)
                if new:
                    now = time.perf_counter()
                    if self.token_ids:
                        metrics.inter_token.observe(now - last)
                    else:
                        metrics.ttft.observe(now - self.accepted)
                    last = now
                    self.token_ids.extend(new)
                    metrics.generation_tokens.inc(len(new))
                if out.finished:
                    self.finish_reason = out.finish_reason or "error"
                    self.error = out.error
                yield new, self.decoder.step(new) if new else "", out
        finally:
            metrics.in_flight.dec()
            if self.finish_reason is None:
                self.abandoned = True
                self.server.ab.abort(self.request_id)
                aclose = getattr(self.outputs, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
                metrics.finished.labels("disconnect").inc()
            else:
                metrics.finished.labels(self.finish_reason).inc()
                metrics.e2e.observe(time.perf_counter() - self.accepted)

    def usage(self) -> Usage:
        n = len(self.token_ids)
        return Usage(prompt_tokens=self.prompt_len, completion_tokens=n,
                     total_tokens=self.prompt_len + n)

    def error_event(self) -> bytes:
        return _sse(ErrorResponse(ErrorBody(message=self.error or "request failed",
                                            type="server_error", code=self.finish_reason)))


class _Server:
    def __init__(self, ab: AsyncBatcher, model_name: str, codec: Codec,
                 max_body_bytes: int, retry_after: int, body_timeout: float = 30.0) -> None:
        self.ab = ab
        self.model_name = model_name
        self.codec = codec
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.retry_after = retry_after
        self.artifact = ab.batcher.artifact
        self.metrics = ServerMetrics(ab.stats, self.artifact.batch_size)
        self.accepting = False
        self.created = int(time.time())

    # -- request parsing ---------------------------------------------------------------------------
    async def decode(self, request: Request, kind: type[T]) -> T:
        body = await self.read_body(request)
        try:
            return msgspec.json.decode(body, type=kind)
        except msgspec.ValidationError as exc:
            raise ApiError(422, str(exc), param=_schema_param(str(exc)),
                           code="invalid_schema") from None
        except msgspec.DecodeError as exc:
            raise ApiError(400, f"body is not valid JSON: {exc}", code="invalid_json") from None

    async def read_body(self, request: Request) -> bytes:
        """The request body, read as it streams in: 413 the moment it passes `max_body_bytes`
        (a chunked upload is never buffered past the limit), 408 past `body_timeout`."""
        limit = self.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"body of {length} bytes exceeds max_body_bytes={limit}",
                           code="body_too_large", headers=_CLOSE)
        body = bytearray()
        try:
            async with asyncio.timeout(self.body_timeout):
                async for chunk in request.stream():
                    if len(body) + len(chunk) > limit:
                        raise ApiError(413, f"body exceeds max_body_bytes={limit} (read "
                                       f"{len(body) + len(chunk)} bytes so far)",
                                       code="body_too_large", headers=_CLOSE)
                    body += chunk
        except TimeoutError:
            raise ApiError(408, f"the body did not arrive within body_timeout="
                           f"{self.body_timeout} s", code="body_timeout",
                           headers=_CLOSE) from None
        return bytes(body)

    def params(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int
               ) -> SamplingParams:
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"model {_clip(repr(body.model))} is not served here; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")
        unsupported: list[tuple[str, object, object]] = [
            ("n", body.n, 1), ("presence_penalty", body.presence_penalty, 0.0),
            ("frequency_penalty", body.frequency_penalty, 0.0)]
        if isinstance(body, CompletionRequest):
            unsupported += [("echo", body.echo, False), ("logprobs", body.logprobs, None)]
        else:
            unsupported += [("logprobs", body.logprobs, False)]
        for name, value, served in unsupported:
            if value != served:
                raise ApiError(400, f"{name}={value!r} is not supported: only {served!r} is served",
                               param=name, code="unsupported_value")
        if body.stop:
            raise ApiError(400, f"stop={_clip(repr(body.stop))}: stop strings are not supported; use "
                           "stop_token_ids", param="stop", code="unsupported_value")
        if body.seed is not None and body.seed < 0:
            raise ApiError(400, f"seed={body.seed} must be >= 0", param="seed",
                           code="invalid_value")
        top_k = 0 if body.top_k == -1 else body.top_k
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_k=top_k,
                              top_p=body.top_p, seed=body.seed,
                              stop_token_ids=tuple(body.stop_token_ids), ignore_eos=body.ignore_eos)

    def encode(self, text: str, param: str) -> list[int]:
        try:
            return self.codec.encode(text)
        except RequestError as exc:
            raise ApiError(400, str(exc), param=param, code="invalid_value") from None

    def submit(self, prefix: str, prompt: list[int], params: SamplingParams,
               prompt_param: str) -> _Generation:
        if not self.accepting:
            raise ApiError(503, "the server is shutting down", type="server_error",
                           code="shutting_down")
        accepted = time.perf_counter()
        request_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        try:
            self.ab.submit(prompt, params, request_id=request_id)
        except CapacityError as exc:
            raise ApiError(429, str(exc), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.retry_after)}) from None
        except RequestError as exc:
            message = str(exc)
            if "not running" in message:
                raise ApiError(503, message, type="server_error", code="shutting_down") from None
            raise ApiError(400, message, param=_engine_param(message, prompt_param),
                           code="invalid_value") from None
        self.metrics.prompt_tokens.inc(len(prompt))
        # Take the output iterator now, before any await: the request may finish at once.
        return _Generation(self, request_id, len(prompt), self.ab.outputs(request_id), accepted)

    # -- endpoints ---------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = await self.decode(request, CompletionRequest)
        params = self.params(body, body.max_tokens)
        prompt = self.encode(body.prompt, "prompt") if isinstance(body.prompt, str) else body.prompt
        gen = self.submit("cmpl", prompt, params, "prompt")
        created = int(time.time())
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return _SSEResponse(self._stream_completion(gen, created, usage), gen)
        text = await self._collect(request, gen)
        return _json(CompletionResponse(
            id=gen.request_id, created=created, model=self.model_name,
            choices=[CompletionChoice(index=0, text=text, token_ids=gen.token_ids,
                                      finish_reason=gen.finish_reason)],
            usage=gen.usage()))

    async def _stream_completion(self, gen: _Generation, created: int,
                                 usage: bool) -> AsyncIterator[bytes]:
        def chunk(choices: list[CompletionChoice], u: Usage | None = None) -> bytes:
            return _sse(CompletionResponse(id=gen.request_id, created=created,
                                           model=self.model_name, choices=choices, usage=u))

        async with contextlib.aclosing(gen.run()) as outputs:
            async for new, text, out in outputs:
                if out.finished and gen.finish_reason == "error":
                    if new:
                        yield chunk([CompletionChoice(index=0, text=text, token_ids=new)])
                    yield gen.error_event()
                    break
                yield chunk([CompletionChoice(index=0, text=text, token_ids=new,
                                              finish_reason=gen.finish_reason)])
        if usage:
            yield chunk([], gen.usage())
        yield _DONE

    async def chat(self, request: Request) -> Response:
        body = await self.decode(request, ChatCompletionRequest)
        messages = []
        for message in body.messages:
            content = message.content
            if isinstance(content, list):
                content = "".join(part.text for part in content)
            messages.append((message.role, content or ""))
        try:
            prompt = self.codec.render_chat(messages)
        except RequestError as exc:
            raise ApiError(400, str(exc), param="messages", code="invalid_value") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else \
            body.max_tokens if body.max_tokens is not None else \
            max(1, self.artifact.max_seq_len - len(prompt))
        params = self.params(body, max_tokens)
        gen = self.submit("chatcmpl", prompt, params, "messages")
        created = int(time.time())
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return _SSEResponse(self._stream_chat(gen, created, usage), gen)
        text = await self._collect(request, gen)
        return _json(ChatResponse(
            id=gen.request_id, created=created, model=self.model_name,
            choices=[ChatChoice(index=0, message=ChatResponseMessage("assistant", text),
                                token_ids=gen.token_ids, finish_reason=gen.finish_reason)],
            usage=gen.usage()))

    async def _stream_chat(self, gen: _Generation, created: int,
                           usage: bool) -> AsyncIterator[bytes]:
        def chunk(choices: list[ChatChunkChoice], u: Usage | None = None) -> bytes:
            return _sse(ChatChunk(id=gen.request_id, created=created, model=self.model_name,
                                  choices=choices, usage=u))

        yield chunk([ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""),
                                     token_ids=[])])
        async with contextlib.aclosing(gen.run()) as outputs:
            async for new, text, out in outputs:
                if out.finished and gen.finish_reason == "error":
                    if new:
                        yield chunk([ChatChunkChoice(index=0, delta=ChatDelta(content=text),
                                                     token_ids=new)])
                    yield gen.error_event()
                    break
                yield chunk([ChatChunkChoice(index=0, delta=ChatDelta(content=text),
                                             token_ids=new, finish_reason=gen.finish_reason)])
        if usage:
            yield chunk([], gen.usage())
        yield _DONE

    async def _collect(self, request: Request, gen: _Generation) -> str:
        """Run a non-streaming request to its end, aborting it if the client goes away."""

        async def collect() -> str:
            parts = []
            async with contextlib.aclosing(gen.run()) as outputs:
                async for _, text, _ in outputs:
                    parts.append(text)
            return "".join(parts)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(collect())
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
            gen.abandon()
        if work.cancelled():
            raise ApiError(499, "client closed the request", code="client_closed")
        text = work.result()
        if gen.finish_reason == "error":
            raise ApiError(500, gen.error or "request failed", type="server_error",
                           code="engine_error")
        return text

    async def models(self, request: Request) -> Response:
        art = self.artifact
        spec = art.model
        info = {"vocab_size": spec.vocab_size, "max_seq_len": art.max_seq_len,
                "batch_size": art.batch_size, "block_size": art.block_size,
                "num_blocks": art.num_blocks, "prefill_chunk_size": art.prefill_chunk_size,
                "family": spec.family, "eos_token_ids": list(spec.eos_token_ids),
                "artifact": art.label, "identity": art.identity,
                "policy": self.ab.batcher.policy.label, "max_waiting": self.ab.batcher.max_waiting,
                "tokenizer": self.codec.name}
        return _json(ModelList(data=[ModelCard(id=self.model_name, created=self.created,
                                               owned_by="atombatch", atombatch=info,
                                               max_model_len=art.max_seq_len)]))

    async def health(self, request: Request) -> Response:
        task = getattr(self.ab, "_task", None)
        if not self.accepting or task is None or task.done():
            return _json({"status": "unavailable"}, status=503)
        return _json({"status": "ok"})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- errors ------------------------------------------------------------------------------------
    async def api_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        if exc.status != 499:
            self.metrics.rejected.labels(str(exc.status)).inc()
        return _json(exc.body, status=exc.status, headers=exc.headers)

    async def http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        body = ErrorResponse(ErrorBody(message=f"{request.method} {request.url.path}: "
                                       f"{exc.detail}", type="invalid_request_error", code=code))
        return _json(body, status=exc.status_code, headers=dict(exc.headers or {}))


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_CLOSE = {"Connection": "close"}  # the rest of a refused body is never read: end the connection
_BACKTICK = re.compile(r"`([^`]*)`")
_PATH = re.compile(r"at `\$\.?([^`]*)`")


def _clip(text: str, limit: int = 80) -> str:
    """Client-supplied text quoted in an error, cut to `limit` characters."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _schema_param(message: str) -> str | None:
    """The offending field of a msgspec validation message, e.g. `max_tokens` or `messages[0].x`."""
    path_match = _PATH.search(message)
    path = path_match.group(1) if path_match else ""
    if message.startswith(("Object contains unknown field", "Object missing required field")):
        field = _BACKTICK.search(message)
        if field:
            return f"{path}.{field.group(1)}" if path else field.group(1)
    return path or None


def _engine_param(message: str, prompt_param: str) -> str | None:
    """The parameter a `RequestError` from `Batcher.validate` names (its messages start with it)."""
    match = re.match(r"(\w+)=", message)
    if match:
        return match.group(1)
    if message.startswith("stop token id"):
        return "stop_token_ids"
    if message.startswith(("prompt", "token id")):
        return prompt_param
    return None


def create_app(batcher_or_async: Batcher | AsyncBatcher, model_name: str,
               tokenizer: Codec | Any | None = None, *,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, retry_after: int = 1,
               on_shutdown: Callable[[], None] | None = None,
               body_timeout: float = 30.0) -> Starlette:
    """Build the OpenAI-compatible app for one engine.

    Args:
        batcher_or_async: a `Batcher` (wrapped in an `AsyncBatcher` that offloads steps to a
            worker thread) or an `AsyncBatcher`. The app's lifespan starts it and, at shutdown,
            closes it with `drain=True` (in-flight requests finish first).
        model_name: the id served at `/v1/models` and expected in `model` fields.
        tokenizer: None (token-id text, see `atombatch.serve.tokens`), a `Codec`, or a
            `tokenizers.Tokenizer`.
        max_body_bytes: larger request bodies answer 413, checked as the body streams in.
        body_timeout: seconds a request body may take to arrive; slower ones answer 408.
        retry_after: seconds sent in `Retry-After` with a 429.
        on_shutdown: called after the engine drained (e.g. to release a device).

    Returns:
        A Starlette app to run with uvicorn; `atombatch.serve.limits.uvicorn_config(app, ...)`
        adds the connection cap and header timeout an exposed server needs.
    """
    ab = batcher_or_async if isinstance(batcher_or_async, AsyncBatcher) else \
        AsyncBatcher(batcher_or_async, offload=True)
    if tokenizer is None:
        codec: Codec = IdCodec(max_ids=ab.batcher.artifact.max_seq_len)
    elif hasattr(tokenizer, "render_chat"):
        codec = tokenizer
    else:
        codec = HFCodec(tokenizer)
    server = _Server(ab, model_name, codec, max_body_bytes, retry_after, body_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await ab.start()
        server.accepting = True
        try:
            yield
        finally:
            server.accepting = False
            await ab.close(drain=True)
            if on_shutdown is not None:
                on_shutdown()

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_endpoint, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: server.api_error,
                                        HTTPException: server.http_error})
    app.state.server = server
    app.state.async_batcher = ab
    app.state.metrics_registry = server.metrics.registry
    return app

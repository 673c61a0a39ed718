"""The ASGI app: OpenAI-compatible completions over an `AsyncBatcher`, on Starlette.

One app serves one artifact. Every generation request is validated (msgspec Structs, then the
engine's own `validate`) before anything is queued, so a bad request costs the engine nothing and
never disturbs another request. A valid one is submitted to the `AsyncBatcher` and its outputs are
sent as they come: one SSE chunk per generated token when streaming, one JSON body otherwise.

A client that goes away aborts its request at once: the SSE response (atombatch/serve/sse.py)
cancels a streaming body when the server reports `http.disconnect` (and the body is closed and
its requests abandoned in a `finally` in any case); a
non-streaming request races its collection against a disconnect watcher. The abort frees the
request's lane and blocks before the next engine step.

Request bodies are decoded leniently, as vLLM does (`atombatch.serve.schema`): unknown fields are
ignored (logged once per name, listed in `X-Ignored-Fields`) unless the app is strict, and `null`
means "default" for optional fields.

Statuses: 400 bad JSON, a body that does not match the schema (wrong type, missing field, unknown
field when strict), a value the engine rejects (over-long prompt, token id outside the vocab,
temperature, top_p, max_tokens, ...), a field that changes the result and that this server
cannot honour (atombatch/serve/unhonoured.py), tools or a structured-output constraint that is
too large or does not compile; 401 a missing API key (`--api-key`); 404 unknown model or path;
413 body too large; 429 queue full (with `Retry-After`); 503 shutting down. Every error body is
`{"error": {message, type, param, code}}`, and the reason of every 4xx is logged (logger
`atombatch.serve`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from atombatch.api.mailbox import Mailbox, as_outputs
from atombatch.api.structs import RequestOutput, SamplingParams, TokenLogprobs
from atombatch.api.validation import queue_limit
from atombatch.core import CoreClient
from atombatch.engine.aio import AsyncBatcher, compact_outputs
from atombatch.engine.batcher import Batcher
from atombatch.errors import (
    CapacityError,
    ConfigError,
    RequestError,
    StateError,
    UnavailableError,
)
from atombatch.logs import logger
from atombatch.sampling.detokenizer import bad_word_ids
from atombatch.sampling.grammar_check import GRAMMAR_WALL_SECONDS
from atombatch.serve import lora, schema, vllm_api
from atombatch.serve.api_error import ApiError
from atombatch.serve.auth import BearerAuth
from atombatch.serve.chat_output import (
    ChatConstraints,
    ChatOutput,
    Piece,
    UnservableConstraint,
    chat_finish_reason,
    delta_of,
    message_of,
)
from atombatch.serve.chat_template import check_template_kwargs
from atombatch.serve.echo import MIN_LOGPROB, Echo, echo_logprobs, joined
from atombatch.serve.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_RESPONSE_BYTES
from atombatch.serve.metrics import ServerMetrics
from atombatch.serve.protocol import (
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatResponse,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptLogprobsJSON,
    PromptTokensDetails,
    StreamOptions,
    TopLogprob,
    Usage,
)
from atombatch.serve.reasoning import REASONING_PARSER_NAMES
from atombatch.serve.responses import ResponsesAPI
from atombatch.serve.sse import SSE_DONE, App, DirectWriter, PlainChunk, SSEResponse
from atombatch.serve.structured import DEFAULT_MAX_STRUCTURED_CHARS, StructuredRequests
from atombatch.serve.tokens import Codec, Decoder, HFCodec, IdCodec
from atombatch.serve.tools import TOOL_PARSER_NAMES, NoToolParser, ToolCallError, ToolPlan

T = TypeVar("T")
log = logger("atombatch.serve")

_ENCODER = msgspec.json.Encoder()
# The response-size estimate (`_Server.check_response_size`): bytes per generated token and per
# logprob candidate in OpenAI's JSON (a candidate carries its text, logprob, rank and bytes).
_TOKEN_BYTES = 16
_LOGPROB_BYTES = 64


@contextlib.contextmanager
def _owned(gens: list[_Generation]) -> Iterator[None]:
    """Until a response owns them, queued generations are aborted by any failure (a response
    that cannot start must not leave its requests generating for nobody)."""
    try:
        yield
    except BaseException:
        for gen in gens:
            gen.abandon()
        raise


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_ENCODER.encode(obj), status_code=status, headers=headers,
                    media_type="application/json")


def _sse(obj: Any) -> bytes:
    return b"data: " + _ENCODER.encode(obj) + b"\n\n"


def _SSEResponse(content: AsyncIterator[bytes], generations: list[_Generation],
                 headers: dict[str, str] | None = None,
                 writer: DirectWriter | None = None) -> SSEResponse:
    """The lean SSE response (atombatch/serve/sse.py): closes its body and its requests (a
    disconnect aborts); `writer` is the stream's direct writer, if it has one."""
    return SSEResponse(content, generations, {**_SSE_HEADERS, **(headers or {})}, writer)


# What a wakeup of plain tokens stands for in `_Generation.run`'s output slot: choice 0, not
# finished, no text, logprobs or prompt logprobs (the streams check `out is _PLAIN`).
_PLAIN = RequestOutput(request_id="", new_token_ids=(), finished=False)


def _step_one(step: Callable[[Sequence[int]], str], token: int) -> str:
    return step((token,))


class _Choice:
    """What one of a request's n choices produced so far."""

    __slots__ = ("decoder", "finish_reason", "logprobs", "stop_reason", "text", "token_ids")

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder                # used when the engine sends no text of its own
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: list[TokenLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None


class _Generation:
    """One accepted request: its engine id, its output iterator and its timing for the metrics."""

    def __init__(self, server: _Server, request_id: str, prompt: list[int],
                 outputs: Mailbox, accepted: float, params: SamplingParams) -> None:
        self.server = server
        self.request_id = request_id
        self.prompt_len = len(prompt)
        self.outputs = outputs
        self.accepted = accepted
        # each choice's text from the request's own params (the engine's Detokenizer)
        self.choices = [_Choice(server.codec.decoder(prompt, params)) for _ in range(params.n)]
        self.generated = 0
        self.finish_reason: str | None = None  # the whole request (an error in any choice wins)
        self.error: str | None = None
        self.error_param: str | None = None  # the request field that caused the error, if any
        self.prompt = prompt                  # the prompt's ids (echo)
        self.prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # when asked for
        self.started = False                 # run() began (it then does its own accounting)
        self.abandoned = False
        self.last_token_at = accepted        # perf_counter of the last token (inter-token gaps)
        self.max_tokens = 0                  # its resolved max_tokens (vLLM's metrics)
        self.cached_tokens: int | None = None  # prompt tokens the prefix cache saved (the
                                             #   engine's count, on choice 0's completion)
        self.model = server.model_name        # the `model` it answers with: the adapter's name
                                             #   when it runs one (vLLM's)

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    def abandon(self) -> None:
        """Abort the request unless it finished (a no-op after run() has cleaned up)."""
        if self.finish_reason is None and not self.abandoned:
            self.abandoned = True
            self.server.ab.abort(self.request_id)
            if not self.started:  # hung up before the first byte of the body
                self.server.metrics.finished.labels("disconnect").inc()
                self._vllm_unfinished()

    def cancel(self) -> None:
        """Withdraw a request that was queued but will not be served (its batch was refused)."""
        if self.finish_reason is None and not self.abandoned:
            self.abandoned = True
            self.server.ab.abort(self.request_id)
            self.server.metrics.finished.labels("abort").inc()
            self._vllm_unfinished()

    def fast_lane(self, template: PlainChunk, writer: DirectWriter) -> None:
        """From now on, while the stream waits, write each plain token's event directly from
        the callback that delivers it (`Mailbox.sink`, `DirectWriter.lane`): the same accounting
        and bytes as `run()` and the stream's plain branch (`_took`, written out here: this is
        the per-token path), without waking the stream's task. Only for one generation of one
        choice whose stream takes plain chunks (the caller's rule)."""
        lane = writer.lane(template)
        if lane is None:
            return
        ready, put = lane
        choice = self.choices[0]
        ids, texts, decoder = choice.token_ids, choice.text, choice.decoder
        step = getattr(decoder, "step_one", None)  # (a codec's decoder written without it:)
        if step is None:
            step = functools.partial(_step_one, decoder.step)
        metrics = self.server.metrics
        direct, generated = metrics.direct_events, metrics.generation_tokens
        gap, first = metrics.inter_token.observe, self._first_token
        clock = time.perf_counter

        def sink(token: int) -> bool:
            if self.finish_reason is not None or not ready():
                return False
            now = clock()
            if self.generated:
                gap(now - self.last_token_at)
            else:
                first(now)
            self.last_token_at = now
            ids.append(token)
            self.generated += 1
            generated.value += 1     # (`_TokenCounter.inc`, without the call: per token)
            text = step(token)
            texts.append(text)
            put(text, token)
            direct.value += 1
            return True

        self.outputs.sink = sink

    def _took(self, choice: _Choice, new: list[int]) -> None:
        """`new` tokens reached `choice`: the timing metrics (first token or inter-token gap),
        the token counts."""
        metrics = self.server.metrics
        now = time.perf_counter()
        if self.generated:
            metrics.inter_token.observe(now - self.last_token_at)
        else:
            self._first_token(now)
        self.last_token_at = now
        choice.token_ids.extend(new)
        self.generated += len(new)
        metrics.generation_tokens.inc(len(new))

    def _first_token(self, now: float) -> None:
        """The request's first token reached the front at `now` (once per request)."""
        metrics = self.server.metrics
        ttft = now - self.accepted
        metrics.ttft.observe(ttft)
        metrics.vllm.first_token(self.prompt_len, ttft)

    def _choice_done(self, choice: _Choice, out: RequestOutput) -> None:
        """One choice ended: vLLM's per-request metrics (vLLM observes each choice of n > 1)."""
        completion = out.completion
        if completion is not None and out.index == 0:
            self.cached_tokens = completion.cached_tokens
        self.server.metrics.vllm.choice_done(
            out.finish_reason, time.perf_counter() - self.accepted, self.prompt_len,
            self.max_tokens, completion, len(choice.token_ids))

    def _vllm_unfinished(self) -> None:
        """The request ends with choices unfinished (the client left, or it never ran): vLLM
        counts each as aborted."""
        vllm = self.server.metrics.vllm
        e2e = time.perf_counter() - self.accepted
        for choice in self.choices:
            if choice.finish_reason is None:
                vllm.choice_done("abort", e2e, self.prompt_len, self.max_tokens, None,
                                 len(choice.token_ids))
        vllm.request_done(len(self.choices), max(len(c.token_ids) for c in self.choices))

    async def run(self, index: int = 0
                  ) -> AsyncGenerator[tuple[int, tuple[list[int], str, RequestOutput]], None]:
        """Yield (index, (new ids, new text, output)) per wakeup and choice: what arrived since
        the last one, merged (so a stream that fell behind catches up in one SSE event and one
        write); abort unless it finished. Metrics move once per wakeup, not per token. A wakeup
        of plain tokens only (ints in the mailbox) yields `_PLAIN` as its output."""
        metrics = self.server.metrics
        self.started = True
        metrics.in_flight.inc()
        box = self.outputs
        try:
            while self.finish_reason is None:
                items = await box.take()
                if (len(items) == 1 and type(items[0]) is int) or \
                        all(type(item) is int for item in items):  # plain tokens only
                    new: list[int] = items  # type: ignore[assignment]
                    choice = self.choices[0]
                    self._took(choice, new)
                    text = choice.decoder.step(new)
                    choice.text.append(text)
                    yield index, (new, text, _PLAIN)
                    continue
                for out in _by_choice(as_outputs(self.request_id, items)):
                    choice = self.choices[out.index] if out.index < len(self.choices) else \
                        self.choices[0]
                    new = list(out.new_token_ids)
                    if new:
                        self._took(choice, new)
                    if out.logprobs:
                        choice.logprobs.extend(out.logprobs)
                    if out.prompt_logprobs is not None:
                        self.prompt_logprobs = out.prompt_logprobs
                    if out.cached_tokens is not None and out.index == 0:
                        self.cached_tokens = out.cached_tokens
                    if out.text is not None:  # the engine detokenized (stop strings held back)
                        text = out.text
                    elif out.finish_reason is not None:  # "stop" here is a stop id: the
                        # engine sends the text of a stop-string match itself
                        text = choice.decoder.finish(new, out.finish_reason == "stop")
                    else:
                        text = choice.decoder.step(new) if new else ""
                    choice.text.append(text)
                    if out.finish_reason is not None:
                        choice.finish_reason = out.finish_reason
                        self._choice_done(choice, out)
                        if out.completion is not None:
                            choice.stop_reason = out.completion.stop_reason
                        if out.finish_reason == "error" and self.error is None:
                            self.error = out.error
                            self.error_param = out.error_param
                    if out.finished:
                        self.finish_reason = "error" if self.error is not None else \
                            out.finish_reason or "error"
                    yield index, (new, text, out)
        finally:
            box.sink = None
            metrics.in_flight.dec()
            if self.finish_reason is None:
                self.abandoned = True
                self.server.ab.abort(self.request_id)
                metrics.finished.labels("disconnect").inc()
                self._vllm_unfinished()
            else:
                metrics.finished.labels(self.finish_reason).inc()
                metrics.e2e.observe(time.perf_counter() - self.accepted)
                metrics.vllm.request_done(len(self.choices),
                                          max(len(c.token_ids) for c in self.choices))

    def usage(self) -> Usage:
        """A continuous-usage chunk's usage (with `prompt_tokens_details` once the first token
        said how many prompt tokens were cached, as vLLM)."""
        n = self.generated
        details = PromptTokensDetails(cached_tokens=self.cached_tokens) \
            if self.server.prompt_tokens_details and self.cached_tokens is not None else None
        return Usage(prompt_tokens=self.prompt_len, completion_tokens=n,
                     total_tokens=self.prompt_len + n, prompt_tokens_details=details)

    def error_event(self) -> bytes:
        if self.error_param is not None:  # the client's constraint failed it, not the engine
            return _sse(ErrorResponse(ErrorBody(message=self.error or "request failed",
                                                type="invalid_request_error",
                                                param=self.error_param,
                                                code="constraint_failed")))
        code = "engine_unavailable" if self.server.core_died else self.finish_reason
        return _sse(ErrorResponse(ErrorBody(message=self.error or "request failed",
                                            type="server_error", code=code)))


class _Server:
    @property
    def core_died(self) -> bool:
        """The engine core process exited without being asked to."""
        return isinstance(self.ab, CoreClient) and self.ab.dead

    def __init__(self, ab: AsyncBatcher | CoreClient, model_name: str, codec: Codec,
                 max_body_bytes: int, retry_after: int, strict_protocol: bool = False,
                 body_timeout: float = 30.0, bounds: schema.Bounds = schema.DEFAULT_BOUNDS,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
                 max_structured_chars: int = DEFAULT_MAX_STRUCTURED_CHARS,
                 tool_parser: str | None = None, reasoning_parser: str | None = None,
                 grammar_check: str | None = None,
                 grammar_wall_seconds: float = GRAMMAR_WALL_SECONDS) -> None:
        self.ab = ab
        self.tool_parser = tool_parser            # --tool-call-parser (tool_choice auto)
        self.reasoning_parser = reasoning_parser  # --reasoning-parser
        self.bounds = bounds
        self.max_response_bytes = max_response_bytes
        # Tokenizing and rendering chat templates: one worker thread, off the event loop that
        # streams to every other client (the tokenizer releases the GIL on long texts); requests
        # needing it queue for it, so many of them cost one core, not all.
        self.text_worker = concurrent.futures.ThreadPoolExecutor(1, "atombatch-text")
        self.strict_protocol = strict_protocol
        self.warned_fields: set[str] = set()      # unknown field names already logged
        self.model_name = model_name
        self.codec = codec
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.retry_after = retry_after
        self.artifact = ab.artifact
        self.structured = StructuredRequests(
            getattr(codec, "tokenizer", None), self.artifact.model.vocab_size,
            self.artifact.model.eos_token_ids, max_structured_chars,
            worker_target=grammar_check, wall_seconds=grammar_wall_seconds)
        self.constraints = ChatConstraints(self.structured, reasoning_parser,
                                           getattr(codec, "tokenizer", None))
        self.max_loras: int | None = None  # --max-loras (vLLM's `max_lora` label)
        self.enable_lora = False            # --enable-lora (or an embedder's enable_lora=True)
        self.lora_paths: dict[str, str] = {}  # adapter -> the directory this front knows
        self.max_cpu_loras = lora.DEFAULT_MAX_CPU_LORAS  # adapters loaded at once, at most
        self.metrics = ServerMetrics(ab.stats, self.artifact, model_name,
                                     shared=getattr(ab, "shared", None),
                                     max_lora=self.max_lora_label)
        self.accepting = False
        self.prompt_tokens_details = False  # --enable-prompt-tokens-details
        self.created = int(time.time())
        self.lora_lock = asyncio.Lock()     # adapters load and unload one at a time

    # -- request parsing ---------------------------------------------------------------------------
    async def decode(self, request: Request, kind: type[T]) -> T:
        body = await self.read_body(request)
        try:
            value, ignored, dropped = schema.decode(body, kind, strict=self.strict_protocol,
                                                    bounds=self.bounds)
        except schema.SchemaError as exc:
            raise ApiError(400, str(exc), param=exc.param, code=exc.code) from None
        except msgspec.DecodeError as exc:
            raise ApiError(400, f"body is not valid JSON: {exc}", code="invalid_json") from None
        model = getattr(value, "model", None)
        if isinstance(model, str):  # before a constraint costs a check: a wrong model is a 404
            self.check_model(model)
        try:  # a new constraint compiles off the event loop (`params` then finds it checked)
            await self.structured.check_off_loop(value)
        except RequestError as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
        except CapacityError as exc:
            raise self.busy(exc) from None
        if ignored:
            request.state.ignored_fields = ignored
            request.state.ignored_count = dropped
            for path in ignored:
                name = _INDEX.sub("[]", path)
                if name in self.warned_fields or len(self.warned_fields) > MAX_WARNED_FIELDS:
                    continue
                self.warned_fields.add(name)
                if len(self.warned_fields) > MAX_WARNED_FIELDS:
                    log.warning("request.unknown_fields_unlogged", limit=MAX_WARNED_FIELDS,
                                note="more distinct unknown request fields than the limit: "
                                     "new ones are no longer logged")
                    break
                log.warning("request.unknown_field_ignored", path=request.url.path, field=name,
                            note="further uses are ignored silently; --strict-protocol "
                                 "rejects them")
        return value

    def headers(self, request: Request) -> dict[str, str] | None:
        """`X-Ignored-Fields` when the body had fields this server does not read."""
        ignored = getattr(request.state, "ignored_fields", None)
        if not ignored:
            return None
        listed = ", ".join(ignored[:MAX_LISTED_FIELDS])
        total = getattr(request.state, "ignored_count", len(ignored))
        if total > MAX_LISTED_FIELDS:
            listed += f", ... ({total - MAX_LISTED_FIELDS} more)"
        return {IGNORED_FIELDS_HEADER: listed}

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

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` (tokenizing, rendering) on the text worker, not on the event loop;
        a token-id codec (no tokenizer) parses on the loop: its work stops at the context."""
        if isinstance(self.codec, IdCodec):
            return fn(*args)
        return await self.in_worker(fn, *args)

    async def in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the text worker (building a response body that may hold up to
        `max_response_bytes` of logprob entries)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.text_worker, functools.partial(fn, *args))

    def check_samplable(self, params: SamplingParams) -> None:
        """Refuse `allowed_token_ids` that `bad_words` ban entirely (single-token words are
        banned at every step): the sampler would find nothing to sample and fail mid-stream.
        (`api/validation.py` refuses the same with stop ids under `min_tokens`.)"""
        allowed, words = params.allowed_token_ids, params.bad_words
        if allowed is None or not words or not isinstance(self.codec, HFCodec):
            return
        banned = {ids[0] for ids in bad_word_ids(self.codec.tokenizer, words) if len(ids) == 1}
        if banned.issuperset(allowed):
            raise ApiError(400, f"bad_words ban every one of allowed_token_ids "
                           f"{sorted(set(allowed))[:8]}: no token could be sampled",
                           param="bad_words", code="invalid_value")

    def check_response_size(self, prompts: list[list[int]], params: SamplingParams,
                            max_tokens: int | None, echoed: list[str] | None = None) -> None:
        """Refuse a request whose response would pass `max_response_bytes` (estimated before it
        is queued): logprob entries repeat per choice, so `prompt_logprobs` x `n` on a long
        prompt asks for hundreds of megabytes from a few kilobytes. With `echoed` (the prompts'
        texts, once they are known) each choice's copy of its prompt's text counts too (twice
        with logprobs: the text and its tokens' strings)."""
        n = params.n
        room = self.artifact.max_seq_len  # a longer max_tokens is refused at submit anyway
        generated = sum(max(0, room - len(p)) if max_tokens is None else
                        max(0, min(max_tokens, room - len(p))) for p in prompts)
        estimate = n * generated * _TOKEN_BYTES
        if params.logprobs is not None:
            estimate += n * generated * (params.logprobs + 1) * _LOGPROB_BYTES
        if params.prompt_logprobs is not None:
            k = max(params.prompt_logprobs, 0)
            estimate += n * sum(len(p) for p in prompts) * (k + 1) * _LOGPROB_BYTES
        if echoed is not None:
            estimate += n * sum(len(text) for text in echoed) * \
                (2 if params.logprobs is not None else 1)
        if estimate > self.max_response_bytes:
            raise ApiError(400, f"the response could take about {estimate} bytes (n={n}, "
                           f"logprobs={params.logprobs}, prompt_logprobs="
                           f"{params.prompt_logprobs}, {len(prompts)} prompt(s)), more than "
                           f"max_response_bytes={self.max_response_bytes}: ask for fewer "
                           "choices, logprobs or tokens", param="n" if n > 1 else
                           "echo" if echoed is not None else
                           "prompt_logprobs" if params.prompt_logprobs is not None else
                           "max_tokens", code="response_too_large")

    def params(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
               echo: Echo | None = None) -> SamplingParams:
        self.check_model(body.model)
        prompt_logprobs = body.prompt_logprobs
        if isinstance(body, CompletionRequest):
            logprobs = body.logprobs
            if echo is not None:
                max_tokens = echo.max_tokens(body.max_tokens)
                prompt_logprobs = echo.prompt_logprobs()
        else:
            if body.top_logprobs is not None and not body.logprobs:
                raise ApiError(400, f"top_logprobs={body.top_logprobs} needs logprobs=true",
                               param="top_logprobs", code="invalid_value")
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        stop: tuple[str, ...] = () if body.stop is None else \
            (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
        bias = None
        if body.logit_bias is not None:
            bias = {}
            for key, value in body.logit_bias.items():
                if not (key.isascii() and key.isdigit() and len(key) <= 12):
                    raise ApiError(400, f"logit_bias key {key!r} must be a token id",
                                   param="logit_bias", code="invalid_value")
                bias[int(key)] = value
        try:
            structured = self.structured.resolve(body)
        except RequestError as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
        except CapacityError as exc:
            raise self.busy(exc) from None
        try:
            return SamplingParams(
                n=body.n, max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=stop,
                stop_token_ids=tuple(body.stop_token_ids),
                include_stop_str_in_output=body.include_stop_str_in_output,
                ignore_eos=body.ignore_eos, presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
                logit_bias=bias,
                allowed_token_ids=None if body.allowed_token_ids is None else
                tuple(body.allowed_token_ids),
                bad_words=tuple(body.bad_words), skip_special_tokens=body.skip_special_tokens,
                spaces_between_special_tokens=body.spaces_between_special_tokens,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured=structured)
        except RequestError as exc:
            message, param = str(exc), exc.param   # the field SamplingParams checked
            if param == "logprobs" and not isinstance(body, CompletionRequest):
                param = "top_logprobs"
                message = message.replace("logprobs=", "top_logprobs=", 1)
            raise ApiError(400, message, param=param, code="invalid_value") from None

    def encode(self, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
        try:
            return vllm_api.encode_prompt(self.codec, text, add_special_tokens)
        except RequestError as exc:
            raise ApiError(400, str(exc), param=param, code="invalid_value") from None

    def submit(self, prefix: str, prompt: list[int], params: SamplingParams,
               prompt_param: str, validated: bool = False, lora: str | None = None
               ) -> _Generation:
        if not self.accepting:
            raise ApiError(503, "the server is shutting down", type="server_error",
                           code="shutting_down")
        accepted = time.perf_counter()
        request_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        try:
            self.ab.submit(prompt, params, request_id=request_id, lora=lora,
                           validated=validated)
        except CapacityError as exc:
            raise self.busy(exc) from None
        except UnavailableError as exc:
            raise ApiError(exc.http_status, str(exc), type="server_error",
                           code="engine_unavailable" if self.core_died else "shutting_down"
                           ) from None
        except RequestError as exc:
            message = str(exc)
            raise ApiError(exc.http_status, message, param=_param(exc, prompt_param),
                           code="invalid_value") from None
        self.metrics.prompt_tokens.inc(len(prompt))
        # Take the output iterator now, before any await: the request may finish at once.
        gen = _Generation(self, request_id, prompt, self.ab.output_box(request_id), accepted,
                          params)
        gen.max_tokens = params.max_tokens if params.max_tokens is not None else \
            self.artifact.max_seq_len - len(prompt)
        gen.model = self.model_name if lora is None else lora
        return gen

    def busy(self, exc: CapacityError) -> ApiError:
        """A 429 with `Retry-After` (a full queue: of requests, or of constraints to compile)."""
        return ApiError(exc.http_status, str(exc), type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(self.retry_after)})

    # -- logprobs in OpenAI's shapes ------------------------------------------------------------
    def token_text(self, token: int) -> str:
        """A logprob entry's token string (the codec's, the same in every mode)."""
        return self.codec.token_text(token)

    def completion_logprobs(self, logprobs: list[TokenLogprobs], start: int = 0
                            ) -> CompletionLogprobs:
        tokens, offsets = [], []
        offset = start
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return CompletionLogprobs(  # -inf (a masked id) is sent as -9999.0, as vLLM does
            tokens=tokens, token_logprobs=[max(lp.logprob, MIN_LOGPROB) for lp in logprobs],
            top_logprobs=[{self.token_text(t.token_id): max(t.logprob, MIN_LOGPROB)
                           for t in lp.top} for lp in logprobs],
            text_offset=offsets)

    def prompt_logprobs_json(self, entries: tuple[TokenLogprobs | None, ...] | None,
                             k: int | None = -1) -> PromptLogprobsJSON | None:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {id: Logprob} holding the
        prompt token and the top candidates (the first `k` of them; -1: all computed); -inf
        clamped to -9999.0 as vLLM does. None when not asked for (`k` None)."""
        if entries is None or k is None:
            return None
        keep = None if k < 0 else k
        texts: dict[int, str] = {}

        def entry(token: int, logprob: float, rank: int) -> PromptLogprob:
            text = texts.get(token)
            if text is None:
                text = texts[token] = self.token_text(token)
            return PromptLogprob(logprob=max(logprob, MIN_LOGPROB), rank=rank, decoded_token=text)

        out: PromptLogprobsJSON = []
        for lp in entries:
            if lp is None:
                out.append(None)
                continue
            position = {str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank)}
            for top in lp.top[:keep]:
                if str(top.token_id) not in position:
                    position[str(top.token_id)] = entry(top.token_id, top.logprob, top.rank)
            out.append(position)
        return out

    def chat_logprobs(self, logprobs: list[TokenLogprobs]) -> ChatLogprobs:
        def top(token: int, logprob: float) -> TopLogprob:
            text = self.token_text(token)
            return TopLogprob(token=text, logprob=max(logprob, MIN_LOGPROB),
                              bytes=list(text.encode()))

        content = []
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            content.append(ChatTokenLogprob(  # -inf (a masked id) is sent as -9999.0
                token=text, logprob=max(lp.logprob, MIN_LOGPROB), bytes=list(text.encode()),
                top_logprobs=[top(t.token_id, t.logprob) for t in lp.top]))
        return ChatLogprobs(content=content)

    def truncate(self, prompts: list[list[int]],
                 body: CompletionRequest | ChatCompletionRequest) -> list[list[int]]:
        """vLLM's `truncate_prompt_tokens`: keep each prompt's last k tokens (-1: the context
        length); refuse beam search, which this server does not run."""
        if body.use_beam_search:
            raise ApiError(400, "use_beam_search=true is not supported: sampling only",
                           param="use_beam_search", code="unsupported_value")
        k = body.truncate_prompt_tokens
        if k is None:
            return prompts
        if k == -1:
            k = self.artifact.max_seq_len
        if k < 1:
            raise ApiError(400, f"truncate_prompt_tokens={k} must be >= 1 (or -1: the context "
                           "length)", param="truncate_prompt_tokens", code="invalid_value")
        return [prompt[-k:] for prompt in prompts]

    def prompts(self, prompt: str | list[Any], n: int = 1,
                add_special_tokens: bool = True) -> list[list[int]]:
        """A completions `prompt` as token-id lists: one, or a batch (strings or id lists).
        Text gets the tokenizer's special tokens unless `add_special_tokens` is false (vLLM's
        default and field); token ids are taken as they are."""
        if isinstance(prompt, str):
            return [self.encode(prompt, "prompt", add_special_tokens)]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            batch = [self.encode(p, f"prompt[{i}]", add_special_tokens)
                     for i, p in enumerate(prompt)]
        elif all(isinstance(p, list) for p in prompt):
            batch = [list(p) for p in prompt]
        else:
            raise ApiError(400, "prompt must be a string, a list of token ids, a list of strings "
                           "or a list of token-id lists, not a mix", param="prompt",
                           code="invalid_type")
        limit = queue_limit(self.artifact.batch_size, self.ab.max_waiting or 0)
        if len(batch) * n > limit:  # each choice of each prompt is a request
            raise ApiError(400, f"a batch of {len(batch)} prompts x n={n} choices exceeds "
                           f"{limit} (lanes + --max-waiting): split it", param="prompt",
                           code="batch_too_large")
        return batch

    def submit_all(self, prefix: str, prompts: list[list[int]], params: SamplingParams,
                   prompt_param: str, lora: str | None = None) -> list[_Generation]:
        """Submit every prompt or none: a rejected one aborts those already queued. Each
        prompt is validated once (a batch's before any is queued; the engine and the core do
        not check again)."""
        validated = len(prompts) > 1
        if validated:
            for i, prompt in enumerate(prompts):
                try:
                    self.ab.validate(prompt, params)
                except RequestError as exc:
                    raise ApiError(400, f"prompt[{i}]: {exc}",
                                   param=_param(exc, f"prompt[{i}]"),
                                   code="invalid_value") from None
        gens: list[_Generation] = []
        try:
            for prompt in prompts:
                gens.append(self.submit(prefix, prompt, params, prompt_param, validated, lora))
        except ApiError:
            for gen in gens:
                gen.cancel()
            raise
        return gens

    def check_chat_features(self, body: ChatCompletionRequest) -> None:
        """Reject what this server cannot honour, naming it."""
        for name in ("functions", "function_call"):
            if getattr(body, name) is not None:
                raise ApiError(400, f"{name}: function calling is not supported", param=name,
                               code="unsupported_value")
        if body.chat_template is not None:
            raise ApiError(400, "chat_template: a per-request template is not accepted; the server "
                           f"renders with {getattr(self.codec, 'chat_template_name', 'its own')}",
                           param="chat_template", code="unsupported_value")

    def check_completion_features(self, body: CompletionRequest) -> None:
        if body.suffix:
            raise ApiError(400, "suffix is not supported (no fill-in-the-middle)", param="suffix",
                           code="unsupported_value")
        if body.best_of not in (None, 1):
            raise ApiError(400, f"best_of={body.best_of} is not supported: only 1 is served",
                           param="best_of", code="unsupported_value")

    # -- endpoints ---------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = await self.decode(request, CompletionRequest)
        self.check_completion_features(body)
        try:
            echo = Echo(body)
        except RequestError as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
        params = self.params(body, body.max_tokens, echo)
        prompts = self.truncate(await self.off_loop(self.prompts, body.prompt, body.n,
                                                    body.add_special_tokens), body)
        self.check_response_size(prompts, params, echo.max_tokens(body.max_tokens))
        self.check_samplable(params)
        try:
            gens = self.submit_all("cmpl", prompts, params, "prompt",
                                   self.check_model(body.model))
        except ApiError as exc:
            raise self.echo_refusal(exc, echo) from None
        with _owned(gens):
            echoed = await self.off_loop(self.echoed_prompts, body, prompts) \
                if echo.enabled else None
            if echoed is not None:  # n copies of a prompt of long tokens (aborted if too big)
                self.check_response_size(prompts, params, echo.max_tokens(body.max_tokens),
                                         echoed)
            created = int(time.time())
            headers = self.headers(request)
            if body.stream:
                usage = _usage_mode(body.stream_options)
                writer = DirectWriter()
                return _SSEResponse(self._stream_completion(gens, created, usage, echo, echoed,
                                                            writer), gens, headers, writer)
            await self._collect(request, gens)
        # the logprob entries (up to max_response_bytes of them) are formatted and encoded on
        # the text worker: on the event loop they stopped every other stream for seconds
        choices = await self.in_worker(self.completion_choices, gens, params, echo, echoed)
        total = _total_usage(gens) if echo.generate else _prompt_usage(gens)
        payload = await self.in_worker(_ENCODER.encode, CompletionResponse(
            id=gens[0].request_id, created=created, model=gens[0].model, choices=choices,
            usage=total))
        return Response(payload, headers=headers, media_type="application/json")

    def completion_choices(self, gens: list[_Generation], params: SamplingParams, echo: Echo,
                           echoed: list[str] | None) -> list[CompletionChoice]:
        """The choices of a finished non-streamed completion (choice `g * n + i` is choice i
        of prompt g); an echoed prompt's logprobs are built once per prompt, not per choice."""
        want_logprobs = params.logprobs is not None
        choices = []
        for g, gen in enumerate(gens):
            prompt_logprobs = self.prompt_logprobs_json(gen.prompt_logprobs,
                                                        echo.user_prompt_logprobs)
            head = self.echo_head(gen) if echoed is not None and want_logprobs else None
            for i, c in enumerate(gen.choices):
                text, token_ids, finish = "".join(c.text), c.token_ids, c.finish_reason
                logprobs = self.completion_logprobs(c.logprobs) if want_logprobs else None
                if not echo.generate:
                    text, token_ids, finish, logprobs = "", [], "length", None
                if echoed is not None:
                    text = echoed[g] + text
                    if head is not None:
                        logprobs = joined(head, logprobs)
                choices.append(CompletionChoice(
                    index=g * params.n + i, text=text, token_ids=token_ids, finish_reason=finish,
                    stop_reason=c.stop_reason if echo.generate else None, logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs))
        return choices

    def echoed_prompts(self, body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """Each prompt's text as echoed: as sent when it was text (and not truncated), else
        decoded from its ids."""
        sent: list[str | None] = [None] * len(prompts)
        if isinstance(body.prompt, str):
            sent = [body.prompt]
        elif body.prompt and all(isinstance(p, str) for p in body.prompt):
            sent = list(body.prompt)  # type: ignore[arg-type]
        if body.truncate_prompt_tokens is not None:
            sent = [None] * len(prompts)
        return [text if text is not None else self.codec.decode(ids)
                for text, ids in zip(sent, prompts, strict=True)]

    def echo_head(self, gen: _Generation) -> CompletionLogprobs:
        try:
            return echo_logprobs(gen.prompt, gen.prompt_logprobs, self.token_text)
        except RequestError as exc:
            raise ApiError(500, str(exc), type="server_error", code="engine_error") from None

    @staticmethod
    def echo_refusal(exc: ApiError, echo: Echo) -> ApiError:
        """A refusal of the prompt logprobs only echo asked for, reworded to name `echo`."""
        error = exc.body.error
        if error.param != "prompt_logprobs":
            return exc
        reworded = echo.explain(RequestError(error.message, param=error.param))
        if reworded.param == error.param:
            return exc
        return ApiError(exc.status, str(reworded), param="echo", code="unsupported_value",
                        headers=exc.headers)

    async def _stream_completion(self, gens: list[_Generation], created: int,
                                 usage: tuple[bool, bool], echo: Echo,
                                 echoed: list[str] | None,
                                 writer: DirectWriter | None = None) -> AsyncIterator[bytes]:
        """Choice `g * n + i` is choice i of prompt g (OpenAI's order for batched prompts). An
        echoed prompt (text and logprobs) leads each choice's first chunk. A single plain
        stream hands its later plain tokens to `writer` (`_Generation.fast_lane`)."""
        include_usage, continuous = usage

        def chunk(choices: list[CompletionChoice], u: Usage | None = None) -> bytes:
            return _sse(CompletionResponse(id=gens[0].request_id, created=created,
                                           model=gens[0].model, choices=choices, usage=u))

        n = len(gens[0].choices)
        offsets = [[0] * n for _ in gens]
        started = [[False] * n for _ in gens]
        tail = _StreamTail(len(gens) * n)
        # the plain chunk of each choice, pre-encoded (not with continuous usage or echo only)
        plain: dict[int, PlainChunk | None] | None = \
            None if continuous or not echo.generate else {}
        async with contextlib.aclosing(_merged(gens)) as events:
            async for g, (new, text, out) in events:
                gen, i = gens[g], out.index
                index = g * n + i
                if out is _PLAIN and plain is not None and (echoed is None or started[g][i]):
                    if index not in plain:
                        plain[index] = PlainChunk.cut(
                            lambda t, ids, index=index: chunk([CompletionChoice(
                                index=index, text=t, token_ids=ids)]))
                    template = plain[index]
                    if template is not None:
                        offsets[g][i] += len(text)  # (plain tokens carry no logprobs)
                        started[g][i] = True
                        yield template(text, new)
                        if writer is not None and len(gens) == 1 and n == 1 and \
                                gen.outputs.sink is None:
                            gen.fast_lane(template, writer)
                        continue
                running = gen.usage() if continuous else None
                logprobs = None
                if not echo.generate:
                    new, text = [], ""
                elif out.logprobs is not None:
                    logprobs = self.completion_logprobs(list(out.logprobs), offsets[g][i])
                offsets[g][i] += len(text)
                if echoed is not None and not started[g][i] and out.finish_reason != "error":
                    text = echoed[g] + text
                    if echo.logprobs is not None:
                        head = await self.in_worker(self.echo_head, gen)
                        logprobs = joined(head, logprobs)
                        offsets[g][i] += head.text_offset[-1] + len(head.tokens[-1]) \
                            if head.tokens else 0
                started[g][i] = True
                if out.finish_reason == "error":
                    if new:
                        yield chunk([CompletionChoice(index=index, text=text, token_ids=new,
                                                      logprobs=logprobs)], running)
                    tail.add(gen.error_event())
                    break
                finish = out.finish_reason
                if finish is not None and not echo.generate:
                    finish = "length"
                prompt_logprobs = None
                if out.prompt_logprobs is not None and echo.user_prompt_logprobs is not None:
                    prompt_logprobs = await self.in_worker(
                        self.prompt_logprobs_json, out.prompt_logprobs, echo.user_prompt_logprobs)
                event = chunk([CompletionChoice(index=index, text=text, token_ids=new,
                                                finish_reason=finish,
                                                stop_reason=gen.choices[i].stop_reason
                                                if out.finish_reason and echo.generate else None,
                                                logprobs=logprobs,
                                                prompt_logprobs=prompt_logprobs)], running)
                if not tail.holds(event, out.finish_reason is not None):
                    yield event
        if include_usage:
            tail.add(chunk([], _total_usage(gens) if echo.generate else _prompt_usage(gens)))
        yield tail.done()

    def tool_plan(self, body: ChatCompletionRequest) -> ToolPlan:
        """What the request's tools ask for (400 naming the field when it cannot be served)."""
        try:
            return ToolPlan.from_request(body.tools, body.tool_choice, body.parallel_tool_calls,
                                         self.tool_parser)
        except RequestError as exc:
            raise ApiError(400, str(exc), param=exc.param or "tools",
                           code="unsupported_value" if isinstance(exc, NoToolParser) else
                           "invalid_value") from None

    async def constrain(self, params: SamplingParams, plan: ToolPlan, prompt: list[int]
                        ) -> SamplingParams:
        """The constraint of a required or named tool choice, and the reasoning before any
        constraint (atombatch/serve/chat_output.py); a new tool schema is compile-checked in a
        worker thread (the event loop keeps streaming)."""
        try:
            if self.constraints.needs_check(plan):
                return await self.structured.run_check(self.constraints.apply, params, plan,
                                                       prompt)
            return self.constraints.apply(params, plan, prompt)
        except CapacityError as exc:
            raise self.busy(exc) from None
        except UnservableConstraint as exc:
            raise ApiError(400, str(exc), param=exc.param, code="unsupported_value") from None
        except RequestError as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None

    async def chat(self, request: Request) -> Response:
        body = await self.decode(request, ChatCompletionRequest)
        self.check_chat_features(body)
        plan = self.tool_plan(body)
        messages = [_message_dict(m) for m in body.messages]
        try:
            check_template_kwargs(body.chat_template_kwargs or {})
        except RequestError as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
        template: dict[str, Any] = dict(body.chat_template_kwargs or {})
        template.update(add_generation_prompt=body.add_generation_prompt,
                        continue_final_message=body.continue_final_message)
        if plan.tools is not None:
            template["tools"] = plan.tools
        if body.documents is not None:
            template["documents"] = body.documents
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else \
            body.max_tokens  # None: up to the context end
        params = self.params(body, max_tokens)
        try:
            prompt = await self.off_loop(functools.partial(self.codec.render_chat, messages,
                                                           **template))
        except RequestError as exc:
            raise ApiError(400, str(exc), param="messages", code="invalid_value") from None
        params = await self.constrain(params, plan, prompt)
        prompts = self.truncate([prompt], body)
        self.check_response_size(prompts, params, max_tokens)
        self.check_samplable(params)
        gens = self.submit_all("chatcmpl", prompts, params, "messages",
                               self.check_model(body.model))
        with _owned(gens):
            created = int(time.time())
            headers = self.headers(request)
            if body.stream:
                usage = _usage_mode(body.stream_options)
                writer = DirectWriter()
                return _SSEResponse(self._stream_chat(gens, created, usage, plan, writer), gens,
                                    headers, writer)
            await self._collect(request, gens)
        # parsed, formatted and encoded on the text worker (see completions)
        payload = await self.in_worker(self.chat_body, gens, params, plan, created)
        return Response(payload, headers=headers, media_type="application/json")

    def chat_body(self, gens: list[_Generation], params: SamplingParams, plan: ToolPlan,
                  created: int) -> bytes:
        """The JSON of a finished non-streamed chat completion."""
        want_logprobs = params.logprobs is not None
        choices = []
        for i, c in enumerate(gens[0].choices):
            output = ChatOutput(plan, self.reasoning_parser)
            try:
                message = message_of(output, "".join(c.text), c.finish_reason)
            except ToolCallError as exc:  # the calls the request asked for passed a bound
                raise ApiError(400, str(exc), param="tools", code="tool_call_limit") from None
            finish = chat_finish_reason(c.finish_reason, output)
            choices.append(ChatChoice(
                index=i, message=message, token_ids=c.token_ids, finish_reason=finish,
                stop_reason=c.stop_reason,
                logprobs=self.chat_logprobs(c.logprobs) if want_logprobs else None))
        return _ENCODER.encode(ChatResponse(
            id=gens[0].request_id, created=created, model=gens[0].model, choices=choices,
            usage=_total_usage(gens),
            prompt_logprobs=self.prompt_logprobs_json(gens[0].prompt_logprobs)))

    async def _stream_chat(self, gens: list[_Generation], created: int,
                           usage: tuple[bool, bool], plan: ToolPlan,
                           writer: DirectWriter | None = None) -> AsyncIterator[bytes]:
        include_usage, continuous = usage

        def chunk(choices: list[ChatChunkChoice], u: Usage | None = None) -> bytes:
            return _sse(ChatChunk(id=gens[0].request_id, created=created, model=gens[0].model,
                                  choices=choices, usage=u))

        n = len(gens[0].choices)
        outputs = [[ChatOutput(plan, self.reasoning_parser) for _ in range(n)] for _ in gens]
        for g, gen in enumerate(gens):
            for i in range(n):
                yield chunk([ChatChunkChoice(index=g * n + i,
                                             delta=ChatDelta(role="assistant", content=""),
                                             token_ids=[])], gen.usage() if continuous else None)
        plain: dict[int, PlainChunk | None] | None = None if continuous else {}
        tail = _StreamTail(len(gens) * n)
        async with contextlib.aclosing(_merged(gens)) as events:
            async for g, (new, text, out) in events:
                gen, i = gens[g], out.index
                index = g * n + i
                output = outputs[g][i]
                if out is _PLAIN and plain is not None and not output.active:
                    if index not in plain:
                        plain[index] = PlainChunk.cut(
                            lambda t, ids, index=index: chunk([ChatChunkChoice(
                                index=index, delta=ChatDelta(content=t), token_ids=ids)]))
                    template = plain[index]
                    if template is not None:
                        yield template(text, new)
                        if writer is not None and len(gens) == 1 and n == 1 and \
                                gen.outputs.sink is None:
                            gen.fast_lane(template, writer)
                        continue
                running = gen.usage() if continuous else None
                logprobs = None if out.logprobs is None else self.chat_logprobs(list(out.logprobs))
                finish: str | None = out.finish_reason
                if output.active:
                    try:
                        piece = output.feed(text)
                        if finish is not None:
                            last = output.finish()
                            piece = Piece(reasoning=piece.reasoning + last.reasoning,
                                          content=piece.content + last.content,
                                          calls=piece.calls + last.calls)
                    except ToolCallError as exc:
                        gen.error = str(exc)
                        tail.add(gen.error_event())
                        break
                    delta = delta_of(piece)
                    finish = chat_finish_reason(finish, output)
                else:
                    delta = ChatDelta(content=text)
                if out.finish_reason == "error":
                    if new:
                        yield chunk([ChatChunkChoice(index=index, delta=delta,
                                                     token_ids=new, logprobs=logprobs)], running)
                    tail.add(gen.error_event())
                    break
                event = chunk([ChatChunkChoice(index=index, delta=delta,
                                               token_ids=new, finish_reason=finish,
                                               stop_reason=gen.choices[i].stop_reason
                                               if out.finish_reason else None,
                                               logprobs=logprobs)], running)
                if not tail.holds(event, out.finish_reason is not None):
                    yield event
        if include_usage:
            tail.add(chunk([], _total_usage(gens)))
        yield tail.done()

    async def _collect(self, request: Request, gens: list[_Generation]) -> None:
        """Run non-streaming requests to their end (their choices keep what they produced),
        aborting them if the client goes away."""

        async def collect() -> None:
            async with contextlib.aclosing(_merged(gens)) as events:
                async for _ in events:
                    pass

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
            for gen in gens:
                gen.abandon()
        if work.cancelled():
            raise ApiError(499, "client closed the request", code="client_closed")
        work.result()
        failed = next((g for g in gens if g.finish_reason == "error"), None)
        if failed is not None and failed.error_param is not None:
            # the request's own constraint failed it (llguidance's limits reached while it
            # generated): the client's input, answered as one, not as a server fault
            raise ApiError(400, failed.error or "request failed", param=failed.error_param,
                           code="constraint_failed")
        if failed is not None and self.core_died:  # the engine is gone, not this request
            raise ApiError(503, failed.error or "the engine core exited", type="server_error",
                           code="engine_unavailable")
        if failed is not None:
            raise ApiError(500, failed.error or "request failed", type="server_error",
                           code="engine_error")

    def model_card(self) -> ModelCard:
        art = self.artifact
        spec = art.model
        info = {"vocab_size": spec.vocab_size, "max_seq_len": art.max_seq_len,
                "batch_size": art.batch_size, "block_size": art.block_size,
                "num_blocks": art.num_blocks, "prefill_chunk_size": art.prefill_chunk_size,
                "family": spec.family, "eos_token_ids": list(spec.eos_token_ids),
                "artifact": art.label, "identity": art.identity,
                "policy": self.ab.policy_label, "max_waiting": self.ab.max_waiting,
                "tokenizer": self.codec.name,
                "chat_template": getattr(self.codec, "chat_template_name", "unknown"),
                "strict_protocol": self.strict_protocol,
                "engine_core": self._engine_core_card()}
        return ModelCard(id=self.model_name, created=self.created, owned_by="atombatch",
                         atombatch=info, max_model_len=art.max_seq_len, root=self.model_name)

    def _engine_core_card(self) -> dict[str, Any]:
        if not isinstance(self.ab, CoreClient):
            return {"mode": "inline"}
        card: dict[str, Any] = {"mode": "process", "pid": self.ab.core_pid}
        shared = self.ab.shared
        if shared is not None:  # one of several fronts on the core (--api-server-count)
            card.update(front=shared.front, fronts=shared.fronts, front_pid=os.getpid())
        return card

    def adapter_card(self, name: str) -> ModelCard:
        """An adapter at /v1/models, as vLLM lists one: `root` its directory (a compiled
        adapter, or one another front loaded: its name), `parent` the served model."""
        info: dict[str, Any] = {}
        adapter = self.ab.batcher.lora_adapters.get(name) \
            if isinstance(self.ab, AsyncBatcher) else None
        if adapter is not None:  # inline: the engine's own record of it
            info = {"lora_int_id": adapter.lora_int_id, "r": adapter.r,
                    "lora_alpha": adapter.lora_alpha,
                    "target_modules": list(adapter.target_modules), "identity": adapter.identity}
        root = self.lora_paths.get(name) or (adapter.path if adapter is not None else "") or name
        return ModelCard(id=name, created=self.created, owned_by="atombatch", atombatch=info,
                         max_model_len=self.artifact.max_seq_len, root=root,
                         parent=self.model_name)

    async def models(self, request: Request) -> Response:
        cards = [self.model_card()]
        cards += [self.adapter_card(name) for name in sorted(self.adapters())]
        return _json(ModelList(data=cards))

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id == self.model_name:
            return _json(self.model_card())
        self.check_model(model_id)
        return _json(self.adapter_card(model_id))

    # -- LoRA adapters (docs/lora.md#serving-adapters) -----------------------------------------
    def adapters(self) -> list[str]:
        """The LoRA adapters requests may name now (the engine's, or its core's as it last
        said: every front of a shared core hears of each change)."""
        return list(getattr(self.ab, "loras", None) or ())

    def lora_on(self) -> bool:
        """LoRA is on: `--enable-lora`, or adapters are served (a compiled artifact's)."""
        return self.enable_lora or bool(self.adapters())

    def max_lora_label(self) -> str | None:
        """`vllm:lora_requests_info`'s `max_lora` label while LoRA is on, else None: the gauge
        is not exported, as in vLLM without LoRA."""
        if not self.lora_on():
            return None
        cap = self.max_loras
        if cap is None and isinstance(self.ab, AsyncBatcher):
            cap = self.ab.batcher.options.max_loras
        return str(cap) if cap is not None else ""

    async def load_lora_adapter(self, request: Request) -> Response:
        try:
            body = lora.decode_load(await self.read_body(request))
        except ValueError as exc:
            raise ApiError(400, str(exc), code="invalid_value") from None
        name, path = body.lora_name, body.lora_path
        self.check_lora_on()
        if name == self.model_name:
            raise ApiError(400, f"The lora adapter '{name}' conflicts with a served base model.",
                           param="lora_name", code="invalid_value")
        async with self.lora_lock:  # one change at a time on this front
            if name in self.adapters():
                why = "load_inplace is not supported here: unload it first" \
                    if body.load_inplace else \
                    "If you want to load the adapter in place, set 'load_inplace' to True."
                raise ApiError(400, f"The lora adapter '{name}' has already been loaded. {why}",
                               param="lora_name", code="invalid_value")
            loaded = len(self.adapters())
            if loaded >= self.max_cpu_loras:
                raise ApiError(400, f"{loaded} LoRA adapters are loaded, at most "
                               f"max_cpu_loras={self.max_cpu_loras} (--max-cpu-loras): unload "
                               "one first", param="lora_name", code="too_many_adapters")
            try:  # the files are read on the engine's loader thread, never on this loop
                # the engine counts again: fronts sharing a core see only their own loads
                await self.ab.load_lora(name, path, max_loaded=self.max_cpu_loras)
            except (ConfigError, RequestError) as exc:
                if len(self.adapters()) >= self.max_cpu_loras:  # another front's load won
                    raise ApiError(400, str(exc), param="lora_name",
                                   code="too_many_adapters") from None
                raise ApiError(400, f"lora_path {_clip(repr(path))}: {exc}", param="lora_path",
                               code="invalid_value") from None
            except UnavailableError as exc:
                raise ApiError(exc.http_status, str(exc), type="server_error",
                               code="engine_unavailable") from None
            served = set(self.adapters())  # (forget those other fronts unloaded: bounded)
            self.lora_paths = {n: p for n, p in self.lora_paths.items() if n in served}
            self.lora_paths[name] = path
        log.info("lora.loaded", name=name, path=path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.",
                        media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        try:
            body = lora.decode_unload(await self.read_body(request))
        except ValueError as exc:
            raise ApiError(400, str(exc), code="invalid_value") from None
        name = body.lora_name
        self.check_lora_on()
        async with self.lora_lock:
            if name not in self.adapters():
                raise self.adapter_not_found(name)
            try:
                await self.ab.unload_lora(name)
            except ConfigError as exc:  # compiled adapters
                raise ApiError(400, str(exc), param="lora_name",
                               code="unsupported_value") from None
            except (StateError, RequestError) as exc:  # in use (or gone meanwhile)
                if name not in self.adapters():
                    raise self.adapter_not_found(name) from None
                raise ApiError(400, str(exc), param="lora_name", code="adapter_in_use") from None
            except UnavailableError as exc:
                raise ApiError(exc.http_status, str(exc), type="server_error",
                               code="engine_unavailable") from None
            self.lora_paths.pop(name, None)
        log.info("lora.unloaded", name=name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.",
                        media_type="text/plain")

    @staticmethod
    def adapter_not_found(name: str) -> ApiError:
        return ApiError(404, f"The lora adapter '{_clip(name)}' cannot be found.",
                        param="lora_name", code="adapter_not_found")

    def check_lora_on(self) -> None:
        if not self.lora_on():
            raise ApiError(400, "LoRA is off: start the server with --enable-lora "
                           "(docs/lora.md)", code="unsupported_value")

    # -- vLLM's operational endpoints (atombatch/serve/vllm_api.py) -----------------------------
    async def tokenize(self, request: Request) -> Response:
        body = await self.decode(request, vllm_api.TokenizeRequest)
        self.check_model(body.model)
        messages = None if body.messages is None else [_message_dict(m) for m in body.messages]
        try:
            answer = await self.off_loop(vllm_api.tokenize, self.codec, body, messages,
                                         self.artifact.max_seq_len)
        except RequestError as exc:
            raise ApiError(400, str(exc), param=exc.param or "prompt",
                           code="invalid_value") from None
        return _json(answer, headers=self.headers(request))

    async def detokenize(self, request: Request) -> Response:
        body = await self.decode(request, vllm_api.DetokenizeRequest)
        self.check_model(body.model)
        try:
            vllm_api.check_ids(body.tokens, self.artifact.model.vocab_size,
                               self.artifact.max_seq_len)
        except RequestError as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
        text = await self.off_loop(self.codec.decode, body.tokens)
        return _json(vllm_api.DetokenizeResponse(prompt=text), headers=self.headers(request))

    async def version(self, request: Request) -> Response:
        from atombatch import __version__
        return _json({"version": __version__})

    async def tokenizer_info(self, request: Request) -> Response:
        return _json(vllm_api.tokenizer_info(self.codec, self.artifact.max_seq_len))

    def check_model(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (None: the served model, or no `model`).

        Raises:
            ApiError: 404, the model is neither the served one nor a served adapter (vLLM's).
        """
        if not model or model == self.model_name:  # "" is the served model too (vLLM's)
            return None
        if model in self.adapters():
            return model
        adapters = sorted(self.adapters())
        also = f" and the LoRA adapters {_clip(', '.join(map(repr, adapters)))}" \
            if adapters else ""
        raise ApiError(404, f"model {_clip(repr(model))} is not served here; this server "
                       f"serves {self.model_name!r}{also}", param="model",
                       code="model_not_found")


    async def health(self, request: Request) -> Response:
        if not self.accepting or not self.ab.running:
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
        if 400 <= exc.status < 500:
            error = exc.body.error
            emit = log.info if exc.status in (429, 499) else log.warning
            emit("request.rejected", method=request.method, path=request.url.path,
                 status=exc.status, code=error.code, param=error.param, message=error.message)
        headers = {**(self.headers(request) or {}), **(exc.headers or {})}
        return _json(exc.body, status=exc.status, headers=headers or None)

    async def http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if 400 <= exc.status_code < 500:
            log.warning("request.rejected", method=request.method, path=request.url.path,
                        status=exc.status_code, code=code, param=None, message=exc.detail)
        body = ErrorResponse(ErrorBody(message=message, type="invalid_request_error", code=code))
        return _json(body, status=exc.status_code, headers=dict(exc.headers or {}))


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
MAX_LISTED_FIELDS = 32       # names in X-Ignored-Fields (a client controls how many there are)
MAX_WARNED_FIELDS = 1024     # distinct names logged once each; past it, no more are logged
_INDEX = re.compile(r"\[\d+\]")


def _usage_mode(options: StreamOptions | None) -> tuple[bool, bool]:
    """(a last usage chunk, usage on every chunk): vLLM's `continuous_usage_stats` needs
    `include_usage` too."""
    if options is None:
        return False, False
    return options.include_usage, options.include_usage and options.continuous_usage_stats


def _total_usage(gens: list[_Generation]) -> Usage:
    prompt = sum(g.prompt_len for g in gens)
    completion = sum(g.generated for g in gens)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion, prompt_tokens_details=_details(gens))


def _prompt_usage(gens: list[_Generation]) -> Usage:
    """Usage of requests that generate nothing (echo with max_tokens=0)."""
    prompt = sum(g.prompt_len for g in gens)
    return Usage(prompt_tokens=prompt, completion_tokens=0, total_tokens=prompt,
                 prompt_tokens_details=_details(gens))


def _details(gens: list[_Generation]) -> PromptTokensDetails | None:
    """`prompt_tokens_details` of a final usage (--enable-prompt-tokens-details): the prompt
    tokens the prefix cache saved, summed over the body's prompts; None (left out) without the
    flag, or when the engine reported none (no request ran)."""
    if not gens or not gens[0].server.prompt_tokens_details:
        return None
    cached = [g.cached_tokens for g in gens if g.cached_tokens is not None]
    return PromptTokensDetails(cached_tokens=sum(cached)) if cached else None


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    """A request message as the chat template sees it (text parts joined by newlines, as vLLM's
    "string" content format does)."""
    content = message.content
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    out: dict[str, Any] = {"role": message.role, "content": content}
    for name in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
        value = getattr(message, name)
        if value is not None:
            out[name] = value
    return out


def _by_choice(batch: list[RequestOutput]) -> list[RequestOutput]:
    """A wakeup's outputs with each run of one choice's consecutive outputs merged into one
    (tokens, text and logprobs joined; the last one's finish kept)."""
    if len(batch) == 1:
        return batch
    merged: list[RequestOutput] = []
    run: list[RequestOutput] = []
    for out in batch:
        if run and (out.index != run[-1].index or run[-1].finish_reason is not None):
            merged.append(compact_outputs(run) if len(run) > 1 else run[0])
            run = []
        run.append(out)
    merged.append(compact_outputs(run) if len(run) > 1 else run[0])
    return merged


class _StreamTail:
    """A stream's last events, written with `[DONE]` and the body's end in one write
    (`SSEResponse`): the final event of the last choice still running, the usage chunk, an
    error event."""

    __slots__ = ("events", "left")

    def __init__(self, choices: int) -> None:
        self.left = choices              # choices without their final event yet
        self.events: list[bytes] = []

    def holds(self, event: bytes, final: bool) -> bool:
        """Keep `event` for the tail if it is the last running choice's final one."""
        if final:
            self.left -= 1
            if not self.left:
                self.events.append(event)
                return True
        return False

    def add(self, event: bytes) -> None:
        self.events.append(event)

    def done(self) -> bytes:
        return b"".join((*self.events, SSE_DONE))


def _merged(gens: list[_Generation]
            ) -> AsyncGenerator[tuple[int, tuple[list[int], str, RequestOutput]], None]:
    """The outputs of several generations as (choice index, output) in arrival order; leaving
    early closes (and so aborts) every generation still running. One generation is its own
    `run()` (no generator between)."""
    if len(gens) == 1:
        return gens[0].run(0)
    return _interleaved(gens)


async def _interleaved(gens: list[_Generation]
                       ) -> AsyncGenerator[tuple[int, tuple[list[int], str, RequestOutput]], None]:
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(index: int, gen: _Generation) -> None:
        try:
            async with contextlib.aclosing(gen.run(index)) as outputs:
                async for item in outputs:
                    queue.put_nowait(item)
        except Exception as exc:
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, done))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_CLOSE = {"Connection": "close"}  # the rest of a refused body is never read: end the connection


def _clip(text: str, limit: int = 80) -> str:
    """Client-supplied text quoted in an error, cut to `limit` characters."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _param(exc: RequestError, prompt_param: str) -> str | None:
    """The request field an engine error names (its `param`), in the server's spelling."""
    return prompt_param if exc.param == "prompt" else exc.param


def create_app(batcher_or_async: Batcher | AsyncBatcher | CoreClient, model_name: str,
               tokenizer: Codec | Any | None = None, *,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, retry_after: int = 1,
               on_shutdown: Callable[[], None] | None = None,
               strict_protocol: bool = False, body_timeout: float = 30.0,
               bounds: schema.Bounds = schema.DEFAULT_BOUNDS,
               max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
               max_structured_chars: int = DEFAULT_MAX_STRUCTURED_CHARS,
               api_keys: Sequence[str] = (), tool_parser: str | None = None,
               reasoning_parser: str | None = None,
               grammar_check: str | None = None,
               grammar_wall_seconds: float = GRAMMAR_WALL_SECONDS,
               enable_prompt_tokens_details: bool = False,
               enable_lora: bool = False, lora_paths: Mapping[str, str] | None = None,
               lora_updates: bool | None = None, max_loras: int | None = None,
               max_cpu_loras: int | None = None) -> Starlette:
    """Build the OpenAI-compatible app for one engine.

    Args:
        batcher_or_async: a `Batcher` (wrapped in an `AsyncBatcher` that offloads steps to a
            worker thread), an `AsyncBatcher`, or a `CoreClient` (the engine in its own process:
            its engine is built here if `start_process()` was not called yet, and its
            tokenizer is the core factory's business). The app's lifespan starts it and, at
            shutdown, closes it with `drain=True` (in-flight requests finish first).
        model_name: the id served at `/v1/models` and expected in `model` fields.
        tokenizer: None (token-id text, see `atombatch.serve.tokens`), a `Codec`, or a
            `tokenizers.Tokenizer`; a Hugging Face tokenizer is also given to the engine (when it
            has none) so stop strings and bad words work and text streams through its
            detokenizer.
        max_body_bytes: larger request bodies answer 413, checked as the body streams in.
        body_timeout: seconds a request body may take to arrive; slower ones answer 408.
        retry_after: seconds sent in `Retry-After` with a 429.
        on_shutdown: called after the engine drained (e.g. to release a device).
        strict_protocol: reject request fields the server does not read (400
            `unknown_parameter`) instead of ignoring them (logged once per name, listed in the
            `X-Ignored-Fields` response header).
        bounds: what decoding one body may cost (nesting, objects walked, unknown names kept).
        max_response_bytes: a request whose response is estimated larger answers 400
            `response_too_large` before it is queued (logprobs x n, prompt logprobs).
        max_structured_chars: characters of one structured-output constraint (a JSON schema,
            regex, grammar or the choices) at most; a longer one answers 400.
        api_keys: when given, `/v1/*` needs `Authorization: Bearer <one of them>` (else 401;
            atombatch/serve/auth.py).
        tool_parser: `hermes` or `llama3_json`: parse tool calls for `tool_choice` auto
            (atombatch/serve/tools.py); None: auto answers 400.
        reasoning_parser: `qwen3`: split `<think>...</think>` into `reasoning_content`.
        grammar_check: `module:function` the grammar workers check constraints with instead of
            `atombatch.sampling.grammar_check.check_in_worker` (fault-injection tests).
        grammar_wall_seconds: a constraint check's wall-time budget (its CPU-time budget is
            `grammar_check.GRAMMAR_SECONDS`).
        enable_prompt_tokens_details: a final `usage` carries `prompt_tokens_details`
            (`cached_tokens`: prompt tokens the prefix cache saved), as vLLM's flag.
        enable_lora: LoRA adapters may be loaded (vLLM's `--enable-lora`); adapters an engine
            serves (a compiled artifact's, `--lora-modules`) are served either way.
        lora_paths: adapter name -> its directory, shown as `root` at /v1/models (the
            `--lora-modules` ones; the front adds those it loads).
        lora_updates: route `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (None: when
            `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is 1 or true, as vLLM; docs/lora.md).
        max_cpu_loras: adapters loaded at once at most (`--max-cpu-loras`): a load past it
            answers 400 (None: `lora.DEFAULT_MAX_CPU_LORAS`, or more if more are served).
        max_loras: the engine's `--max-loras`, shown as `vllm:lora_requests_info`'s
            `max_lora` label (None: read from an in-process engine's options).

    Returns:
        A Starlette app to run with uvicorn; `atombatch.serve.limits.uvicorn_config(app, ...)`
        adds the connection cap and header timeout an exposed server needs.
    """
    ab: AsyncBatcher | CoreClient
    if isinstance(batcher_or_async, AsyncBatcher | CoreClient):
        ab = batcher_or_async
    else:
        ab = AsyncBatcher(batcher_or_async, offload=True)
    if isinstance(ab, CoreClient):
        ab.start_process()  # the artifact and rules come from the core (ConfigError here)
    if tokenizer is None:
        codec: Codec = IdCodec(max_ids=ab.artifact.max_seq_len)
    elif hasattr(tokenizer, "render_chat"):
        codec = tokenizer
    else:
        codec = HFCodec(tokenizer)
    if isinstance(codec, HFCodec) and isinstance(ab, AsyncBatcher) and ab.batcher.tokenizer is None:
        # The engine gets the tokenizer for stop strings, bad words and structured output, and
        # leaves every other request's text to the front, as the engine core process does
        # (cli.core_batcher): inline or not, a request's text is made in the same place.
        ab.batcher.use_tokenizer(codec.tokenizer, detokenize=False)
    if tool_parser is not None and tool_parser not in TOOL_PARSER_NAMES:
        raise ConfigError(f"tool-call parser {tool_parser!r} is not one of "
                          f"{', '.join(TOOL_PARSER_NAMES)}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSER_NAMES:
        raise ConfigError(f"reasoning parser {reasoning_parser!r} is not one of "
                          f"{', '.join(REASONING_PARSER_NAMES)}")
    if isinstance(codec, HFCodec) and codec.max_chars is None:
        codec.bound(ab.artifact.max_seq_len)  # text that cannot fit is refused untokenized
    server = _Server(ab, model_name, codec, max_body_bytes, retry_after, strict_protocol,
                     body_timeout, bounds, max_response_bytes, max_structured_chars,
                     tool_parser, reasoning_parser, grammar_check, grammar_wall_seconds)
    server.prompt_tokens_details = enable_prompt_tokens_details
    server.max_loras = max_loras
    server.enable_lora = enable_lora
    if max_cpu_loras is not None:
        server.max_cpu_loras = max_cpu_loras
    server.lora_paths.update(lora_paths or {})
    if lora_updates is None:
        lora_updates = lora.runtime_updates_allowed()
    if lora_updates:
        log.warning("lora.runtime_updates", note=f"{lora.ENV_RUNTIME_UPDATES} is set: "
                    "/v1/load_lora_adapter and /v1/unload_lora_adapter are served (anyone "
                    "who can reach /v1 can load adapters from this host's files)")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if isinstance(ab, AsyncBatcher):  # (a core process prepares before it says Ready)
            ab.batcher.prepare_structured()
        await ab.start()
        server.structured.warm()
        server.accepting = True
        try:
            yield
        finally:
            server.accepting = False
            await ab.close(drain=True)
            server.text_worker.shutdown(wait=False, cancel_futures=True)
            server.structured.close()
            if on_shutdown is not None:
                on_shutdown()

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", server.model, methods=["GET"]),
        *([Route("/v1/load_lora_adapter", server.load_lora_adapter, methods=["POST"]),
           Route("/v1/unload_lora_adapter", server.unload_lora_adapter, methods=["POST"])]
          if lora_updates else []),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/version", server.version, methods=["GET"]),
        Route("/tokenizer_info", server.tokenizer_info, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/ping", server.health, methods=["GET", "POST"]),  # vLLM's (SageMaker's) probe
        Route("/metrics", server.metrics_endpoint, methods=["GET"]),
    ]
    responses = ResponsesAPI(server)
    routes += [Route("/v1/responses", responses.create, methods=["POST"]),
               Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
               Route("/v1/responses/{response_id}/cancel", responses.cancel, methods=["POST"])]
    middleware = [Middleware(BearerAuth, keys=list(api_keys))] if api_keys else []
    app = App(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={ApiError: server.api_error,
                                        HTTPException: server.http_error})
    app.state.server = server
    app.state.responses = responses
    app.state.async_batcher = ab
    app.state.metrics_registry = server.metrics.registry
    return app

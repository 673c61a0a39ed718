"""`AtomIngress`: HTTP in front of the replicas. It reads a body once, digests the prompt's
leading blocks for the router, forwards the request and streams the replica's answer back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any

import msgspec
from ray import serve

from atombatch.cluster.routing import DEFAULT_MAX_BLOCKS, DEFAULT_ROUTE_BLOCK, route_digests
from atombatch.logs import logger
from atombatch.serve.ray.board import board
from atombatch.serve.ray.wire import ForwardedRequest, ResponseStart

log = logger("atombatch.serve.ray")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class _RoutingBody(msgspec.Struct):
    """The fields routing reads from a generation body (anything else is ignored here; the
    replica's app validates the whole body)."""

    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None


class _ModelBody(msgspec.Struct):
    model: str | None = None


def lora_for_routing(body: bytes, base_names: Collection[str]) -> str | None:
    """The LoRA adapter a generation body names, for the routing digests (`route_digests(lora=)`):
    its `model` when that is not one of the base model's names (vLLM serves an adapter under its
    own name), else None. Best effort: a wrong guess costs affinity, never correctness (the
    replica checks the name)."""
    try:
        model = msgspec.json.decode(body, type=_ModelBody).model
    except Exception:
        return None
    return model if model and model not in base_names else None


def prompt_for_routing(body: bytes, codec: Any) -> list[int]:
    """The prompt's token ids as the replica will see them, best effort: [] when the body is not a
    generation request the codec can render (the replica answers its error)."""
    try:
        parsed = msgspec.json.decode(body, type=_RoutingBody)
        if parsed.prompt is not None:
            return codec.encode(parsed.prompt) if isinstance(parsed.prompt, str) \
                else list(parsed.prompt)
        if parsed.messages is not None:
            messages = []
            for message in parsed.messages:
                content = message.get("content")
                if isinstance(content, list):  # text parts joined as the replica's app joins them
                    content = "\n".join(str(part.get("text", "")) for part in content
                                       if isinstance(part, dict))
                messages.append({"role": str(message.get("role", "user")),
                                 "content": content or ""})
            return list(codec.render_chat(messages, add_generation_prompt=True,
                                          continue_final_message=False))
    except Exception:
        return []
    return []


class AtomIngress:
    """HTTP in front of the replicas: digests the prompt, forwards, streams the answer back."""

    def __init__(self, replicas: Any, engine_args: Sequence[str],
                 route_block: int = DEFAULT_ROUTE_BLOCK,
                 max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        from atombatch.serve.app import DEFAULT_MAX_BODY_BYTES
        from atombatch.serve.cli import parser
        from atombatch.serve.tokens import HFCodec, IdCodec

        args = parser().parse_args(list(engine_args))
        model_dir = args.model if args.model and os.path.isdir(args.model) else None
        tokenizer_dir = args.tokenizer or model_dir
        self.codec: Any = (HFCodec.from_dir(tokenizer_dir) if tokenizer_dir else None) or \
            IdCodec()
        self.replicas = replicas
        self.app_name = serve.get_replica_context().app_name
        self.route_block = route_block
        self.max_blocks = max_blocks
        self.max_body_bytes = DEFAULT_MAX_BODY_BYTES
        # the base model's names: a body naming anything else names an adapter (routing roots)
        self.base_names = frozenset(filter(None, [args.model, *(args.served_model_name or ())]))

    def __serve_build_asgi_app__(self) -> Any:
        return _ASGI(self._asgi)

    async def _asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):   # mounted under a route prefix
            path = path[len(root):] or "/"
        if path == "/metrics" and scope["method"] == "GET":
            await self._metrics(send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await _send_error(send, 413, f"body exceeds {self.max_body_bytes} bytes",
                                  "body_too_large")
                return
            if not message.get("more_body", False):
                break
        digests: tuple[bytes, ...] = ()
        if scope["method"] == "POST" and path in GENERATION_PATHS:
            prompt = prompt_for_routing(bytes(body), self.codec)
            digests = route_digests(prompt, self.route_block, self.max_blocks,
                                    lora=lora_for_routing(bytes(body), self.base_names)) \
                if prompt else ()
        request = ForwardedRequest(
            method=scope["method"], path=path,
            query_string=scope.get("query_string", b""),
            headers=[(bytes(k), bytes(v)) for k, v in scope.get("headers", [])],
            body=bytes(body), digests=digests, request_id=uuid.uuid4().hex)
        await self._forward(request, receive, send)

    async def _forward(self, request: ForwardedRequest, receive: Any, send: Any) -> None:
        started = False
        for attempt in range(2):
            stream = self.replicas.options(stream=True).forward.remote(request)
            watcher = asyncio.ensure_future(_disconnect(receive))
            ended = False
            try:
                async for part in _race(stream, watcher):
                    if isinstance(part, ResponseStart):
                        headers = list(part.headers) + [(b"x-atombatch-replica",
                                                         part.replica.encode())]
                        await send({"type": "http.response.start", "status": part.status,
                                    "headers": headers})
                        started = True
                    else:
                        await send({"type": "http.response.body", "body": part,
                                    "more_body": True})
                if watcher.done():  # the client went away: cancelling tells the replica
                    return
                ended = True
                if started:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                else:
                    await _send_error(send, 502, "the replica sent no response", "replica_failed")
                return
            except Exception as exc:  # the replica died or was unreachable
                log.warning("ray.replica_failed", error=repr(exc), attempt=attempt,
                            started=started, request_id=request.request_id)
                if started:
                    # mid-stream: end the stream with an error event the clients understand
                    message = _error_body(f"the replica serving this request failed: "
                                          f"{type(exc).__name__}", "replica_failed")
                    with contextlib.suppress(Exception):
                        await send({"type": "http.response.body",
                                    "body": b"data: " + message + b"\n\n", "more_body": False})
                    return
                if attempt == 1:
                    await _send_error(send, 502, "no replica could serve the request: "
                                      f"{type(exc).__name__}", "replica_failed")
                    return
                continue  # nothing reached the client yet: try another replica once
            finally:
                watcher.cancel()
                if not ended:
                    with contextlib.suppress(Exception):
                        stream.cancel()
        await _send_error(send, 502, "no replica answered", "replica_failed")

    async def _metrics(self, send: Any) -> None:
        """Every live replica's metrics (as last reported to the board), merged with a
        `replica` label."""
        from atombatch.serve.metrics_merge import merge_metrics

        reports = await board(self.app_name).reports.remote()
        body = merge_metrics({key: report["metrics"] for key, report in reports.items()})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})


class _ASGI:
    """An ASGI 3 callable around a coroutine function (uvicorn detects ASGI 3 by `__call__`)."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.handler(scope, receive, send)


async def _disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _race(stream: Any, watcher: asyncio.Future[None]) -> AsyncIterator[Any]:
    """Iterate a response generator until it ends or the client disconnects.

    Ray Serve cancels this request's task when the client goes away (a client that read a whole
    Content-Length body and closed, too); the pending step is cancelled with it and its outcome,
    Ray's `RequestCancelledError`, is retrieved, not printed as "Task exception was never
    retrieved" once per request."""
    iterator = stream.__aiter__()
    while True:
        step = asyncio.ensure_future(iterator.__anext__())
        step.add_done_callback(_retrieve)
        try:
            await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not step.done():
                step.cancel()
        if not step.done() or step.cancelled():
            with contextlib.suppress(BaseException):
                await step
            return
        try:
            yield step.result()
        except StopAsyncIteration:
            return


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _error_body(message: str, code: str) -> bytes:
    from atombatch.serve.protocol import ErrorBody, ErrorResponse

    return msgspec.json.encode(ErrorResponse(ErrorBody(message=message, type="server_error",
                                                       code=code)))


async def _send_error(send: Any, status: int, message: str, code: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": _error_body(message, code),
                "more_body": False})

"""`AtomReplica`: one engine on one device behind the single-process server's ASGI app, as a
Ray Serve replica (with its PD producer pool when the application has producers)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import ray
from ray import serve

from atombatch import logs
from atombatch.aio import AsyncBatcher
from atombatch.cluster.routing import DEFAULT_MAX_BLOCKS, DEFAULT_ROUTE_BLOCK
from atombatch.cluster.summary import DEFAULT_SUMMARY_BITS, CacheSummarizer
from atombatch.errors import AtomBatchError
from atombatch.serve.ray.board import DEFAULT_APP, board
from atombatch.serve.ray.wire import ForwardedRequest, ResponseStart
from atombatch.structs import SamplingParams


# -- devices ---------------------------------------------------------------------------------------
def assigned_devices(resource: str | None, count: int) -> list[int] | None:
    """The device indices this replica may use, or None when it asked for no device resource.

    Ray's RBLN accelerator ids when Ray assigned some (it sets `RBLN_DEVICES`); otherwise, with a
    custom resource, `count` consecutive indices from the replica's rank on its node.
    """
    if not resource:
        return None
    context = ray.get_runtime_context()
    ids = context.get_accelerator_ids().get("RBLN") or []
    if ids:
        return [int(i) for i in ids][:count]
    rank = 0
    with contextlib.suppress(Exception):
        rank = int(serve.get_replica_context().rank.local_rank)
    return list(range(rank * count, rank * count + count))


# -- the replica -----------------------------------------------------------------------------------
class _AppDriver:
    """Runs an ASGI app for forwarded requests (lifespan included)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._stack = contextlib.AsyncExitStack()
        self.started = False

    async def start(self) -> None:
        if not self.started:
            await self._stack.enter_async_context(self.app.router.lifespan_context(self.app))
            self.started = True

    async def stop(self) -> None:
        if self.started:
            self.started = False
            await self._stack.aclose()

    async def run(self, request: ForwardedRequest, replica: str
                  ) -> AsyncIterator[ResponseStart | bytes]:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": request.method, "scheme": "http", "path": request.path,
                 "raw_path": request.path.encode(), "root_path": "",
                 "query_string": request.query_string, "headers": list(request.headers),
                 "client": None, "server": None, "state": {}}
        parts: asyncio.Queue[Any] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await parts.put(message)

        async def call() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                await parts.put(None)

        task = asyncio.ensure_future(call())
        try:
            while True:
                message = await parts.get()
                if message is None:
                    break
                if message["type"] == "http.response.start":
                    yield ResponseStart(message["status"],
                                        [(bytes(k), bytes(v)) for k, v in
                                         message.get("headers", [])], replica)
                elif message["type"] == "http.response.body":
                    chunk = message.get("body", b"")
                    if chunk:
                        yield bytes(chunk)
                    if not message.get("more_body", False):
                        break
        finally:
            gone.set()  # the client (or the ingress) went away: the app aborts the request
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=10)
            except BaseException:
                task.cancel()


class AtomReplica:
    """A Ray Serve replica: one engine on one device behind the single-process server's app.

    Args:
        engine_args: flags of `python -m atombatch.serve` describing the engine.
        atom_resource: the custom resource naming a device (None: no device, NumPy runtime).
        pd: take prompts' KV from the PD producers registered on board `pd_app` (docs/pd.md);
            with none registered the replica prefills natively.
        pd_check_s: seconds between syncs with the producer registry and liveness checks.
        report_s: seconds between reports (engine stats, metrics) to the application's board.
        route_block, max_blocks, summary_bits: how the replica summarizes its prefix cache for
            the router (the ingress's routing digests; the Bloom filter's size).
    """

    async def __init__(self, engine_args: Sequence[str],  # type: ignore[misc]
                       atom_resource: str | None = None,
                       pd: bool = False, pd_app: str = DEFAULT_APP, pd_check_s: float = 0.5,
                       report_s: float = 0.5, route_block: int = DEFAULT_ROUTE_BLOCK,
                       max_blocks: int = DEFAULT_MAX_BLOCKS,
                       summary_bits: int = DEFAULT_SUMMARY_BITS) -> None:
        from threadpoolctl import threadpool_limits

        from atombatch.serve.app import create_app
        from atombatch.serve.cli import build_engine, parser

        args = parser().parse_args(list(engine_args))
        logs.setup(args.log_level, args.log_format)
        tp = len(str(args.device).split(",")) if args.runtime == "rebel" else 1
        devices = assigned_devices(atom_resource, tp)
        if devices is not None and args.runtime == "rebel":
            args.device = ",".join(str(d) for d in devices)
        if args.runtime == "numpy" and args.blas_threads > 0:
            threadpool_limits(limits=args.blas_threads, user_api="blas")
        batcher, name, codec = build_engine(args)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.devices = devices
        self.batcher = batcher
        self.pool = None
        self.summarizer = CacheSummarizer(route_block, max_blocks, bits=summary_bits)
        self._stats_seq = 0
        self._stats_held = (0, 0)
        self._stop_checks = threading.Event()
        if pd:
            from atombatch.cluster.pd_pool import ProducerPool

            self._registry = board(pd_app)
            self._producers: dict[str, Any] = {}
            self.pool = ProducerPool()
            with contextlib.suppress(Exception):
                self._sync_producers(await self._registry.producers.remote())
            ab: Any = _PooledAsyncBatcher(batcher, self.pool)
            threading.Thread(target=self._check_producers, args=(pd_check_s,), daemon=True,
                             name="atombatch-pd-check").start()
        else:
            ab = AsyncBatcher(batcher, offload=True)
        self.app = create_app(ab, name, codec, strict_protocol=args.strict_protocol,
                              max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                              max_structured_chars=args.max_structured_chars,
                              api_keys=args.api_key or (), tool_parser=args.tool_call_parser,
                              reasoning_parser=args.reasoning_parser)  # headers are forwarded
        self.driver = _AppDriver(self.app)
        await self.driver.start()
        self._board = board(serve.get_replica_context().app_name)
        self._reporter = asyncio.ensure_future(self._report_loop(report_s))

    async def _report_loop(self, period: float) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self._board.report.remote(self.replica, {"stats": self.stats(),
                                                               "metrics": self.metrics_text()})
            await asyncio.sleep(period)

    def _sync_producers(self, registry: dict[str, tuple[str, Any]]) -> None:
        """Follow the board's producer registry: new producers join the pool, removed ones
        retire (their requests in flight carry on)."""
        assert self.pool is not None
        self._producers = {name: actor for name, (_, actor) in registry.items()}
        self.pool.sync({name: endpoint for name, (endpoint, _) in registry.items()})

    def _check_producers(self, period: float) -> None:
        assert self.pool is not None
        pool = self.pool

        def alive(state: Any) -> bool:
            actor = self._producers.get(state.name)
            if actor is None:
                return state.retired  # a retired producer stays until its requests end
            ready, _ = ray.wait([actor.ping.remote()], timeout=max(period, 1.0))
            return bool(ready) and ray.get(ready[0]) is True

        while not self._stop_checks.wait(period):
            with contextlib.suppress(Exception):
                self._sync_producers(ray.get(self._registry.producers.remote(),
                                             timeout=max(period, 1.0)))
            for gone in pool.check(alive):  # dead: out of the registry too (if still the same)
                with contextlib.suppress(Exception):
                    self._registry.deregister_producer.remote(gone.name, gone.endpoint)

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Run the app for one forwarded request; yields a `ResponseStart`, then body chunks."""
        async for part in self.driver.run(request, self.replica):
            yield part

    def record_routing_stats(self) -> dict[str, Any]:
        s = self.batcher.stats()
        scheduler = self.batcher.scheduler
        stats: dict[str, Any] = {
            "lanes": self.batcher.artifact.batch_size, "occupied": s.occupied_lanes,
            "queue": s.queue_length, "prefix_cache": scheduler.prefix is not None,
            "prefix_hits": s.prefix_hits, "prefix_hit_tokens": s.prefix_hit_tokens,
            "seq": self._stats_seq}
        held = (s.occupied_lanes, s.queue_length)
        if held != self._stats_held:  # a new figure (the router judges each one once)
            self._stats_held = held
            self._stats_seq += 1
            stats["seq"] = self._stats_seq
        if scheduler.prefix is not None:
            summary = self.summarizer.summary(scheduler.prefix, scheduler.host)
            stats.update(summary_bits=summary.bits, summary_hashes=summary.hashes,
                         summary_count=summary.count, summary_truncated=summary.truncated,
                         route_block=summary.route_block)
        return stats

    def stats(self) -> dict[str, Any]:
        """The engine's `EngineStats` as plain data, with the replica id and its devices."""
        data = msgspec.to_builtins(self.batcher.stats())
        data.update(replica=self.replica, devices=self.devices, pid=os.getpid())
        if self.pool is not None:
            data["producers"] = msgspec.to_builtins(self.pool.snapshot())
        return dict(data)

    def metrics_text(self) -> bytes:
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.app.state.metrics_registry))

    def check_health(self) -> None:
        task = getattr(self.app.state.async_batcher, "_task", None)
        if task is not None and task.done():
            raise RuntimeError("the engine loop stopped")

    async def __del__(self) -> None:
        self._stop_checks.set()
        self._reporter.cancel()
        with contextlib.suppress(Exception):
            await self._board.leave.remote(self.replica)
        with contextlib.suppress(Exception):
            await self.driver.stop()


class _PooledAsyncBatcher(AsyncBatcher):
    """An `AsyncBatcher` whose requests take their KV from a `ProducerPool` (PD); with no
    producer up, a request is prefilled by the replica itself."""

    def __init__(self, batcher: Any, pool: Any) -> None:
        super().__init__(batcher, offload=True)
        self.pool = pool
        self.native_fallbacks = 0       # requests prefilled here: no producer was available

    def submit(self, prompt: Any, params: SamplingParams | None = None,
               request_id: str | None = None, kv: Any = None) -> str:
        params = params or SamplingParams()
        # n > 1, logprobs and bad_words need the engine to sample the first token, and
        # prompt_logprobs every prompt position's logits: prefilled here
        if kv is None and params.n == 1 and params.logprobs is None and not params.bad_words \
                and params.prompt_logprobs is None:
            self.batcher.validate(prompt, params)   # a bad request costs no producer work
            request_id = request_id or f"pd-{uuid.uuid4().hex[:16]}"
            try:
                kv = self.pool.open(request_id, [int(t) for t in prompt], params)
            except AtomBatchError:  # no producer is up: the replica prefills natively
                self.native_fallbacks += 1
                kv = None
        try:
            return super().submit(prompt, params, request_id, kv)
        except BaseException:
            if kv is not None:
                kv.close()
            raise

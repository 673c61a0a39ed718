"""`AtomReplica`: one engine on one device behind the single-process server's ASGI app, as a
Ray Serve replica (with its PD producer pool when the application has producers).

By default (`--engine-core process` among the engine flags) the engine steps in an engine core
process of its own (`atombatch.core.CoreClient`) and the replica is its front: HTTP app, Ray
calls, reports. With PD the producer pool lives in that core (atombatch/core/pd.py): the replica
follows the board's registry and pings the producer actors (the core has no Ray), and sends both
to the core as messages; the pool's snapshot comes back with the engine stats. The prefix-cache
summary the router reads is computed in the core on request (atombatch/core/routing.py).
`--engine-core inline` keeps the engine (and the pool) in the replica's own process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import ray
from ray import serve

from atombatch import logs
from atombatch.api.structs import SamplingParams
from atombatch.cluster.routing import DEFAULT_MAX_BLOCKS, DEFAULT_ROUTE_BLOCK
from atombatch.cluster.summary import DEFAULT_SUMMARY_BITS, CacheSummarizer, cache_roots
from atombatch.core.pd import pd_eligible
from atombatch.engine.aio import AsyncBatcher
from atombatch.errors import AtomBatchError, ConfigError
from atombatch.serve.ray.board import DEFAULT_APP, board
from atombatch.serve.ray.wire import ForwardedRequest, ResponseStart

if TYPE_CHECKING:
    from atombatch.core import CoreClient


SUMMARY_WAIT_S = 0.25     # how long a routing report waits for the engine core's cache summary


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

        from atombatch.serve import lora
        from atombatch.serve.app import create_app
        from atombatch.serve.cli import build_engine, parser

        args = parser().parse_args(list(engine_args))
        logs.setup(args.log_level, args.log_format)
        lora.check_lora_flags(args, args.served_model_name)  # as the plain server (a ConfigError)
        tp = len(str(args.device).split(",")) if args.runtime == "rebel" else 1
        devices = assigned_devices(atom_resource, tp)
        if devices is not None and args.runtime == "rebel":
            args.device = ",".join(str(d) for d in devices)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.devices = devices
        self.pool = None
        self.summarizer = CacheSummarizer(route_block, max_blocks, bits=summary_bits)
        self._summary_args = (route_block, max_blocks, summary_bits)
        self._prefix_cache = args.prefix_cache is not False  # None: the default (on where supported)
        self._loop = asyncio.get_running_loop()
        self._stats_seq = 0
        self._stats_held = (0, 0)
        self._stop_checks = threading.Event()
        self._follower: asyncio.Future[None] | None = None
        self.core: CoreClient | None = None
        self.batcher: Any = None
        ab: Any
        self._producers: dict[str, Any] = {}
        if args.engine_core == "process":
            name, codec, ab = await self._start_core(args, pd, pd_app, pd_check_s)
        else:  # the engine (and the PD pool) in this process
            if args.pd_producer:
                raise ConfigError("--pd-producer needs --engine-core process (the engine core "
                                  "connects to the producers; docs/pd.md)")
            if args.runtime == "numpy" and args.blas_threads > 0:
                threadpool_limits(limits=args.blas_threads, user_api="blas")
            batcher, name, codec = build_engine(args)
            self.batcher = batcher
            if pd:
                from atombatch.pd.pool import ProducerPool

                self._registry = board(pd_app)
                self.pool = ProducerPool()
                with contextlib.suppress(Exception):
                    self._sync_producers(await self._registry.producers.remote())
                ab = _PooledAsyncBatcher(batcher, self.pool)
                threading.Thread(target=self._check_producers, args=(pd_check_s,),
                                 daemon=True, name="atombatch-pd-check").start()
            else:
                ab = AsyncBatcher(batcher, offload=True)
        self.app = create_app(ab, name, codec, strict_protocol=args.strict_protocol,
                              max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                              max_structured_chars=args.max_structured_chars,
                              api_keys=args.api_key or (), tool_parser=args.tool_call_parser,
                              reasoning_parser=args.reasoning_parser,  # headers are forwarded
                              enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                              **lora.app_options(args))
        core, pool = self.core, self.pool
        if core is not None and core.pd_options is not None:  # the pool on /metrics
            from atombatch.serve.pd_metrics import add_pd_metrics
            add_pd_metrics(self.app, lambda: core.pd_stats)
        elif pool is not None:
            from atombatch.core.messages import PDStats
            from atombatch.serve.pd_metrics import add_pd_metrics
            add_pd_metrics(self.app, lambda: PDStats(pool.snapshot(), ab.native_fallbacks))
        self.driver = _AppDriver(self.app)
        await self.driver.start()
        self._board = board(serve.get_replica_context().app_name)
        self._reporter = asyncio.ensure_future(self._report_loop(report_s))

    async def _start_core(self, args: Any, pd: bool, pd_app: str, period: float
                          ) -> tuple[str, Any, CoreClient]:
        """The engine in a core process of its own; with PD, the pool in that core, this
        replica following the registry and pinging the producers for it."""
        from atombatch.core import CoreClient
        from atombatch.core.pd import PDOptions
        from atombatch.serve.cli import _model_dir, codec_from_args, core_batcher, pd_options

        if pd and args.pd_producer:
            raise ConfigError("--pd-producer names static producers; a PD application's "
                              "replicas follow its registered producers (--producers, "
                              "docs/cluster.md): give one or the other")
        codec = codec_from_args(args, _model_dir(args))
        client = CoreClient(functools.partial(core_batcher, args),
                            stream_interval=args.stream_interval,
                            hang_timeout=args.core_hang_timeout,
                            pd=PDOptions(mode=args.pd_mode) if pd else pd_options(args))
        ready = await asyncio.to_thread(client.start_process)
        self.core = client
        if pd:
            self._registry = board(pd_app)
            self._follower = asyncio.ensure_future(self._follow_producers(period))
        return args.served_model_name or ready.rules.artifact.model.name, codec, client

    async def _follow_producers(self, period: float) -> None:
        """The core's pool follows the board's registry; the producer actors are pinged here
        (the core has no Ray) and the verdicts sent to the core."""
        from atombatch.core.messages import Verdict

        client = self.core
        assert client is not None
        timeout = max(period, 1.0)

        async def verdict(state: Any) -> Verdict | None:
            actor = self._producers.get(state.name)
            if actor is None:  # left the registry: the sync retires it (requests carry on)
                return None
            try:
                ok = await asyncio.wait_for(actor.ping.remote(), timeout) is True
            except Exception:
                ok = False
            return Verdict(state.name, state.endpoint, ok)

        while True:
            with contextlib.suppress(Exception):
                registry = await asyncio.wait_for(self._registry.producers.remote(), timeout)
                self._producers = {name: actor for name, (_, actor) in registry.items()}
                client.sync_producers({name: endpoint
                                       for name, (endpoint, _) in registry.items()})
            found = [v for v in await asyncio.gather(*(verdict(s) for s in client.producers))
                     if v is not None]
            if found:
                client.producer_verdicts(found)
            for gone in found:  # dead: out of the registry too (if still the same)
                if not gone.alive:
                    with contextlib.suppress(Exception):
                        self._registry.deregister_producer.remote(gone.name, gone.endpoint)
            await asyncio.sleep(period)

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

    def _engine(self) -> Any:
        return self.core if self.core is not None else self.batcher

    async def record_routing_stats(self) -> dict[str, Any]:
        engine = self._engine()
        summary = None
        if self.core is not None:
            # asked of the core (a fixed-size Bloom filter comes back); if it is slow to answer,
            # the last one it sent
            prefix_on = self._prefix_cache
            if prefix_on:
                waiter: concurrent.futures.Future[Any] = concurrent.futures.Future()
                self._loop.call_soon_threadsafe(self.core.request_summary,
                                                *self._summary_args, waiter)
                try:
                    summary = await asyncio.wait_for(asyncio.wrap_future(waiter),
                                                     SUMMARY_WAIT_S)
                except (TimeoutError, concurrent.futures.CancelledError):
                    summary = self.core.summary
        else:
            scheduler = self.batcher.scheduler
            prefix_on = scheduler.prefix is not None
            if prefix_on:
                summary = self.summarizer.summary(
                    scheduler.prefix, scheduler.host,
                    roots=cache_roots(self.batcher.lora_adapters.values()))
        s = engine.stats()
        stats: dict[str, Any] = {
            "lanes": engine.artifact.batch_size, "occupied": s.occupied_lanes,
            "queue": s.queue_length, "prefix_cache": prefix_on,
            "prefix_hits": s.prefix_hits, "prefix_hit_tokens": s.prefix_hit_tokens,
            "seq": self._stats_seq}
        held = (s.occupied_lanes, s.queue_length)
        if held != self._stats_held:  # a new figure (the router judges each one once)
            self._stats_held = held
            self._stats_seq += 1
            stats["seq"] = self._stats_seq
        if summary is not None:
            stats.update(summary_bits=summary.bits, summary_hashes=summary.hashes,
                         summary_count=summary.count, summary_truncated=summary.truncated,
                         route_block=summary.route_block)
        return stats

    def stats(self) -> dict[str, Any]:
        """The engine's `EngineStats` as plain data, with the replica id and its devices."""
        data = msgspec.to_builtins(self._engine().stats())
        data.update(replica=self.replica, devices=self.devices, pid=os.getpid())
        if self.core is not None:
            data.update(engine_core=self.core.core_pid)
            if self.core.pd_options is not None:
                data["producers"] = msgspec.to_builtins(self.core.producers)
                pd = self.core.pd_stats
                data["native_fallbacks"] = pd.native_fallbacks if pd is not None else 0
        elif self.pool is not None:
            data["producers"] = msgspec.to_builtins(self.pool.snapshot())
            data["native_fallbacks"] = self.app.state.async_batcher.native_fallbacks
        return dict(data)

    def metrics_text(self) -> bytes:
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.app.state.metrics_registry))

    def check_health(self) -> None:
        if self.core is not None:
            if self.core.dead:
                raise RuntimeError("the engine core exited")
            return
        task = getattr(self.app.state.async_batcher, "_task", None)
        if task is not None and task.done():
            raise RuntimeError("the engine loop stopped")

    async def __del__(self) -> None:
        self._stop_checks.set()
        self._reporter.cancel()
        if self._follower is not None:
            self._follower.cancel()
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
               request_id: str | None = None, kv: Any = None, *,
               lora: str | None = None, validated: bool = False) -> str:
        params = params or SamplingParams()
        # n > 1, logprobs and bad_words need the engine to sample the first token, and
        # prompt_logprobs every prompt position's logits: prefilled here
        if kv is None and pd_eligible(params):
            if not validated:  # a bad request costs no producer work
                prompt = self.batcher.validate(prompt, params)
                validated = True
            request_id = request_id or f"pd-{uuid.uuid4().hex[:16]}"
            try:
                kv = self.pool.open(request_id, [int(t) for t in prompt], params, lora)
            except AtomBatchError:  # no producer is up: the replica prefills natively
                self.native_fallbacks += 1
                kv = None
        try:
            return super().submit(prompt, params, request_id, kv, lora=lora,
                                  validated=validated)
        except BaseException:
            if kv is not None:
                kv.close()
            raise

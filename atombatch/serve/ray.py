"""Replicas on Ray Serve: one `AsyncBatcher` per device, a router that knows lanes and prefixes.

    python -m atombatch.serve.ray --replicas 2                 # local Ray, NumPy runtime
    python -m atombatch.serve.ray --replicas 8 --atom-resource ATOM --runtime rebel \\
        --model /models/koni-8b-rbln --device 0,1 --address auto   # an existing Ray cluster

Every flag of `python -m atombatch.serve` describes each replica's engine (docs/server.md).

Theory of operation
-------------------
Two deployments. `AtomIngress` takes HTTP: it reads a generation request's body once, computes
the chained digests of the prompt's leading blocks (`atombatch.cluster.route_digests`, the prefix
cache's digest function) and hands the raw request with its digests to `AtomReplica` through a
deployment handle. The handle's request router is `AtomRequestRouter`: Ray Serve calls it with the
request (so it sees the digests) and the running replicas (each with the lane and queue figures
it last reported through `record_routing_stats`), and it ranks them with
`atombatch.cluster.PrefixAffinityPolicy`: prefix affinity under a bound on imbalance.

Each `AtomReplica` owns one `Batcher` on one device and serves it with the very ASGI app of the
single-process server (`atombatch.serve.app.create_app`): the ingress forwards method, path,
headers and body, the replica runs the app and streams the response back in parts (status and
headers, then body chunks). So the endpoints, validation, error bodies, SSE framing and
per-replica metrics are the single-process server's; `/metrics` at the ingress merges every
replica's registry with a `replica` label.

Devices: a replica asks Ray for `--atom-resource` (one unit per device; tensor parallel N asks
for N). The device indices come from Ray's RBLN accelerator ids when Ray detects the NPUs
(`RBLN_DEVICES`), else from the replica's rank on its node. Without `--atom-resource` replicas
run where Ray puts them (NumPy runtime).

A replica that dies: its streams end with an error event (SSE) or a 502 (not yet started: the
request is retried once on another replica), the router drops it from its table as soon as Ray
reports the actor dead, and Serve starts a replacement.

PD pools (`--producers M`): M `ProducerActor`s, each a `Producer` behind a `ZmqProducerServer`
(docs/pd.md); every replica holds a `ProducerPool` and submits each request with a `ZmqSource` to
the least loaded live producer (see `atombatch.cluster.pd_pool`). Producers register themselves on
the application's board and deregister when removed; replicas follow the registry, so
`scale_producers` (or `python -m atombatch.serve.ray --scale-producers M`) changes the pool
while the application runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import msgspec

try:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("atombatch.serve.ray needs Ray Serve: pip install 'atombatch[ray]'") from exc

from atombatch.aio import AsyncBatcher
from atombatch.cluster.routing import (
    DEFAULT_MAX_BLOCKS,
    DEFAULT_ROUTE_BLOCK,
    OtherRouters,
    PrefixAffinityPolicy,
    ReplicaLoad,
    route_digests,
)
from atombatch.cluster.summary import (
    DEFAULT_SUMMARY_BITS,
    CacheSummarizer,
    CacheSummary,
    check_summary_size,
)
from atombatch.errors import AtomBatchError, ConfigError
from atombatch.structs import SamplingParams

logger = logging.getLogger("atombatch.serve.ray")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_APP = "atombatch"


# -- what crosses from the ingress to a replica -----------------------------------------------------
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


class _RoutingBody(msgspec.Struct):
    """The fields routing reads from a generation body (anything else is ignored here; the
    replica's app validates the whole body)."""

    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None


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


# -- the router ------------------------------------------------------------------------------------
class AtomRequestRouter(RequestRouter):
    """Ray Serve request router: prefix affinity under a bound on imbalance.

    Replicas report `{"lanes", "occupied", "queue"}` and a summary of what their prefix cache
    holds (`summary_*`: `atombatch.cluster.summary.CacheSummary`) through `record_routing_stats`;
    the router adds its own count of requests in flight per replica (sent, not completed) and
    what it sent in the last `pending_s` seconds. Configured with `request_router_kwargs`:
    `max_imbalance`, `min_match_blocks`, `capacity`, `pending_s`.
    """

    def initialize_state(self, max_imbalance: int = 4, min_match_blocks: int = 1,
                         capacity: int = 200_000, pending_s: float = 2.0, **_: Any) -> None:
        self.policy = PrefixAffinityPolicy(max_imbalance=max_imbalance,
                                           min_match_blocks=min_match_blocks, capacity=capacity,
                                           pending_s=pending_s)
        self.in_flight: dict[str, int] = {}
        # internal request id -> (replica id, the request's digests)
        self._requests: dict[str, tuple[str, tuple[bytes, ...]]] = {}
        self.others = OtherRouters()

    def _state(self) -> PrefixAffinityPolicy:
        if not hasattr(self, "policy"):
            self.initialize_state()
        return self.policy

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        """The replica's load: this router's requests in flight there (exact) plus the other
        routers' (`atombatch.cluster.routing.OtherRouters`, from its reports)."""
        stats = replica.routing_stats or {}
        key = replica.replica_id.unique_id
        self.policy.report(key, summary_from_stats(stats))
        mine = self.in_flight.get(key, 0)
        others = self.others.estimate(key, stats.get("seq"), int(stats.get("occupied", 0)) +
                                      int(stats.get("queue", 0)), mine)
        return ReplicaLoad(key, lanes=int(stats.get("lanes", 1)), in_flight=mine + others,
                           prefix_cache=bool(stats.get("prefix_cache", True)))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        policy = self._state()
        if not candidate_replicas:
            return []
        digests = _digests_of(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranking = policy.rank(digests, [self._load(r) for r in candidate_replicas],
                              time.monotonic())
        return [[by_id[key]] for key in ranking]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        policy = self._state()
        key = replica_id.unique_id
        digests = _digests_of(pending_request)
        policy.routed(digests, key, time.monotonic())
        self.in_flight[key] = self.in_flight.get(key, 0) + 1
        self.others.sent(key, self.in_flight[key])
        self._requests[pending_request.metadata.internal_request_id] = (key, digests)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        policy = self._state()
        key, digests = self._requests.pop(internal_request_id, (None, ()))
        if key is None:
            return
        policy.completed(digests, key, time.monotonic())
        if self.in_flight.get(key, 0) > 0:
            self.in_flight[key] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self._replica_id_set) if hasattr(self, "_replica_id_set") else set()
        super().update_replicas(replicas)
        for gone in before - set(self._replica_id_set):
            self._forget(gone.unique_id)

    def _forget(self, key: str) -> None:
        self._state().forget(key)
        self.in_flight.pop(key, None)
        self.others.forget(key)
        self._requests = {rid: v for rid, v in self._requests.items() if v[0] != key}


def summary_from_stats(stats: dict[str, Any]) -> CacheSummary | None:
    """The cache summary a replica put in its routing stats, None if it reports none."""
    bits = stats.get("summary_bits")
    if not isinstance(bits, bytes) or not bits:
        return None
    hashes, count = stats.get("summary_hashes", 7), stats.get("summary_count", 0)
    route_block = stats.get("route_block", DEFAULT_ROUTE_BLOCK)
    try:
        # a replica's report is bounded like a summary built here: a forged one (10**6 hashes:
        # seconds and hundreds of MiB per routing decision) is ignored, not trusted
        if not all(isinstance(v, int) and not isinstance(v, bool)
                   for v in (hashes, count, route_block)):
            raise ConfigError(f"summary fields must be ints: hashes={hashes!r}, "
                              f"count={count!r}, route_block={route_block!r}")
        check_summary_size(len(bits) * 8, hashes)
        if not 1 <= route_block <= MAX_ROUTE_BLOCK or count < 0:
            raise ConfigError(f"route_block={route_block} must be in 1..{MAX_ROUTE_BLOCK} and "
                              f"count={count} >= 0")
    except ConfigError as exc:
        _warn_bad_summary(str(exc))
        return None
    return CacheSummary(bits, hashes=hashes, count=count, route_block=route_block,
                        truncated=bool(stats.get("summary_truncated", False)))


MAX_ROUTE_BLOCK = 1 << 16
_bad_summaries = 0


def _warn_bad_summary(reason: str) -> None:
    """Log the first and every 1000th refused summary (a flood must not flood the log)."""
    global _bad_summaries
    _bad_summaries += 1
    if _bad_summaries % 1000 == 1:
        logger.warning("router: ignoring a replica's cache summary (%s; %d so far)", reason[:200],
                    _bad_summaries)


def _digests_of(pending_request: PendingRequest | None) -> tuple[bytes, ...]:
    if pending_request is None:
        return ()
    for arg in pending_request.args or ():
        # by attribute, not isinstance: Ray may load this module twice (by value and by name)
        digests = getattr(arg, "digests", None)
        if isinstance(digests, tuple):
            return digests
    return ()


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


# -- PD producers ----------------------------------------------------------------------------------
class _CountingProducer:
    """A `Producer` that counts the requests it is producing and can be held before each layer
    (`ProducerActor.pause`: maintenance, and tests that must kill a producer mid-request)."""

    def __init__(self, producer: Any) -> None:
        self._producer = producer
        self.artifact = producer.artifact
        self.active = 0                  # requests being produced
        self.layers_sent = 0             # layers handed to the transport, over all requests
        self.held = 0                    # requests waiting at the gate now
        self.gate = threading.Event()
        self.gate.set()

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        from atombatch.pd import KVHeader

        self.active += 1
        try:
            for item in self._producer.stream(*args, **kwargs):
                if not isinstance(item, KVHeader) and not self.gate.is_set():
                    self.held += 1
                    try:
                        self.gate.wait()
                    finally:
                        self.held -= 1
                yield item
                if not isinstance(item, KVHeader):
                    self.layers_sent += 1
        finally:
            self.active -= 1


class ProducerActor:
    """A Ray actor: a `Producer` on its own runtime behind a `ZmqProducerServer` (docs/pd.md).

    It registers itself on the board of `app_name` as `name` when it is up (replicas add it to
    their pools); `scale_producers` deregisters it, waits for its requests to end, then ends it.

    Args:
        engine_args: flags of `python -m atombatch.serve` for the producer's runtime (the same
            model as the decoders; its artifact may differ).
        app_name, name: where and under which name to register (None: not registered).
        host: address to advertise (default: this node's IP); the socket binds every interface.
    """

    def __init__(self, engine_args: Sequence[str], app_name: str | None = None,
                 name: str | None = None, host: str | None = None,
                 **server_options: Any) -> None:
        from atombatch.pd import Producer, ZmqProducerServer
        from atombatch.serve.cli import build_engine, parser

        args = parser().parse_args(list(engine_args))
        batcher, _, _ = build_engine(args)
        host = host or ray.util.get_node_ip_address()
        self.producer = _CountingProducer(Producer(batcher.runtime))
        self.server = ZmqProducerServer(self.producer, "tcp://*:0",  # type: ignore[arg-type]
                                        **server_options)
        port = self.server.last_endpoint.rsplit(":", 1)[1]
        self._endpoint = f"tcp://{host}:{port}"
        threading.Thread(target=self.server.serve_forever, daemon=True,
                         name="atombatch-producer").start()
        if app_name is not None and name is not None:
            me = ray.get_runtime_context().current_actor
            ray.get(board(app_name).register_producer.remote(name, self._endpoint, me))

    def endpoint(self) -> str:
        return self._endpoint

    def ping(self) -> bool:
        return True

    def status(self) -> dict[str, Any]:
        """What it is doing: requests being produced (`active`), received and waiting their turn
        (`queued`), held at the gate, served."""
        peers = list(self.server._peers.values())
        return {"active": self.producer.active, "held": self.producer.held,
                "queued": sum(len(p.requests) for p in peers),
                "layers_sent": self.producer.layers_sent, "served": int(self.server.served),
                "paused": not self.producer.gate.is_set(), "pid": os.getpid()}

    def pause(self) -> None:
        """Hold every request before its next layer until `resume` (the header still goes)."""
        self.producer.gate.clear()

    def resume(self) -> None:
        self.producer.gate.set()

    def served(self) -> int:
        return int(self.server.served)

    def pid(self) -> int:
        return os.getpid()


# -- the ingress -----------------------------------------------------------------------------------
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
            digests = route_digests(prompt, self.route_block, self.max_blocks) if prompt else ()
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
                logger.warning("ray.replica_failed %r", exc)
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
    """Iterate a response generator until it ends or the client disconnects."""
    iterator = stream.__aiter__()
    while True:
        step = asyncio.ensure_future(iterator.__anext__())
        await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not step.done():
            step.cancel()
            with contextlib.suppress(BaseException):
                await step
            return
        try:
            yield step.result()
        except StopAsyncIteration:
            return


def _error_body(message: str, code: str) -> bytes:
    from atombatch.serve.protocol import ErrorBody, ErrorResponse

    return msgspec.json.encode(ErrorResponse(ErrorBody(message=message, type="server_error",
                                                       code=code)))


async def _send_error(send: Any, status: int, message: str, code: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": _error_body(message, code),
                "more_body": False})


# -- the board: what every replica last reported ---------------------------------------------------
BOARD_NAMESPACE = "atombatch"


class Board:
    """A Ray actor holding each replica's last report (engine stats and metrics text) and the
    application's registry of PD producers.

    Replicas report every `report_s`; a report older than `stale_s` is dropped (a dead replica
    leaves the board by going silent).
    """

    def __init__(self, stale_s: float = 5.0) -> None:
        self.stale_s = stale_s
        self._reports: dict[str, tuple[float, dict[str, Any]]] = {}
        self._producers: dict[str, tuple[str, Any]] = {}   # name -> (endpoint, actor handle)
        self._producer_args: list[str] | None = None

    def set_producer_args(self, args: list[str]) -> None:
        """The engine flags new producers of this application get by default."""
        self._producer_args = list(args)

    def producer_args(self) -> list[str] | None:
        return self._producer_args

    def register_producer(self, name: str, endpoint: str, actor: Any) -> None:
        self._producers[name] = (endpoint, actor)

    def deregister_producer(self, name: str, endpoint: str | None = None) -> bool:
        """Remove a producer (only if still at `endpoint`, when given)."""
        current = self._producers.get(name)
        if current is None or (endpoint is not None and current[0] != endpoint):
            return False
        del self._producers[name]
        return True

    def producers(self) -> dict[str, tuple[str, Any]]:
        """The registered PD producers: name -> (ZeroMQ endpoint, actor handle)."""
        return dict(self._producers)

    def report(self, replica: str, report: dict[str, Any]) -> None:
        self._reports[replica] = (time.monotonic(), report)

    def leave(self, replica: str) -> None:
        self._reports.pop(replica, None)

    def reports(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        self._reports = {k: v for k, v in self._reports.items() if now - v[0] <= self.stale_s}
        return {k: v[1] for k, v in self._reports.items()}


def board(app_name: str = DEFAULT_APP) -> Any:
    """The application's board actor (created on first use; detached, no CPU)."""
    actor = ray.remote(num_cpus=0)(Board)
    return actor.options(name=f"board-{app_name}", namespace=BOARD_NAMESPACE,
                         get_if_exists=True, lifetime="detached").remote()


# -- the application -------------------------------------------------------------------------------
def producer_name(app_name: str, index: int) -> str:
    return f"{app_name}-producer-{index}"


def scale_producers(app_name: str, count: int, engine_args: Sequence[str] = (), *,
                    replica_cpus: float = 1.0, atom_resource: str | None = None,
                    producer_options: dict[str, Any] | None = None, drain_s: float = 60.0,
                    settle_s: float = 1.5, wait: bool = True,
                    placement_timeout: float = 120.0) -> list[str]:
    """Make the application's PD pool `count` producers while it runs; returns their names.

    New producers (`ProducerActor`, detached, named `{app_name}-producer-{i}` in Ray namespace
    "atombatch", `engine_args` as their engine flags; default: the flags the application's
    producers were built with) register on the board when up, and every
    replica adds them to its pool at its next sync (`pd_check_s`). Removed producers (highest
    index first) are deregistered, so replicas stop choosing them; after `settle_s` (replicas
    have synced) and once the producer has no request left to produce (at most `drain_s`), it is
    ended. Requests in flight on it finish; only if `drain_s` runs out do they fail (alone, with
    `finish_reason="error"`, as on any producer fault).

    Call it from any process connected to the Ray cluster (`ray.init(address=...)`).

    With `wait`, a new producer that is not up within `placement_timeout` seconds (the cluster
    lacks the CPUs or the ATOM resource it asks for, so Ray keeps it pending) is killed and the
    call fails naming what it asked for; a name left by such an attempt (a named actor that is
    not registered) is replaced, so a retry does not fail with `ActorAlreadyExistsError`.

    Raises:
        ConfigError: `count` is negative, producers are to be added and neither `engine_args`
            nor the application's stored producer flags say what they run, or a new producer
            could not be placed within `placement_timeout`.
    """
    if count < 0:
        raise ConfigError(f"count={count} producers must be >= 0")
    registry = board(app_name)
    engine_args = list(engine_args) or ray.get(registry.producer_args.remote()) or []
    registered = ray.get(registry.producers.remote())
    for name, (_, actor) in registered.items():   # registrations of producers that died
        ready, _ = ray.wait([actor.ping.remote()], timeout=5.0)
        try:
            ok = bool(ready) and ray.get(ready[0]) is True
        except Exception:
            ok = False
        if not ok:
            ray.get(registry.deregister_producer.remote(name))
    current = sorted(ray.get(registry.producers.remote()),
                     key=lambda n: int(n.rsplit("-", 1)[1]) if n.rsplit("-", 1)[1].isdigit()
                     else -1)
    new: list[Any] = []
    index = 0
    names = set(current)
    if len(current) < count and not engine_args:
        raise ConfigError(f"application {app_name!r} has no stored producer engine flags (it was "
                          "not built with PD producers): give the producers' engine flags")
    while len(current) + len(new) < count:
        name = producer_name(app_name, index)
        index += 1
        if name in names:
            continue
        options: dict[str, Any] = {"num_cpus": replica_cpus}
        if atom_resource:
            options["resources"] = {atom_resource: 1}
        with contextlib.suppress(ValueError):  # an unregistered actor by that name: stale
            ray.kill(ray.get_actor(name, namespace=BOARD_NAMESPACE), no_restart=True)
            _wait_name_free(name)
        actor = ray.remote(ProducerActor).options(name=name, namespace=BOARD_NAMESPACE,
                                                  lifetime="detached", **options)
        new.append(actor.remote(list(engine_args), app_name, name,
                                **(producer_options or {})))
        names.add(name)
    if new and wait:
        pings = [a.ping.remote() for a in new]   # registered once its constructor returned
        ready, pending = ray.wait(pings, num_returns=len(pings), timeout=placement_timeout)
        if pending:
            for actor in new:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            free = ray.available_resources()
            raise ConfigError(
                f"{len(pending)} of {len(new)} new PD producers did not come up within "
                f"placement_timeout={placement_timeout} s: each asks for num_cpus="
                f"{replica_cpus}{f' and {atom_resource}=1' if atom_resource else ''}; the "
                f"cluster has {free.get('CPU', 0):g} CPUs"
                f"{f' and {free.get(atom_resource, 0):g} {atom_resource}' if atom_resource else ''}"
                " free (lower --replica-cpus, or add nodes)")
        ray.get(ready)
    doomed = current[count:] if len(current) > count else []
    remove_producers(app_name, doomed, drain_s=drain_s, settle_s=settle_s)
    return sorted(ray.get(registry.producers.remote()))


def _wait_name_free(name: str, timeout: float = 10.0) -> None:
    """`ray.kill` returns before the GCS frees the actor's name: wait until it has."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=BOARD_NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)


def remove_producers(app_name: str, names: Sequence[str], *, drain_s: float = 60.0,
                     settle_s: float = 1.5) -> None:
    """Take producers out of the application's pool gracefully: deregister them (replicas stop
    choosing them at their next sync), wait `settle_s`, then end each once it has no request
    left to produce (at most `drain_s`; requests still on it then fail alone)."""
    registry = board(app_name)
    for name in names:
        ray.get(registry.deregister_producer.remote(name))
    if names:
        time.sleep(settle_s)
    for name in names:
        with contextlib.suppress(Exception):
            actor = ray.get_actor(name, namespace=BOARD_NAMESPACE)
            deadline = time.monotonic() + drain_s
            while time.monotonic() < deadline:
                status: Any = ray.get(actor.status.remote(), timeout=10)
                if status["active"] == 0 and status["queued"] == 0:
                    break
                time.sleep(0.1)
            ray.kill(actor, no_restart=True)


def build_app(engine_args: Sequence[str], *, replicas: int = 1, atom_resource: str | None = None,
              replica_cpus: float = 1.0, producers: int = 0, pd: bool | None = None,
              producer_args: Sequence[str] | None = None, max_imbalance: int = 4,
              route_block: int = DEFAULT_ROUTE_BLOCK, routing_stats_s: float = 0.5,
              report_s: float = 0.5, producer_options: dict[str, Any] | None = None,
              app_name: str = DEFAULT_APP, router: str = "prefix", pending_s: float = 2.0,
              summary_bits: int = DEFAULT_SUMMARY_BITS, pd_check_s: float = 0.5) -> Any:
    """The Ray Serve application: `AtomIngress` -> `AtomReplica` x `replicas` (+ PD producers).

    Args:
        engine_args: flags of `python -m atombatch.serve` for every replica's engine.
        replicas: decode replicas (one engine, one device or TP group, each).
        atom_resource: custom Ray resource naming a device ("ATOM"); a replica asks for as many
            as its engine's `--device` list is long. None: no device resource (NumPy runtime).
        replica_cpus: CPUs Ray reserves per replica (and per producer).
        producers: PD producer actors to start now (`scale_producers` changes it later).
        pd: replicas take KV from the registered producers (default: `producers > 0`; True with
            0 producers: a PD application whose producers are added later).
        producer_args: engine flags of the producers (default: `engine_args`).
        max_imbalance, route_block, pending_s: the router's policy (docs/cluster.md).
        routing_stats_s: how often replicas report lanes, queue and cache summary to the router.
        report_s: how often replicas report stats and metrics to the board.
        producer_options: `ZmqProducerServer` options of the producers (tests: `layer_delay`).
        app_name: the Serve application's name (its board, its producers
            `{app_name}-producer-{i}` in Ray namespace "atombatch").
        router: "prefix" (`AtomRequestRouter`) or "default" (Ray Serve's own power-of-two
            choices router; for comparisons).
        summary_bits: size of each replica's cache summary (a Bloom filter).
        pd_check_s: how often replicas sync with the producer registry and ping producers.

    A replica whose engine flags break a configuration rule fails its deployment (Ray Serve
    reports the replica's `ConfigError`).
    """
    from atombatch.serve.cli import parser

    args = parser().parse_args(list(engine_args))
    lanes = args.batch_size
    tp = len(str(args.device).split(",")) if args.runtime == "rebel" else 1
    options: dict[str, Any] = {"num_cpus": replica_cpus}
    if atom_resource:
        options["resources"] = {atom_resource: tp}
    if router not in ("prefix", "default"):
        raise ConfigError(f"router={router!r} is not 'prefix' or 'default'")
    use_pd = bool(producers) if pd is None else pd
    if use_pd:
        ray.get(board(app_name).set_producer_args.remote(list(producer_args or engine_args)))
    if producers:
        scale_producers(app_name, producers, list(producer_args or engine_args),
                        replica_cpus=replica_cpus, atom_resource=atom_resource,
                        producer_options=producer_options)
    deployment: Any = serve.deployment
    router_config: Any = RequestRouterConfig
    routing: dict[str, Any] = {"request_routing_stats_period_s": routing_stats_s,
                               "request_routing_stats_timeout_s": max(routing_stats_s, 1.0)}
    if router == "prefix":
        routing.update(request_router_class="atombatch.serve.ray.AtomRequestRouter",
                       request_router_kwargs={"max_imbalance": max_imbalance,
                                              "pending_s": pending_s})
    replica = deployment(
        AtomReplica, name="AtomReplica", num_replicas=replicas,
        max_ongoing_requests=lanes + (args.max_waiting or 0) + 8,
        ray_actor_options=options,
        request_router_config=router_config(**routing),
        health_check_period_s=2.0, health_check_timeout_s=30.0)
    ingress = deployment(serve.ingress()(AtomIngress), name="AtomIngress",
                               ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000)
    return ingress.bind(replica.bind(list(engine_args), atom_resource,
                                     pd=use_pd, pd_app=app_name,
                                     pd_check_s=pd_check_s, report_s=report_s,
                                     route_block=route_block, summary_bits=summary_bits),
                        list(engine_args), route_block=route_block)


def app_builder(args: dict[str, Any]) -> Any:
    """A Ray Serve application builder (`import_path: atombatch.serve.ray:app_builder` in a Serve
    config, e.g. KubeRay's RayService): `engine` (serve flags) plus any `build_app` keyword."""
    options = dict(args)
    engine = options.pop("engine", [])
    if isinstance(engine, str):
        engine = engine.split()
    known = {"replicas", "atom_resource", "replica_cpus", "producers", "producer_args",
             "max_imbalance", "route_block", "routing_stats_s", "report_s", "app_name", "router",
             "pd", "pending_s", "summary_bits", "pd_check_s"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"app_builder args {unknown} are unknown; known: engine, "
                          f"{', '.join(sorted(known))}")
    return build_app([str(a) for a in engine], **options)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m atombatch.serve.ray", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every other flag is passed to each replica's engine: see "
               "`python -m atombatch.serve --help`.")
    p.add_argument("--replicas", type=int, default=2, help="decode replicas (default 2)")
    p.add_argument("--atom-resource", help="custom Ray resource naming one device, e.g. ATOM "
                   "(start nodes with `ray start --resources '{\"ATOM\": 8}'`)")
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--producers", type=int, default=0, help="PD producer actors (default 0)")
    p.add_argument("--pd", action="store_true",
                   help="replicas use PD producers even if --producers is 0 (added later with "
                   "--scale-producers)")
    p.add_argument("--scale-producers", type=int, metavar="M",
                   help="do not start an application: make the running application --app-name "
                   "(on --address) have M PD producers, then exit; the engine flags describe "
                   "new producers")
    p.add_argument("--max-imbalance", type=int, default=4,
                   help="requests a replica may hold beyond the least loaded one and still win "
                   "on prefix affinity (default 4)")
    p.add_argument("--route-block", type=int, default=DEFAULT_ROUTE_BLOCK,
                   help=f"tokens per routing digest (default {DEFAULT_ROUTE_BLOCK})")
    p.add_argument("--router", choices=("prefix", "default"), default="prefix",
                   help="prefix: atombatch's router (default); default: Ray Serve's own")
    p.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    p.add_argument("--num-cpus", type=int, help="local Ray only: CPUs to give it")
    p.add_argument("--app-name", default=DEFAULT_APP)
    return p


def main(argv: list[str] | None = None) -> int:
    from atombatch.serve.cli import parser as engine_parser

    args, engine_args = _parser().parse_known_args(argv)
    engine = engine_parser().parse_args(engine_args)
    logging.basicConfig(level=engine.log_level.upper(), format="%(message)s")
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_cpus)
    try:
        return _run(args, engine, engine_args)
    finally:
        # A SIGTERM (see `_run`) unwinds to here like Ctrl-C: the local cluster this process
        # started stops with it (its dashboard and runtime-env agents too, not left at PPID 1).
        if not args.address:
            with contextlib.suppress(Exception):
                ray.shutdown()


def _run(args: argparse.Namespace, engine: argparse.Namespace, engine_args: list[str]) -> int:
    import signal

    def terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    if args.scale_producers is not None:
        try:
            names = scale_producers(args.app_name, args.scale_producers, engine_args,
                                    replica_cpus=args.replica_cpus,
                                    atom_resource=args.atom_resource)
        except ConfigError as exc:
            print(f"atombatch.serve.ray: {exc}", file=sys.stderr)
            return 2
        print(f"atombatch.serve.ray: {args.app_name} has {len(names)} PD producers: "
              f"{', '.join(names) or '-'}", file=sys.stderr)
        return 0
    serve.start(http_options={"host": engine.host, "port": engine.port})
    try:
        app = build_app(engine_args, replicas=args.replicas, atom_resource=args.atom_resource,
                        replica_cpus=args.replica_cpus, producers=args.producers,
                        max_imbalance=args.max_imbalance, route_block=args.route_block,
                        app_name=args.app_name, router=args.router,
                        pd=args.pd or args.producers > 0)
    except ConfigError as exc:
        print(f"atombatch.serve.ray: {exc}", file=sys.stderr)
        return 2
    serve.run(app, name=args.app_name, route_prefix="/")
    print(f"atombatch.serve.ray: {args.replicas} replicas"
          f"{f', {args.producers} PD producers' if args.producers else ''} on "
          f"http://{engine.host}:{engine.port} (Ctrl-C stops)", file=sys.stderr)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        with contextlib.suppress(Exception):
            scale_producers(args.app_name, 0, drain_s=5.0, settle_s=0.0)
        serve.shutdown()
    return 0


if __name__ == "__main__":
    # Run from the module by its import name: Ray pickles classes of `__main__` by value, and a
    # by-value copy of the msgspec Structs above does not rebuild in the workers.
    from atombatch.serve.ray import main as _main

    sys.exit(_main())

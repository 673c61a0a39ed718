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
the least loaded live producer (see `atombatch.pd.pool`). Producers register themselves on
the application's board and deregister when removed; replicas follow the registry, so
`scale_producers` (or `python -m atombatch.serve.ray --scale-producers M`) changes the pool
while the application runs.

Modules (one concept each): `wire` (what crosses from the ingress to a replica), `router`
(`AtomRequestRouter`), `replica` (`AtomReplica`), `ingress` (`AtomIngress`), `board` (the
per-application `Board` actor), `producers` (`ProducerActor`, `scale_producers`,
`remove_producers`), `app` (`build_app`, `app_builder`), `cli` (`python -m atombatch.serve.ray`).
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
    from ray import serve  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("atombatch.serve.ray needs Ray Serve: pip install 'atombatch[ray]'") from exc

from atombatch.serve.ray.app import app_builder, build_app
from atombatch.serve.ray.board import BOARD_NAMESPACE, DEFAULT_APP, Board, board
from atombatch.serve.ray.cli import _parser, main
from atombatch.serve.ray.ingress import GENERATION_PATHS, AtomIngress, prompt_for_routing
from atombatch.serve.ray.producers import (
    ProducerActor,
    producer_name,
    remove_producers,
    scale_producers,
)
from atombatch.serve.ray.replica import AtomReplica, _PooledAsyncBatcher, assigned_devices
from atombatch.serve.ray.router import MAX_ROUTE_BLOCK, AtomRequestRouter, summary_from_stats
from atombatch.serve.ray.wire import ForwardedRequest, ResponseStart

__all__ = [
    "BOARD_NAMESPACE",
    "DEFAULT_APP",
    "GENERATION_PATHS",
    "MAX_ROUTE_BLOCK",
    "AtomIngress",
    "AtomReplica",
    "AtomRequestRouter",
    "Board",
    "ForwardedRequest",
    "ProducerActor",
    "ResponseStart",
    "_PooledAsyncBatcher",
    "_parser",
    "app_builder",
    "assigned_devices",
    "board",
    "build_app",
    "main",
    "producer_name",
    "prompt_for_routing",
    "remove_producers",
    "scale_producers",
    "summary_from_stats",
]

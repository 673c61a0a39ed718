"""The Ray Serve application: `build_app` (ingress -> replicas, router, PD producers) and
`app_builder` for Serve configs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from atombatch.api.validation import queue_limit
from atombatch.cluster.routing import DEFAULT_ROUTE_BLOCK
from atombatch.cluster.summary import DEFAULT_SUMMARY_BITS
from atombatch.errors import ConfigError
from atombatch.serve.ray.board import DEFAULT_APP, board
from atombatch.serve.ray.ingress import AtomIngress
from atombatch.serve.ray.producers import scale_producers
from atombatch.serve.ray.replica import AtomReplica


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
        routing.update(request_router_class="atombatch.serve.ray.router.AtomRequestRouter",
                       request_router_kwargs={"max_imbalance": max_imbalance,
                                              "pending_s": pending_s})
    replica = deployment(
        AtomReplica, name="AtomReplica", num_replicas=replicas,
        max_ongoing_requests=queue_limit(lanes, args.max_waiting or 0) + 8,
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

"""PD producers: `ProducerActor` (a `Producer` behind a `ZmqProducerServer`, registered on the
board) and the functions that change an application's pool while it runs."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import ray

from atombatch import logs
from atombatch.errors import ConfigError
from atombatch.serve.ray.board import BOARD_NAMESPACE, board


# -- the producer actor ----------------------------------------------------------------------------
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

    def lora_int_id_of(self, name: str | None) -> int:
        """The producer's id of LoRA adapter `name` (`Producer.lora_int_id_of`)."""
        return int(self._producer.lora_int_id_of(name))

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
        logs.setup(args.log_level, args.log_format)
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


# -- the pool of a running application -------------------------------------------------------------
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

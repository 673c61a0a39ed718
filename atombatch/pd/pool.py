"""A decoder's pool of PD producers: pick one by load, stop using one that failed or died.

A decoder replica holds one `ProducerPool`. Every PD request opens a `ZmqSource` to the producer
with the fewest requests this decoder has in flight there (ties: the one used least recently), and
the pool counts it until the engine closes the source. A source that fails on the transport marks
its producer *suspect*: no new request goes there until `check` (called periodically, off the
engine's loop) finds the producer alive again; a producer found dead is removed for good. So a
producer that dies or is removed fails only the requests in flight on it (the engine turns their
`KVTransferError` into `finish_reason="error"`), and the next requests go to the others.

Producers come and go while the decoder runs: `sync` takes the current registry (name ->
endpoint; in `atombatch.serve.ray` the application's board, where producers register and
deregister themselves): a new name joins the pool and gets requests at once (it has none in
flight, so it is the least loaded); a name that left is *retired*: never chosen again, kept in the
snapshot until its requests in flight end (they finish normally; if the producer dies meanwhile,
they fail alone).

`check` takes the liveness test as a function (a Ray actor ping in `atombatch.serve.ray`, anything
in tests), so the pool itself does no I/O besides the sources it opens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from atombatch.api.reports import ProducerState
from atombatch.api.structs import SamplingParams
from atombatch.errors import CapacityError, KVTransferError
from atombatch.pd.zmq_transport import ZmqSource

__all__ = ["ProducerPool", "ProducerState"]


class _PooledSource:
    """A `KVSource` that tells its pool when it ends, and how."""

    def __init__(self, pool: ProducerPool, producer: ProducerState, inner: Any) -> None:
        self._pool = pool
        self._producer = producer
        self._inner = inner
        self._ended = False

    def poll(self) -> Any:
        try:
            return self._inner.poll()
        except KVTransferError:
            self._pool._transport_failed(self._producer)
            raise

    def done(self) -> bool:
        return bool(self._inner.done())

    def expect(self, artifact: Any, prompt: Any, require_full: bool) -> None:
        """Pass the engine's header check on to the transport (see `ZmqSource.expect`)."""
        expect = getattr(self._inner, "expect", None)
        if expect is not None:
            expect(artifact, prompt, require_full)

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            if not self._ended:
                self._ended = True
                self._pool._closed(self._producer)


class ProducerPool:
    """Producers by name -> endpoint; `open` picks one by load (see the module docstring).

    Args:
        producers: (name, endpoint) pairs.
        source_factory: builds a source, default `ZmqSource(endpoint, request_id, prompt,
            params, mode)` (tests pass another transport).
        mode: "layer-stream" or "whole".
    """

    def __init__(self, producers: Sequence[tuple[str, str]] = (), *,
                 source_factory: Callable[..., Any] | None = None,
                 mode: str = "layer-stream") -> None:
        self._lock = threading.Lock()
        self._producers: dict[str, ProducerState] = {}
        self._factory: Callable[..., Any] = source_factory or ZmqSource
        self.mode = mode
        self._uses = 0
        self._dead: set[tuple[str, str]] = set()   # (name, endpoint) found dead: never re-added
        for name, endpoint in producers:
            self.add(name, endpoint)

    def add(self, name: str, endpoint: str) -> None:
        """A producer joins (or rejoins under a new endpoint)."""
        with self._lock:
            if (name, endpoint) in self._dead:
                return
            current = self._producers.get(name)
            if current is None or current.retired or current.endpoint != endpoint:
                self._producers[name] = ProducerState(name, endpoint)

    def remove(self, name: str) -> None:
        """Stop choosing a producer; its requests in flight carry on until their sources end."""
        with self._lock:
            current = self._producers.get(name)
            if current is None:
                return
            if current.in_flight > 0:
                current.retired = True
            else:
                del self._producers[name]

    def sync(self, registry: dict[str, str]) -> None:
        """Make the pool the registry's producers (name -> endpoint): new ones join, those
        that left are removed (see the module docstring)."""
        for name, endpoint in registry.items():
            self.add(name, endpoint)
        for state in self.snapshot():
            if state.name not in registry and not state.retired:
                self.remove(state.name)

    def snapshot(self) -> list[ProducerState]:
        with self._lock:
            return [msgspec.structs.replace(p) for p in self._producers.values()]

    @property
    def available(self) -> list[str]:
        with self._lock:
            return [p.name for p in self._producers.values() if not (p.suspect or p.retired)]

    def choose(self) -> ProducerState:
        """The producer for the next request.

        Raises:
            CapacityError: no producer is available (none configured, or all suspect).
        """
        with self._lock:
            usable = [p for p in self._producers.values() if not (p.suspect or p.retired)]
            if not usable:
                raise CapacityError(f"no PD producer is available ({len(self._producers)} known, "
                                    "all failed, retired or none configured)")
            best = min(usable, key=lambda p: (p.in_flight, p.last_used))
            self._uses += 1
            best.in_flight += 1
            best.opened += 1
            best.last_used = self._uses
            return best

    def open(self, request_id: str, prompt: Sequence[int],
             params: SamplingParams | None = None, lora: str | None = None) -> _PooledSource:
        """A KV source for `prompt` from the least loaded available producer (`lora`: the
        LoRA adapter it prefills under, by name; the factory is given it as `lora=`).

        Raises:
            CapacityError: no producer is available.
            KVTransferError: the chosen producer cannot be reached (it is then suspect).
        """
        producer = self.choose()
        try:
            inner = self._factory(producer.endpoint, request_id, list(prompt), params,
                                  self.mode, **({"lora": lora} if lora is not None else {}))
        except Exception:
            self._closed(producer)
            self._transport_failed(producer)
            raise
        return _PooledSource(self, producer, inner)

    def check(self, alive: Callable[[ProducerState], bool]) -> list[ProducerState]:
        """Re-test every producer: a dead one is removed (and never re-added under the same
        endpoint), a suspect one that answers is used again; returns the dead ones. Call it
        periodically from a thread of its own (it may block in `alive`)."""
        verdicts = []
        for producer in self.snapshot():
            ok = False
            try:
                ok = bool(alive(producer))
            except Exception:
                ok = False
            verdicts.append((producer.name, producer.endpoint, ok))
        return self.apply(verdicts)

    def apply(self, verdicts: Sequence[tuple[str, str, bool]]) -> list[ProducerState]:
        """Take liveness verdicts found elsewhere (name, endpoint tested, alive), as `check`
        does with its own: returns the producers removed as dead. A verdict on an endpoint the
        name no longer has is ignored."""
        dead: list[ProducerState] = []
        with self._lock:
            for name, endpoint, ok in verdicts:
                current = self._producers.get(name)
                if current is None or current.endpoint != endpoint:
                    continue
                if not ok:
                    del self._producers[name]
                    self._dead.add((name, endpoint))
                    dead.append(msgspec.structs.replace(current))
                else:
                    current.suspect = False
        return dead

    def probe(self, alive: Callable[[ProducerState], bool]) -> tuple[list[str], list[str]]:
        """Test every producer not retired: one that answers is used again, one that does not
        becomes suspect (never removed: static producers may come back). Returns the names
        revived and the names lost. May block in `alive`: call it from a thread of its own."""
        found = []
        for producer in self.snapshot():
            if producer.retired:
                continue
            try:
                ok = bool(alive(producer))
            except Exception:
                ok = False
            found.append((producer, ok))
        revived, lost = [], []
        with self._lock:
            for producer, ok in found:
                current = self._producers.get(producer.name)
                if current is None or current.endpoint != producer.endpoint:
                    continue
                if ok and current.suspect:
                    revived.append(current.name)
                elif not ok and not current.suspect:
                    lost.append(current.name)
                current.suspect = not ok
        return revived, lost

    # -- from the sources -------------------------------------------------------------------------
    def _closed(self, producer: ProducerState) -> None:
        with self._lock:
            producer.in_flight = max(0, producer.in_flight - 1)
            if producer.retired and producer.in_flight == 0 and \
                    self._producers.get(producer.name) is producer:
                del self._producers[producer.name]

    def _transport_failed(self, producer: ProducerState) -> None:
        with self._lock:
            if not producer.suspect:
                producer.failed += 1
            producer.suspect = True

"""PD through the engine core: the producer pool lives in the core process.

The core decodes, so the KV sources a PD request reads from must be opened there: a source holds a
ZeroMQ socket and the engine polls it between steps. The core therefore owns the
`ProducerPool` (atombatch/pd/pool.py) and opens each request's source itself; nothing but
messages crosses the process boundary:

- `PDOptions` (given to `CoreClient(..., pd=...)`, passed to the core at spawn) turns PD on: the
  producers known at start (name -> endpoint; `python -m atombatch.serve --pd-producer`), the
  pacing mode and, for static producers, how often the core re-probes a suspect one.
- The front marks each `Submit` that may take its KV from a producer (`pd_eligible`: one choice,
  no logprobs, no bad words, no prompt logprobs; the engine must sample the others' first token
  itself). The front validated the request before sending it (a bad request costs no
  producer work; the core trusts it and checks nothing again); the core opens a source from the
  least loaded live producer, and with none up prefills the request itself and counts a native
  fallback.
- Registry changes (`Producers`) and liveness verdicts (`ProducerVerdicts`) come from the front:
  on Ray the replica follows the application's board and pings the producer actors (the core has
  no Ray). Each one is answered with a stats `Step`, whose `PDStats` (the pool's snapshot) the
  front keeps in `CoreClient.pd_stats`; every other stats `Step` carries it too.
- A source that fails on the transport fails its request alone (`finish_reason="error"`) and marks
  its producer suspect: no new request goes there until a verdict finds it alive again. Static
  producers have no front to ping them: the core probes them itself (`PDOptions.probe_s`: a
  ZeroMQ handshake with each endpoint, from a thread of its own), so one that died while idle
  turns suspect and one that came back is used again.
- A front that dies has its requests aborted in the core (`CoreLoop`), which closes their sources.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.api.structs import SamplingParams
from atombatch.artifact.config import ArtifactConfig
from atombatch.core.messages import (
    PDStats,
    Producers,
    ProducerVerdicts,
    Submit,
    Summary,
    SummaryRequest,
    Verdict,
    front_encoder,
)
from atombatch.errors import AtomBatchError, ConfigError
from atombatch.logs import logger
from atombatch.pd.pool import ProducerPool, ProducerState

if TYPE_CHECKING:
    from atombatch.cluster.summary import CacheSummary
    from atombatch.engine.batcher import Batcher, KVSource

log = logger("atombatch.core")

MAX_PRODUCERS = 1024          # producers one registry message may name


class PDOptions(msgspec.Struct, frozen=True):
    """PD in the engine core (see the module docstring).

    Args:
        producers: name -> ZeroMQ endpoint of a `ZmqProducerServer`, known at start.
        mode: "layer-stream" (layers written as they arrive) or "whole".
        probe_s: > 0: every `probe_s` seconds the core tries a ZeroMQ handshake with each
            producer: one that does not answer becomes suspect (no new requests), one that
            answers is used again (static producers, no front to ping them); 0: only the
            front's verdicts judge producers.
    """

    producers: dict[str, str] = {}
    mode: Literal["layer-stream", "whole"] = "layer-stream"
    probe_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.producers) > MAX_PRODUCERS:
            raise ConfigError(f"{len(self.producers)} PD producers: at most {MAX_PRODUCERS}")
        if self.probe_s < 0:
            raise ConfigError(f"probe_s={self.probe_s} must be >= 0")


def pd_eligible(params: SamplingParams) -> bool:
    """Whether a request may take its KV from a producer: one choice, no logprobs, no bad words
    (their first token needs the engine's sampler) and no prompt logprobs (they need every prompt
    position's logits, which the wire does not carry)."""
    return params.n == 1 and params.logprobs is None and not params.bad_words and \
        params.prompt_logprobs is None


def static_producers(endpoints: list[str]) -> dict[str, str]:
    """Names for `--pd-producer` endpoints: `producer-0`, `producer-1`, ... in the given order.

    Raises:
        ConfigError: an endpoint is not a ZeroMQ `tcp://` or `ipc://` address, or
            is named twice.
    """
    if len(set(endpoints)) != len(endpoints):
        raise ConfigError(f"--pd-producer names an endpoint twice: {endpoints}")
    for endpoint in endpoints:
        if not endpoint.startswith(("tcp://", "ipc://")) or len(endpoint) > 1024:
            raise ConfigError(f"--pd-producer {endpoint[:80]!r} is not a ZeroMQ endpoint "
                              "(tcp://HOST:PORT or ipc:///PATH of a ZmqProducerServer; "
                              "docs/pd.md)")
    return {f"producer-{i}": endpoint for i, endpoint in enumerate(endpoints)}


def handshake(endpoint: str, timeout: float = 1.0, context: Any = None) -> bool:
    """Whether a ZeroMQ peer at `endpoint` completes a handshake within `timeout` seconds (a
    producer process that is up; the socket sends nothing)."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(endpoint)
        if not monitor.poll(int(timeout * 1000)):
            return False
        return bool(recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED)
    except zmq.ZMQError:
        return False
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


# -- the core's side -------------------------------------------------------------------------------
class CorePD:
    """The producer pool of an engine core, and how its messages change it."""

    def __init__(self, options: PDOptions, artifact: ArtifactConfig) -> None:
        self.options = options
        self.artifact = artifact
        self.pool = ProducerPool(list(options.producers.items()), mode=options.mode,
                                 source_factory=self._source)
        self.native_fallbacks = 0
        self.report_due = False     # the probe changed the pool: the front should hear of it
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None
        if options.probe_s > 0:
            self._prober = threading.Thread(target=self._probe, name="atombatch-pd-probe",
                                            daemon=True)
            self._prober.start()

    def _source(self, endpoint: str, request_id: str, prompt: list[int],
                params: SamplingParams | None, mode: Any, lora: str | None = None) -> Any:
        from atombatch.pd import ZmqSource
        # the artifact caps every frame at its largest legal layer (docs/security.md)
        return ZmqSource(endpoint, request_id, prompt, params, mode, artifact=self.artifact,
                         lora=lora)

    def source(self, batcher: Batcher, message: Submit,
               tokens: npt.NDArray[np.int64]) -> KVSource | None:
        """The KV source of a submitted request: None to prefill it in the core (not marked for
        PD, not eligible, or no producer up: a native fallback).

        Raises:
        """
        if not message.pd or not pd_eligible(message.params):
            return None
        try:  # (the front validated the request against this core's rules)
            return self.pool.open(message.request_id, tokens.tolist(), message.params,
                                  message.lora)
        except AtomBatchError as exc:
            self.native_fallbacks += 1
            log.info("pd.native_fallback", request_id=message.request_id, reason=str(exc))
            return None

    def apply(self, message: Producers | ProducerVerdicts) -> None:
        if isinstance(message, Producers):
            if len(message.registry) > MAX_PRODUCERS:
                log.warning("pd.registry_too_large", producers=len(message.registry))
                return
            self.pool.sync(dict(message.registry))
        else:
            dead = self.pool.apply([(v.name, v.endpoint, v.alive) for v in message.verdicts])
            for state in dead:
                log.warning("pd.producer_dead", producer=state.name, endpoint=state.endpoint,
                            in_flight=state.in_flight)

    def stats(self) -> PDStats:
        return PDStats(producers=self.pool.snapshot(), native_fallbacks=self.native_fallbacks)

    def close(self) -> None:
        self._stop.set()

    def _probe(self) -> None:
        period = self.options.probe_s
        while not self._stop.wait(period):
            try:
                revived, lost = self.pool.probe(
                    lambda p: handshake(p.endpoint, timeout=min(1.0, period)))
            except Exception:  # the probe must never take the core down
                log.exception("pd.probe_failed")
                continue
            for name in revived:
                log.info("pd.producer_revived", producer=name)
            for name in lost:
                log.warning("pd.producer_unreachable", producer=name)
            if revived or lost:
                self.report_due = True


# -- the front's side (mixed into CoreClient) ------------------------------------------------------
class PDFront:
    """What a front says to its core about producers and routing summaries; call these from the
    event loop the client runs on (as `submit`)."""

    pd_options: PDOptions | None = None
    pd_stats: PDStats | None = None          # the core's pool as of its last stats (PD only)
    summary: CacheSummary | None = None      # the core's last prefix-cache summary
    summaries: int = 0                       # Summary answers received
    _to_core: Any = None
    _process: Any = None
    _dead: bool = False

    def _send_to_core(self, message: Any) -> bool:
        """Send a message to the core without ever waiting on a dead one (a PUSH socket whose
        peer is gone blocks a plain send for good, and with it the event loop that would have
        learnt of the exit). Returns False when the core is gone: a request it carried is then
        failed with the others when the exit is noticed."""
        import zmq

        sock = self._to_core
        if self._dead or sock is None:
            return False
        frame = front_encoder.encode(message)
        refused_at = None
        while True:
            try:
                sock.send(frame, zmq.NOBLOCK)
                return True
            except zmq.Again:  # no peer, or its queue is full: wait while the core lives
                refused_at = time.monotonic() if refused_at is None else refused_at
                if self._process is None or not self._process.is_alive() or \
                        self._send_stalled(time.monotonic() - refused_at):
                    return False
                sock.poll(100, zmq.POLLOUT)

    def _send_stalled(self, waited: float) -> bool:
        """Whether a send the core's socket has refused for `waited` seconds gives up (the
        core is then killed as hung: `CoreClient`); here, never."""
        return False

    @property
    def producers(self) -> list[ProducerState]:
        """The core's producer pool as of its last report (empty without PD)."""
        return [] if self.pd_stats is None else list(self.pd_stats.producers)

    def sync_producers(self, registry: Mapping[str, str]) -> bool:
        """Make the core's pool these producers (name -> endpoint): new ones join, those that
        left retire. Returns False when the core is gone."""
        if len(registry) > MAX_PRODUCERS:
            raise ConfigError(f"{len(registry)} PD producers: at most {MAX_PRODUCERS}")
        return self._send_to_core(Producers(dict(registry)))

    def producer_verdicts(self, verdicts: list[Verdict]) -> bool:
        """Liveness found by the front: a dead producer leaves the core's pool for good, a
        suspect one found alive is used again."""
        return self._send_to_core(ProducerVerdicts(verdicts))

    def request_summary(self, route_block: int, max_blocks: int, bits: int,
                        waiter: concurrent.futures.Future[Any] | None = None) -> bool:
        """Ask the core for a summary of its prefix cache (`atombatch.cluster.summary`); it
        arrives in `summary` (one `Summary` per request) and, if given, in `waiter` (a
        thread-safe future, so a caller on any thread or loop can wait for it)."""
        sent = self._send_to_core(SummaryRequest(route_block, max_blocks, bits))
        if sent:  # one entry per request, in order (the core answers in order)
            self.__dict__.setdefault("_summary_waiters", deque()).append(waiter)
        return sent

    def _on_message(self, message: Any) -> None:
        """A core message other than Step and Stopped (in the event loop)."""
        if isinstance(message, Summary):
            self.summary = message.summary
            self.summaries += 1
            waiters = self.__dict__.get("_summary_waiters")
            if waiters:  # the core answers in order: the oldest request is answered
                waiter = waiters.popleft()
                if waiter is not None and not waiter.done():
                    waiter.set_result(message.summary)

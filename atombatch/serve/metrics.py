"""Prometheus metrics of one server, in a registry of its own (two apps in a process never mix).

Engine gauges and counters are read from `Batcher.stats()` when `/metrics` is scraped; latency
histograms and finish reasons are observed by the HTTP layer as tokens reach the client. The two
moved once per streamed event (generated tokens, the inter-token gap) are counted in plain Python
numbers (`_TokenCounter`, `_GapHistogram`: no lock per call, which is all prometheus_client's own
objects cost there) and exposed in the same shape when scraped.

| metric | type | labels |
|---|---|---|
| atombatch_lanes | gauge | (decode lanes of the artifact, B) |
| atombatch_occupied_lanes | gauge | lanes holding a request |
| atombatch_decoding_lanes | gauge | lanes decoding |
| atombatch_queue_length | gauge | requests without a lane (waiting + staged) |
| atombatch_blocks | gauge | state = free, spare, staged, lane, cached |
| atombatch_engine_<counter>_total | counter | (each scalar of `EngineCounters`: steps, imports |
|  |  | (PD), prefill_chunks, staged_chunks, decode_steps, generated_tokens, rotations, |
|  |  | preemptions, prefix_hits, prefix_misses, prefix_hit_tokens, prefix_query_tokens, |
|  |  | host_restores, evictions, prompt_forks, fork_saved_tokens, slot_saves, |
|  |  | slot_restores, iteration_tokens_sum) |
| atombatch_engine_requests_finished_total | counter | reason (engine view, all requests) |
| atombatch_device_seconds_total | counter | wall time inside device calls |
| atombatch_host_gap_seconds_total, atombatch_host_gaps_total | counter | the host's time between |
|  |  | two device calls while work was pending, and how many such gaps |
| atombatch_overlapped_steps_total | counter | decode steps launched straight after the one before |
| atombatch_overlapped_prefills_total | counter | of those, chunks of requests admitted while a decode ran |
| atombatch_overlapped_joins_total | counter | requests of such chunks that joined the decode after them |
|  |  | (their inputs built while it ran: `--overlap`) |
| atombatch_chained_chunks_total | counter | chunks launched right after a chunk, decided with it (a wave) |
| atombatch_requests_in_flight | gauge | HTTP requests between accept and last byte |
| atombatch_requests_finished_total | counter | reason = stop, length, abort, error, disconnect |
| atombatch_requests_rejected_total | counter | status = 400, 404, 413, 429, 503 |
| atombatch_prompt_tokens_total, atombatch_generation_tokens_total | counter | |
| atombatch_time_to_first_token_seconds | histogram | accept -> first token out |
| atombatch_inter_token_latency_seconds | histogram | gap between consecutive tokens out |
| atombatch_e2e_request_latency_seconds | histogram | accept -> finish |

Beside them, vLLM's `vllm:` families (atombatch/serve/vllm_metrics.py).
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from atombatch.api.reports import SCALAR_COUNTERS, EngineStats
from atombatch.artifact.config import ArtifactConfig
from atombatch.logs import logger
from atombatch.serve.metrics_merge import exposition, sum_metrics
from atombatch.serve.vllm_metrics import VllmEngineFamilies, VllmRequestMetrics

log = logger("atombatch.serve")

FRONT_WRITE_INTERVAL = 1.0   # seconds between a shared core's front writing its HTTP metrics

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 60.0, 120.0, 180.0, 300.0, 600.0)
_ENGINE_COUNTERS = SCALAR_COUNTERS  # every scalar engine counter, named once


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], lanes: int) -> None:
        self._stats = stats
        self._lanes = lanes

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("atombatch_lanes", "Decode lanes of the artifact (B).",
                                value=self._lanes)
        yield GaugeMetricFamily("atombatch_occupied_lanes", "Lanes holding a request.",
                                value=s.occupied_lanes)
        yield GaugeMetricFamily("atombatch_decoding_lanes", "Lanes decoding.",
                                value=s.decoding_lanes)
        yield GaugeMetricFamily("atombatch_queue_length",
                                "Requests without a lane (waiting, staging or staged).",
                                value=s.queue_length)
        blocks = GaugeMetricFamily("atombatch_blocks", "KV blocks by ownership state.",
                                   labels=["state"])
        for state, value in (("free", s.free_blocks), ("spare", s.spare_blocks),
                             ("staged", s.staged_blocks), ("lane", s.lane_blocks),
                             ("cached", s.cached_blocks)):
            blocks.add_metric([state], value)
        yield blocks
        for name in _ENGINE_COUNTERS:
            yield CounterMetricFamily(f"atombatch_engine_{name}", f"Engine {name} so far.",
                                      value=getattr(s, name))
        finished = CounterMetricFamily("atombatch_engine_requests_finished",
                                       "Requests the engine finished, by reason.",
                                       labels=["reason"])
        for reason, value in sorted(s.finished.items()):
            finished.add_metric([reason], value)
        yield finished
        yield CounterMetricFamily("atombatch_device_seconds",
                                  "Wall seconds the engine spent inside device calls.",
                                  value=s.device_s)
        yield CounterMetricFamily("atombatch_host_gap_seconds",
                                  "Wall seconds between one device call's end and the next "
                                  "one's start while work was pending (the device waited for "
                                  "the host).", value=s.host_gap_s)
        yield CounterMetricFamily("atombatch_host_gaps", "Intervals counted in "
                                  "atombatch_host_gap_seconds.", value=s.host_gaps)
        yield CounterMetricFamily("atombatch_overlapped_steps", "Decode steps launched straight "
                                  "after the step before them, their inputs built while it ran "
                                  "(--overlap).", value=s.overlapped_steps)
        yield CounterMetricFamily("atombatch_overlapped_prefills", "Of those, prefill chunks of "
                                  "requests admitted while a decode ran (--overlap).",
                                  value=s.overlapped_prefills)
        yield CounterMetricFamily("atombatch_overlapped_joins", "Requests of those chunks that "
                                  "joined the decode right after them, their first token written "
                                  "in on the device thread; counted when that decode lands "
                                  "(--overlap).", value=s.overlapped_joins)
        yield CounterMetricFamily("atombatch_chained_chunks", "Prefill chunks launched right "
                                  "after another chunk, decided with it: a wave of arrivals "
                                  "planned as one chain (--overlap).", value=s.chained_chunks)


class _TokenCounter(Collector):
    """A counter without labels, as prometheus_client's `Counter` exposes it (`_total`,
    `_created`), incremented from the event loop's thread only."""

    def __init__(self, name: str, documentation: str) -> None:
        self.name, self.documentation = name, documentation
        self.value = 0
        self.created = time.time()

    def inc(self, amount: int = 1) -> None:
        self.value += amount

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.documentation, value=self.value,
                                  created=self.created)


class _GapHistogram(Collector):
    """A histogram without labels, as prometheus_client's `Histogram` exposes it, observed from
    the event loop's thread only."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)   # the last: above every bound (+Inf)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1  # le: amount <= bound
        self.sum += amount

    def collect(self) -> Iterator[Metric]:
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family = HistogramMetricFamily(self.name, self.documentation, buckets=buckets,
                                       sum_value=self.sum)
        family.add_sample(f"{self.name}_created", {}, self.created)
        yield family


class _FrontFamilies(Collector):
    """The HTTP metrics of this front; with a shared core (`--api-server-count N`), summed over
    every front: each front writes its own to `metrics-<front>.prom` in the core's directory
    (every `FRONT_WRITE_INTERVAL` seconds and at each scrape) and a scrape adds the others' last
    files to its own live values (so another front's share is at most that old). A front
    started again on an index carries its predecessor's counters and histograms on in its own
    file (a sum that went down would read as a counter reset), not its gauges."""

    def __init__(self, registry: CollectorRegistry, shared: Any = None) -> None:
        self.registry = registry
        self.shared = shared
        self._writing = threading.Lock()  # the timer and a scrape share the one temporary file
        self.carried = b"" if shared is None else _carried(shared)  # the predecessor's counts

    def describe(self) -> Iterator[Metric]:
        yield from self.registry.collect()

    def write(self) -> bytes:
        """This front's HTTP metrics as exposition text, also written to its file (atomically)."""
        text = bytes(generate_latest(self.registry))
        if self.carried:
            text = exposition(sum_metrics([text, self.carried]))
        if self.shared is not None:
            path = front_metrics_path(self.shared.directory, self.shared.front)
            # (an OSError: the directory went with the launcher)
            with self._writing, contextlib.suppress(OSError):
                with open(f"{path}.tmp", "wb") as handle:
                    handle.write(text)
                os.replace(f"{path}.tmp", path)
        return text

    def collect(self) -> Iterator[Metric]:
        if self.shared is None:
            yield from self.registry.collect()
            return
        texts: list[bytes | str] = [self.write()]
        for front in range(self.shared.fronts):
            if front != self.shared.front:
                path = front_metrics_path(self.shared.directory, front)
                with contextlib.suppress(OSError), open(path, "rb") as handle:  # (not up yet)
                    texts.append(handle.read())
        yield from sum_metrics(texts)

    def write_every(self, interval: float) -> None:
        """Write this front's file every `interval` seconds, from a daemon thread."""
        def run() -> None:
            while True:
                time.sleep(interval)
                try:
                    self.write()
                except Exception:  # a metrics bug must not end the front
                    log.exception("metrics.write_failed")

        threading.Thread(target=run, name="atombatch-front-metrics", daemon=True).start()


def front_metrics_path(directory: str, front: int) -> str:
    return os.path.join(directory, f"metrics-{front}.prom")


def _carried(shared: Any) -> bytes:
    """The counters and histograms in the file of this front's predecessor on its index (none:
    the first front there); its gauges ended with it (its requests in flight, for one)."""
    path = front_metrics_path(shared.directory, shared.front)
    try:
        with open(path, "rb") as handle:
            text = handle.read()
    except OSError:
        return b""
    try:
        return exposition([family for family in sum_metrics([text]) if family.type != "gauge"])
    except Exception:  # a metrics bug must not stop the front from starting
        log.exception("metrics.carry_failed", front=shared.front)
        return b""


class ServerMetrics:
    """The metric objects of one app, registered in `self.registry`; with `shared` (a
    `SharedCore`: this front is one of several on one engine core) the HTTP metrics are the sum
    over every front (`_FrontFamilies`) and the engine's are the core's, as every front sees
    them."""

    def __init__(self, stats: Callable[[], EngineStats], artifact: ArtifactConfig,
                 model_name: str, shared: Any = None,
                 max_lora: Callable[[], str | None] = lambda: None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(stats, artifact.batch_size))
        self.registry.register(VllmEngineFamilies(stats, artifact, model_name, max_lora))
        self.front_registry = registry = CollectorRegistry(auto_describe=True)
        self.in_flight = Gauge("atombatch_requests_in_flight",
                               "HTTP generation requests being served.", registry=registry)
        self.finished = Counter("atombatch_requests_finished", "HTTP requests by finish reason.",
                                ["reason"], registry=registry)
        self.rejected = Counter("atombatch_requests_rejected",
                                "HTTP requests answered with an error status before generation.",
                                ["status"], registry=registry)
        self.prompt_tokens = Counter("atombatch_prompt_tokens", "Prompt tokens accepted.",
                                     registry=registry)
        self.generation_tokens = _TokenCounter("atombatch_generation_tokens",
                                               "Generated tokens sent to clients.")
        registry.register(self.generation_tokens)
        self.direct_events = _TokenCounter(
            "atombatch_stream_direct_events",
            "Streamed events written to the connection as their token was delivered, without "
            "waking the stream's task (a plain stream that keeps up; docs/overlap.md).")
        registry.register(self.direct_events)
        self.ttft = Histogram("atombatch_time_to_first_token_seconds",
                              "Request accepted -> first generated token handed to the client.",
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.inter_token = _GapHistogram("atombatch_inter_token_latency_seconds",
                                         "Gap between consecutive generated tokens of a request.",
                                         _LATENCY_BUCKETS)
        registry.register(self.inter_token)
        self.e2e = Histogram("atombatch_e2e_request_latency_seconds",
                             "Request accepted -> finished.", buckets=_LATENCY_BUCKETS,
                             registry=registry)
        self.vllm = VllmRequestMetrics(registry, model_name, artifact.max_seq_len,
                                       lambda: self.generation_tokens.value)
        self.fronts = _FrontFamilies(registry, shared)
        self.registry.register(self.fronts)
        if shared is not None:
            self.fronts.write()  # at once: a predecessor's gauges leave the sums
            self.fronts.write_every(FRONT_WRITE_INTERVAL)

"""vLLM's Prometheus metrics (the `vllm:` names of vLLM 0.34's `PrometheusStatLogger`), exported
beside atombatch's own on `/metrics` so vLLM's Grafana dashboard and alerts work unchanged
(docs/from-vllm.md#metrics lists every family, its source here and each deviation).

Every family carries vLLM's labels `model_name` (the served name) and `engine` ("0": one engine
core per server). Two sources:

- the engine's (`VllmEngineFamilies`): gauges and counters read from `EngineStats` when
  `/metrics` is scraped, the core's own view, the same on every front of a shared core;
- the requests' (`VllmRequestMetrics`): observed by the HTTP layer once per request or choice
  (its first token, its end), never per token: a request's inter-token gaps come with its
  `Completion` (the engine's clock) and are binned in one NumPy call at its end. They live in
  the front's registry, so with `--api-server-count N` they are summed over the fronts like
  atombatch's HTTP metrics (atombatch/serve/metrics.py). `vllm:generation_tokens_total` is the
  front's per-token counter exposed under vLLM's name (no second count per token).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from atombatch.api.structs import Completion
from atombatch.artifact.config import ArtifactConfig
from atombatch.engine.batcher import EngineStats
from atombatch.engine.request import ITERATION_TOKEN_BUCKETS

LABELS = ("model_name", "engine")
ENGINE = "0"   # vLLM's engine index: one engine core per server (no data parallelism)

# vLLM 0.34's bucket families (vllm/v1/metrics/buckets.py)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# vLLM's finish reasons (`FinishReason`): each label value is exported from the start, at 0
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


def request_token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's `request_tokens` family: 1, 2, 5, 10, 20, 50, ... up to `max_model_len`."""
    bounds: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(bounds)
            bounds.append(mantissa * scale)
        scale *= 10


def finished_reason(reason: str | None) -> str:
    """vLLM's `finished_reason` label for one of atombatch's reasons (a client that hung up is
    an abort there)."""
    if reason in ("stop", "length", "abort", "error"):
        return reason
    return "abort"


def _histogram(name: str, documentation: str, labels: Sequence[str],
               bounds: Sequence[float], counts: Sequence[int], total: float) -> Metric:
    """A histogram family from per-bucket counts (the last: above every bound)."""
    cumulative, buckets = 0, []
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        cumulative += count
        buckets.append((floatToGoString(bound), cumulative))
    family = HistogramMetricFamily(name, documentation, labels=list(LABELS))
    family.add_metric(list(labels), buckets, total)
    return family


class VllmEngineFamilies(Collector):
    """The engine's `vllm:` gauges and counters, read from `EngineStats` at each scrape."""

    def __init__(self, stats: Callable[[], EngineStats], artifact: ArtifactConfig,
                 model_name: str) -> None:
        self._stats = stats
        self._artifact = artifact
        self._labels = [model_name, ENGINE]

    def collect(self) -> Iterator[Metric]:
        s, labels, art = self._stats(), self._labels, self._artifact

        def gauge(name: str, documentation: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, documentation, labels=list(LABELS))
            family.add_metric(labels, value)
            return family

        def counter(name: str, documentation: str, value: float) -> Metric:
            family = CounterMetricFamily(name, documentation, labels=list(LABELS))
            family.add_metric(labels, value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution "
                    "batches (atombatch: lanes holding a request).", s.occupied_lanes)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed "
                    "(atombatch: requests without a lane).", s.queue_length)
        held = s.lane_blocks + s.staged_blocks + s.cached_blocks - s.evictable_blocks
        usage = held / art.num_blocks if art.num_blocks else 0.0
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage "
                    "(blocks a request holds: its own, staged, or cached ones it shares; cached "
                    "blocks nobody holds count as free).", usage)
        yield gauge("vllm:gpu_cache_usage_perc", "vLLM's older name of vllm:kv_cache_usage_perc "
                    "(its Grafana dashboard still queries it).", usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number "
                      "of queried tokens.", s.prefix_query_tokens)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of "
                      "cached tokens.", s.prefix_hit_tokens)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      s.preemptions)
        if s.spec_decode_num_accepted_tokens_per_pos:  # speculative decoding is on and has run
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                          s.spec_decode_num_drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                          s.spec_decode_num_draft_tokens)
            yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          s.spec_decode_num_accepted_tokens)
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft position.",
                                          labels=[*LABELS, "position"])
            for position, count in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([*labels, str(position)], count)
            yield per_pos
        counts = s.iteration_tokens or (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
        yield _histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per "
                         "engine_step (atombatch: per device call).", labels,
                         ITERATION_TOKEN_BUCKETS, counts, s.iteration_tokens_sum)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                                 "CacheConfig", labels=[*_CACHE_INFO, "engine"])
        info.add_metric([str(art.block_size), str(art.kv_dtype or "auto"),
                         str(s.prefix_cache), "xxhash", str(art.num_blocks), "None", "None",
                         ENGINE], 1)
        yield info


# the CacheConfig fields vLLM's `vllm:cache_config_info` labels that atombatch has an answer for
_CACHE_INFO = ("block_size", "cache_dtype", "enable_prefix_caching", "prefix_caching_hash_algo",
               "num_gpu_blocks", "num_cpu_blocks", "sliding_window")


class _BinnedHistogram(Collector):
    """A histogram with one label set, observed in bulk (a NumPy array at a time) from the event
    loop's thread; with `aliases`, the same counts are exposed under more names."""

    def __init__(self, names: Sequence[tuple[str, str]], bounds: Sequence[float],
                 labels: Sequence[str]) -> None:
        self.names = names
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self.labels = list(labels)
        self.counts = np.zeros(len(bounds) + 1, dtype=np.int64)
        self.sum = 0.0

    def observe_many(self, values: Sequence[float]) -> None:
        if not len(values):
            return
        array = np.asarray(values, dtype=np.float64)
        # le: value <= bound, so the first bound >= value
        self.counts += np.bincount(np.searchsorted(self.bounds, array, side="left"),
                                   minlength=len(self.counts))
        self.sum += float(array.sum())

    def collect(self) -> Iterator[Metric]:
        counts = self.counts.tolist()
        for name, documentation in self.names:
            yield _histogram(name, documentation, self.labels, self.bounds.tolist(), counts,
                             self.sum)


class _AliasCounter(Collector):
    """A counter of the front's, exposed under vLLM's name and labels (read, never counted
    again)."""

    def __init__(self, name: str, documentation: str, value: Callable[[], float],
                 labels: Sequence[str]) -> None:
        self.name, self.documentation, self.value = name, documentation, value
        self.labels = list(labels)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=list(LABELS))
        family.add_metric(self.labels, self.value())
        yield family


class VllmRequestMetrics:
    """The requests' `vllm:` families, registered in the front's registry (summed over fronts)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int,
                 generated: Callable[[], float]) -> None:
        labels = self.labels = (model_name, ENGINE)
        tokens = request_token_buckets(max_model_len)

        def histogram(name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, documentation, list(LABELS), buckets=buckets,
                             registry=registry).labels(*labels)

        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     list(LABELS), registry=registry).labels(*labels)
        registry.register(_AliasCounter("vllm:generation_tokens",
                                        "Number of generation tokens processed.", generated,
                                        labels))
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*LABELS, "finished_reason"], registry=registry)
        self.success = {reason: success.labels(*labels, reason) for reason in FINISHED_REASONS}
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", tokens)
        self.params_n = histogram("vllm:request_params_n",
                                  "Histogram of the n request parameter.",
                                  REQUEST_PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.",
                                           tokens)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.",
                              TIME_TO_FIRST_TOKEN_BUCKETS)
        self.inter_token = _BinnedHistogram(
            (("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
             ("vllm:time_per_output_token_seconds", "vLLM's older name of "
              "vllm:inter_token_latency_seconds (its Grafana dashboard still queries it).")),
            INTER_TOKEN_LATENCY_BUCKETS, labels)
        registry.register(self.inter_token)
        self.time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.",
                                   REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.",
                                 REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.",
                                REQUEST_LATENCY_BUCKETS)

    def first_token(self, prompt_len: int, ttft: float) -> None:
        """A request's first token reached the front (once per request)."""
        self.prompt_tokens.inc(prompt_len)
        self.ttft.observe(ttft)

    def choice_done(self, reason: str | None, e2e: float, prompt_len: int, max_tokens: int,
                    completion: Completion | None, generated: int) -> None:
        """One choice of a request ended (`completion`: the engine's record of it, None when
        the request never ran or the client left first)."""
        self.success[finished_reason(reason)].inc()
        self.e2e.observe(e2e)
        self.request_prompt_tokens.observe(prompt_len)
        self.params_max_tokens.observe(max_tokens)
        if completion is not None:
            generated = len(completion.token_ids)
        self.request_generation_tokens.observe(generated)
        timings = completion.timings if completion is not None else None
        if timings is None:
            return
        self.queue.observe(timings.queue_wait)
        decode = timings.finished - timings.first_token
        self.prefill.observe(timings.first_token - timings.admitted)
        self.decode.observe(decode)
        self.inference.observe(timings.finished - timings.admitted)
        if generated > 1:
            self.time_per_output_token.observe(decode / (generated - 1))
        self.inter_token.observe_many(timings.inter_token)

    def request_done(self, n: int, max_generated: int) -> None:
        """Every choice of a request ended: vLLM's per-request `n` and the most tokens any of
        its choices generated."""
        self.params_n.observe(n)
        self.max_num_generation_tokens.observe(max_generated)

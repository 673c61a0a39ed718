"""vLLM's metrics on `/metrics` (atombatch/serve/vllm_metrics.py) and
`usage.prompt_tokens_details` (`--enable-prompt-tokens-details`), through the real server in
each engine-core mode: inline, process, and two fronts on one core (their request metrics
summed). The values are checked against each other and against the responses' usage; every
series vLLM's Grafana dashboard and alert rules query (tests/support/vllm_grafana.py) exists."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.served import served
from support.vllm_grafana import ALERTS, DASHBOARD

from atombatch.serve.vllm_metrics import _BinnedHistogram

NAME = "vllm-compat"
CHUNK = 16
FLAGS = ("--runtime", "null", "--null-step-ms", "2", "--batch-size", "2", "--max-seq-len", "256",
         "--block-size", "16", "--prefill-chunk-size", str(CHUNK), "--served-model-name", NAME)
MODES = {"inline": ("--engine-core", "inline"), "process": ("--engine-core", "process"),
         "two-fronts": ("--api-server-count", "2")}

# vLLM 0.34's bucket bounds (vllm/v1/metrics/buckets.py), as its exposition writes them
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": (
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    "vllm:inter_token_latency_seconds": (
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0),
    "vllm:e2e_request_latency_seconds": (
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
        240.0, 480.0, 960.0, 1920.0, 7680.0),
    "vllm:iteration_tokens_total": (
        1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
    "vllm:request_params_n": (1, 2, 5, 10, 20),
    # the 1-2-5 series up to max_model_len (256 here)
    "vllm:request_prompt_tokens": (1, 2, 5, 10, 20, 50, 100, 200),
}
for _alias, _of in (("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"),
                    ("vllm:request_time_per_output_token_seconds",
                     "vllm:inter_token_latency_seconds"),
                    ("vllm:request_queue_time_seconds", "vllm:e2e_request_latency_seconds"),
                    ("vllm:request_generation_tokens", "vllm:request_prompt_tokens"),
                    ("vllm:request_params_max_tokens", "vllm:request_prompt_tokens")):
    VLLM_BUCKETS[_alias] = VLLM_BUCKETS[_of]


def scrape(url: str) -> dict[str, list[Any]]:
    """Sample name -> its samples."""
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
        samples.setdefault(family.name, [])  # a counter's family name (no _total) is a name too
    return samples


def value(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    found = [s.value for s in samples.get(name, [])
             if all(s.labels.get(k) == v for k, v in labels.items())]
    assert found, (name, labels)
    return float(sum(found))


def complete(url: str, body: dict[str, Any], path: str = "/v1/completions",
             every: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A response's usage, streamed (the last usage chunk; `every` gets each chunk's) or not."""
    if not body.get("stream"):
        response = httpx.post(url + path, json=body, timeout=60)
        assert response.status_code == 200, response.text
        return dict(response.json()["usage"])
    usage = None
    with httpx.stream("POST", url + path, json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    if every is not None:
                        every.append(usage)
    assert usage is not None
    return dict(usage)


def wait_for(url: str, want: dict[str, float], **labels: str) -> dict[str, list[Any]]:
    """The scrape once every name in `want` reached its value (another front's share is written
    every second; the core's counts come with its steps)."""
    deadline = time.monotonic() + 20
    while True:
        samples = scrape(url)
        if all(name in samples and value(samples, name, **labels) == v
               for name, v in want.items()):
            return samples
        assert time.monotonic() < deadline, (want, labels, {n: samples.get(n) for n in want})
        time.sleep(0.1)


def selectors(expression: str) -> list[tuple[str, str]]:
    """(metric name, its label matchers) of every `vllm:` series a PromQL expression reads."""
    return re.findall(r"(vllm:[A-Za-z0-9_:]+)(\{[^}]*\})?", expression)


@pytest.mark.parametrize("mode", list(MODES))
def test_vllm_metrics_and_cached_tokens_in_every_mode(mode: str) -> None:
    prompt = list(range(10, 60))                           # 50 tokens
    other = list(range(100, 137))
    chat = {"model": NAME, "messages": [{"role": "user", "content": "<7><8><9>" * 12}],
            "max_tokens": 3}
    continuous: list[dict[str, Any]] = []
    with served(*FLAGS, *MODES[mode], "--enable-prompt-tokens-details") as (url, _):
        usages = [
            complete(url, {"model": NAME, "prompt": prompt, "max_tokens": 5}),
            complete(url, {"model": NAME, "prompt": prompt, "max_tokens": 4, "stream": True,
                           "stream_options": {"include_usage": True,
                                              "continuous_usage_stats": True}},
                     every=continuous),
            complete(url, {"model": NAME, "prompt": other, "max_tokens": 6, "stream": True,
                           "stream_options": {"include_usage": True}}),
            complete(url, chat, "/v1/chat/completions"),
            complete(url, {**chat, "stream": True, "stream_options": {"include_usage": True}},
                     "/v1/chat/completions"),
        ]
        n = len(usages)
        prompts = sum(u["prompt_tokens"] for u in usages)
        samples = wait_for(url, {"vllm:request_success_total": n,
                                 "vllm:prefix_cache_queries_total": prompts},
                           model_name=NAME, engine="0")
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    # the first sight of a prompt finds nothing; the second resumes at the last chunk boundary
    # before its last token (docs/prefix-cache.md), streamed or not, chat or completions
    assert cached[0] == 0 and cached[2] == 0 and cached[3] == 0
    assert cached[1] == (len(prompt) - 1) // CHUNK * CHUNK
    # every continuous-usage chunk says it, from the first token's on (as vLLM; a stream that
    # fell behind merges events, so at least the first and the usage chunk)
    assert len(continuous) >= 2 and \
        all(u["prompt_tokens_details"] == {"cached_tokens": cached[1]} for u in continuous)
    assert cached[4] == (usages[4]["prompt_tokens"] - 1) // CHUNK * CHUNK > 0
    generated = sum(u["completion_tokens"] for u in usages)
    labels = {"model_name": NAME, "engine": "0"}
    # the engine's prefix-cache counters agree with what each response said
    assert value(samples, "vllm:prefix_cache_hits_total", **labels) == sum(cached)
    assert value(samples, "vllm:prefix_cache_queries_total", **labels) == prompts
    assert value(samples, "atombatch_engine_prefix_hit_tokens_total") == sum(cached)
    assert value(samples, "atombatch_engine_prefix_query_tokens_total") == prompts
    assert value(samples, "atombatch_engine_prefix_hits_total") == sum(c > 0 for c in cached)
    assert value(samples, "atombatch_engine_prefix_misses_total") == sum(c == 0 for c in cached)
    # tokens the device computed: the prompts less what the cache held, and every generated
    # token after each request's first (that one comes from its last prefill chunk)
    assert value(samples, "vllm:iteration_tokens_total_sum", **labels) == \
        prompts - sum(cached) + generated - n
    assert value(samples, "vllm:prompt_tokens_total", **labels) == prompts
    assert value(samples, "vllm:generation_tokens_total", **labels) == generated
    assert value(samples, "vllm:request_prompt_tokens_sum", **labels) == prompts
    assert value(samples, "vllm:request_generation_tokens_sum", **labels) == generated
    assert value(samples, "vllm:request_params_max_tokens_sum", **labels) == generated
    assert value(samples, "vllm:request_params_n_count", **labels) == n
    assert value(samples, "vllm:inter_token_latency_seconds_count", **labels) == generated - n
    assert value(samples, "vllm:time_per_output_token_seconds_count", **labels) == generated - n
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert value(samples, f"vllm:{name}_count", **labels) == n, name
    assert value(samples, "vllm:request_success_total", finished_reason="length") == n
    for reason in ("stop", "abort", "error"):
        assert value(samples, "vllm:request_success_total", finished_reason=reason) == 0
    assert value(samples, "vllm:num_requests_running", **labels) == 0
    assert value(samples, "vllm:num_requests_waiting", **labels) == 0
    (info,) = samples["vllm:cache_config_info"]
    assert info.labels["enable_prefix_caching"] == "True" and info.labels["block_size"] == "16"
    # every series vLLM's dashboard and alerts read is there, with the labels they select on
    for expression in (*DASHBOARD, *ALERTS):
        for name, matchers in selectors(expression):
            if name == "vllm:":  # `{__name__=~"vllm:.*"}`: any vllm: series with a model_name
                assert any(s.labels.get("model_name") == NAME for key, found in samples.items()
                           if key.startswith("vllm:") for s in found)
                continue
            assert name in samples, (name, expression)
            found = samples[name] or samples.get(f"{name}_total", [])
            assert found, (name, expression)
            if "$model_name" in matchers:
                assert any(s.labels.get("model_name") == NAME for s in found), name
            if 'le="120"' in matchers:
                assert any(float(s.labels["le"]) == 120 for s in found), name
        for label in re.findall(r"by ?\(([^)]*)\)", expression):
            for part in label.split(","):
                name = selectors(expression)[0][0]
                assert all(part.strip() in s.labels for s in samples[name]), (part, name)


def test_bucket_bounds_the_flag_off_the_cache_off_and_a_hang_up() -> None:
    """Without --enable-prompt-tokens-details usage has no prompt_tokens_details (as vLLM);
    --no-enable-prefix-caching leaves the cache off (nothing queried, the info label says so);
    a client that hangs up mid-stream is vLLM's abort; the histograms carry vLLM's bounds."""
    prompt = list(range(10, 60))
    with served(*FLAGS, "--engine-core", "inline", "--no-enable-prefix-caching") as (url, _):
        continuous: list[dict[str, Any]] = []
        usages = [complete(url, {"model": NAME, "prompt": prompt, "max_tokens": 3}),
                  complete(url, {"model": NAME, "prompt": prompt, "max_tokens": 3,
                                 "stream": True, "stream_options": {
                                     "include_usage": True, "continuous_usage_stats": True}},
                           every=continuous)]
        long = list(range(200, 240))                       # 3 blocks of 16 when it decodes
        body = {"model": NAME, "prompt": long, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    running = scrape(url)  # while it streams
                    break  # then hang up (leaving the loop closes the response)
        samples = wait_for(url, {"vllm:request_success_total": 3})
    assert value(running, "vllm:num_requests_running") == 1
    blocks = value(running, "vllm:cache_config_info")  # (one sample, value 1)
    num_blocks = float(running["vllm:cache_config_info"][0].labels["num_gpu_blocks"])
    assert blocks == 1 and value(running, "vllm:kv_cache_usage_perc") >= 3 / num_blocks
    assert value(samples, "vllm:kv_cache_usage_perc") == 0
    assert value(samples, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 2
    assert value(samples, "vllm:e2e_request_latency_seconds_count") == 3
    assert value(samples, "vllm:request_params_n_count") == 3
    assert continuous and \
        all("prompt_tokens_details" not in usage for usage in [*usages, *continuous])
    assert value(samples, "vllm:prefix_cache_queries_total") == 0
    assert value(samples, "vllm:prefix_cache_hits_total") == 0
    (info,) = samples["vllm:cache_config_info"]
    assert info.labels["enable_prefix_caching"] == "False"
    for name, bounds in VLLM_BUCKETS.items():
        les = [float(s.labels["le"]) for s in samples[f"{name}_bucket"]]
        assert les == [*map(float, bounds), float("inf")], name


@pytest.mark.parametrize("values", [
    [0.01, 0.025, 0.0250001, 80.0, 80.5, 0.0, 1e-9],       # on, just above and past the bounds
    [0.3 * k / 7 for k in range(60)],
])
def test_bulk_binning_equals_prometheus_clients_histogram(values: list[float]) -> None:
    bounds = VLLM_BUCKETS["vllm:inter_token_latency_seconds"]
    registry = CollectorRegistry()
    reference = Histogram("vllm:inter_token_latency_seconds", "doc", ["model_name", "engine"],
                          buckets=bounds, registry=registry).labels(NAME, "0")
    for v in values:
        reference.observe(v)
    binned = _BinnedHistogram((("vllm:inter_token_latency_seconds", "doc"),), bounds,
                              (NAME, "0"))
    binned.observe_many(values[:3])
    binned.observe_many(values[3:])
    mine = CollectorRegistry()
    mine.register(binned)

    def series(text: bytes) -> dict[tuple[str, str], float]:
        return {(s.name, s.labels.get("le", "")): s.value
                for f in text_string_to_metric_families(text.decode()) for s in f.samples
                if not s.name.endswith("_created")}

    want, got = series(generate_latest(registry)), series(generate_latest(mine))
    assert want.keys() == got.keys()
    for key, v in want.items():
        assert got[key] == pytest.approx(v), key

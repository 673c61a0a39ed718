"""What vLLM's Grafana dashboard and alert rules ask Prometheus, recorded so a test can check
that every series they query exists on atombatch's `/metrics` (docs/from-vllm.md#metrics).

`DASHBOARD`: every `expr` of vLLM's examples/online_serving/prometheus_grafana/grafana.json (at
vLLM commit 004f771f3a6b49597546b05c7d83686d1e121fa0, `$model_name` and `$__rate_interval` as
Grafana leaves them) and its `model_name` variable's query. `ALERTS`: the vLLM expressions of
examples/online_serving/prometheus_grafana/k8s-monitoring/prometheusrule.yaml (commit
cf6f12c20b258469cb45d5d0f2fe3edb110aed43)."""

from __future__ import annotations

_SEL = '{model_name="$model_name"}'
_RATE = "[$__rate_interval]"


def _quantiles(histogram: str) -> list[str]:
    return [f"histogram_quantile({q}, sum by(le) (rate({histogram}_bucket{_SEL}{_RATE})))"
            for q in ("0.99", "0.95", "0.9", "0.5")]


def _mean(histogram: str) -> str:
    return f"rate({histogram}_sum{_SEL}{_RATE})\n/\nrate({histogram}_count{_SEL}{_RATE})"


DASHBOARD = (
    # E2E Request Latency
    *_quantiles("vllm:e2e_request_latency_seconds"), _mean("vllm:e2e_request_latency_seconds"),
    # Token Throughput
    f"rate(vllm:prompt_tokens_total{_SEL}{_RATE})",
    f"rate(vllm:generation_tokens_total{_SEL}{_RATE})",
    # Time Per Output Token Latency
    *_quantiles("vllm:time_per_output_token_seconds"),
    _mean("vllm:time_per_output_token_seconds"),
    # Scheduler State
    f"vllm:num_requests_running{_SEL}",
    f"vllm:num_requests_waiting{_SEL}",
    # Time To First Token Latency
    *_quantiles("vllm:time_to_first_token_seconds"), _mean("vllm:time_to_first_token_seconds"),
    # Cache Utilization
    f"vllm:gpu_cache_usage_perc{_SEL}",
    # Request Prompt Length, Request Generation Length (heatmaps)
    f"sum by(le) (increase(vllm:request_prompt_tokens_bucket{_SEL}{_RATE}))",
    f"sum by(le) (increase(vllm:request_generation_tokens_bucket{_SEL}{_RATE}))",
    # Finish Reason
    f"sum by(finished_reason) (increase(vllm:request_success_total{_SEL}{_RATE}))",
    # Queue Time
    f"rate(vllm:request_queue_time_seconds_sum{_SEL}{_RATE})",
    # Requests Prefill and Decode Time
    f"rate(vllm:request_prefill_time_seconds_sum{_SEL}{_RATE})",
    f"rate(vllm:request_decode_time_seconds_sum{_SEL}{_RATE})",
    # Max Generation Token in Sequence Group
    f"rate(vllm:request_max_num_generation_tokens_sum{_SEL}{_RATE})",
    # the model_name variable
    'label_values({__name__=~"vllm:.*"},model_name)',
)

ALERTS = (
    "histogram_quantile(0.99, sum by (le, model_name) "
    "(rate(vllm:e2e_request_latency_seconds_bucket[5m]))) > 120",
    "histogram_quantile(0.99, sum by (le, model_name) "
    "(rate(vllm:time_to_first_token_seconds_bucket[5m]))) > 30",
    "histogram_quantile(0.99, sum by (le, model_name) "
    "(rate(vllm:inter_token_latency_seconds_bucket[5m]))) > 1",
    'increase(vllm:e2e_request_latency_seconds_bucket{le="120"}[5m]) < '
    "increase(vllm:e2e_request_latency_seconds_count[5m])",
    "vllm:kv_cache_usage_perc > 0.95",
    "vllm:num_requests_waiting > 50",
    "rate(vllm:num_preemptions[5m]) > 1",
)

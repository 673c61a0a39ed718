"""Figures in the shape of vLLM's scheduler probe (atombatch/bench/vllm_scheduler_probe.py):
for tests/bench/test_bench_vllm_scheduler.py and for the stand-in executable it runs in place of
vLLM's Python."""

from __future__ import annotations

import json
from typing import Any


def figure(cpu: float) -> dict[str, Any]:
    return {"wall_ns": cpu * 1.1, "cpu_ns": cpu, "cpu_ns_range": [cpu * 0.9, cpu * 1.2],
            "repeats": 3}


def hit_result(schedule: float) -> dict[str, Any]:
    return {"case": "hit", "lanes": 1, "prompt_tokens": 8192, "hit_tokens": 8176,
            "num_blocks": 577, "loops": 5, "request": figure(1_400_000.0),
            "add_request": figure(10_000.0), "schedule": figure(schedule),
            "finish": figure(200_000.0), "add_request_schedule": figure(schedule + 10_000.0),
            "step": figure(schedule + 210_000.0)}


def full_result(lanes: int, cached: int) -> dict[str, Any]:
    steady = 50_000.0 * lanes
    return {"case": "full", "lanes": lanes, "cached": cached,
            "num_blocks": cached + lanes * 128 + 200, "prompt_tokens": 128,
            "max_model_len": 2048, "loops": 5, "fill_seconds": 0.4,
            "cached_blocks_at_end": cached, "evicted_per_admission": 7,
            "admit_schedule": figure(steady * 0.7 + 100_000.0),
            "admit_step": figure(steady + 150_000.0), "steady_schedule": figure(steady * 0.7),
            "steady_step": figure(steady), "extra_schedule": figure(100_000.0),
            "extra_step": figure(150_000.0)}


def probe_json(results: list[dict[str, Any]]) -> str:
    return json.dumps({"vllm": "0.33.0", "torch": "2.14.1", "python": "3.11.7",
                       "log_stats": True, "hash_algo": "sha256",
                       "load_before": [0.5, 0.4, 0.3], "load_after": [0.6, 0.4, 0.3],
                       "results": results})

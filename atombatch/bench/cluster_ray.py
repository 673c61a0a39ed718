"""`python -m atombatch.bench cluster --ray`: the prefix-aware router vs Ray Serve's default router
on a real local Ray Serve deployment (real HTTP/SSE, real routers), side by side in one run.

Both applications get the same replicas (`atombatch.serve.ray.build_app`, prefix cache on), the
same shared-prefix chat workload and the same client: `--concurrency` conversations at a time,
each `--turns` turns long, every turn's prompt the whole conversation so far, opening with one of
`--system-prompts` shared system prompts. `--repeat` rounds alternate the routers, so load from
elsewhere on the machine falls on both. Measured at the client: TTFT (request sent -> first
token in the SSE stream), requests/s and output tokens/s; from the replicas' own counters (the
board): prompt tokens whose prefill the prefix cache saved; and the machine's load average.

The replicas' runtime (default) is the simulator paced in wall time (`--runtime sim
--sim-pace 1`): every prefill chunk and decode step sleeps the calibrated device time of the
model (qwen3-4b: a 1 024-token prefill takes about 0.45 s, a decode step of 4 lanes about 45 ms),
so a prefix hit saves real wall time of the size a device would save, while the replicas use
almost no CPU: the comparison does not depend on what else runs on the machine. The NumPy
runtime (`ENGINE_NUMPY`) computes real decoder math on the CPU instead: there the shared machine's
load is the noise.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from typing import Any

import msgspec
import numpy as np

# Each replica: qwen3-4b on the paced simulator, 4 lanes, 48 blocks of 128 tokens (6 144 tokens:
# the running lanes plus about 3 of 8 system prompts of 1 024 tokens; one replica cannot hold the
# whole working set, two can).
ENGINE = ["--runtime", "sim", "--model", "qwen3-4b", "--sim-pace", "1", "--batch-size", "4",
          "--max-seq-len", "4096", "--block-size", "128", "--num-blocks", "48",
          "--prefill-chunk-size", "128", "--prefix-cache", "--max-waiting", "1024"]
ENGINE_NUMPY = ["--batch-size", "2", "--max-seq-len", "2048", "--block-size", "64",
                "--num-blocks", "96", "--prefill-chunk-size", "64", "--prefix-cache"]


class RayRouterResult(msgspec.Struct, frozen=True):
    router: str                          # "prefix" (atombatch) | "default" (Ray Serve's)
    round: int                           # repetition (routers alternate within a round)
    replicas: int
    requests: int
    failed: int
    prompt_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    requests_per_s: float
    output_tok_s: float
    per_replica: dict[str, int]          # requests each replica served
    ttft_mean_s: float = 0.0
    load_before: float = 0.0             # 1-minute load average when the run started
    load_after: float = 0.0              # ... and when it ended
    seconds: float = 0.0                 # wall time of the run


class RouterSummary(msgspec.Struct, frozen=True):
    """One router over the rounds: medians of the per-round figures."""

    router: str
    rounds: int
    prefix_hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    requests_per_s: float
    failed: int


async def _conversation(client: Any, url: str, system: list[int], users: list[list[int]],
                        output_len: int, ttfts: list[float], replicas: dict[str, int],
                        counts: dict[str, int]) -> None:
    history = list(system)
    for user in users:
        prompt = history + user
        body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0,
                "ignore_eos": True, "stream": True}
        sent = time.perf_counter()
        first = None
        tokens: list[int] = []
        counts["prompt_tokens"] += len(prompt)
        try:
            async with client.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    counts["failed"] += 1
                    return
                replica = response.headers.get("x-atombatch-replica", "?")
                replicas[replica] = replicas.get(replica, 0) + 1
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    ids = json.loads(line[6:])["choices"]
                    new = ids[0].get("token_ids", []) if ids else []
                    if new and first is None:
                        first = time.perf_counter() - sent
                    tokens.extend(new)
        except Exception:
            counts["failed"] += 1
            return
        if first is None or len(tokens) != output_len:
            counts["failed"] += 1
            return
        ttfts.append(first)
        counts["output_tokens"] += len(tokens)
        history = prompt + tokens


async def _drive(url: str, plans: list[tuple[list[int], list[list[int]]]], output_len: int,
                 concurrency: int, ttfts: list[float], served: dict[str, int],
                 counts: dict[str, int]) -> float:
    """Run every conversation, `concurrency` at a time; returns the wall time."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(system: list[int], users: list[list[int]]) -> None:
            async with gate:
                await _conversation(client, url, system, users, output_len, ttfts, served,
                                    counts)

        start = time.perf_counter()
        await asyncio.gather(*(one(s, u) for s, u in plans))
        return time.perf_counter() - start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(*, replicas: int = 2, conversations: int = 16, turns: int = 3, system_prompts: int = 2,
        system_len: int = 768, user_len: int = 32, output_len: int = 16, concurrency: int = 4,
        routers: tuple[str, ...] = ("default", "prefix"), seed: int = 0,
        num_cpus: int = 2, repeat: int = 1, engine: list[str] | None = None,
        max_imbalance: int = 4) -> list[RayRouterResult]:
    """Deploy one application per router on a local Ray and drive the same workload through
    each (see the module docstring)."""
    engine = list(ENGINE if engine is None else engine)
    import ray
    from ray import serve

    from atombatch.serve.ray import board, build_app

    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, 1000, system_len).tolist() for _ in range(system_prompts)]
    plans = [(systems[c % system_prompts],
              [rng.integers(3, 1000, user_len).tolist() for _ in range(turns)])
             for c in range(conversations)]
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    results = []
    try:
        for router, rep in [(r, k) for k in range(repeat) for r in routers]:
            name = f"bench-{router}-{rep}"
            serve.run(build_app(engine, replicas=replicas,
                                replica_cpus=min(0.5, num_cpus / (replicas + 1)),
                                router=router, routing_stats_s=0.2, app_name=name,
                                max_imbalance=max_imbalance),
                      name=name, route_prefix=f"/{name}")
            _wait_reports(name, replicas)
            url = f"http://127.0.0.1:{port}/{name}/v1/completions"
            ttfts: list[float] = []
            served: dict[str, int] = {}
            counts = {"prompt_tokens": 0, "output_tokens": 0, "failed": 0}

            load_before = os.getloadavg()[0]
            elapsed = asyncio.run(_drive(url, plans, output_len, concurrency, ttfts, served,
                                         counts))
            load_after = os.getloadavg()[0]
            time.sleep(1.5)                 # let every replica report its counters
            stats = {k: v["stats"] for k, v in ray.get(board(name).reports.remote()).items()}
            hits = sum(s["prefix_hit_tokens"] for s in stats.values())
            done = len(ttfts)
            array = np.asarray(ttfts or [float("nan")])
            results.append(RayRouterResult(
                router=router, round=rep, replicas=replicas, requests=conversations * turns,
                failed=counts["failed"], prompt_tokens=counts["prompt_tokens"],
                prefix_hit_tokens=hits,
                prefix_hit_rate=hits / counts["prompt_tokens"] if counts["prompt_tokens"] else 0.0,
                ttft_p50_s=float(np.percentile(array, 50)),
                ttft_p99_s=float(np.percentile(array, 99)),
                requests_per_s=done / elapsed, output_tok_s=counts["output_tokens"] / elapsed,
                per_replica=served, ttft_mean_s=float(np.mean(array)),
                load_before=load_before, load_after=load_after, seconds=elapsed))
            serve.delete(name)
    finally:
        serve.shutdown()
        ray.shutdown()
    return results


def _wait_reports(name: str, count: int, timeout: float = 60.0) -> None:
    """Until every replica reported (so both routers start from replicas that are up)."""
    import ray

    from atombatch.serve.ray import board

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(ray.get(board(name).reports.remote())) >= count:
            return
        time.sleep(0.2)


def summarize(results: list[RayRouterResult]) -> list[RouterSummary]:
    """Per router, the medians over its rounds."""
    out = []
    for router in dict.fromkeys(r.router for r in results):
        mine = [r for r in results if r.router == router]

        def median(field: str, rows: list[RayRouterResult] = mine) -> float:
            return float(np.median([getattr(r, field) for r in rows]))

        out.append(RouterSummary(router=router, rounds=len(mine),
                                 prefix_hit_rate=median("prefix_hit_rate"),
                                 ttft_p50_s=median("ttft_p50_s"), ttft_p99_s=median("ttft_p99_s"),
                                 requests_per_s=median("requests_per_s"),
                                 failed=sum(r.failed for r in mine)))
    return out


def format_table(results: list[RayRouterResult], engine: list[str] | None = None) -> str:
    head = (f"{'router':<8} {'#':>2} {'N':>2} {'reqs':>4} {'fail':>4} {'hit%':>5} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'req/s':>6} {'tok/s':>6} {'load':>9}  per replica")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.router:<8} {r.round:>2} {r.replicas:>2} {r.requests:>4} {r.failed:>4} "
                     f"{100 * r.prefix_hit_rate:>5.1f} {1000 * r.ttft_p50_s:>7.1f}ms "
                     f"{1000 * r.ttft_p99_s:>7.1f}ms {r.requests_per_s:>6.2f} "
                     f"{r.output_tok_s:>6.1f} {r.load_before:>4.1f}>{r.load_after:<4.1f}  "
                     f"{sorted(r.per_replica.values())}")
    summary = summarize(results)
    lines.append("")
    lines.append("medians over the rounds:")
    for s in summary:
        lines.append(f"  {s.router:<8} hit {100 * s.prefix_hit_rate:5.1f}%  TTFT p50 "
                     f"{1000 * s.ttft_p50_s:7.1f} ms  p99 {1000 * s.ttft_p99_s:7.1f} ms  "
                     f"{s.requests_per_s:5.2f} req/s  failed {s.failed}")
    by = {s.router: s for s in summary}
    if "prefix" in by and "default" in by:
        p, d = by["prefix"], by["default"]
        lines.append(f"  prefix / default: TTFT p50 x{p.ttft_p50_s / d.ttft_p50_s:.2f}, p99 "
                     f"x{p.ttft_p99_s / d.ttft_p99_s:.2f}, req/s "
                     f"x{p.requests_per_s / d.requests_per_s:.2f}, hit rate "
                     f"{100 * d.prefix_hit_rate:.1f}% -> {100 * p.prefix_hit_rate:.1f}%")
    paced = engine is not None and "sim" in engine
    lines.append("(wall time on this machine, local Ray, real HTTP/SSE; replicas: "
                 + ("the simulator paced in wall time" if paced else "NumPy, real math")
                 + "; load = 1-minute load average before>after each run)")
    return "\n".join(lines)

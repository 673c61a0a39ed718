"""`python -m atombatch.bench cache_cost`: what the prefix cache, on by default in the server
(as vLLM), costs a workload that never shares a prefix.

    python -m atombatch.bench cache_cost --batch-size 8 --step-ms 5 --repeats 7 --json cc.json

Two servers on the null device (atombatch/runtime/null.py) run side by side, one with
`--no-enable-prefix-caching`, one with `--enable-prefix-caching`, otherwise alike. Each repeat
sends one round of B streamed requests (`bench overlap`'s client and CPU accounting) to each, in
alternating order (off then on, then on then off: a drift in the machine's load falls on both).
Every prompt of every round is new: its first two tokens are unique to it, so no request ever
finds a cached block and the cache can only cost (lookups, digests, blocks kept and evicted).

Reported: the medians of delivered tok/s and of front and core CPU per token for each side, and
the ratios on / off of those medians (1.0: no cost), with the commit and the load average before
and after the run; then the engine alone on the same prompts (a `Batcher` on a null device that
does not sleep, this process's CPU per generated token, alternating sides): the figure least
moved by other processes on a shared machine.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from atombatch.bench import provenance
from atombatch.bench.overlap import Load, Round, Server, _load, request_bodies, server_round

SIDES = ("off", "on")


class Side(msgspec.Struct, frozen=True):
    cache: str                          # off | on
    command: str
    rounds: list[Round]
    tok_per_s: float                    # medians over the rounds
    front_us_per_token: float
    core_us_per_token: float
    # the server's own prefix-cache counters after the run (`vllm:prefix_cache_*` on /metrics):
    # tokens looked up (0: the cache is off) and found (0: no prompt shared a prefix)
    queried_tokens: float | None = None
    hit_tokens: float | None = None


class CacheCost(msgspec.Struct, frozen=True):
    command: str
    commit: str | None
    machine: str
    params: dict[str, Any]
    load_before: Load
    load_after: Load
    sides: list[Side]
    # on / off of the medians: tok/s (1.0 or above: no cost), CPU per token (1.0 or below)
    tok_per_s_ratio: float
    front_cpu_ratio: float
    core_cpu_ratio: float
    # the engine alone (a Batcher on a null device that does not sleep, this process's CPU per
    # generated token over the same rounds, alternating): medians off and on, and on / off
    engine_us_per_token: dict[str, float] | None = None
    engine_cpu_ratio: float | None = None


def unshared_prompts(rounds: int, batch_size: int, prompt_len: int, vocab_size: int,
                     seed: int) -> list[list[list[int]]]:
    """`rounds` x `batch_size` prompts no two of which share their first two tokens (hence no
    prefix-cache block: the first block's digest covers them)."""
    rng = np.random.default_rng(seed)
    ids = vocab_size - 3  # ids from 3 up: clear of the tiny spec's bos (1) and eos (2)
    if ids * ids < rounds * batch_size:
        raise ValueError(f"{rounds} x {batch_size} prompts need more than {ids * ids} "
                         "distinct leading pairs")
    chosen = rng.choice(ids * ids, rounds * batch_size, replace=False).tolist()
    out: list[list[list[int]]] = []
    for r in range(rounds):
        batch = []
        for i in range(batch_size):
            pair = chosen[r * batch_size + i]
            head = [3 + pair // ids, 3 + pair % ids]
            batch.append([*head, *rng.integers(3, vocab_size, prompt_len - 2).tolist()])
        out.append(batch)
    return out


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def prefix_counters(server: Server) -> tuple[float, float]:
    """(queried, hit) tokens of the server's prefix cache, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    host = f"[{server.host}]" if ":" in server.host else server.host
    with urllib.request.urlopen(f"http://{host}:{server.port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = {sample.name: sample.value for family in text_string_to_metric_families(text)
             for sample in family.samples}
    return (found["vllm:prefix_cache_queries_total"], found["vllm:prefix_cache_hits_total"])


def _side(cache: str, argv: list[str], rounds: list[Round],
          counters: tuple[float, float]) -> Side:
    def per_token(get: Any) -> float:
        return _median([1e6 * get(r) / r.tokens for r in rounds if r.tokens])

    return Side(cache=cache, command=shlex.join(argv), rounds=rounds,
                tok_per_s=_median([r.tok_per_s for r in rounds]),
                front_us_per_token=per_token(lambda r: r.front_cpu_s),
                core_us_per_token=per_token(lambda r: r.core_cpu_s),
                queried_tokens=counters[0], hit_tokens=counters[1])


def engine_cpu(args: argparse.Namespace, prompts: list[list[list[int]]]) -> dict[str, list[float]]:
    """CPU microseconds per generated token of the engine alone, cache off and on, each round's
    prompts on both (alternating which goes first), the first round a warm-up."""
    from atombatch import ArtifactConfig, Batcher, SamplingParams
    from atombatch.runtime.null import NullRuntime
    from atombatch.serve.cli import DEFAULT_SPEC

    bps = args.max_seq_len // args.block_size
    art = ArtifactConfig(model=DEFAULT_SPEC, batch_size=args.batch_size,
                         max_seq_len=args.max_seq_len, block_size=args.block_size,
                         num_blocks=args.batch_size * bps + 1,
                         prefill_chunk_size=args.prefill_chunk_size)
    engines = {side: Batcher(NullRuntime(art, step_ms=0.0, prefill_ms=0.0),
                             prefix_cache=side == "on") for side in SIDES}
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    out: dict[str, list[float]] = {side: [] for side in SIDES}
    for index, batch in enumerate(prompts):
        for side in SIDES if index % 2 == 0 else SIDES[::-1]:
            started = time.process_time()
            engines[side].generate(batch, params)
            if index:
                out[side].append(1e6 * (time.process_time() - started) /
                                 (len(batch) * args.max_tokens))
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m atombatch.bench cache_cost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=8, help="lanes B = requests per round")
    p.add_argument("--step-ms", type=float, default=5.0, help="null device: ms per decode step")
    p.add_argument("--prefill-ms", type=float, default=1.0, help="ms per prefill chunk")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64,
                   help="KV block size (the prefix cache's unit; default 64)")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--prefill-chunk-size", type=int, default=64)
    p.add_argument("--engine-core", choices=("inline", "process"), default="process")
    p.add_argument("--repeats", type=int, default=5, help="rounds per side (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the report here")
    return p


def run(args: argparse.Namespace) -> CacheCost:
    from atombatch.serve.cli import DEFAULT_SPEC

    commit = provenance.git_commit()
    load_before = _load()
    batch = args.batch_size
    prompts = unshared_prompts(args.repeats + 1, batch, args.prompt_len,
                               DEFAULT_SPEC.vocab_size, args.seed)
    base = [sys.executable, "-m", "atombatch.serve", "--runtime", "null", "--null-step-ms",
            f"{args.step_ms:g}", "--null-prefill-ms", f"{args.prefill_ms:g}", "--batch-size",
            str(batch), "--max-seq-len", str(args.max_seq_len), "--block-size",
            str(args.block_size), "--prefill-chunk-size", str(args.prefill_chunk_size),
            "--engine-core", args.engine_core, "--port", "0", "--log-level", "warning"]
    argvs = {"off": [*base, "--no-enable-prefix-caching"],
             "on": [*base, "--enable-prefix-caching"]}
    split: Literal["thread", "process"] = "process" if args.engine_core == "process" else "thread"
    timeout = 10 * (args.max_tokens * args.step_ms / 1e3 + batch * args.prefill_ms / 1e3) + 60
    servers = {side: Server(argvs[side]) for side in SIDES}
    rounds: dict[str, list[Round]] = {side: [] for side in SIDES}
    try:
        for side in SIDES:  # a warm-up round each, on prompts of its own
            server_round(servers[side], request_bodies(DEFAULT_SPEC.name, prompts[0], 4), 4,
                         batch, args.step_ms, split, timeout)
        for repeat in range(args.repeats):
            bodies = request_bodies(DEFAULT_SPEC.name, prompts[repeat + 1], args.max_tokens)
            order = SIDES if repeat % 2 == 0 else SIDES[::-1]
            for side in order:  # the same (new) prompts on both sides
                rounds[side].append(server_round(servers[side], bodies, args.max_tokens, batch,
                                                 args.step_ms, split, timeout))
                print(f"  repeat {repeat + 1}/{args.repeats} cache {side}: "
                      f"{rounds[side][-1].tok_per_s:.0f} tok/s", file=sys.stderr)
        counters = {side: prefix_counters(servers[side]) for side in SIDES}
    finally:
        for server in servers.values():
            server.stop()
    sides = [_side(side, argvs[side], rounds[side], counters[side]) for side in SIDES]
    off, on = sides
    engine = {side: _median(values) for side, values in engine_cpu(args, prompts).items()}
    params = {key: value for key, value in vars(args).items() if key != "json"}
    return CacheCost(command=shlex.join(["python", "-m", "atombatch.bench", "cache_cost",
                                         *sys.argv[2:]]),
                     commit=commit, machine=provenance.machine(), params=params,
                     load_before=load_before, load_after=_load(), sides=sides,
                     tok_per_s_ratio=on.tok_per_s / off.tok_per_s,
                     front_cpu_ratio=on.front_us_per_token / off.front_us_per_token,
                     core_cpu_ratio=on.core_us_per_token / off.core_us_per_token,
                     engine_us_per_token=engine, engine_cpu_ratio=engine["on"] / engine["off"])


def format_table(report: CacheCost) -> str:
    lines = [f"prefix cache on vs off, no shared prefixes: B{report.params['batch_size']}, "
             f"step {report.params['step_ms']:g} ms, prompt {report.params['prompt_len']}, "
             f"{report.params['max_tokens']} tokens, --engine-core "
             f"{report.params['engine_core']}, medians of {report.params['repeats']} rounds",
             f"{'cache':<6} {'tok/s':>9} {'front us/tok':>13} {'core us/tok':>12}"]
    for side in report.sides:
        lines.append(f"{side.cache:<6} {side.tok_per_s:>9.1f} {side.front_us_per_token:>13.1f} "
                     f"{side.core_us_per_token:>12.1f}")
    lines.append(f"on/off {report.tok_per_s_ratio:>9.3f} {report.front_cpu_ratio:>13.3f} "
                 f"{report.core_cpu_ratio:>12.3f}")
    failed = sum(r.ok != r.requests for side in report.sides for r in side.rounds)
    if report.engine_us_per_token is not None and report.engine_cpu_ratio is not None:
        lines.append(f"engine alone (no device time): {report.engine_us_per_token['off']:.1f} "
                     f"us/token off, {report.engine_us_per_token['on']:.1f} on, on/off "
                     f"{report.engine_cpu_ratio:.3f}")
    on = report.sides[1]
    lines.append(f"cache on: {on.queried_tokens:.0f} prompt tokens looked up, "
                 f"{on.hit_tokens:.0f} found (no shared prefixes: 0)")
    lines.append(f"commit {report.commit or '?'}; load average before {report.load_before}, "
                 f"after {report.load_after}" + (f"; {failed} rounds with failed requests"
                                                 if failed else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.repeats < 1 or args.batch_size < 1 or args.prompt_len < 2:
        print("error: --repeats, --batch-size >= 1 and --prompt-len >= 2", file=sys.stderr)
        return 2
    report = run(args)
    print(format_table(report))
    if args.json is not None:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    failed = any(r.ok != r.requests for side in report.sides for r in side.rounds)
    return 1 if failed else 0

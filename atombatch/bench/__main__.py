"""`python -m atombatch.bench [SUBCOMMAND] ...` (see DESCRIPTIONS); no subcommand runs a short
micro + batch invariance + serve."""

from __future__ import annotations

import importlib
import sys
import time

# What each subcommand measures (its own --help has the flags).
DESCRIPTIONS = {
    "micro": "the hot path, compiled vs pure-Python twin: block/lane ops, the decode step, the "
             "engine step, the prefix cache at scale (ns/op, JSON with the load average)",
    "serve": "the origin issue's matrix on the simulator: models x prompt/output lengths x B1 vs "
             "B4, TTFT p50/p99/max, tok/s, timeouts, occupied lanes",
    "fit": "the memory planner: does an artifact's KV and weights fit the device",
    "http": "a load generator against a running server (the origin issue's HTTP/SSE matrix)",
    "invariance": "B4 logits of a lane equal its B1 logits (NumPy runtime)",
    "device": "the RebelRuntime path on an optimum-rbln compiled directory (emulated rebel here)",
    "cluster": "replicas behind the router on the simulator (or Ray with --ray): sizing for an SLO",
    "overlap": "delivered / ideal throughput of the whole serving path on the null device, "
               "inline vs engine-core process, with and without the decode pipeline (--overlap), "
               "CPU per token of front, core and client",
    "stalls": "how long decoding streams wait behind a burst of prompts, per policy (simulator)",
    "argmax": "a decode step's greedy pick after a device wait: numpy's argmax against the "
              "compiled argmax_rows, per shape of logits",
    "cache_cost": "the default prefix cache on a workload with no shared prefixes: server rounds "
                  "cache on vs off side by side, ratio of medians (tok/s, CPU per token)",
    "structured": "structured-output grammar masks per step at B = 4..256 with a 152k vocabulary, "
                  "next to the unconstrained greedy and sampled step",
}
SUBCOMMANDS = tuple(DESCRIPTIONS)
USAGE = ("usage: python -m atombatch.bench [SUBCOMMAND] [options]\n"
         "       python -m atombatch.bench            (short micro + invariance + serve)\n"
         "       python -m atombatch.bench SUBCOMMAND --help\n\nsubcommands:\n" +
         "\n".join(f"  {name:<11} {text}" for name, text in DESCRIPTIONS.items()))

# The short default serve: two models, two prompt lengths, B1 vs B4 on one device and on two.
SHORT_SERVE = ["--models", "qwen3-4b,koni-8b", "--routes", "native", "--inputs", "2048,8192",
               "--outputs", "128", "--artifacts", "B1/k1,B4/k5,B1/k1/tp2,B4/k5/tp2",
               "--policies", "stall-free:8", "--no-progress"]


def _short_default() -> int:
    status = 0
    started = time.perf_counter()
    print("== micro (quick) ==")
    try:
        micro = importlib.import_module("atombatch.bench.micro")
    except ImportError as exc:
        print(f"micro is not available yet ({exc}); skipped")
    else:
        result = micro.run(quick=True)
        table = getattr(micro, "format_table", None)
        print(table(result) if callable(table) and result is not None else result)
    print()
    print("== batch invariance (NumPy runtime, probe lane at B4 vs alone at B1) ==")
    from atombatch.bench import invariance
    print(invariance.format_table(invariance.run(steps=8)))
    print()
    print("== serve (short: " + " ".join(SHORT_SERVE) + ") ==")
    from atombatch.bench import serve
    status = serve.main(SHORT_SERVE) or status
    print(f"\n(short default finished in {time.perf_counter() - started:.1f} s; "
          "run a subcommand with --help for the full benchmarks)")
    return status


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        return _short_default()
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help"):
        print(USAGE)
        return 0
    if command not in SUBCOMMANDS:
        print(f"error: unknown benchmark {command!r}\n{USAGE}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"atombatch.bench.{command}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

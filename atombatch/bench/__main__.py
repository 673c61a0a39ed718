"""`python -m atombatch.bench [SUBCOMMAND] ...` (see DESCRIPTIONS); no subcommand runs a short
micro + batch invariance + serve, writes every table to bench-details.txt and a picture to
bench-summary.png, and ends with one screen of the figures that matter (`summary.py`)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import msgspec

# What each subcommand measures (its own --help has the flags).
DESCRIPTIONS = {
    "micro": "the hot path, compiled vs pure-Python twin: block/lane ops, the decode step, the "
             "engine step, the prefix cache at scale (ns/op, JSON with the load average)",
    "serve": "the origin issue's matrix on the simulator: models x prompt/output lengths x B1 vs "
             "B4, TTFT p50/p99/max, tok/s, timeouts, occupied lanes",
    "fit": "the memory planner: does an artifact's KV and weights fit the device (quantized "
           "formats, LoRA adapters; --quant-table: the largest B per format, simulated)",
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
    "lora": "what LoRA adapters add to a decode step and a prefill chunk on the simulator, "
            "by rank and by distinct adapters in the step",
    "spec": "speculative decoding: projected c16 gain per acceptance and the batch size where "
            "it stops paying (simulator); measured acceptance of n-gram drafts on copy-heavy texts",
}
SUBCOMMANDS = tuple(DESCRIPTIONS)
USAGE = ("usage: python -m atombatch.bench [SUBCOMMAND] [options]\n"
         "       python -m atombatch.bench [--verbose] [--out DIR]\n"
         "           (short micro + invariance + serve: one screen of figures at the end,\n"
         "            every table in DIR/bench-details.txt, a picture in DIR/bench-summary.png)\n"
         "       python -m atombatch.bench SUBCOMMAND --help\n\nsubcommands:\n" +
         "\n".join(f"  {name:<11} {text}" for name, text in DESCRIPTIONS.items()))

# The short default serve: two models, two prompt lengths, B1 vs B4 on one device and on two.
SHORT_SERVE = ["--models", "qwen3-4b,koni-8b", "--routes", "native", "--inputs", "2048,8192",
               "--outputs", "128", "--artifacts", "B1/k1,B4/k5,B1/k1/tp2,B4/k5/tp2",
               "--policies", "stall-free:8", "--no-progress"]


def default_parser() -> argparse.ArgumentParser:
    """The options of the short default run (no subcommand)."""
    parser = argparse.ArgumentParser(
        prog="python -m atombatch.bench",
        description="The short default: micro (quick) + batch invariance + a small serve "
                    "matrix; ends with one screen of the figures that matter and a picture.")
    parser.add_argument("--out", type=Path, default=Path("."), metavar="DIR",
                        help="where bench-details.txt (every table) and bench-summary.png go "
                             "(default: the current directory)")
    parser.add_argument("--verbose", action="store_true",
                        help="print every table as it is measured too (they always go to "
                             "bench-details.txt)")
    return parser


def _load1() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - platforms without a load average
        return -1.0


def _short_default(argv: list[str]) -> int:
    from atombatch.bench import invariance, micro, provenance, serve, summary

    args = default_parser().parse_args(argv)
    details_path, picture_path = args.out / "bench-details.txt", args.out / "bench-summary.png"
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        details_file = details_path.open("w", encoding="utf-8")
    except OSError as exc:
        print(f"error: {args.out}: cannot write there ({exc.strerror})", file=sys.stderr)
        return 2
    started = time.perf_counter()
    loads = [_load1()]

    def show(text: str) -> None:
        details_file.write(text + "\n")
        if args.verbose:
            print(text, flush=True)

    with details_file, tempfile.TemporaryDirectory() as scratch:
        print("python -m atombatch.bench: micro (quick), batch invariance, serve (short); "
              "about a minute", file=sys.stderr, flush=True)
        show("== micro (quick) ==")
        records = micro.run(quick=True)
        loads += [r.load1 for r in records]
        show(micro.format_table(records))
        show("\n== batch invariance (NumPy runtime, probe lane at B4 vs alone at B1) ==")
        checks = invariance.run(steps=8)
        show(invariance.format_table(checks))
        show("\n== serve (short: " + " ".join(SHORT_SERVE) + ") ==")
        report_path = Path(scratch) / "serve.json"
        table = io.StringIO()
        with contextlib.redirect_stdout(table):
            status = serve.main([*SHORT_SERVE, "--json", str(report_path)])
        show(table.getvalue().rstrip("\n"))
        if status:
            return status
        report = msgspec.json.decode(report_path.read_bytes(), type=serve.ServeReport)
    loads.append(_load1())
    run = summary.Run(micro=records, invariance=checks, serve=report,
                      commit=provenance.git_commit(), loads=loads, cpus=os.cpu_count(),
                      seconds=time.perf_counter() - started)
    picture: Path | None = picture_path
    reason = None
    try:
        summary.write_picture(run, picture_path)
    except ImportError:
        picture, reason = None, "matplotlib is not installed (pip install 'atombatch[plot]')"
    if args.verbose:
        print()
    print("\n".join(summary.lines(run, details_path, picture, reason)))
    return 0 if all(r.tokens_equal for r in checks) else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("--") and argv[0] != "--help"):
        return _short_default(argv)
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

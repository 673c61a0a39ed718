"""`python -m atombatch.bench [micro|serve|fit|http|invariance|device|cluster|overlap] ...`; no subcommand
runs a short micro + batch invariance + serve."""

from __future__ import annotations

import importlib
import sys
import time

SUBCOMMANDS = ("micro", "serve", "fit", "http", "invariance", "device", "cluster", "overlap")
USAGE = ("usage: python -m atombatch.bench "
         "[micro|serve|fit|http|invariance|device|cluster|overlap] [options]\n"
         "       python -m atombatch.bench            (short micro + invariance + serve)\n"
         "       python -m atombatch.bench SUBCOMMAND --help")

# The short default serve: two models, two prompt lengths, B1 vs B4 on one device and on two.
SHORT_SERVE = ["--models", "qwen3-4b,koni-8b", "--routes", "native", "--inputs", "2048,8192",
               "--outputs", "128", "--artifacts", "B1/k1,B4/k5,B1/k1/tp2,B4/k5/tp2",
               "--policies", "prefill-first", "--no-progress"]


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

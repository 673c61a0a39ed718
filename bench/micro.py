#!/usr/bin/env python3
"""The micro-benchmarks as a pyperf suite: calibrated loops, worker processes, metadata.

    python bench/micro.py --fast --lanes 16 --ops engine_step,prefix_lookup,prefix_insert
    python bench/micro.py -o micro.json                 # every compiled case (about an hour)
    python -m pyperf compare_to base.json head.json --table
    python bench/compare.py BASE [HEAD]                 # two commits, one command

The cases are `atombatch.bench.cases`, the same ones `python -m atombatch.bench micro` times;
nothing here redefines them. By default only the compiled core is measured (`--impls c,py` adds
the pure-Python twin, which `bench micro` already compares side by side). A case takes about
20 s with `--fast` on a 2-core machine (10 worker processes, 2 values each), about 40 s without.
Benchmark names are `op/shape/B<lanes>/<impl>`, e.g.
`engine_step/partitioned/B64/c`; every value is the time of one operation (one engine step, one
lookup of the 8 192-token prompt, ...). pyperf records the machine's load average with each run
(`python -m pyperf dump --verbose`); the commit measured is in the `atombatch_commit` metadata.

The script measures the checkout it lives in (it puts that checkout first on `sys.path`, for the
worker processes too), so two worktrees at two commits give two comparable result files.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(CHECKOUT))

import pyperf  # noqa: E402

from atombatch.bench import cases, provenance  # noqa: E402

DEFAULT_LANES = "1,4,16,64,256"


def _add_cmdline_args(cmd: list[str], args) -> None:  # type: ignore[no-untyped-def]
    """Forward the suite's own options to pyperf's worker processes."""
    cmd.extend(("--lanes", args.lanes, "--ops", args.ops, "--impls", args.impls))


def _lazy(make: Callable[[], cases.TimeFunc]) -> cases.TimeFunc:
    """Build the case on first use: a worker builds only the case it measures."""
    built: list[cases.TimeFunc] = []

    def time_func(loops: int) -> float:
        if not built:
            built.append(make())
        return built[0](loops)

    return time_func


def _csv(text: str, known: tuple[str, ...] | None, what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = sorted(set(items) - set(known)) if known is not None else []
    if not items or unknown:
        raise SystemExit(f"--{what}={text!r}: expected a comma-separated list of "
                         f"{', '.join(known) if known else 'values'}")
    return items


def main() -> None:
    runner = pyperf.Runner(add_cmdline_args=_add_cmdline_args)
    runner.argparser.add_argument("--lanes", default=DEFAULT_LANES,
                                  help=f"batch sizes B (default: {DEFAULT_LANES})")
    runner.argparser.add_argument("--ops", default=",".join(cases.OPS),
                                  help="operations (default: all of atombatch.bench.cases.OPS)")
    runner.argparser.add_argument("--impls", default="c",
                                  help="block cores: c (compiled), py (twin); default c")
    args = runner.parse_args()
    try:
        lanes = [int(b) for b in _csv(args.lanes, None, "lanes")]
    except ValueError:
        raise SystemExit(f"--lanes={args.lanes!r}: expected comma-separated integers") from None
    if min(lanes) <= 0:
        raise SystemExit(f"--lanes={args.lanes!r}: batch sizes must be positive")
    ops = _csv(args.ops, cases.OPS, "ops")
    impls = _csv(args.impls, ("c", "py"), "impls")
    runner.metadata["atombatch_commit"] = provenance.git_commit() or "unknown"
    runner.metadata["atombatch_checkout"] = str(CHECKOUT)
    for case in cases.cases(lanes, ops, impls):
        runner.bench_time_func(case.name, _lazy(case.make), metadata={
            "atombatch_op": case.op, "atombatch_impl": case.impl, "atombatch_shape": case.shape,
            "atombatch_lanes": case.lanes, "atombatch_num_blocks": case.num_blocks})


if __name__ == "__main__":
    main()

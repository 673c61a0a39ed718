"""`python -m atombatch.bench argmax`: a decode step's greedy pick after a device wait.

For each shape (rows x vocab) of float32 logits it alternates, `--repeats` times, numpy's
`argmax(axis=1)` followed by `blocks.picked_logits` (what the device thread ran before c11d9a0)
and `blocks.argmax_rows` (one compiled pass that also keeps the picked logit), each after a
sleep of `--sleep-ms` that stands in for the device call: what the host pays on its critical
path is the call after a wait, with its code and the logits cold, not the call back to back.
Prints the median of each in microseconds, their ratio, the commit and the load average
(docs/overlap.md, "The argmax in one compiled call").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from atombatch.bench.provenance import git_commit
from atombatch.kernel import blocks as core

DEFAULT_SHAPES = "64x1024,256x1024,64x4096,64x32768,1x151936,8x151936,64x151936"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """`"64x1024,1x151936"` -> [(64, 1024), (1, 151936)]; each side a positive int."""
    shapes = []
    for part in text.split(","):
        rows, sep, vocab = part.strip().partition("x")
        if not sep or not rows.isdigit() or not vocab.isdigit() or int(rows) < 1 or \
                int(vocab) < 1 or int(rows) * int(vocab) > 1 << 26:
            raise argparse.ArgumentTypeError(
                f"shape {part!r} must be ROWSxVOCAB, both positive, at most 2**26 logits")
        shapes.append((int(rows), int(vocab)))
    return shapes


def measure(rows: int, vocab: int, repeats: int, sleep_s: float,
            seed: int = 0) -> tuple[float, float]:
    """Median seconds of (numpy argmax + picked_logits, argmax_rows), alternated; checks they
    pick the same tokens."""
    logits = np.random.default_rng(seed).standard_normal((rows, vocab)).astype(np.float32)
    greedy = np.zeros(rows, dtype=np.int64)
    best = np.zeros(rows, dtype=np.float32)
    numpy_s, compiled_s = [], []
    clock = time.perf_counter
    for _ in range(repeats):
        time.sleep(sleep_s)
        start = clock()
        np.argmax(logits, axis=1, out=greedy)
        core.picked_logits(logits, greedy, best, rows)
        numpy_s.append(clock() - start)
        want = greedy.copy()
        time.sleep(sleep_s)
        start = clock()
        core.argmax_rows(logits, greedy, best)
        compiled_s.append(clock() - start)
        if not np.array_equal(greedy, want):
            raise AssertionError(f"argmax_rows picked other tokens than numpy at {rows}x{vocab}")
    return statistics.median(numpy_s), statistics.median(compiled_s)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m atombatch.bench argmax",
        description="The greedy pick of a decode step after a device wait: numpy's argmax and "
                    "picked_logits against the compiled argmax_rows, alternated, per shape.")
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES),
                   help=f"ROWSxVOCAB,... (default {DEFAULT_SHAPES})")
    p.add_argument("--repeats", type=int, default=30, help="alternated calls of each (default 30)")
    p.add_argument("--sleep-ms", type=float, default=5.0,
                   help="the wait before each call, standing in for the device (default 5)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.repeats < 1 or not 0 <= args.sleep_ms <= 1000:
        parser().error(f"--repeats {args.repeats} must be >= 1 and --sleep-ms {args.sleep_ms} "
                       "within 0..1000")
    load = os.getloadavg()
    print(f"{'logits':>14} {'numpy+picked us':>16} {'argmax_rows us':>15} {'ratio':>6}")
    for rows, vocab in args.shapes:
        slow, fast = measure(rows, vocab, args.repeats, args.sleep_ms / 1e3)
        print(f"{f'{rows}x{vocab}':>14} {1e6 * slow:16.1f} {1e6 * fast:15.1f} {slow / fast:6.2f}")
    after = os.getloadavg()
    print(f"commit {git_commit() or 'unknown'}, implementation {core.IMPLEMENTATION}, "
          f"sleep {args.sleep_ms:g} ms, {args.repeats} alternated calls each, load average "
          f"{load[0]:.2f} before, {after[0]:.2f} after")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

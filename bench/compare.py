#!/usr/bin/env python3
"""Run the pyperf suite on two commits and compare them: a regression is one command away.

    python bench/compare.py BASE [HEAD] [--keep DIR] [-- SUITE OPTIONS...]

e.g. `python bench/compare.py main HEAD -- --fast --lanes 16,256 --ops engine_step`. Each commit is
checked out into a temporary git worktree (HEAD may also be `WORKTREE`: this checkout as it is,
uncommitted changes included), its extension is built in place (`setup.py build_ext --inplace`,
needs Cython: `pip install -e ".[bench]"`), the commit's own `bench/micro.py` writes
`<rev>.json`, and `python -m pyperf compare_to BASE.json HEAD.json --table` prints the
differences with their significance. Both commits must contain the suite (`bench/micro.py`).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def _measure(rev: str, work: Path, suite_args: list[str]) -> Path:
    """Check `rev` out (or use this checkout for WORKTREE), build it, run its suite."""
    label = rev.replace("/", "_")
    if rev == "WORKTREE":
        tree = CHECKOUT
    else:
        commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
                                cwd=CHECKOUT, check=True, capture_output=True,
                                text=True).stdout.strip()
        tree = work / f"tree-{label}"
        _run(["git", "worktree", "add", "--detach", str(tree), commit], CHECKOUT)
    if not (tree / "bench" / "micro.py").exists():
        raise SystemExit(f"{rev} has no bench/micro.py: it predates the pyperf suite")
    _run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], tree)
    output = work / f"{label}.json"
    _run([sys.executable, str(tree / "bench" / "micro.py"), "-o", str(output), *suite_args], tree)
    return output


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    suite_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, suite_args = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(prog="python bench/compare.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", help="the reference commit (branch, tag or hash)")
    parser.add_argument("head", nargs="?", default="HEAD",
                        help="the commit to compare (default HEAD; WORKTREE: this checkout)")
    parser.add_argument("--keep", metavar="DIR",
                        help="keep the result files in DIR (default: a temporary directory)")
    args = parser.parse_args(argv)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="atombatch-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        base = _measure(args.base, work, suite_args)
        head = _measure(args.head, work, suite_args)
        _run([sys.executable, "-m", "pyperf", "compare_to", str(base), str(head), "--table"],
             CHECKOUT)
    finally:
        for tree in work.glob("tree-*"):
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=CHECKOUT,
                           check=False)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

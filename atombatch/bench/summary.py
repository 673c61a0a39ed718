"""The one screen that ends `python -m atombatch.bench` (no subcommand), and its picture.

The short default measures three things: the hot path compiled vs its pure-Python twin (`micro
--quick`), batch invariance (a lane's logits at B4 vs alone at B1), and a small `serve` matrix on
the calibrated simulator (B1 vs B4, one device and two). Their full tables go to a file; this
module turns the same records into at most `MAX_LINES` lines and a three-panel PNG.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from atombatch.bench.invariance import InvarianceRecord
from atombatch.bench.micro import MicroRecord

MAX_LINES = 25                      # one screen
ENGINE_LANES = (1, 16, 256)         # the engine-step batch sizes the summary quotes


class Run:
    """What one short default run measured, with where and when."""

    def __init__(self, *, micro: Sequence[MicroRecord], invariance: Sequence[InvarianceRecord],
                 serve: Any, commit: str | None, loads: Sequence[float], cpus: int | None,
                 seconds: float) -> None:
        self.micro = list(micro)            # `micro.run(quick=True)`'s records
        self.invariance = list(invariance)  # one record per model family
        self.serve = serve                  # the `ServeReport` of the short serve matrix
        self.commit = commit                # HEAD (+ "-dirty"), None outside a checkout
        self.loads = list(loads)            # 1-minute load averages sampled before/during/after
        self.cpus = cpus
        self.seconds = seconds              # the whole run's wall time


def _time(ns: float) -> str:
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.3g} µs"
    return f"{ns:.0f} ns"


def _pairs(records: Sequence[MicroRecord], op: str, shape: str = "eager"
           ) -> dict[int, tuple[MicroRecord, MicroRecord]]:
    """B -> (compiled, twin) records of `op` on `shape`."""
    found: dict[tuple[int, str], MicroRecord] = {
        (r.lanes, r.impl): r for r in records if r.op == op and r.shape == shape}
    return {b: (found[(b, "c")], found[(b, "py")]) for b, impl in found
            if impl == "c" and (b, "py") in found}


def twin_ratios(records: Sequence[MicroRecord]) -> list[float]:
    """Twin ÷ compiled wall medians of every case measured both ways."""
    both: dict[tuple[str, str, int], dict[str, float]] = {}
    for r in records:
        both.setdefault((r.op, r.shape, r.lanes), {})[r.impl] = r.ns_per_op
    return [v["py"] / v["c"] for v in both.values() if "py" in v and "c" in v and v["c"] > 0]


def comparisons(report: Any) -> list[tuple[Any, Any]]:
    """(B1 cell, multi-lane cell) pairs of the serve matrix: same model, route, lengths, policy,
    context, block size and devices; the B1 reference is the one with the fewest blocks."""
    ok = [c for c in report.cells if c.status == "ok"]
    pairs = []
    for cell in ok:
        if cell.batch_size == 1 or cell.decoder_batch_sizes:
            continue
        key = (cell.model, cell.route, cell.input_len, cell.output_len, cell.policy,
               cell.max_seq_len, cell.block_size, cell.tensor_parallel)
        refs = [r for r in ok if r.batch_size == 1 and key == (
            r.model, r.route, r.input_len, r.output_len, r.policy, r.max_seq_len, r.block_size,
            r.tensor_parallel)]
        if refs and min(refs, key=lambda r: r.num_blocks).output_tok_s:
            pairs.append((min(refs, key=lambda r: r.num_blocks), cell))
    return pairs


def _why(cell: Any) -> str:
    """Why a serve cell did not run, in a few words."""
    why = cell.status.split(":", 1)[-1].strip()
    if cell.fit.projected_bytes and cell.fit.device_bytes:
        why += (f": {cell.fit.projected_bytes / 1e9:.2f} GB projected of "
                f"{cell.fit.device_bytes / 1e9:.2f} GB")
    return why


def invariance_verdict(records: Sequence[InvarianceRecord]) -> str:
    worst = max((r.max_abs_diff for r in records), default=0.0)
    families = ", ".join(r.family for r in records)
    equal = all(r.tokens_equal for r in records)
    verdict = "PASS" if worst == 0 and equal else "FAIL"
    return (f"{verdict}: max |Δlogit| {worst:.3g} over {families}; greedy tokens "
            f"{'equal' if equal else 'differ'}")


def lines(run: Run, details: Path, picture: Path | None, no_picture: str | None) -> list[str]:
    """The closing screen: at most MAX_LINES lines."""
    loads = [x for x in run.loads if x >= 0]
    load = f"{min(loads):.2f}..{max(loads):.2f}" if loads else "unknown"
    out = [f"== atombatch bench (short default): commit {(run.commit or 'unknown')[:12]}, "
           f"1-minute load average {load} (cpus={run.cpus}), {run.seconds:.0f} s ==",
           "hot path, compiled vs pure-Python twin (wall median per call, quick repeats):"]
    for op, name in (("engine_step", "engine step"), ("decode_build", "table build")):
        pairs = _pairs(run.micro, op)
        cells = [f"B{b} {_time(c.ns_per_op)} vs {_time(py.ns_per_op)} "
                 f"({py.ns_per_op / c.ns_per_op:.1f}x)" for b, (c, py) in sorted(pairs.items())
                 if b in ENGINE_LANES]
        if cells:
            out.append(f"  {name:<12} " + " | ".join(cells))
    ratios = twin_ratios(run.micro)
    if ratios:
        out.append(f"  all {len(ratios)} cases, twin ÷ compiled: median "
                   f"{statistics.median(ratios):.0f}x (from {min(ratios):.1f}x to "
                   f"{max(ratios):.0f}x)")
    out.append("batch invariance (NumPy runtime, a lane at B4 vs alone at B1): "
               + invariance_verdict(run.invariance))
    report = run.serve
    load_params = report.params.get("load", {})
    policies = ",".join(report.params.get("policies", []))
    out.append(f"serve on the calibrated simulator (c{load_params.get('concurrency', '?')}, "
               f"{policies}; tp2 = two devices): output tok/s and max first token, B1 -> B4")
    for ref, cell in comparisons(report):
        out.append(f"  {cell.model:<9} {cell.input_len:>5}/{cell.output_len:<4} "
                   f"{ref.artifact:>9} -> {cell.artifact:<9} {ref.output_tok_s:6.1f} -> "
                   f"{cell.output_tok_s:6.1f} tok/s (x{cell.output_tok_s / ref.output_tok_s:.2f})"
                   f"  {ref.max_first_token_all:6.1f} -> {cell.max_first_token_all:6.1f} s")
    skipped = sorted({(c.model, c.artifact, _why(c)) for c in report.cells if c.status != "ok"})
    for model, artifact, why in skipped:
        out.append(f"  {model} {artifact}: not run ({why})")
    out.append(f"every table: {details}")
    out.append(f"picture: {picture}" if picture is not None else f"no picture: {no_picture}")
    return out


def write_picture(run: Run, path: Path) -> None:
    """Three panels: the engine step compiled vs twin by B (log scale), then the serve pairs'
    output tok/s and max first token, B1 beside B4; the title carries the commit, the load and
    the invariance verdict. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (step, tok, ttft) = plt.subplots(1, 3, figsize=(15, 5.2))
    pairs = sorted(_pairs(run.micro, "engine_step").items())
    xs = range(len(pairs))
    step.bar([x - 0.2 for x in xs], [c.ns_per_op / 1e3 for _, (c, _py) in pairs], 0.4,
             label="compiled (_blocks)")
    step.bar([x + 0.2 for x in xs], [py.ns_per_op / 1e3 for _, (_c, py) in pairs], 0.4,
             label="pure-Python twin")
    for x, (_, (c, py)) in zip(xs, pairs, strict=True):
        step.annotate(f"{py.ns_per_op / c.ns_per_op:.0f}x", (x + 0.2, py.ns_per_op / 1e3),
                      ha="center", va="bottom", fontsize=8)
    step.set_xticks(list(xs), [f"B{b}" for b, _ in pairs])
    step.set_yscale("log")
    step.set_ylabel("µs per engine step (wall median)")
    step.set_title("engine step on a null device, eager", fontsize=10)
    step.legend(fontsize=8)
    serve_pairs = comparisons(run.serve)
    labels = [f"{c.model}\n{c.input_len}/{c.output_len}\n{c.artifact}" for _, c in serve_pairs]
    xs = range(len(serve_pairs))
    for ax, metric, unit in ((tok, "output_tok_s", "output tok/s (higher is better)"),
                             (ttft, "max_first_token_all", "max first token, s (lower is better)")):
        ax.bar([x - 0.2 for x in xs], [getattr(r, metric) for r, _ in serve_pairs], 0.4,
               label="B1 (single lane)")
        ax.bar([x + 0.2 for x in xs], [getattr(c, metric) for _, c in serve_pairs], 0.4,
               label="B4 (four lanes)")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel(unit)
        ax.set_title(f"serve, simulator: {unit.split(' (')[0]}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    loads = [x for x in run.loads if x >= 0]
    load = f"{min(loads):.2f}..{max(loads):.2f}" if loads else "unknown"
    fig.suptitle(f"python -m atombatch.bench at {(run.commit or 'unknown')[:12]}, load "
                 f"{load} (cpus={run.cpus}); batch invariance "
                 f"{invariance_verdict(run.invariance)}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)

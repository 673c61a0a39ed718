"""The serving matrix as text (the table, the multi-lane and bucket comparisons) and as a plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from atombatch.bench.serve.records import Cell, ServeReport

_DIGITS = [1]  # decimals of the table's seconds: 1 on the simulator, 3 for wall-time runs


def _f(value: float | None, digits: int | None = None) -> str:
    return "-" if value is None else f"{value:.{_DIGITS[0] if digits is None else digits}f}"


def _histogram(histogram: Sequence[int]) -> str:
    return " ".join(f"{lanes}:{n}" for lanes, n in enumerate(histogram) if n) or "-"


def format_table(report: ServeReport) -> str:
    """A readable fixed-width table, one row per cell, with the calibration above it."""
    load = report.params["load"]
    unit = "virtual s" if report.runtime == "sim" else "wall s"
    _DIGITS[0] = 1 if report.runtime == "sim" else 3
    lines = []
    if report.cost_model is not None:
        lines.append(report.cost_model.describe())
    timeout = load["timeout_s"]
    lines.append(f"load: c{load['concurrency']}, {load['requests'] or load['concurrency']} "
                 f"requests, arrivals {load['arrivals']}"
                 + (f" at {load['rate']}/s" if load["arrivals"] == "poisson" else "")
                 + f"; timeout {timeout} s ({load['timeout_action']}); times in {unit}; latency "
                 "figures exclude failed requests")
    lora = load.get("lora_adapters") or 0
    if lora:
        cap = load.get("max_loras")
        lines.append(f"LoRA: {100 * load['lora_share']:g}% of the requests under {lora} "
                     f"adapters of rank {load['lora_rank']} (every linear layer) in turn, the "
                     f"rest the base model; max-loras {cap if cap is not None else 'no cap'}; "
                     "'lora' = the adapters' device seconds, of prefill and decode")
    wide = max([14] + [len(cell.artifact) for cell in report.cells])  # quantized specs are longer
    header = (f"{'model':<11} {'route':<15} {'in/out':>9} {'artifact':<{wide}} {'policy':<13} "
              f"{'ok/n':>5} {'t/o':>3} {'TTFT p50':>8} {'p99':>7} {'max':>7} {'done p50':>8} "
              f"{'max':>7} {'gap max':>7} {'tok/s':>7} {'all max':>7} {'prefill':>8} {'import':>7} "
              f"{'decode':>8}{' ' + format('lora', '>7') if lora else ''}  lanes/step")
    lines += [header, "-" * len(header)]
    previous = None
    for cell in report.cells:
        group = (cell.model, cell.route)
        if previous is not None and group != previous:
            lines.append("")
        previous = group
        head = (f"{cell.model:<11} {cell.route:<15} {cell.input_len:>4}/{cell.output_len:<4} "
                f"{cell.artifact:<{wide}} {cell.policy:<13}")
        if cell.status != "ok":
            why = cell.status
            if cell.status == "not-run: does not fit" and cell.fit.projected_bytes is not None:
                why += (f" ({cell.fit.projected_bytes / 1e9:.2f} GB projected of "
                        f"{(cell.fit.device_bytes or 0) / 1e9:.2f} GB, {cell.fit.method})")
            elif cell.error:
                why += ": " + _first_sentence(cell.error)
            lines.append(f"{head} {why}")
            continue
        ttft, done = cell.ttft, cell.completion
        assert ttft is not None and done is not None
        mark = "*" if cell.hypothetical else ""
        lines.append(
            f"{head} {cell.completed:>2}/{cell.requests:<2} {cell.timeouts:>3} "
            f"{_f(ttft.p50):>8} {_f(ttft.p99):>7} {_f(ttft.max):>7} {_f(done.p50):>8} "
            f"{_f(done.max):>7} {_f(cell.max_gap_s, 2):>7} {cell.output_tok_s:>7.2f} "
            f"{_f(cell.max_completion_all):>7} "
            f"{_f(cell.prefill_device_s):>8} {_f(cell.import_device_s, 2):>7} "
            f"{_f(cell.decode_device_s):>8}"
            f"{' ' + format(_f(cell.lora_device_s, 2), '>7') if lora else ''}  "
            f"{_histogram(cell.lane_histogram)}"
            f"{mark}")
    lines.append("")
    lines.append("t/o = requests over the timeout (failures); 'gap max' = the longest pause "
                 "between two decoded tokens of an on-time request (from its second token: a "
                 "staged request's first gap is its wait for a lane); 'all max' = latest "
                 "completion over "
                 "every request, timed out or not (how the origin figures were measured); "
                 "prefill/import/decode = the decoder's device seconds (import: PD KV writes; "
                 "the producer's prefill is not in them); lanes/step = decode steps by decoding "
                 "lanes"
                 + ("; * = does not fit the device, run with --ignore-fit (hypothetical)"
                    if any(c.hypothetical for c in report.cells) else ""))
    comparison = format_comparison(report)
    if comparison:
        lines += ["", comparison]
    return "\n".join(lines)


def _first_sentence(text: str) -> str:
    """A reason's first sentence, whole (never cut mid-word): the rest is in the JSON."""
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def format_comparison(report: ServeReport) -> str:
    """Each multi-lane artifact vs the single-lane one with the fewest blocks at the same context and
    split, under the same load: throughput, worst first token and timeouts."""
    ok = [c for c in report.cells if c.status == "ok"]
    rows = []
    for cell in ok:
        if cell.batch_size == 1:
            continue
        refs = [r for r in ok if r.batch_size == 1 and (r.model, r.route, r.input_len,
                r.output_len, r.policy, r.max_seq_len, r.block_size, r.tensor_parallel) ==
                (cell.model, cell.route, cell.input_len, cell.output_len, cell.policy,
                 cell.max_seq_len, cell.block_size, cell.tensor_parallel)]
        if not refs:
            continue
        ref = min(refs, key=lambda r: r.num_blocks)
        if not ref.output_tok_s:
            continue
        rows.append(
            f"{cell.model:<11} {cell.route:<15} {cell.input_len:>4}/{cell.output_len:<4} "
            f"{cell.policy:<13} {ref.artifact:>9} -> {cell.artifact:<9} "
            f"{ref.output_tok_s:>7.2f} -> {cell.output_tok_s:>7.2f} tok/s "
            f"(x{cell.output_tok_s / ref.output_tok_s:.2f}); max first token "
            f"{_f(ref.max_first_token_all)} -> {_f(cell.max_first_token_all)} s; timeouts "
            f"{ref.timeouts} -> {cell.timeouts}" + (" *" if cell.hypothetical or ref.hypothetical
                                                    else ""))
    sections = []
    if rows:
        sections += ["multi-lane vs single-lane (same load, context and split):", *rows]
    buckets = format_bucket_comparison(ok)
    if buckets:
        sections += ([""] if sections else []) + buckets
    return "\n".join(sections)


def _shape_key(cell: Cell) -> tuple[Any, ...]:
    return (cell.model, cell.route, cell.input_len, cell.output_len, cell.policy, cell.batch_size,
            cell.num_blocks, cell.max_seq_len, cell.block_size, cell.tensor_parallel)


def format_bucket_comparison(ok: Sequence[Cell]) -> list[str]:
    """Each artifact with decode buckets vs the same artifact with its full decode batch only: the
    rows its decode steps ran, decode device time, throughput and the worst first token."""
    plain = {_shape_key(c): c for c in ok if len(c.decoder_batch_sizes) <= 1}
    rows = []
    for cell in ok:
        ref = plain.get(_shape_key(cell)) if len(cell.decoder_batch_sizes) > 1 else None
        if ref is None or not ref.output_tok_s or not ref.decode_device_s:
            continue
        rows.append(
            f"{cell.model:<11} {cell.route:<15} {cell.input_len:>4}/{cell.output_len:<4} "
            f"{cell.policy:<13} {ref.artifact:>9} -> {cell.artifact:<14} rows/step "
            f"{ref.decode_rows / max(ref.decode_calls, 1):.2f} -> "
            f"{cell.decode_rows / max(cell.decode_calls, 1):.2f}; decode "
            f"{_f(ref.decode_device_s)} -> {_f(cell.decode_device_s)} s "
            f"(x{cell.decode_device_s / ref.decode_device_s:.3f}); "
            f"{ref.output_tok_s:.2f} -> {cell.output_tok_s:.2f} tok/s; max first token "
            f"{_f(ref.max_first_token_all)} -> {_f(cell.max_first_token_all)} s"
            + (" *" if cell.hypothetical or ref.hypothetical else ""))
    if not rows:
        return []
    return ["decode buckets vs the full decode batch only (same load and artifact):", *rows]


def write_plot(report: ServeReport, path: Path, grid: bool = False) -> list[Path]:
    """The headline panels, or with `grid` box plots of every model, route, input, output and
    artifact (see atombatch.bench.plot)."""
    from atombatch.bench import plot
    return plot.write_plot(report, path, grid=grid)

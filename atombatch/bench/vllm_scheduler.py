"""vLLM v1's own scheduler beside atombatch's, as `bench micro`'s admission baseline.

When `$ATOMBATCH_VLLM_PYTHON` names the Python of a virtual environment that holds vLLM (built
apart from atombatch's; docs/prefix-cache.md gives the commands), `bench micro` runs
`vllm_scheduler_probe.py` with it as a subprocess and adds what it measured to its records
(impl "vllm"): vLLM's real `Scheduler` admitting the cached 8 192-token prompt of
`prefix_admit_hit`, and, at the workload of `prefix_admit` (16-token blocks, 2 048-token
context, a full prefix cache that must evict, B requests decoding), the step that admits one
128-token request beside a steady decode step. micro's own `prefix_admit` cases then also run at
B = 64 (`EXTRA_LANES` at `EXTRA_CACHED` blocks: 30k cached blocks and 64 × 128 more do not fit
the device's int16 block tables, nor does B = 256 with 2 048-token sequences at any cache, so
vLLM's B = 256 stands alone). Without the variable nothing of this runs.

This module parses the probe's JSON (`parse`), turns it into (op, B, shape, blocks, wall, CPU)
rows (`measured`) and writes the comparison lines and table (`ratio_lines`, `section`); it
imports nothing of atombatch, so the case definitions can import it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

ENV = "ATOMBATCH_VLLM_PYTHON"
PROBE = Path(__file__).with_name("vllm_scheduler_probe.py")
EXTRA_LANES = (64, 256)        # prefix_admit / prefix_steady beside vLLM's, at EXTRA_CACHED blocks
EXTRA_CACHED = 10_000          # (30k + B x 128 blocks would not fit int16 block tables at B64)
TIMEOUT_S = 1800.0

HIT_OPS = (
    "prefix_admit_hit_vllm_schedule",      # vLLM's Scheduler.schedule() admitting the cached
                                           #   8 192-token prompt (511 blocks hit, 16 tokens run)
    "prefix_admit_hit_vllm_add_schedule",  # add_request + that schedule()
    "prefix_admit_hit_vllm_step",          # add_request + schedule() + get_grammar_bitmask +
                                           #   update_from_output (its first token)
    "prefix_admit_hit_vllm_request",       # making its Request: its block hashes (sha256), which
                                           #   vLLM computes at arrival
)
FULL_OPS = (
    "prefix_admit_vllm_step",      # B decoding at a full cache: the step admitting a 128-token
                                   #   request (schedule() + update_from_output), a miss that evicts
    "prefix_admit_vllm_schedule",  # that step's schedule() alone
    "prefix_steady_vllm_step",     # a steady decode step of the same B requests
    "prefix_steady_vllm_schedule",  # its schedule() alone
)
OPS = HIT_OPS + FULL_OPS


class Figure(msgspec.Struct, frozen=True):
    """Medians over repeats of the mean per call, in ns."""

    wall_ns: float                    # wall clock
    cpu_ns: float                     # process CPU time
    cpu_ns_range: tuple[float, float]  # lowest and highest repeat's CPU mean
    repeats: int


class HitResult(msgspec.Struct, frozen=True, tag="hit", tag_field="case"):
    """Admitting a prompt whose every full block is cached (B = 1)."""

    lanes: int
    prompt_tokens: int
    hit_tokens: int                   # tokens found cached (vLLM recomputes the last block)
    num_blocks: int
    loops: int                        # admissions per repeat
    request: Figure                   # Request(...): its block hashes
    add_request: Figure
    schedule: Figure                  # the admitting schedule()
    finish: Figure                    # get_grammar_bitmask + update_from_output of that step
    add_request_schedule: Figure
    step: Figure                      # add_request + schedule + finish


class FullResult(msgspec.Struct, frozen=True, tag="full", tag_field="case"):
    """B requests decoding at a full prefix cache; one 128-token request admitted."""

    lanes: int
    cached: int                       # the cached blocks the pool is sized for
    num_blocks: int
    prompt_tokens: int
    max_model_len: int
    loops: int
    fill_seconds: float               # filling the cache (untimed)
    cached_blocks_at_end: int
    evicted_per_admission: float      # median blocks the admitted request took from the cache
    admit_schedule: Figure
    admit_step: Figure                # schedule + get_grammar_bitmask + update_from_output
    steady_schedule: Figure
    steady_step: Figure
    extra_schedule: Figure            # admitting minus steady, per repeat
    extra_step: Figure


class ProbeRun(msgspec.Struct, frozen=True):
    """What the probe prints."""

    vllm: str                         # vLLM's version
    torch: str
    python: str
    log_stats: bool                   # the scheduler's stats on (as `vllm serve` has them)
    hash_algo: str                    # prefix_caching_hash_algo
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    results: list[HitResult | FullResult]


class Measured(NamedTuple):
    op: str
    lanes: int
    shape: str
    num_blocks: int
    wall_ns: float
    cpu_ns: float


def parse(data: bytes | str) -> ProbeRun:
    """The probe's JSON, typed; a ValueError naming what is wrong otherwise."""
    try:
        return msgspec.json.decode(data, type=ProbeRun)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"the vLLM scheduler probe's output is not its JSON: {exc}") from exc


def wanted(ops: Iterable[str]) -> tuple[bool, bool]:
    """(the hit case, the full-cache case) the requested ops need."""
    chosen = set(ops)
    return bool(chosen & set(HIT_OPS)), bool(chosen & set(FULL_OPS))


def extra_lanes() -> tuple[int, ...]:
    """The B at which micro's admission cases also run, beside vLLM's (none without `ENV`)."""
    return EXTRA_LANES if os.environ.get(ENV) else ()


def probe_argv(python: str, *, hit_tokens: int, hit_max_model_len: int,
               full: Sequence[tuple[int, int]], max_model_len: int, prompt_tokens: int,
               repeats: int, loops: int) -> list[str]:
    """The probe's command line (`-P`: this directory stays off its `sys.path`); `full` holds
    the (B, cached blocks) of the full-cache case."""
    return [python, "-P", str(PROBE), "--hit-tokens", str(hit_tokens),
            "--hit-max-model-len", str(hit_max_model_len),
            "--full", ",".join(f"{b}:{cached}" for b, cached in full),
            "--max-model-len", str(max_model_len), "--prompt-tokens", str(prompt_tokens),
            "--repeats", str(repeats), "--loops", str(loops)]


def run_probe(argv: Sequence[str], timeout: float = TIMEOUT_S) -> ProbeRun:
    """Run the probe; its stderr is passed through (progress), its stdout parsed."""
    try:
        done = subprocess.run(list(argv), stdout=subprocess.PIPE, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"the vLLM scheduler probe ({argv[0]}) did not run: {exc}") from exc
    if done.returncode != 0:
        raise RuntimeError(f"the vLLM scheduler probe ({argv[0]}) exited with status "
                           f"{done.returncode}; ${ENV} must name a Python that has vLLM "
                           "(docs/prefix-cache.md)")
    return parse(done.stdout)


def measured(run: ProbeRun) -> list[Measured]:
    """One row per figure, named as micro's ops."""
    rows = []
    for result in run.results:
        if isinstance(result, HitResult):
            pairs = (("prefix_admit_hit_vllm_schedule", result.schedule),
                     ("prefix_admit_hit_vllm_add_schedule", result.add_request_schedule),
                     ("prefix_admit_hit_vllm_step", result.step),
                     ("prefix_admit_hit_vllm_request", result.request))
            rows += [Measured(op, result.lanes, "bs16", result.num_blocks, f.wall_ns, f.cpu_ns)
                     for op, f in pairs]
        else:
            shape = f"cached{result.cached // 1000}k"
            pairs = (("prefix_admit_vllm_step", result.admit_step),
                     ("prefix_admit_vllm_schedule", result.admit_schedule),
                     ("prefix_steady_vllm_step", result.steady_step),
                     ("prefix_steady_vllm_schedule", result.steady_schedule))
            rows += [Measured(op, result.lanes, shape, result.num_blocks, f.wall_ns, f.cpu_ns)
                     for op, f in pairs]
    return rows


# -- beside atombatch's figures (records: anything with op/impl/lanes/shape/cpu_ns_per_op) -------


def _cpu(records: Sequence[Any], op: str, shape: str, lanes: int) -> float | None:
    for r in records:
        if r.op == op and r.shape == shape and r.lanes == lanes and r.cpu_ns_per_op >= 0:
            return float(r.cpu_ns_per_op)
    return None


def _us(ns: float) -> str:
    return f"{ns / 1000:,.0f} µs".replace(",", " ") if abs(ns) >= 10_000 else \
        f"{ns / 1000:.1f} µs"


HIT_PAIRS = (  # (ours, theirs, what is compared)
    ("prefix_admit_hit_schedule", "prefix_admit_hit_vllm_schedule",
     "the admitting schedule() {r:.1f}× cheaper than vLLM's scheduler's"),
    ("prefix_admit_hit_schedule", "prefix_admit_hit_vllm_add_schedule",
     "{r:.1f}× cheaper than its add_request + schedule()"),
    ("prefix_admit_hit", "prefix_admit_hit_vllm_step",
     "the whole admitting step {r:.1f}× cheaper than its add_request + schedule() + "
     "update_from_output()"),
)


class FullRow(NamedTuple):
    """One B and cache of the full-cache admission, in CPU ns (None: not measured here)."""

    lanes: int
    shape: str
    ours_admit: float | None      # atombatch: the admitting step (a prefill step of its own)
    ours_steady: float | None     # atombatch: a steady decode step
    theirs_admit: float           # vLLM's scheduler: the admitting step (prefill + B − 1 decodes)
    theirs_steady: float          # vLLM's scheduler: a steady decode step

    @property
    def theirs(self) -> float:
        """What one admission adds to vLLM's scheduler: its admitting step − a steady one."""
        return self.theirs_admit - self.theirs_steady


def full_rows(records: Sequence[Any]) -> list[FullRow]:
    """Every B and cache vLLM's scheduler was measured at, beside atombatch's where it was.

    The two admissions differ in kind: atombatch's prefill runs in a step of its own (the
    device's prefill is its own batch-1 graph; the lanes decode in the steps before and after),
    so what one admission adds is that whole step; vLLM schedules the new prompt's tokens into
    a decode step, so what it adds is that step minus a steady one."""
    rows = []
    keys = sorted({(r.lanes, r.shape) for r in records if r.op == "prefix_admit_vllm_step"})
    for lanes, shape in keys:
        ours, ours_steady, theirs, theirs_steady = (
            _cpu(records, op, shape, lanes) for op in
            ("prefix_admit", "prefix_steady", "prefix_admit_vllm_step", "prefix_steady_vllm_step"))
        if theirs is not None and theirs_steady is not None:
            rows.append(FullRow(lanes, shape, ours, ours_steady, theirs, theirs_steady))
    return rows


def ratio_lines(records: Sequence[Any]) -> list[str]:
    """How atombatch's admission compares with vLLM's scheduler in CPU time, as sentences."""
    out = []
    hit = [text.format(r=theirs / ours) for ours_op, theirs_op, text in HIT_PAIRS
           if (ours := _cpu(records, ours_op, "bs16", 1)) and
           (theirs := _cpu(records, theirs_op, "bs16", 1))]
    if hit:
        out.append("a cached 8 192-token prompt beside vLLM's own scheduler (CPU): "
                   + "; ".join(hit) + ".")
    full = [f"B{row.lanes} {_us(row.ours_admit)} vs {_us(row.theirs)} "
            f"({row.theirs / row.ours_admit:.1f}×)"
            for row in full_rows(records) if row.ours_admit]
    if full:
        out.append("one admission at a full cache that must evict (CPU), the whole admitting "
                   "step here (its own prefill step) vs vLLM's admitting step minus its steady "
                   "step: " + ", ".join(full) + ".")
    return out


def section(records: Sequence[Any]) -> str:
    """docs/prefix-cache.md's table of the full-cache admission beside vLLM's scheduler."""
    lines = ["| B | cached blocks | atombatch: admitting step (its own prefill step) | "
             "atombatch: steady step | vLLM scheduler: admitting step | vLLM: steady step | "
             "vLLM: admitting − steady | vLLM's admission ÷ ours |",
             "|---|---|---|---|---|---|---|---|"]
    for row in full_rows(records):
        ours = _us(row.ours_admit) if row.ours_admit is not None else \
            "- (does not fit int16 tables)"
        steady = _us(row.ours_steady) if row.ours_steady is not None else "-"
        ratio = f"{row.theirs / row.ours_admit:.1f}×" if row.ours_admit else "-"
        lines.append(f"| {row.lanes} | {row.shape.removeprefix('cached')} | {ours} | {steady} | "
                     f"{_us(row.theirs_admit)} | {_us(row.theirs_steady)} | {_us(row.theirs)} | "
                     f"{ratio} |")
    return "\n".join(lines)

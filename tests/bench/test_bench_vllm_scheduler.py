"""vLLM's own scheduler as `bench micro`'s admission baseline (atombatch/bench/vllm_scheduler.py).

Without vLLM: the probe's JSON is parsed and checked, turned into micro's records, compared and
tabled; micro's wiring runs a stand-in *executable* in place of vLLM's Python (it checks the
command line micro gives it and prints figures derived from it), which tests the plumbing only.
The probe itself (atombatch/bench/vllm_scheduler_probe.py) runs against vLLM only where
`$ATOMBATCH_VLLM_PYTHON` names a Python that has it (the last test).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from support.vllm_probe import full_result, hit_result, probe_json

from atombatch.bench import cases, micro, vllm_scheduler
from atombatch.bench import vllm_scheduler_probe as probe

ROOT = Path(__file__).resolve().parents[2]


def test_the_probes_json_is_parsed_into_typed_results() -> None:
    run = vllm_scheduler.parse(probe_json([hit_result(700_000.0), full_result(4, 30_000)]))
    hit, full = run.results
    assert isinstance(hit, vllm_scheduler.HitResult) and hit.schedule.cpu_ns == 700_000.0
    assert isinstance(full, vllm_scheduler.FullResult) and full.extra_step.cpu_ns == 150_000.0
    assert run.vllm == "0.33.0" and run.load_before == (0.5, 0.4, 0.3)


@pytest.mark.parametrize("text", ["", "not json", probe_json([{"case": "nope"}]),
                                  probe_json([{**hit_result(1.0), "schedule": "fast"}])])
def test_output_that_is_not_the_probes_json_is_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match="vLLM scheduler probe's output is not its JSON"):
        vllm_scheduler.parse(text)


def test_every_figure_becomes_a_row_named_as_micros_ops() -> None:
    run = vllm_scheduler.parse(probe_json([hit_result(700_000.0), full_result(64, 10_000)]))
    rows = {(m.op, m.lanes, m.shape): m for m in vllm_scheduler.measured(run)}
    assert {op for op, _, _ in rows} == set(vllm_scheduler.OPS) == \
        set(cases.VLLM_SCHEDULER_OPS)
    assert rows[("prefix_admit_hit_vllm_schedule", 1, "bs16")].cpu_ns == 700_000.0
    assert rows[("prefix_admit_hit_vllm_step", 1, "bs16")].cpu_ns == 910_000.0
    assert rows[("prefix_admit_vllm_step", 64, "cached10k")].cpu_ns == 64 * 50_000 + 150_000
    assert rows[("prefix_steady_vllm_schedule", 64, "cached10k")].num_blocks == 10_000 + 8392


def record(op: str, cpu: float, lanes: int = 1, shape: str = "bs16",
           impl: str = "c") -> micro.MicroRecord:
    return micro.MicroRecord(op=op, impl=impl, lanes=lanes, num_blocks=1, ns_per_op=cpu,
                             shape=shape, cpu_ns_per_op=cpu)


def test_the_comparison_divides_vllms_cpu_by_ours() -> None:
    records = [record("prefix_admit_hit_schedule", 50_000.0), record("prefix_admit_hit", 91_000.0),
               record("prefix_admit", 120_000.0, 4, "cached30k"),
               record("prefix_steady", 20_000.0, 4, "cached30k")]
    run = vllm_scheduler.parse(probe_json([hit_result(700_000.0), full_result(4, 30_000),
                                           full_result(256, 10_000)]))
    records += [record(m.op, m.cpu_ns, m.lanes, m.shape, "vllm")
                for m in vllm_scheduler.measured(run)]
    hit, full = vllm_scheduler.ratio_lines(records)
    assert "the admitting schedule() 14.0× cheaper than vLLM's scheduler's" in hit
    assert "14.2× cheaper than its add_request + schedule()" in hit
    assert "the whole admitting step 10.0× cheaper" in hit
    # ours: the whole admitting step (a prefill step of its own); vLLM's: admitting − steady
    assert full.endswith("B4 120 µs vs 150 µs (1.2×).")  # B256: no figure of ours, no ratio
    table = vllm_scheduler.section(records).splitlines()
    assert table[2] == "| 4 | 30k | 120 µs | 20 µs | 350 µs | 200 µs | 150 µs | 1.2× |"
    assert table[3] == ("| 256 | 10k | - (does not fit int16 tables) | - | 12 950 µs | "
                        "12 800 µs | 150 µs | - |")


def test_without_the_variable_micro_measures_no_vllm_scheduler(monkeypatch) -> None:
    monkeypatch.delenv(vllm_scheduler.ENV, raising=False)
    assert micro.run(lanes=(4,), quick=True, ops=vllm_scheduler.OPS) == []
    assert not any(b > 16 for op, _, b, _ in cases.prefix_scale_shapes() if op == "prefix_admit")


FAKE_PYTHON = '''#!{python}
"""Stands in for vLLM's Python: checks micro's command line, prints figures derived from it."""
import argparse, json, sys
sys.path.insert(0, {tests!r})
from support.vllm_probe import full_result, hit_result, probe_json
assert sys.argv[1] == "-P" and sys.argv[2].endswith("vllm_scheduler_probe.py"), sys.argv
parser = argparse.ArgumentParser()
for flag in ("--hit-tokens", "--hit-max-model-len", "--max-model-len", "--prompt-tokens",
             "--repeats", "--loops"):
    parser.add_argument(flag, type=int, required=True)
parser.add_argument("--full", required=True)
args = parser.parse_args(sys.argv[3:])
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[3:]) + "\\n")
results = [hit_result(args.hit_tokens * 100.0)] if args.hit_tokens else []
for item in filter(None, args.full.split(",")):
    lanes, cached = map(int, item.split(":"))
    results.append(full_result(lanes, cached))
print(probe_json(results))
'''


@pytest.fixture
def fake_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path, log = tmp_path / "python", tmp_path / "argv.log"
    path.write_text(FAKE_PYTHON.format(python=sys.executable, tests=str(Path(__file__).parents[1]),
                                       log=str(log)))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv(vllm_scheduler.ENV, str(path))
    return log


def test_micro_runs_the_probe_with_its_workloads_and_records_what_it_printed(
        fake_python: Path, tmp_path: Path) -> None:
    recorded = tmp_path / "run.json"
    records = micro.run(lanes=(4,), json_path=str(recorded), quick=True, repeats=2,
                        ops=vllm_scheduler.OPS)
    argv = json.loads(fake_python.read_text())
    assert argv[argv.index("--hit-tokens") + 1] == str(cases.PREFIX_TOKENS)
    assert argv[argv.index("--full") + 1] == "4:30000,16:30000,64:10000,256:10000"
    assert argv[argv.index("--repeats") + 1] == "2"
    assert argv[argv.index("--max-model-len") + 1] == str(cases.ADMIT_MAX_SEQ_LEN)
    assert {r.impl for r in records} == {"vllm"}
    assert {(r.lanes, r.shape) for r in records if r.op == "prefix_admit_vllm_step"} == {
        (4, "cached30k"), (16, "cached30k"), (64, "cached10k"), (256, "cached10k")}
    schedule = next(r for r in records if r.op == "prefix_admit_hit_vllm_schedule")
    assert schedule.cpu_ns_per_op == cases.PREFIX_TOKENS * 100.0
    run = msgspec.json.decode(recorded.read_bytes(), type=micro.MicroRun)
    assert run.vllm_probe is not None and run.vllm_probe.vllm == "0.33.0"
    assert run.records == records
    table = micro.format_table(records)
    assert "prefix_admit_hit_vllm_schedule" in table and "cheaper" not in table  # none of ours


def test_only_the_probe_cases_asked_for_are_run(fake_python: Path) -> None:
    micro.run(lanes=(4,), quick=True, ops=("prefix_steady_vllm_step",))
    argv = json.loads(fake_python.read_text())
    assert argv[argv.index("--hit-tokens") + 1] == "0"
    micro.run(lanes=(4,), quick=True, ops=("prefix_admit_hit_vllm_step",))
    argv = json.loads(fake_python.read_text().splitlines()[1])
    assert argv[argv.index("--full") + 1] == ""
    assert micro.run(lanes=(4,), quick=True, ops=("prefix_lookup",)) and \
        len(fake_python.read_text().splitlines()) == 2  # no vLLM op asked for: no probe run


def test_with_the_variable_our_admission_cases_run_at_the_larger_b_that_fit(fake_python) -> None:
    admit = {(b, shape, n) for op, shape, b, n in cases.prefix_scale_shapes()
             if op == "prefix_admit"}
    assert (64, "cached10k", cases.admit_num_blocks(64, 10_000)) in admit
    assert not any(b == 256 for b, _, _ in admit)  # 256 x 128 blocks exceed int16 tables


def test_a_probe_that_fails_names_the_variable(tmp_path: Path, monkeypatch) -> None:
    failing = tmp_path / "python"
    failing.write_text("#!/bin/sh\nexit 3\n")
    failing.chmod(0o755)
    monkeypatch.setenv(vllm_scheduler.ENV, str(failing))
    with pytest.raises(RuntimeError, match=r"exited with status 3; \$ATOMBATCH_VLLM_PYTHON"):
        micro.run(lanes=(4,), quick=True, ops=vllm_scheduler.HIT_OPS)
    monkeypatch.setenv(vllm_scheduler.ENV, str(tmp_path / "absent"))
    with pytest.raises(RuntimeError, match="did not run"):
        micro.run(lanes=(4,), quick=True, ops=vllm_scheduler.HIT_OPS)


def test_the_report_tables_vllms_scheduler_beside_ours(tmp_path: Path, fake_python) -> None:
    (tmp_path / "docs" / "bench").mkdir(parents=True)
    for name in ("README.md", "docs/prefix-cache.md", "docs/overlap.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    recorded = tmp_path / "docs" / "bench" / "vllm-test.json"
    micro.run(lanes=(4,), json_path=str(recorded), quick=True, repeats=1,
              ops=("prefix_admit_hit_schedule", "prefix_admit", "prefix_steady",
                   *vllm_scheduler.OPS))
    micro.write_report(str(recorded), root=str(tmp_path))
    doc = (tmp_path / "docs" / "prefix-cache.md").read_text()
    scale = doc[doc.index("<!-- prefix-scale:start -->"):doc.index("<!-- prefix-scale:end -->")]
    assert "vLLM's own `Scheduler.schedule()` admitting it" in scale
    assert "A cached 8 192-token prompt beside vLLM's own scheduler (CPU)" in scale
    assert "| 64 | 10k |" in scale and "| 256 | 10k | - (does not fit int16 tables)" in scale


def test_the_probe_summarises_medians_of_repeats_without_vllm() -> None:
    """The probe's own helpers (it is imported here without vLLM: vLLM only inside functions)."""
    out = probe.summary([(10.0, 9.0), (30.0, 29.0), (20.0, 19.0)])
    assert out == {"wall_ns": 20.0, "cpu_ns": 19.0, "cpu_ns_range": [9.0, 29.0], "repeats": 3}
    clock = probe.Clock()
    assert clock.time(sum, [1, 2]) == 3 and clock.wall > 0 and clock.cpu >= 0


@pytest.mark.skipif(not os.environ.get(vllm_scheduler.ENV) or
                    not Path(os.environ.get(vllm_scheduler.ENV, "")).exists(),
                    reason="needs $ATOMBATCH_VLLM_PYTHON, a Python with vLLM "
                           "(docs/prefix-cache.md)")
def test_the_probe_drives_vllms_real_scheduler() -> None:
    python = os.environ[vllm_scheduler.ENV]
    argv = vllm_scheduler.probe_argv(python, hit_tokens=256, hit_max_model_len=512,
                                     full=[(2, 200)], max_model_len=512, prompt_tokens=32,
                                     repeats=1, loops=2)
    run = vllm_scheduler.parse(subprocess.run(argv, check=True, capture_output=True,
                                              timeout=600).stdout)
    hit, full = run.results
    assert isinstance(hit, vllm_scheduler.HitResult) and hit.hit_tokens == 240
    assert isinstance(full, vllm_scheduler.FullResult) and full.evicted_per_admission >= 1
    assert run.vllm.startswith("0.") and hit.schedule.cpu_ns > 0

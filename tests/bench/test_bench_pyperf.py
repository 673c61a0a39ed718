"""The pyperf suite in bench/ runs (fastest mode) and its results compare with pyperf."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyperf  # the bench extra, part of the test extra

ROOT = Path(__file__).resolve().parents[2]


def test_pyperf_suite_runs_the_shared_cases_and_compares(tmp_path):
    from atombatch.bench import cases

    output = tmp_path / "suite.json"
    ops = "decode_build,engine_step,prefix_lookup,prefix_insert"
    subprocess.run([sys.executable, str(ROOT / "bench" / "micro.py"), "--debug-single-value",
                    "--quiet", "--lanes", "2", "--impls", "c,py", "--ops", ops,
                    "-o", str(output)], cwd=tmp_path, check=True, capture_output=True,
                   text=True, timeout=600)
    suite = pyperf.BenchmarkSuite.load(str(output))
    want = {case.name for case in cases.cases((2,), ops.split(","))}
    assert set(suite.get_benchmark_names()) == want
    assert {"engine_step/partitioned/B2/c", "prefix_insert/partitioned/B1/c"} <= want
    for bench in suite.get_benchmarks():
        assert bench.get_nvalue() >= 1 and bench.median() > 0
        metadata = bench.get_metadata()
        assert metadata["atombatch_op"] == bench.get_name().split("/")[0]
        assert "load_avg_1min" in metadata and "atombatch_commit" in metadata
    compared = subprocess.run([sys.executable, "-m", "pyperf", "compare_to", str(output),
                               str(output), "--table"], check=True, capture_output=True,
                              text=True, timeout=120)
    assert "engine_step/eager/B2/c" in compared.stdout


def test_pyperf_suite_rejects_an_unknown_operation(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "micro.py"), "--ops", "nope",
                             "--debug-single-value"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0 and "--ops='nope'" in result.stderr


def test_micro_report_regenerates_readme_and_docs_figures_from_a_recorded_run(tmp_path):
    import shutil

    from atombatch.bench import micro

    (tmp_path / "docs" / "bench").mkdir(parents=True)
    for name in ("docs/hot-path.md", "docs/prefix-cache.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    recorded = tmp_path / "docs" / "bench" / "micro-test.json"
    micro.run(lanes=(4,), json_path=str(recorded), quick=True,
              ops=("engine_step", "decode_build", "prefix_lookup", "prefix_insert"))
    micro.write_report(str(recorded), root=str(tmp_path))
    hot = (tmp_path / "docs" / "hot-path.md").read_text()
    section = hot[hot.index("<!-- micro:start -->"):hot.index("<!-- micro:end -->")]
    assert "(bench/micro-test.json)" in section and "load average" in section
    assert "| 4 | " in section and "≤ 6 µs" in section
    assert hot.count("<!-- micro:start -->") == 1 and "issue 10's targets" in hot
    doc = (tmp_path / "docs" / "prefix-cache.md").read_text()
    figures = doc[doc.index("<!-- prefix-results:start -->"):]
    assert "bench/micro-test.json" in figures and "full hit" in figures and "≤ 150 µs" in figures


def test_micro_report_writes_the_prefix_scale_and_admission_tables_it_measured(tmp_path):
    """A prefix-only run rewrites docs/prefix-cache.md's scale table and docs/overlap.md's
    admission stalls, and leaves docs/hot-path.md (whose cases it did not measure) alone."""
    import shutil

    from atombatch.bench import micro

    (tmp_path / "docs" / "bench").mkdir(parents=True)
    for name in ("docs/hot-path.md", "docs/prefix-cache.md", "docs/overlap.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    hot = (tmp_path / "docs" / "hot-path.md").read_text()
    recorded = tmp_path / "docs" / "bench" / "prefix-test.json"
    micro.run(lanes=(4,), json_path=str(recorded), quick=True, repeats=1,
              ops=("prefix_miss", "prefix_hash_lookup", "prefix_hash_lookup_vllm",
                   "prefix_admit", "prefix_steady", "prefix_admit_nocache"))
    done = micro.write_report(str(recorded), root=str(tmp_path))
    assert done == ["docs/prefix-cache.md (the index at scale)",
                    "docs/overlap.md (admission stalls)"]
    assert (tmp_path / "docs" / "hot-path.md").read_text() == hot
    doc = (tmp_path / "docs" / "prefix-cache.md").read_text()
    scale = doc[doc.index("<!-- prefix-scale:start -->"):doc.index("<!-- prefix-scale:end -->")]
    assert "bench/prefix-test.json" in scale and "miss, 30k cached blocks" in scale
    assert "× cheaper than" in scale and "| 16 | 30k |" in scale
    overlap = (tmp_path / "docs" / "overlap.md").read_text()
    stalls = overlap[overlap.index("<!-- admission-stall:start -->"):
                     overlap.index("<!-- admission-stall:end -->")]
    assert stalls.count("| 4 |") == 3 and stalls.count("| 16 |") == 3 and "load average" in stalls

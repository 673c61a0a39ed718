"""The benchmarks as a person meets them: missing optional dependencies fail before a run,
progress is visible without a terminal, plots show the whole matrix, and the tables explain
themselves in whole sentences."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from atombatch.bench import fit, http, micro, plot, serve
from atombatch.bench.progress import CellProgress

SMALL = ["--models", "qwen3-0.6b", "--routes", "native,pd-whole", "--inputs", "128,512",
         "--outputs", "16", "--artifacts", "B1/k1,B4/k5,B4/k1", "--policies", "prefill-first",
         "--concurrency", "4"]


def test_plot_without_matplotlib_fails_before_any_cell_runs(monkeypatch: Any, capsys: Any,
                                                            tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert serve.main([*SMALL, "--plot", str(tmp_path / "p.png")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no table: nothing was run
    assert "pip install 'atombatch[plot]'" in captured.err
    assert "[1/" not in captured.err and not (tmp_path / "p.png").exists()


def test_plot_and_plot_grid_from_the_command_line(capsys: Any, tmp_path: Path) -> None:
    summary, grid = tmp_path / "summary.png", tmp_path / "grid.png"
    assert serve.main([*SMALL, "--no-progress", "--plot", str(summary), "--plot-grid",
                       str(grid)]) == 0
    assert f"plot: {summary}" in capsys.readouterr().err
    assert summary.read_bytes()[:4] == grid.read_bytes()[:4] == b"\x89PNG"
    assert summary.read_bytes() != grid.read_bytes()


def test_progress_is_one_line_per_cell_without_a_terminal(capsys: Any) -> None:
    assert serve.main(SMALL) == 0
    err = capsys.readouterr().err.splitlines()
    cells = 2 * 2 * 3
    pattern = re.compile(r"^\[ ?(\d+)/12\] qwen3-0\.6b (native|pd-whole) (128|512)/16 \S+ "
                         r"prefill-first: (ok|rejected) in \d+\.\d s \| elapsed \d\d:\d\d, "
                         r"left ~\d\d:\d\d$")
    lines = [line for line in err if pattern.match(line)]
    assert [int(pattern.match(line).group(1)) for line in lines] == list(range(1, cells + 1))
    assert err[-1].startswith(f"{cells} cells in ")
    assert serve.main([*SMALL, "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_progress_on_a_terminal_is_a_tqdm_bar() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    meter = CellProgress(3, stream=stream)
    for n in range(3):
        meter.start(f"cell {n}")
        meter.finish(f"cell {n}", "ok")
    meter.close()
    text = stream.getvalue()
    assert "\r" in text and "3/3" in text and "cell 2" in text and "last: ok" in text


@pytest.fixture(scope="module")
def report() -> serve.ServeReport:
    return serve.run(models=["qwen3-0.6b", "koni-8b"], routes=["native", "pd-whole"],
                     inputs=[128, 2048], outputs=[16], artifacts=["B1/k1", "B4/k5", "B4/k1"],
                     policies=["prefill-first", "decode-first"], load=serve.Load(concurrency=4))


def test_plot_panels_cover_the_matrix_and_mark_what_did_not_run(report: Any) -> None:
    panels = plot.panels(report)
    assert {(p.model, p.route, p.metric) for p in panels} == {
        (m, r, k) for m in ("qwen3-0.6b", "koni-8b") for r in ("native", "pd-whole")
        for k in ("ttft", "e2e")}
    for panel in panels:
        assert {(b.input_len, b.artifact) for b in panel.boxes} == {
            (i, a) for i in (128, 2048) for a in ("B1/k1", "B4/k5", "B4/k1")}
        by = {(b.input_len, b.artifact): b for b in panel.boxes}
        assert by[(128, "B4/k1")].mark == "rejected" and not by[(128, "B4/k1")].values
        if panel.model == "koni-8b":  # B4/k5 at context 9216 does not fit one device
            assert by[(2048, "B4/k5")].mark == "no fit"
        else:
            assert len(by[(2048, "B4/k5")].values) == 4
        values = [v for b in panel.boxes for v in b.values]
        assert panel.log_scale == (max(values) / min(values) > plot.LOG_SPAN)
        # 180 s is far above these runs' latencies: no line, but the title says so
        assert panel.timeout_line is None and "timeout 180 s off scale" in panel.title
    assert any(p.log_scale for p in panels) and not all(p.log_scale for p in panels)


def test_plot_timeout_line_only_when_in_range(report: Any) -> None:
    top = max(v for p in plot.panels(report) for b in p.boxes for v in b.values)
    params = {**report.params, "load": {**report.params["load"], "timeout_s": top / 2}}
    near = plot.panels(msgspec.structs.replace(report, params=params))
    drawn = [p for p in near if p.timeout_line is not None]
    assert drawn and all(p.timeout_line == top / 2 for p in drawn)
    assert all("off scale" in p.title for p in near if p.timeout_line is None)


@pytest.mark.parametrize("grid", [False, True], ids=["summary", "grid"])
def test_plot_writes_one_png_per_policy(report: Any, tmp_path: Path, grid: bool) -> None:
    paths = serve.write_plot(report, tmp_path / "serve.png", grid=grid)
    assert paths == [tmp_path / "serve.png", tmp_path / "serve-decode-first.png"]
    for path in paths:
        head = path.read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
        if not grid:  # the default: one screen, whatever the size of the matrix
            assert (width, height) == (1500, 860)


def test_plot_summary_is_six_headline_panels(report: Any) -> None:
    panels = plot.summary(report)
    assert len(panels) == 6
    top, bottom = panels[:3], panels[3:]
    # the headline workload (longest prompt and output, native route) across every model
    for panel, metric in zip(top, ("TTFT p99", "completion max", "output tok/s"), strict=True):
        assert panel.title == f"in 2048 / out 16 native c4: {metric}"
        assert panel.kind == "bars" and panel.groups == ["qwen3-0.6b", "koni-8b"]
    by = {(p.group, p.artifact): p for p in top[0].points}
    cell = next(c for c in report.cells if (c.model, c.route, c.input_len, c.artifact, c.policy)
                == ("qwen3-0.6b", "native", 2048, "B4/k5", "prefill-first"))
    assert by[("qwen3-0.6b", "B4/k5")].value == cell.ttft.p99
    assert by[("koni-8b", "B4/k5")].value is None and by[("koni-8b", "B4/k5")].mark == "no fit"
    assert by[("koni-8b", "B4/k1")].mark == "rejected"
    tok_s = {(p.group, p.artifact): p.value for p in top[2].points}
    assert tok_s[("qwen3-0.6b", "B4/k5")] == cell.output_tok_s
    # the first model across prompt lengths, and across routes
    assert [p.title for p in bottom] == ["qwen3-0.6b native out 16: TTFT p99",
                                         "qwen3-0.6b native out 16: output tok/s",
                                         "qwen3-0.6b in 2048 / out 16 by route: TTFT p99"]
    assert bottom[0].kind == "lines" and bottom[0].groups == ["in 128", "in 2048"]
    assert bottom[2].groups == ["native", "pd-whole"]
    routes = {(p.group, p.artifact): p.value for p in bottom[2].points}
    pd = next(c for c in report.cells if (c.model, c.route, c.input_len, c.artifact, c.policy)
              == ("qwen3-0.6b", "pd-whole", 2048, "B1/k1", "prefill-first"))
    assert routes[("pd-whole", "B1/k1")] == pd.ttft.p99
    assert len(plot.summary(report, "decode-first")) == 6


def test_matrix_reasons_are_whole_sentences(report: Any) -> None:
    table = serve.format_table(report)
    rejected = [c for c in report.cells if c.status == "rejected"]
    assert rejected
    for cell in rejected:
        first = cell.error.split(". ")[0]
        assert first in table  # never cut mid-word or mid-clause


def test_micro_explains_its_columns() -> None:
    records = [micro.MicroRecord(op=op, impl=impl, lanes=4, num_blocks=5, ns_per_op=100.0)
               for op in micro.OPS for impl in ("c", "py")]
    text = micro.format_table(records)
    header = text.splitlines()[0].split()
    legend = "\n".join(micro.LEGEND)
    assert legend in text
    for column in ("shape", "B", "blocks", "op", "c ns", "py ns", "py/c"):
        assert column in " ".join(header)
        assert re.search(rf"(^|[ ;/]){re.escape(column)} =", legend, re.M), column
    for op in micro.OPS:
        assert op in legend


def test_fit_single_and_table_agree(capsys: Any) -> None:
    assert fit.main(["--table", "--model", "koni-8b"]) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("koni-8b") and
               " 1 B1/k1 " in line)
    kv, other, projected, headroom = re.findall(r"-?[\d,]{5,}", row)
    assert fit.main(["--model", "koni-8b", "--num-blocks", "1"]) == 0
    single = capsys.readouterr().out
    for name, value in (("KV/device", kv), ("other/device", other), ("projected", projected),
                        ("headroom", headroom)):
        assert re.search(rf"^  {re.escape(name)} +{value} bytes", single, re.M), name
    assert re.search(r"^  verdict +fits$", single, re.M) and " fits " in row
    assert re.search(r"^  basis +observed \(conditional\)$", single, re.M)
    assert row.rstrip().endswith("observed (conditional)")
    # --estimate gives the table's other basis word
    assert fit.main(["--model", "koni-8b", "--num-blocks", "1", "--estimate"]) == 1
    assert re.search(r"^  basis +estimate$", capsys.readouterr().out, re.M)


def test_bench_http_reports_each_finished_request(capsys: Any) -> None:
    from support.served import ServerThread

    from atombatch import ArtifactConfig, Batcher, ModelSpec
    from atombatch.runtime import NumpyRuntime
    from atombatch.serve import create_app

    spec = ModelSpec(name="tiny", family="llama", vocab_size=128, hidden_size=32, num_heads=2,
                     intermediate_size=64, num_layers=1, num_kv_heads=1, head_dim=16)
    art = ArtifactConfig(model=spec, batch_size=2, max_seq_len=64, block_size=64, num_blocks=3,
                         prefill_chunk_size=32)
    with ServerThread(create_app(Batcher(NumpyRuntime.random(art, seed=0)), "tiny")) as s:
        assert http.main(["--url", s.url, "-c", "2", "--requests", "3", "--input-len", "8",
                          "--output-len", "4"]) == 0
        out, err = capsys.readouterr()
        assert "ok 3/3" in out
        lines = err.splitlines()
        pattern = re.compile(r"^\[(\d)/3\] request [0-2]: ok in \d+\.\d s \| elapsed \d\d:\d\d, "
                             r"left ~\d\d:\d\d$")
        assert [int(m.group(1)) for m in map(pattern.match, lines[:3]) if m] == [1, 2, 3], err
        assert lines[3].startswith("3 requests in ")
        assert http.main(["--url", s.url, "-c", "2", "--requests", "2", "--input-len", "8",
                          "--output-len", "4", "--no-progress"]) == 0
        assert capsys.readouterr().err == ""


def test_every_subcommand_help_says_what_it_measures(capsys: Any) -> None:
    import importlib

    from atombatch.bench.__main__ import DESCRIPTIONS

    for name in DESCRIPTIONS:
        with pytest.raises(SystemExit) as exit_:
            importlib.import_module(f"atombatch.bench.{name}").main(["--help"])
        assert exit_.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith(f"usage: python -m atombatch.bench {name} "), text[:80]
        description = text.split("\n\n")[1]  # between the usage and the options
        assert not description.startswith(("options:", "positional")), name
        assert len(description.split()) >= 6, (name, description)


def test_bench_http_without_httpx_fails_at_once(monkeypatch: Any, capsys: Any) -> None:
    from atombatch.bench import http

    monkeypatch.setitem(sys.modules, "httpx", None)
    assert http.main(["--url", "http://127.0.0.1:9", "-c", "2", "--input-len", "8",
                      "--output-len", "4"]) == 2
    assert "pip install 'atombatch[server]'" in capsys.readouterr().err


def test_an_unwritable_output_fails_before_the_run(capsys: Any, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert serve.main([*SMALL, "--json", str(blocker / "out.json")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "out.json: cannot create its folder" in captured.err


def test_bench_help_describes_every_subcommand(capsys) -> None:
    import importlib

    from atombatch.bench.__main__ import DESCRIPTIONS, main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, text in DESCRIPTIONS.items():
        assert f"  {name:<11} {text}" in out
        assert callable(importlib.import_module(f"atombatch.bench.{name}").main)


def test_default_run_without_matplotlib_says_so_and_verbose_prints_the_tables(
        monkeypatch: Any, capsys: Any, tmp_path: Path) -> None:
    """`python -m atombatch.bench --verbose --out DIR` with matplotlib missing: the run ends
    well, the closing screen says why there is no picture, no PNG is written, and the tables
    printed are the ones in bench-details.txt (a smaller micro and serve matrix here)."""
    import functools

    from atombatch.bench import __main__ as bench_main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(micro, "run", functools.partial(
        micro.run, lanes=(1, 4), ops=("engine_step", "decode_build", "allocate+free")))
    monkeypatch.setattr(bench_main, "SHORT_SERVE", [*SMALL[:-2], "--no-progress"])
    assert bench_main.main(["--verbose", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    tables, screen = out.split("\n\n== atombatch bench (short default)")
    details = (tmp_path / "out" / "bench-details.txt").read_text()
    assert tables.strip() == details.strip()
    assert "== micro" in details and "== serve" in details
    screen_lines = screen.strip().splitlines()
    assert len(screen_lines) < 25
    assert screen_lines[-1] == ("no picture: matplotlib is not installed "
                                "(pip install 'atombatch[plot]')")
    assert re.search(r"engine step +B1 \S+ \S+ vs \S+ \S+ \(\d+\.\dx\)$", screen, re.M), screen
    assert "qwen3-0.6b B4/k1: not run (rejected)" in screen
    assert not (tmp_path / "out" / "bench-summary.png").exists()


def test_default_run_refuses_an_unwritable_folder(capsys: Any, tmp_path: Path) -> None:
    from atombatch.bench.__main__ import main

    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["--out", str(blocker / "sub")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "cannot write there" in captured.err


def test_plain_python_m_atombatch_bench_ends_with_one_screen_and_a_picture(
        tmp_path: Path) -> None:
    """The default run: every table in bench-details.txt, a PNG, and at most 25 lines on stdout
    carrying the compiled-vs-twin ratio, the invariance verdict, B1 -> B4 and the provenance."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run([sys.executable, "-m", "atombatch.bench"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) <= 25, result.stdout
    text = result.stdout
    assert re.search(r"commit [0-9a-f]{7,}", text) and "1-minute load average" in text
    assert re.search(r"engine step +B1 .* vs .* \(\d+\.\dx\)", text), text
    assert "batch invariance" in text and "PASS: max |Δlogit| 0 over llama, qwen3, gemma3" in text
    assert re.search(r"qwen3-4b +2048/128 +B1/k1 -> B4/k5 .* tok/s \(x\d\.\d\d\)", text), text
    assert "koni-8b B4/k5: not run (does not fit: " in text
    assert lines[-2:] == ["every table: bench-details.txt", "picture: bench-summary.png"]
    details = (tmp_path / "bench-details.txt").read_text()
    assert "== micro" in details and "== serve" in details and "calibration:" in details
    assert "multi-lane vs single-lane" in details and "tokens equal" in details
    head = (tmp_path / "bench-summary.png").read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")) == (1500, 520)

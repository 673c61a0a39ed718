"""`python -m atombatch.bench overlap` in its smallest mode: the report's figures agree with each
other and with what was asked; the byte-scanning client counts what the server sent."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from atombatch.bench import overlap, send_floor
from atombatch.bench.overlap import Report
from atombatch.bench.sse_client import Stream

B, MAX_TOKENS = 4, 16


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Report:
    path = tmp_path_factory.mktemp("overlap") / "overlap.json"
    # in a child process, as a user runs it (the module's main owns the server's lifetime)
    done = subprocess.run([sys.executable, "-m", "atombatch.bench", "overlap", "--batch-sizes",
                           str(B), "--step-ms", "5", "--max-tokens", str(MAX_TOKENS),
                           "--repeats", "1", "--sustained", "3", "--json", str(path)],
                          capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stdout + done.stderr
    # progress per case
    assert re.search(r"B4 step 5 ms server tokenizer wordlevel( --engine-core \w+)? "
                     r"(no-)?overlap: ratio",
                     done.stderr), done.stderr
    assert "bench overlap: delivered / ideal throughput" in done.stdout
    return msgspec.json.decode(path.read_bytes(), type=Report)


def test_report_has_every_case_with_its_parameters(report: Report) -> None:
    paths = [(c.path, c.tokenizer, c.overlap) for c in report.cases]
    cores = 2 if report.engine_core_flag else 1
    assert report.params["overlap"] == [True, False]  # by default both, side by side
    for on in (True, False):
        assert paths.count(("engine", False, on)) == 1
        assert paths.count(("server", False, on)) == cores
        assert paths.count(("server", True, on)) == cores
    assert report.params["max_tokens"] == MAX_TOKENS and report.params["batch_sizes"] == [B]
    assert report.commit and report.machine
    assert all(x >= 0 for x in (*report.load_before, *report.load_after))
    for case in report.cases:
        assert (case.batch_size, case.step_ms) == (B, 5.0)
        assert case.ideal_tok_s == pytest.approx(B / 0.005)
        assert case.bound_ratio == pytest.approx(MAX_TOKENS / (MAX_TOKENS - 1))
        assert len(case.rounds) == 1
        assert (case.command is not None) == (case.path == "server")
        if case.command is not None:
            assert "--runtime null --null-step-ms 5" in case.command
            assert ("--tokenizer" in case.command) == case.tokenizer
            assert case.command.split().count("--overlap" if case.overlap else "--no-overlap") == 1


def test_figures_are_consistent(report: Report) -> None:
    for case in report.cases:
        assert case.median is not None
        assert case.error is None or case.error.startswith("recovered by a restart")
        for r in case.rounds:
            assert r.errors == ()
            assert r.requests == r.ok == B
            assert r.tokens == B * MAX_TOKENS                  # every token arrived, counted once
            assert r.tok_per_s == pytest.approx(r.tokens / r.duration_s)
            assert r.ratio == pytest.approx(r.tok_per_s / case.ideal_tok_s)
            assert 0 < r.ratio <= 1.2
            # the device alone needs max_tokens - 1 steps: a round cannot beat them
            assert r.duration_s >= (MAX_TOKENS - 1) * 0.005
            # every request's decode rate was measured; in the engine (exact times) none beats
            # one token per device step; the client reads a first token up to half a step late,
            # or later on a loaded machine, so there only the measurement itself is checked
            assert r.steady is not None and r.steady > 0
            if case.path == "engine":
                assert r.steady <= 1.0 + 1e-6
            if case.path == "engine":
                assert r.core_cpu_s > 0
                assert r.decode_steps == MAX_TOKENS - 1     # the first token is the prefill's
                assert r.device_s is not None and r.device_s >= r.decode_steps * 0.005
                assert case.median.host_ms_per_step is not None
                assert case.median.device_ms_per_step is not None
                assert case.median.device_ms_per_step >= 5.0  # the null device slept its step
            else:
                assert 0 < r.events <= r.tokens  # an event carries one token or, late, more
                assert r.front_cpu_s > 0 and r.core_cpu_s > 0 and r.client_cpu_s > 0
                # the streaming window: read right after the reads that passed a quarter and
                # three quarters of the tokens (none when one late read passed both)
                if r.mid_tokens is not None:
                    assert 0 < r.mid_tokens <= B * MAX_TOKENS * 0.75
                    assert r.mid_front_cpu_s is not None and r.mid_front_sys_s is not None
                    assert 0 < r.mid_front_cpu_s <= r.front_cpu_s
                    assert r.mid_front_sys_s >= 0  # clock ticks: coarse, never negative
        m = case.median
        assert m.ratio == case.rounds[0].ratio
        if case.path == "server":
            assert m.front_us_per_token == pytest.approx(
                1e6 * case.rounds[0].front_cpu_s / (B * MAX_TOKENS))
            assert m.client_us_per_token > 0


@pytest.mark.parametrize("policy", [None, "stall-free:3", "prefill-first", "fill-first:4",
                                    "interleave:2", "decode-first"])
@pytest.mark.parametrize("batch", [1, 5, 20])
@pytest.mark.parametrize("pipeline", [False, True])
def test_the_bound_counts_the_decode_steps_the_policy_runs(policy: str | None, batch: int,
                                                           pipeline: bool) -> None:
    """`bound`'s ramp is what the scheduler does: the engine's round of B requests submitted at
    once runs max_tokens - 1 + ramp_steps decode calls, synchronous or pipelined."""
    from atombatch.serve.cli import DEFAULT_SPEC

    prompts = overlap._prompts(batch, 8, DEFAULT_SPEC.vocab_size, 0)
    r = overlap.engine_round(batch, 0.5, 0.0, prompts, 6, 1024, 128, policy, DEFAULT_SPEC,
                             None, pipeline)
    assert r.decode_steps == 5 + overlap.ramp_steps(policy, batch, 6)
    assert overlap.bound_ratio(batch, 0.5, 0.0, 8, 128, 6, policy) == \
        pytest.approx(6 / r.decode_steps)


def test_steady_ratio_is_each_requests_rate_against_one_token_per_step() -> None:
    step = 0.01
    on_time = (1.0, 1.0 + 15 * step, 16)       # 16 tokens in 15 steps: no step waited
    half = (2.0, 2.0 + 30 * step, 16)          # every step took two device steps
    slow = (0.5, 0.5 + 20 * step, 16)
    assert overlap.steady_ratio([on_time], step) == pytest.approx(1.0)
    assert overlap.steady_ratio([half], step) == pytest.approx(0.5)
    assert overlap.steady_ratio([on_time, half, slow], step) == pytest.approx(0.75)
    # a request with one token, or no first-token time, says nothing about the rate
    assert overlap.steady_ratio([(0.0, 1.0, 16), (1.0, 2.0, 1)], step) is None


def test_table_shows_the_figures(report: Report) -> None:
    table = overlap.format_table(report)
    assert re.search(r"\| ids  on ", table) and re.search(r"\| ids  off ", table)
    server = next(c for c in report.cases if c.path == "server" and not c.tokenizer)
    assert f"{server.median.ratio:.3f}" in table
    assert server.median.steady is not None and f"{server.median.steady:.3f}" in table
    assert " mid " in table and " sys " in table
    if server.median.mid_front_us_per_token is not None:
        assert f"{server.median.mid_front_us_per_token:.1f}" in table
    assert f"commit {report.commit}" in table and "load average" in table
    [floor] = report.send_floors or []
    assert f"B{B} x 5 ms {floor.us_per_write:.1f} us" in table


def test_every_case_ran_under_sustained_load_and_the_table_shows_it(report: Report) -> None:
    """--sustained 3: 3 x B requests with B in flight, every one complete, on every path."""
    assert report.params["sustained"] == 3
    table = overlap.format_table(report)
    assert "sustained load: B requests in flight" in table
    for case in report.cases:
        held = case.sustained
        assert held is not None, (case.path, case.tokenizer, case.overlap)
        assert held.errors == ()
        assert held.requests == held.ok == 3 * B
        assert held.total_tokens == 3 * B * MAX_TOKENS
        assert held.window_s > 0 and held.ratio > 0
        if case.path == "server":
            assert held.front_cpu_s > 0 and held.client_cpu_s > 0
        assert f"{held.ratio:.3f}" in table


def test_the_send_floor_is_one_write_per_stream_per_step(report: Report) -> None:
    """Measured once per B x step of the server cases; every write was made and read."""
    [floor] = report.send_floors or []
    assert (floor.batch_size, floor.step_ms) == (B, 5.0)
    assert floor.writes == B * max(send_floor.MIN_STEPS, min(
        send_floor.MAX_STEPS, int(send_floor.FLOOR_SECONDS / 0.005)))
    # a write costs something, and far less than a step's worth of CPU
    assert 0 < floor.us_per_write < 5_000


SSE = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
       b"10c\r\ndata: {\"choices\":[{\"text\":\"w1\",\"token_ids\":[7]}]}\n\n\r\n"
       b"10c\r\ndata: {\"choices\":[{\"text\":\"w1 w2 w3\",\"token_ids\":[8,9,10]}]}\n\n\r\n"
       b"10c\r\ndata: {\"choices\":[{\"text\":\"\",\"token_ids\":[]}]}\n\n\r\n"
       b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")


@pytest.mark.parametrize("piece", [1, 7, 64, len(SSE)])
def test_stream_counts_events_and_tokens_however_the_bytes_are_split(piece: int) -> None:
    stream = Stream()
    at = 0
    while not stream.feed(SSE[at:at + piece], float(at)):
        at += piece
        assert at < len(SSE), "[DONE] was not seen"
    assert b"data:" not in SSE[at + piece:]  # over once [DONE] is complete, not before
    assert stream.ended == float(at)
    assert (stream.status, stream.tokens, stream.events, stream.error) == (200, 4, 3, None)
    assert stream.finished


def test_stream_reports_an_error_status_and_an_error_event() -> None:
    refused = Stream()
    refused.feed(b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\n\r\n{}", 0.0)
    refused.closed(1.0)
    assert refused.error is not None and refused.error.startswith("HTTP 429")
    failed = Stream()
    failed.feed(SSE[:SSE.index(b"10c")] + b"5f\r\ndata: {\"error\":{\"message\":\"boom\"}}\n\n", 0)
    failed.closed(1.0)
    assert failed.error is not None and "boom" in failed.error and not failed.finished


def test_server_cpu_sees_a_childs_threads_and_grandchildren() -> None:
    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
              "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        time.sleep(1.0)
        before = overlap.server_cpu(proc.pid)
        time.sleep(0.5)
        spent = overlap.server_cpu(proc.pid) - before
        assert spent.children > 0.05         # the spinning grandchild
        assert spent.main < 0.05              # the sleeping parent
    finally:
        for child in overlap._descendants(proc.pid):
            os.kill(child, 9)
        proc.kill()
        proc.wait()


def test_bad_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert overlap.main(["--max-tokens", "0", "--no-server", "--no-engine"]) == 2
    with pytest.raises(SystemExit):
        overlap.main(["--overlap", "maybe"])
    assert "--max-tokens must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        overlap.main(["--step-ms", "0"])
    with pytest.raises(SystemExit):
        overlap.main(["--tokenizers", "sentencepiece"])


def test_admission_stalls_measure_every_cache_size_beside_a_steady_step(tmp_path: Path) -> None:
    path = tmp_path / "admission.json"
    done = subprocess.run([sys.executable, "-m", "atombatch.bench", "overlap", "--no-engine",
                           "--no-server", "--admission-stalls", "--repeats", "1", "--json",
                           str(path)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    report = msgspec.json.decode(path.read_bytes(), type=Report)
    assert report.admission is not None
    cases = {(r["op"], r["lanes"], r["shape"]) for r in report.admission}
    for lanes in overlap.ADMISSION_LANES:
        for size in ("cached1k", "cached10k", "cached30k"):
            assert ("prefix_admit", lanes, size) in cases and ("prefix_steady", lanes, size) in cases
        assert ("prefix_admit_nocache", lanes, "nocache") in cases
    assert all(r["ns_per_op"] > 0 and r["cpu_ns_per_op"] > 0 for r in report.admission)
    assert "admission stalls" in done.stdout and "| 16 | 30k |" in done.stdout
    # the pipeline's side: every case on and off, and with it on every admitted chunk was
    # planned while a decode ran and launched by the device thread (none without it)
    gaps = report.pipeline_admission
    assert gaps is not None
    assert {(g.lanes, g.cached, g.overlap) for g in gaps} == \
        {(b, c, o) for b in (4, 16) for c in (1_000, 10_000, 30_000) for o in (True, False)}
    assert all(g.cycles >= 20 and g.ahead == (g.cycles if g.overlap else 0) for g in gaps)
    assert all(g.before_us > 0 and g.after_us > 0 and g.steady_us > 0 for g in gaps)
    assert "admission in the pipeline" in done.stdout


def test_lora_mix_runs_base_and_mixed_engine_cases_side_by_side(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--lora-mix N`: each engine case runs again with the requests spread over the base and N
    adapters of the null device; both deliver every token, their host cost per step is tabled."""
    path = tmp_path / "lora.json"
    assert overlap.main(["--no-server", "--batch-sizes", "4", "--step-ms", "2", "--max-tokens",
                         str(MAX_TOKENS), "--repeats", "2", "--lora-mix", "3", "--overlap",
                         "on,off", "--no-progress", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    report = msgspec.json.decode(path.read_bytes(), type=Report)
    assert report.params["lora_mix"] == 3
    pairs = overlap.lora_pairs(report)
    assert sorted(bool(base.overlap) for base, _ in pairs) == [False, True]
    for base, mixed in pairs:
        assert (base.lora_mix, mixed.lora_mix) == (0, 3)
        for case in (base, mixed):
            assert len(case.rounds) == 2 and case.median is not None
            for r in case.rounds:
                assert r.ok == r.requests == 4 and r.tokens == 4 * MAX_TOKENS
                assert r.host_gaps and r.host_gap_s is not None and r.host_gap_s > 0
        # the same schedule: the adapters change no step
        assert [r.decode_steps for r in base.rounds] == [r.decode_steps for r in mixed.rounds]
    assert "host cost per step, base only | requests over the base and 3 adapters" in out
    assert len(re.findall(r"^\s+4\s+2 (on |off) \|", out, re.M)) == 2
    assert overlap.lora_names(5, 3) == [None, "null-1", "null-2", "null-3", None]
    assert overlap.main(["--no-server", "--lora-mix", "-1"]) == 2
    assert overlap.main(["--no-server", "--no-engine", "--lora-mix", "2"]) == 2
    assert "--lora-mix" in capsys.readouterr().err

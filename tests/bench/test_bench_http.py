"""`python -m atombatch.bench http` against a real server on the null device: every request is
recorded with the tokens the server generated, a request cut by its deadline is a timeout, and the
load generator reports its own CPU per token (the raw-socket client of
atombatch/bench/sse_client.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
from support.served import served

from atombatch.bench.http import Report
from atombatch.bench.sse_client import Stream


def bench(url: str, out: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], Report]:
    done = subprocess.run([sys.executable, "-m", "atombatch.bench", "http", "--url", url,
                           "--json", str(out), *flags], capture_output=True, text=True,
                           timeout=180)
    return done, msgspec.json.decode(out.read_bytes(), type=Report)


def test_every_request_is_recorded_with_its_tokens_and_the_client_cost(tmp_path: Path) -> None:
    with served("--runtime", "null", "--null-step-ms", "2", "--batch-size", "4") as (url, _):
        done, report = bench(url, tmp_path / "a.json", "-c", "4", "--requests", "10",
                             "--input-len", "8", "--output-len", "24")
        assert done.returncode == 0, done.stdout + done.stderr
        s = report.summary
        assert s.requests == s.ok == 10 and s.errors == s.timeouts == 0
        assert s.output_tokens == 10 * 24
        assert [r.index for r in report.records] == list(range(10))
        for r in report.records:
            assert r.outcome == "ok" and r.http_status == 200 and r.output_tokens == 24
            assert r.finish_reason == "length"
            assert r.first_sse is not None and r.completion is not None
            # 23 decode steps of 2 ms come after the first token
            assert 0 < r.first_sse < r.completion and r.completion >= 23 * 0.002
        # four in flight at once: the fifth request went out only when one had ended
        starts = sorted(r.started for r in report.records)
        ends = sorted(r.started + r.completion for r in report.records)
        assert starts[4] >= ends[0] - 1e-3
        assert s.client_cpu_s is not None and s.client_cpu_s > 0
        assert s.client_us_per_token is not None and s.client_us_per_token > 0
        assert "client CPU" in done.stdout and "us per token received" in done.stdout
        # a deadline shorter than the generation: every request is a timeout, not a latency
        done, report = bench(url, tmp_path / "b.json", "-c", "2", "--requests", "2",
                             "--input-len", "8", "--output-len", "500", "--timeout", "0.3")
        assert done.returncode == 1
        assert [r.outcome for r in report.records] == ["timeout", "timeout"]
        assert report.summary.ok == 0 and report.summary.completion_p50 is None


def test_an_error_status_and_a_server_without_ids_are_counted() -> None:
    refused = Stream()
    assert not refused.feed(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 9\r\n\r\n", 1.0)
    assert refused.error is not None and refused.error.startswith("HTTP 400")
    textual = Stream()
    body = (b"HTTP/1.1 200 OK\r\n\r\n"
            b'data: {"choices":[{"text":"a","finish_reason":null}]}\n\n'
            b'data: {"choices":[{"text":"","finish_reason":null}]}\n\n'
            b'data: {"choices":[{"text":"b","finish_reason":"stop"}]}\n\n'
            b"data: [DONE]\n\n")
    assert textual.feed(body, 2.0)
    assert textual.tokens == 2 and textual.finish_reason == "stop" and textual.error is None

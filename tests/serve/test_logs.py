"""One logging setup, JSON or console (atombatch/logs.py, docs/server.md "Logs"): the library's
events and other libraries' records in the format chosen by `configure`, `ATOMBATCH_LOG_FORMAT`
or the terminal, and `python -m atombatch.serve --log-format` end to end."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.served import free_port

from atombatch import ConfigError, logs

ROOT = Path(__file__).resolve().parents[2]
STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z"


class Tty(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def emitted(caplog: pytest.LogCaptureFixture, name: str = "atombatch.test") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name]


def test_json_event_carries_its_name_level_time_and_fields(caplog: Any) -> None:
    logs.configure("json")
    with caplog.at_level(logging.INFO, logger="atombatch.test"):
        logs.logger("atombatch.test").info("request.admitted", request_id="r1", lane=3)
    (line,) = emitted(caplog)
    event = json.loads(line)
    assert event.pop("timestamp").endswith("Z")
    assert event == {"request_id": "r1", "lane": 3, "event": "request.admitted", "level": "info"}


def test_console_event_reads_as_a_line(caplog: Any) -> None:
    logs.configure("console")
    with caplog.at_level(logging.INFO, logger="atombatch.test"):
        logs.logger("atombatch.test").warning("request.rejected", status=400, param="temperature")
    (line,) = emitted(caplog)
    assert re.fullmatch(STAMP + r" \[warning\s*\] request\.rejected\s+status=400 "
                        r"param=temperature", line), line
    with pytest.raises(ValueError):
        json.loads(line)


def test_the_format_is_read_when_the_event_happens(caplog: Any) -> None:
    log = logs.logger("atombatch.test")  # made before the choice, as module-level loggers are
    with caplog.at_level(logging.INFO, logger="atombatch.test"):
        logs.configure("console")
        log.info("a.b", k=1)
        logs.configure("json")
        log.info("a.b", k=1)
    console, as_json = emitted(caplog)
    assert "a.b" in console and not console.startswith("{")
    assert json.loads(as_json)["k"] == 1


def test_a_traceback_in_json_is_a_string_in_console_plain_text(caplog: Any) -> None:
    log = logs.logger("atombatch.test")
    with caplog.at_level(logging.INFO, logger="atombatch.test"):
        for format in logs.FORMATS:
            logs.configure(format)
            try:
                {}["missing_key"]
            except KeyError:
                log.exception("engine.step_loop_failed", secret_local="sk-123")
    as_json, console = emitted(caplog)
    exception = json.loads(as_json)["exception"]
    assert exception.startswith("Traceback (most recent call last)") and "KeyError" in exception
    assert "Traceback (most recent call last)" in console and "KeyError: 'missing_key'" in console
    assert console.count("sk-123") == 1  # the event's field, never a dump of the frame's locals


def test_default_environment_then_terminal(monkeypatch: Any) -> None:
    monkeypatch.delenv(logs.ENV, raising=False)
    assert logs.default_format(Tty(True)) == "console"
    assert logs.default_format(Tty(False)) == "json"
    monkeypatch.setenv(logs.ENV, "json")
    assert logs.default_format(Tty(True)) == "json"
    monkeypatch.setenv(logs.ENV, "Console")
    assert logs.default_format(Tty(False)) == "console"
    assert logs.configure(None) == "console"  # no choice made: the environment's
    monkeypatch.setenv(logs.ENV, "yaml")
    with pytest.raises(ConfigError, match=r"ATOMBATCH_LOG_FORMAT='yaml' is not a log format: "
                                          r"use one of json, console"):
        logs.default_format()
    with pytest.raises(ConfigError, match="format='xml'"):
        logs.configure("xml")


@pytest.mark.parametrize("format", logs.FORMATS)
def test_setup_renders_other_libraries_records_in_the_same_format(format: str) -> None:
    # A fresh interpreter: setup installs its handler only on a root logger with none of its own.
    code = ("import logging; from atombatch import logs; "
            f"logs.setup('info', {format!r}); "
            "logs.logger('atombatch.serve').warning('request.rejected', status=400); "
            "logging.getLogger('uvicorn.access').info('%s %d', 'GET /health', 200); "
            "logging.getLogger('uvicorn.access').debug('below the level')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    ours, theirs = out.stderr.splitlines()
    if format == "json":
        assert json.loads(ours)["event"] == "request.rejected"
        record = json.loads(theirs)
        assert (record["event"], record["logger"], record["level"]) == \
            ("GET /health 200", "uvicorn.access", "info")
    else:
        assert re.fullmatch(STAMP + r" \[warning\s*\] request\.rejected\s+status=400", ours)
        assert re.fullmatch(STAMP + r" \[info\s*\] GET /health 200\s+\[uvicorn\.access\]", theirs)


def test_setup_leaves_an_embedders_handlers_alone() -> None:
    root = logging.getLogger()
    mine = logging.StreamHandler(io.StringIO())
    root.addHandler(mine)
    level = root.level
    try:
        assert logs.setup("debug", "console") == "console"
        assert mine in root.handlers and root.level == level
    finally:
        root.removeHandler(mine)
    with pytest.raises(ConfigError, match="log level 'loud'"):
        logs.setup("loud")


def serve_and_reject(flags: list[str], env: dict[str, str]) -> list[str]:
    """Start the server (access lines on: --enable-log-requests), send one request it rejects,
    stop it: its stderr lines after the banner."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "atombatch.serve", "--port", str(port), "--max-seq-len", "128",
         "--batch-size", "1", "--log-level", "info", "--enable-log-requests", *flags],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 120
        while "listening on" not in proc.stderr.readline():
            assert time.monotonic() < deadline and proc.poll() is None, "no banner"
        url = f"http://127.0.0.1:{port}"
        bad = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6], "temperature": -1.0},
                         timeout=30)
        assert bad.status_code == 400
    finally:
        proc.terminate()
        _, rest = proc.communicate(timeout=30)
    return [line for line in rest.splitlines() if line.strip()]


def test_server_logs_json_when_the_environment_says_so() -> None:
    lines = serve_and_reject([], {logs.ENV: "json"})
    events = [json.loads(line) for line in lines]  # every line: uvicorn's records too
    rejected = next(e for e in events if e["event"] == "request.rejected")
    assert (rejected["status"], rejected["param"]) == (400, "temperature")
    assert any(e.get("logger") == "uvicorn.access" and "/v1/completions" in e["event"]
               for e in events)


def test_server_logs_console_with_the_flag() -> None:
    lines = serve_and_reject(["--log-format", "console"], {logs.ENV: "json"})
    assert all(re.match(STAMP + r" \[", line) for line in lines), lines
    assert any("request.rejected" in line and "param=temperature" in line for line in lines)
    assert any("/v1/completions" in line and "[uvicorn.access]" in line for line in lines)

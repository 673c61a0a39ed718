"""Stopping `python -m atombatch.serve` as an operator does: Ctrl-C (SIGINT to the terminal's
process group, the engine core included) or SIGTERM (a service manager) ends it cleanly: no
traceback, the exit status a shell expects, and no child process left (the engine core and
multiprocessing's resource tracker); tests/core/test_core_socket_dir.py checks the sockets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.served import free_port, running


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start(engine_core: str, sigint_ignored: bool = False) -> tuple[subprocess.Popen[str], int]:
    """The server in its own session; `sigint_ignored`: started with SIGINT ignored, as a
    script's background job is (and CI when it runs in one)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "atombatch.serve", "--port", str(port), "--max-seq-len", "128",
         "--batch-size", "1", "--engine-core", engine_core, "--log-level", "debug"],
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=_ignore_sigint if sigint_ignored else None,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stderr is not None
    try:
        deadline = time.monotonic() + 120
        while "listening on" not in proc.stderr.readline():
            assert time.monotonic() < deadline and proc.poll() is None, "no banner"
        done = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                          json={"prompt": [5, 6], "max_tokens": 2})
        assert done.status_code == 200
    except BaseException:  # its own session: nothing else would ever stop it
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise
    return proc, port


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.parametrize(("how", "engine_core", "code"), [
    ("ctrl-c", "process", 130), ("ctrl-c", "inline", 130),
    # SIGINT sent to a server that inherited it ignored: uvicorn still catches it; its re-raise
    # is ignored, and the exit status is Ctrl-C's all the same
    ("ctrl-c ignored", "process", 130),
    # uvicorn drains, then re-raises SIGTERM: killed by it (143 in a shell), a clean stop to
    # systemd and Kubernetes
    ("sigterm", "process", -signal.SIGTERM)])
def test_a_stop_is_quiet_and_leaves_nothing(how: str, engine_core: str, code: int) -> None:
    proc, _ = start(engine_core, sigint_ignored=how == "ctrl-c ignored")
    children = children_of(proc.pid)
    assert children if engine_core == "process" else not children
    try:
        if how.startswith("ctrl-c"):
            os.killpg(proc.pid, signal.SIGINT)  # the terminal signals the whole group
        else:
            proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == code
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    deadline = time.monotonic() + 10  # the resource tracker exits when it reads end of file
    while (alive := [c for c in children if running(c)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive, [Path(f"/proc/{c}/cmdline").read_text() for c in alive]



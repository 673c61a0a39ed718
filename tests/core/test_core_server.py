"""`python -m atombatch.serve` with its engine core in another process (the default): streams,
429, metrics, disconnects and a core that dies, all through real processes and sockets."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
from support.served import served


def stream_tokens(url: str, prompt: list[int], max_tokens: int) -> tuple[list[int], str | None]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    tokens: list[int] = []
    reason = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                tokens.extend(choice["token_ids"])
                reason = choice["finish_reason"] or reason
    return tokens, reason


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith(name) and not line.startswith("#")]
    return sum(values)


def card(url: str) -> dict:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["atombatch"]


def test_the_default_server_runs_its_engine_in_another_process_with_the_same_tokens() -> None:
    with served("--batch-size", "2") as (core_url, pid), \
            served("--batch-size", "2", "--engine-core", "inline") as (inline_url, _):
        core = card(core_url)["engine_core"]
        assert core["mode"] == "process" and core["pid"] not in (pid, os.getpid())
        assert card(inline_url)["engine_core"] == {"mode": "inline"}
        for prompt in ([5, 6, 7], list(range(20, 60))):
            got, reason = stream_tokens(core_url, prompt, 12)
            want, _ = stream_tokens(inline_url, prompt, 12)
            assert got == want and len(got) == 12 and reason == "length"
        deadline = time.monotonic() + 5
        while metric(core_url, "atombatch_generation_tokens_total") < 24:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_queue_bound_disconnect_and_a_dying_core() -> None:
    # the null device: a decode step waits 50 ms, so a 900-token stream stays open for 45 s
    with served("--runtime", "null", "--null-step-ms", "50", "--batch-size", "1",
                "--max-waiting", "1") as (url, pid):
        long = {"prompt": [5, 6], "max_tokens": 900, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{url}/v1/completions", json=long) as first:
                assert first.status_code == 200
                first_lines = first.iter_lines()   # held: a collected iterator closes the stream
                next(first_lines)
                with client.stream("POST", f"{url}/v1/completions", json=long) as second:
                    assert second.status_code == 200  # waits for the lane
                    third = httpx.post(f"{url}/v1/completions", json=long, timeout=10)
                    assert third.status_code == 429 and "Retry-After" in third.headers
            # both streams closed early: the core aborts them and frees the lane
            deadline = time.monotonic() + 10
            while metric(url, "atombatch_occupied_lanes") != 0:
                assert time.monotonic() < deadline, "the lane was not freed"
                time.sleep(0.05)
            core_pid = card(url)["engine_core"]["pid"]
            with client.stream("POST", f"{url}/v1/completions", json=long) as doomed:
                lines = doomed.iter_lines()
                next(lines)
                os.kill(core_pid, signal.SIGKILL)
                rest = "\n".join(lines)
            assert "engine core exited" in rest
            assert '"code":"engine_unavailable"' in rest   # the engine is gone, not the request
        # the front answers 503 while it stops, then exits non-zero
        deadline = time.monotonic() + 20
        while True:
            try:
                status = httpx.get(f"{url}/health", timeout=2).status_code
                assert status == 503
            except httpx.TransportError:
                break
            assert time.monotonic() < deadline, "the front kept running without its core"
            time.sleep(0.1)
        deadline = time.monotonic() + 10
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            assert time.monotonic() < deadline, "the front did not exit"
            time.sleep(0.1)
        assert os.waitstatus_to_exitcode(done[1]) == 1


def test_a_hung_core_is_killed_and_the_server_exits() -> None:
    """SIGSTOP the core mid-stream: after --core-hang-timeout seconds of silence the front
    kills it, the stream ends with engine_unavailable, and the server stops non-zero (a
    supervisor starts it again), rather than holding the stream open for good."""
    with served("--runtime", "null", "--null-step-ms", "20", "--batch-size", "2",
                "--core-hang-timeout", "1") as (url, pid):
        core_pid = card(url)["engine_core"]["pid"]
        long = {"prompt": [5, 6], "max_tokens": 900, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as doomed:
            lines = doomed.iter_lines()
            next(lines)
            os.kill(core_pid, signal.SIGSTOP)
            stopped = time.monotonic()
            rest = "\n".join(lines)
        assert time.monotonic() - stopped < 6
        assert "hung" in rest and '"code":"engine_unavailable"' in rest
        deadline = time.monotonic() + 20
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            assert time.monotonic() < deadline, "the front did not exit"
            time.sleep(0.1)
        assert os.waitstatus_to_exitcode(done[1]) == 1
        try:
            os.kill(core_pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        assert not alive, "the hung core outlived its front"

"""`python -m atombatch.serve --api-server-count N`: N front processes on one engine core, through
real processes and sockets. Each front serves what it accepts with the core's tokens, the metrics
of any front are the sum over all, a front that dies has its requests aborted in the core while
the other front's streams go on, and is started again; a core that dies stops the server; a stop
leaves nothing behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from support.served import free_port, running

NULL = ("--runtime", "null", "--null-step-ms", "5", "--batch-size", "4", "--max-seq-len", "8192",
        "--log-level", "warning")


class Launched:
    """The launcher process and what it printed (read on a thread, so the pipe never fills)."""

    def __init__(self, *flags: str, tmp: Path | None = None) -> None:
        self.port = free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if tmp is not None:  # where the core's socket directory goes
            env["TMPDIR"] = str(tmp)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "atombatch.serve", "--port", str(self.port), *flags],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
            start_new_session=True, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, count: int = 1, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        # counted in the whole text: two fronts' lines can interleave on the one pipe
        while "".join(self.lines).count(text) < count:
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, f"no {text!r} x{count}: {''.join(self.lines)}"
            time.sleep(0.05)

    def children(self) -> list[int]:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)],
                             capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def close(self) -> None:
        """Kill whatever still runs and close the pipe."""
        if self.proc.poll() is None:
            self.kill_all()
        self._reader.join(10)
        assert self.proc.stderr is not None
        self.proc.stderr.close()

    def kill_all(self) -> None:
        for pid in [self.proc.pid, *self.children()]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # the fronts run in process groups of their own
        self.proc.wait(10)


@contextmanager
def launched(*flags: str, fronts: int = 2, tmp: Path | None = None) -> Iterator[Launched]:
    server = Launched(*flags, "--api-server-count", str(fronts), tmp=tmp)
    try:
        server.wait_for("listening on", count=fronts)
        yield server
    finally:
        server.close()


def front_of(client: httpx.Client, url: str) -> dict:
    """The engine-core card of the front that serves `client`'s one connection."""
    return client.get(f"{url}/v1/models").json()["data"][0]["atombatch"]["engine_core"]


def clients_per_front(url: str, fronts: int) -> dict[int, httpx.Client]:
    """One single-connection client bound to each front (new connections until each is hit)."""
    found: dict[int, httpx.Client] = {}
    for _ in range(200):
        client = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=1))
        front = front_of(client, url)["front"]
        if front in found:
            client.close()
        else:
            found[front] = client
        if len(found) == fronts:
            return found
    raise AssertionError(f"connections reached fronts {sorted(found)} only")


def body(prompt: list[int], max_tokens: int, stream: bool = True) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def stream_tokens(client: httpx.Client, url: str, prompt: list[int], max_tokens: int,
                  on_first: threading.Event | None = None) -> list[int]:
    tokens: list[int] = []
    with client.stream("POST", f"{url}/v1/completions", json=body(prompt, max_tokens)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                tokens.extend(json.loads(line[6:])["choices"][0]["token_ids"])
                if on_first is not None:
                    on_first.set()
    return tokens


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + labels + " ") or
               (not labels and line.startswith(name + "{")))


def wait_until(check, timeout: float = 10.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_two_fronts_serve_the_cores_tokens_and_sum_their_metrics() -> None:
    with launched(*NULL) as server:
        clients = clients_per_front(server.url, 2)
        cards = {front: front_of(client, server.url) for front, client in clients.items()}
        assert len({card["front_pid"] for card in cards.values()}) == 2
        assert len({card["pid"] for card in cards.values()}) == 1  # one core
        prompts = [[5, 6, 7], list(range(20, 40)), [9] * 11]
        got = {front: [stream_tokens(client, server.url, p, 12) for p in prompts]
               for front, client in clients.items()}
        # the same greedy tokens whichever front asked, and as a request alone on the engine
        assert got[0] == got[1] and all(len(tokens) == 12 for tokens in got[0])
        for client in clients.values():
            client.close()
        # each front counted its own 3 requests; any front's /metrics answers the sum
        wait_until(lambda: metric(server.url, "atombatch_requests_finished_total",
                                  '{reason="length"}') == 6, what="summed finishes")
        assert metric(server.url, "atombatch_generation_tokens_total") == 72
        assert metric(server.url, "atombatch_engine_generated_tokens_total") == 72


def test_a_dying_front_has_its_requests_aborted_while_the_other_streams_on() -> None:
    with launched(*NULL) as server:
        clients = clients_per_front(server.url, 2)
        doomed_pid = front_of(clients[0], server.url)["front_pid"]
        started = threading.Event()
        victim: list[list[int]] = []
        # the victim: 400 tokens at 5 ms a step, on front 1 while front 0 dies
        runner = threading.Thread(target=lambda: victim.append(
            stream_tokens(clients[1], server.url, [3, 4], 400, started)))
        runner.start()
        lost = threading.Thread(target=lambda: _swallow(
            lambda: stream_tokens(clients[0], server.url, [8, 9], 5000)))
        lost.start()
        assert started.wait(20)
        wait_until(lambda: metric(server.url, "atombatch_occupied_lanes") == 2,
                   what="both requests on a lane")
        os.kill(doomed_pid, signal.SIGKILL)
        lost.join(20)
        # the core aborts what the dead front submitted: its lane frees long before 5000 tokens
        wait_until(lambda: metric(server.url, "atombatch_engine_requests_finished_total",
                                  '{reason="abort"}') == 1, what="the dead front's request")
        runner.join(60)
        assert victim and len(victim[0]) == 400  # the other front's stream lost nothing
        server.wait_for("starting it again")
        server.wait_for("listening on", count=3)  # front 1/2 again
        clients[0].close()
        fresh = clients_per_front(server.url, 2)
        assert front_of(fresh[0], server.url)["front_pid"] != doomed_pid
        assert stream_tokens(fresh[0], server.url, [3, 4], 400) == victim[0]
        for client in [*fresh.values(), clients[1]]:
            client.close()


def _swallow(call) -> None:  # type: ignore[no-untyped-def]
    # its front (or the core) died under it: a cut stream, or an error event without choices
    with contextlib.suppress(httpx.HTTPError, AssertionError, KeyError):
        call()


def test_a_dying_core_stops_the_server_and_leaves_nothing() -> None:
    with launched(*NULL) as server:
        core_pid = httpx.get(f"{server.url}/v1/models").json()["data"][0]["atombatch"][
            "engine_core"]["pid"]
        children = server.children()
        assert core_pid in children and len(children) >= 3  # the core and two fronts
        os.kill(core_pid, signal.SIGKILL)
        assert server.proc.wait(30) == 1
        assert "the engine core exited" in "".join(server.lines)
        _none_outlive(children)


def test_a_killed_launcher_takes_the_core_and_the_fronts_with_it(tmp_path: Path) -> None:
    with launched(*NULL, tmp=tmp_path) as server:
        children = [pid for pid in server.children() if running(pid)]
        assert len(children) >= 3
        [directory] = tmp_path.glob("atombatch-core-*")
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        # the core sees its parent gone and exits; each front sees the core gone and exits
        wait_until(lambda: not any(running(pid) for pid in children), timeout=20,
                   what="a child outlived its launcher")
        # and the core removed the socket directory the launcher can no longer remove
        assert not directory.exists(), sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("how", ["sigterm", "sigint"])
def test_a_stop_drains_every_front_and_leaves_nothing(how: str, tmp_path: Path) -> None:
    with launched(*NULL) as server:
        children = server.children()
        clients = clients_per_front(server.url, 2)
        results: list[list[int]] = []
        started = [threading.Event(), threading.Event()]
        runners = [threading.Thread(target=lambda c=client, e=started[front]: results.append(
            stream_tokens(c, server.url, [5, 6], 300, e))) for front, client in clients.items()]
        for runner in runners:
            runner.start()
        assert all(event.wait(20) for event in started)
        # SIGINT as a terminal's Ctrl-C: the launcher's process group (the fronts have their own)
        os.killpg(server.proc.pid, signal.SIGINT) if how == "sigint" else server.proc.terminate()
        for runner in runners:
            runner.join(60)
        assert server.proc.wait(60) == 0
        assert [len(tokens) for tokens in results] == [300, 300]  # in-flight streams finished
        _none_outlive(children)
        assert "Traceback" not in "".join(server.lines)
        for client in clients.values():
            client.close()


def test_a_core_that_dies_while_the_fronts_drain_makes_the_stop_fail() -> None:
    with launched(*NULL) as server:
        core_pid = httpx.get(f"{server.url}/v1/models").json()["data"][0]["atombatch"][
            "engine_core"]["pid"]
        clients = clients_per_front(server.url, 2)
        started = threading.Event()
        runner = threading.Thread(target=lambda: _swallow(
            lambda: stream_tokens(clients[0], server.url, [5, 6], 3000, started)))
        runner.start()
        assert started.wait(20)
        server.proc.terminate()          # a drain begins: the stream holds front 0 open
        time.sleep(1.0)                  # (the fronts have their SIGTERM; 15 s of stream left)
        assert server.proc.poll() is None
        os.kill(core_pid, signal.SIGKILL)
        runner.join(30)
        assert server.proc.wait(60) == 1  # not a clean stop: the stream ended in an error
        assert "while the fronts drained" in "".join(server.lines)
        for client in clients.values():
            client.close()


def test_a_core_that_cannot_start_ends_the_launcher_with_its_message() -> None:
    server = Launched(*NULL, "--api-server-count", "2", "--max-seq-len", "100",
                      "--block-size", "7")
    try:
        assert server.proc.wait(60) == 2
        server._reader.join(10)
        assert "max_seq_len=100 must be a multiple of block_size=7" in "".join(server.lines)
    finally:
        server.close()


def _none_outlive(children: list[int]) -> None:
    """None of the launcher's children outlives it by more than a moment (multiprocessing's
    resource tracker, a child of the launcher too, exits once the launcher's end of its pipe
    closes: just after the launcher)."""
    wait_until(lambda: not any(running(pid) for pid in children), timeout=5,
               what=f"children outlived the server: {[p for p in children if running(p)]}")




def clients_on_front(url: str, front: int, count: int) -> list[httpx.Client]:
    """`count` single-connection clients whose connection front `front` accepted."""
    found: list[httpx.Client] = []
    for _ in range(400):
        client = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=1))
        if front_of(client, url)["front"] == front:
            found.append(client)
            if len(found) == count:
                return found
        else:
            client.close()
    raise AssertionError(f"{len(found)} connections reached front {front}")


def test_each_front_admits_its_share_of_the_queue() -> None:
    # 4 lanes + --max-waiting 2 over 2 fronts: 3 choices in flight per front
    with launched(*NULL, "--max-waiting", "2") as server:
        streams = clients_on_front(server.url, 0, 3)
        [extra] = clients_on_front(server.url, 0, 1)
        [elsewhere] = clients_on_front(server.url, 1, 1)
        started = [threading.Event() for _ in streams]
        runners = [threading.Thread(target=lambda c=client, e=event: _swallow(
            lambda: stream_tokens(c, server.url, [5, 6], 600, e)))
            for client, event in zip(streams, started, strict=True)]
        try:
            for runner in runners:  # front 0's whole share, streaming
                runner.start()
            assert all(event.wait(20) for event in started)
            r = extra.post(f"{server.url}/v1/completions", json=body([1], 4, False))
            assert r.status_code == 429 and r.headers["Retry-After"] == "1"
            message = r.json()["error"]["message"]
            assert "3 of its 3 choices" in message and "2 fronts" in message, message
            # the core has a lane left, and front 1 its own share
            r = elsewhere.post(f"{server.url}/v1/completions", json=body([1], 4, False))
            assert r.status_code == 200
        finally:
            for runner in runners:
                runner.join(60)
            for client in [*streams, extra, elsewhere]:
                client.close()


@pytest.mark.parametrize(("flags", "message"), [
    (("--api-server-count", "0"), "--api-server-count 0 must be in 1..256"),
    (("--api-server-count", "100000"), "--api-server-count 100000 must be in 1..256"),
    (("--api-server-count", "2", "--engine-core", "inline"), "needs --engine-core process"),
    (("--api-server-count", "2", "--front-stall-timeout", "0"),
     "--front-stall-timeout 0 must be a positive number of seconds"),
    (("--api-server-count", "2", "--front-stall-timeout", "nan"),
     "--front-stall-timeout nan must be a positive number of seconds")])
def test_a_bad_front_count_is_refused_before_anything_starts(flags: tuple[str, ...],
                                                             message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "atombatch.serve", "--port", "0", *NULL, *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_hung_core_stops_the_server_and_leaves_nothing() -> None:
    """SIGSTOP the shared core mid-stream: a front with the stream in flight hears nothing for
    --core-hang-timeout seconds, kills the core (through its pidfd), and the launcher stops as
    when the core dies: the stream ends, exit status 1, no child left."""
    with launched(*NULL, "--core-hang-timeout", "1") as server:
        core_pid = httpx.get(f"{server.url}/v1/models").json()["data"][0]["atombatch"][
            "engine_core"]["pid"]
        children = server.children()
        started = threading.Event()
        with httpx.Client(timeout=60) as client:
            runner = threading.Thread(target=_swallow, args=(
                lambda: stream_tokens(client, server.url, [5, 6], 5000, started),))
            runner.start()
            assert started.wait(20)
            os.kill(core_pid, signal.SIGSTOP)
            stopped = time.monotonic()
            assert server.proc.wait(30) == 1
            assert time.monotonic() - stopped < 15
            runner.join(30)
            assert not runner.is_alive()
        lines = "".join(server.lines)
        assert "core.hung" in lines and "the engine core exited" in lines
        _none_outlive(children)


def stream_lines(client: httpx.Client, url: str, request: dict, lines: list[str]) -> None:
    """Every data line of a streamed completion (error events too), into `lines`."""
    with client.stream("POST", f"{url}/v1/completions", json=request) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])


def test_a_front_that_stops_reading_frees_its_lanes_for_the_other_front() -> None:
    """SIGSTOP a front holding 32 streamed choices (every lane, the rest queued: 200 s of work
    at 5 ms a step). Within --front-stall-timeout (2 s) the core aborts them, so a request
    through the other front is served at once; before, it waited until the core killed the
    stopped front (10 000 messages unread: ~50 s). The stopped front is not killed: SIGCONT, and
    its streams end with an error naming the stall, and it serves new requests."""
    with launched(*NULL, "--max-waiting", "60", "--front-stall-timeout", "2") as server:
        held = clients_on_front(server.url, 0, 4)
        stalled_pid = front_of(held[0], server.url)["front_pid"]
        lines: list[list[str]] = [[] for _ in held]
        request = {**body([8, 9], 5000), "n": 8}   # front 0's whole share: 32 choices
        runners = [threading.Thread(target=_swallow, args=(
            lambda c=client, got=got: stream_lines(c, server.url, request, got),))
            for client, got in zip(held, lines, strict=True)]
        for runner in runners:
            runner.start()
        try:
            wait_until(lambda: metric(server.url, "atombatch_occupied_lanes") == 4 and
                       metric(server.url, "atombatch_queue_length") == 28, timeout=20,
                       what="front 0's choices on every lane and queued")
            os.kill(stalled_pid, signal.SIGSTOP)
            # a new connection: front 0 cannot accept it
            with httpx.Client(timeout=30, limits=httpx.Limits(max_connections=1)) as fresh:
                assert front_of(fresh, server.url)["front"] == 1
                victim = stream_tokens(fresh, server.url, [3, 4], 12)
                assert len(victim) == 12
            # it got a lane because the stopped front's choices were aborted (each on a lane
            # counted; the choices held for their request's first prefill are not), and the
            # engine holds nothing of them any more
            assert metric(server.url, "atombatch_engine_requests_finished_total",
                          '{reason="abort"}') >= 4
            wait_until(lambda: metric(server.url, "atombatch_occupied_lanes") == 0 and
                       metric(server.url, "atombatch_queue_length") == 0, timeout=5,
                       what="the stopped front's choices still hold lanes or wait")
            assert running(stalled_pid)  # stopped, not killed
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stalled_pid, signal.SIGCONT)
        for runner in runners:
            runner.join(30)
            assert not runner.is_alive()
        for got in lines:  # each stream ended with the error that names the stall
            assert got[-1] == "[DONE]", got[-3:]
            assert "stopped reading" in json.loads(got[-2])["error"]["message"], got[-2]
        [again] = clients_on_front(server.url, 0, 1)  # the same process serves on
        assert front_of(again, server.url)["front_pid"] == stalled_pid
        assert stream_tokens(again, server.url, [3, 4], 12) == victim
        for client in [*held, again]:
            client.close()
        text = "".join(server.lines)
        assert text.count("core.front_stalled") == 1 and "core.front_stuck" not in text

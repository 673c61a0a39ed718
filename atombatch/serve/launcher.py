"""`python -m atombatch.serve --api-server-count N`: one engine core, N front processes.

The launcher (this process) owns the listening socket and the core's socket directory. It
starts the core (`run_shared_core`), waits until its engine is built (a `ConfigError` there
ends the launcher with status 2 and the core's message), then starts N fronts: each is the
ordinary server (`cli._serve`) on the inherited socket, connected to its own pair of the core's
endpoints (atombatch/core/shared.py). The kernel hands each new connection to whichever front
accepts it first, so a busy front takes fewer.

Supervision:

* A front that exits after it started listening is started again on the same index (the core
  aborted its requests when it exited; its clients see their connections close). More than
  `MAX_RESTARTS` restarts within `RESTART_WINDOW` seconds stop the server (status 1): a front
  that keeps dying is a bug, not bad luck. A front that exits before it listens stops the
  server with its status (a flag the fronts refuse, e.g. a bad --chat-template, is status 2).
* A front that stops reading (a stopped process, a hung event loop) for `--front-stall-timeout`
  seconds has its requests aborted by the core (atombatch/core/shared.py); it serves on when it
  reads again, and is killed (then started again) if it stays stopped until its queue is full.
* The core exiting stops the server (status 1): every front answers 503 and fails what it holds
  in flight, then exits; the launcher waits `FRONT_EXIT_TIMEOUT` for them, then kills them.
* SIGINT or SIGTERM stops the server gracefully (status 0): each front gets one SIGTERM (they
  run in their own process group, so a terminal's Ctrl-C reaches the launcher only), stops
  accepting, finishes its streams and leaves the core; then the core is stopped. A second
  signal kills the fronts.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from atombatch.core.messages import Failed, Ready, core_decoder
from atombatch.core.pd import PDOptions
from atombatch.core.process import SOCKET_DIR_PREFIX, run_shared_core
from atombatch.core.shared import SharedCore
from atombatch.engine.batcher import Batcher
from atombatch.errors import ConfigError

MAX_FRONTS = 256          # --api-server-count at most (each front is a process and a pair of sockets)
MAX_RESTARTS = 5          # front restarts allowed within RESTART_WINDOW seconds
RESTART_WINDOW = 60.0
FRONT_EXIT_TIMEOUT = 10.0  # seconds fronts get to exit after the core died
POLL_S = 0.5


def front_main(serve: Callable[..., int], args: argparse.Namespace, sock: socket.socket,
               shared: SharedCore, started: Any) -> None:
    """A front process: the ordinary server (`serve`, cli._serve) on the inherited socket, on a
    shared core."""
    from atombatch import logs

    os.setpgrp()  # a terminal's Ctrl-C goes to the launcher, which forwards one SIGTERM
    logs.setup(args.log_level, args.log_format)
    try:
        code = serve(args, sock, shared=shared, started=started)
    finally:
        sock.close()
    sys.exit(code)


class _Fronts:
    """The launcher's front processes, by index."""

    def __init__(self, serve: Callable[..., int], args: argparse.Namespace, sock: socket.socket,
                 directory: str, core_pid: int) -> None:
        self.serve = serve
        self.args, self.sock, self.directory, self.core_pid = args, sock, directory, core_pid
        self.spawn = multiprocessing.get_context("spawn")
        count = args.api_server_count
        self.processes: list[Any] = [None] * count
        self.started: list[Any] = [None] * count
        self.restarts: list[float] = []

    def start(self, front: int) -> None:
        shared = SharedCore(directory=self.directory, fronts=len(self.processes), front=front,
                            core_pid=self.core_pid)
        started = self.spawn.Event()
        process = self.spawn.Process(target=front_main, name=f"atombatch-front-{front}",
                                     args=(self.serve, self.args, self.sock, shared, started))
        process.start()
        self.processes[front], self.started[front] = process, started

    def alive(self) -> list[Any]:
        return [p for p in self.processes if p is not None and p.is_alive()]

    def may_restart(self) -> bool:
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW]
        if len(self.restarts) >= MAX_RESTARTS:
            return False
        self.restarts.append(now)
        return True

    def signal_all(self, signum: int) -> None:
        for process in self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signum)

    def join_all(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for process in self.processes:
            if process is None:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            process.join(left)


def launch(args: argparse.Namespace, sock: socket.socket, serve: Callable[..., int],
           factory: Callable[[], Batcher], pd: Callable[[], PDOptions | None],
           check: Callable[[], object]) -> int:
    """Run the core and `args.api_server_count` fronts on `sock` until stopped (module
    docstring); the exit status. `serve` runs one front (cli._serve), `factory` builds the
    core's engine, `pd` makes the core's PD options and `check` loads what a front would (the
    tokenizer, the chat template) so a bad flag is refused before the core is built; the last
    two raise `ConfigError`."""
    count = args.api_server_count
    if not 1 <= count <= MAX_FRONTS:
        print(f"atombatch.serve: --api-server-count {count} must be in 1..{MAX_FRONTS}",
              file=sys.stderr)
        return 2
    if args.engine_core != "process":
        print("atombatch.serve: --api-server-count > 1 needs --engine-core process (the fronts "
              "share one engine core process)", file=sys.stderr)
        return 2
    try:
        options = pd()
        check()
    except ConfigError as exc:
        print(f"atombatch.serve: {exc}", file=sys.stderr)
        return 2
    directory = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX)
    spawn = multiprocessing.get_context("spawn")
    report, report_child = spawn.Pipe(duplex=False)
    core = spawn.Process(target=run_shared_core, name="atombatch-core",
                         args=(factory, directory, count, os.getpid(), report_child, options,
                               args.front_stall_timeout))
    stop: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        stop.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    fronts: _Fronts | None = None
    try:
        core.start()
        report_child.close()
        message = _wait_ready(core, report, stop)
        if message is None:
            return 128 + stop[0] if stop else 2  # (a shell's status for that signal)
        assert core.pid is not None
        fronts = _Fronts(serve, args, sock, directory, core.pid)
        for front in range(count):
            fronts.start(front)
        return _supervise(core, fronts, stop)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if fronts is not None:
            fronts.signal_all(signal.SIGKILL)
            fronts.join_all(5)
        if core.is_alive():
            core.terminate()
            core.join(10)
            if core.is_alive():
                core.kill()
                core.join(5)
        shutil.rmtree(directory, ignore_errors=True)


def _wait_ready(core: Any, report: Any, stop: list[int]) -> Ready | None:
    """The core's Ready; None (after saying why) if it failed, exited or a signal came."""
    while not report.poll(0.1):
        if stop:
            return None
        if not core.is_alive():
            print(f"atombatch.serve: the engine core exited with code {core.exitcode} while "
                  "starting", file=sys.stderr)
            return None
    try:
        message = core_decoder.decode(report.recv_bytes())
    except EOFError:
        message = None
    if isinstance(message, Failed):
        print(f"atombatch.serve: {message.error}" if message.config else
              f"atombatch.serve: the engine core failed to start: {message.error}",
              file=sys.stderr)
        return None
    if not isinstance(message, Ready):
        print("atombatch.serve: the engine core exited while starting", file=sys.stderr)
        return None
    return message


def _supervise(core: Any, fronts: _Fronts, stop: list[int]) -> int:
    """Watch the core and the fronts until the server stops; its exit status."""
    while True:
        if stop:
            return _stop_gracefully(core, fronts, stop)
        sentinels = [core.sentinel] + [p.sentinel for p in fronts.processes]
        multiprocessing.connection.wait(sentinels, timeout=POLL_S)
        if stop:
            continue
        if not core.is_alive():
            print(f"atombatch.serve: the engine core exited (code {core.exitcode}); stopping",
                  file=sys.stderr, flush=True)
            fronts.join_all(FRONT_EXIT_TIMEOUT)  # each answers 503 meanwhile, then exits
            return 1
        for front, process in enumerate(fronts.processes):
            if process.is_alive():
                continue
            code = process.exitcode
            if not fronts.started[front].is_set():
                print(f"atombatch.serve: front {front + 1} exited with code {code} while "
                      "starting; stopping", file=sys.stderr, flush=True)
                fronts.signal_all(signal.SIGTERM)
                fronts.join_all(FRONT_EXIT_TIMEOUT)
                return code if code and code > 0 else 1
            if not fronts.may_restart():
                print(f"atombatch.serve: front {front + 1} exited with code {code}, more than "
                      f"{MAX_RESTARTS} restarts in {RESTART_WINDOW:g} s; stopping",
                      file=sys.stderr, flush=True)
                fronts.signal_all(signal.SIGTERM)
                fronts.join_all(FRONT_EXIT_TIMEOUT)
                return 1
            print(f"atombatch.serve: front {front + 1} exited with code {code}; starting it "
                  "again", file=sys.stderr, flush=True)
            fronts.start(front)


def _stop_gracefully(core: Any, fronts: _Fronts, stop: list[int]) -> int:
    """One SIGTERM to each front; wait for them (a second signal kills them). 0, or 1 when the
    core died meanwhile (the fronts failed what they were draining)."""
    seen = len(stop)
    fronts.signal_all(signal.SIGTERM)
    while fronts.alive():
        if len(stop) > seen:
            fronts.signal_all(signal.SIGKILL)
            break
        multiprocessing.connection.wait([p.sentinel for p in fronts.alive()], timeout=POLL_S)
    fronts.join_all(5)
    if not core.is_alive():
        print(f"atombatch.serve: the engine core exited (code {core.exitcode}) while the fronts "
              "drained", file=sys.stderr, flush=True)
        return 1
    return 0

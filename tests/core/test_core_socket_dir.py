"""The temporary directory of a `CoreClient`'s IPC sockets goes away however the client ends: a
clean close, a factory that fails, a spawn that fails, a core that dies, a client dropped or an
interpreter that exits without `close()`, a front killed outright (its core removes it). Each test
runs a real core process and finds the client's own directory by the pid it was made for."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from support.engines import failing_factory, numpy_batcher

from atombatch import ConfigError, SamplingParams
from atombatch.core import CoreClient
from atombatch.core import client as client_module

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every socket directory a client of this process makes (the real `mkdtemp`, recorded)."""
    paths: list[Path] = []
    mkdtemp = client_module.tempfile.mkdtemp

    def recorded(*args: Any, **kwargs: Any) -> str:
        path = mkdtemp(*args, **kwargs)
        paths.append(Path(path))
        return path

    monkeypatch.setattr(client_module.tempfile, "mkdtemp", recorded)
    return paths


def wait_gone(path: Path, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


async def test_a_clean_close_removes_it(made: list[Path]) -> None:
    async with CoreClient(functools.partial(numpy_batcher)) as client:
        (path,) = made
        assert path.is_dir() and path.name.startswith("atombatch-core-")
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        assert [o async for o in client.outputs(client.submit([5, 6], params))][-1].finished
    assert not path.exists()


def test_a_factory_that_fails_removes_it(made: list[Path]) -> None:
    client = CoreClient(functools.partial(failing_factory, "no engine today"))
    with pytest.raises(ConfigError, match="no engine today"):
        client.start_process()
    (path,) = made
    assert not path.exists()


def test_a_spawn_that_fails_removes_it(made: list[Path]) -> None:
    client = CoreClient(lambda: numpy_batcher())  # a lambda cannot be pickled for the child
    with pytest.raises(Exception, match="pickle"):
        client.start_process()
    (path,) = made
    assert not path.exists()


async def test_a_core_that_dies_removes_it_before_close(made: list[Path]) -> None:
    exited: list[int | None] = []
    client = CoreClient(functools.partial(numpy_batcher), on_core_exit=exited.append)
    async with client:
        (path,) = made
        request_id = client.submit([5, 6, 7], SamplingParams(max_tokens=120, ignore_eos=True))
        outputs = client.outputs(request_id)
        await outputs.__anext__()
        assert client.core_pid is not None
        os.kill(client.core_pid, signal.SIGKILL)
        assert [o async for o in outputs][-1].finish_reason == "error"
        assert exited and not path.exists()  # the front saw the death: gone before close()


def test_a_dropped_client_removes_it_and_stops_its_core(made: list[Path]) -> None:
    client = CoreClient(functools.partial(numpy_batcher))
    client.start_process()
    (path,) = made
    core = client._process
    # Never closed, garbage-collected (CPython: at once). Its ZeroMQ sockets warn as unclosed
    # files do (a dropped client is its owner's bug); the directory and the core must not stay.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        del client
        gc.collect()
    assert not path.exists()
    core.join(10)
    assert not core.is_alive()


FRONT = textwrap.dedent("""
    import functools, os, sys
    sys.path.insert(0, {tests!r})
    from support.engines import numpy_batcher
    from atombatch.core import CoreClient

    client = CoreClient(functools.partial(numpy_batcher))
    client.start_process()
    print(client._dir, client.core_pid, flush=True)
    {end}
""")


def run_front(end: str) -> tuple[subprocess.Popen[str], Path, int]:
    front = subprocess.Popen([sys.executable, "-c", FRONT.format(tests=str(TESTS), end=end)],
                             stdout=subprocess.PIPE, text=True)
    assert front.stdout is not None
    directory, pid = front.stdout.readline().split()
    return front, Path(directory), int(pid)


def test_an_interpreter_that_exits_without_close_removes_it() -> None:
    front, path, core_pid = run_front("")  # the script ends with the client still open
    try:
        assert front.wait(30) == 0  # and does not wait for the core forever
    finally:
        front.kill()
        front.stdout.close()  # type: ignore[union-attr]
    assert not path.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(core_pid, 0)


def test_a_killed_front_leaves_it_to_its_core() -> None:
    front, path, core_pid = run_front("import time; time.sleep(600)")
    try:
        assert path.is_dir()
        front.kill()
        front.wait(10)
        assert wait_gone(path), "the core left its killed front's socket directory behind"
    finally:
        front.kill()
        front.wait(10)
        front.stdout.close()  # type: ignore[union-attr]
        with contextlib.suppress(ProcessLookupError):
            os.kill(core_pid, signal.SIGKILL)

"""Attacks on the front's hang detection (`CoreClient(hang_timeout=)`): ways a hung core could
go unnoticed, or a healthy one be taken for hung. Real core processes, stopped with SIGSTOP
or slowed with the null device."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading
import time

from support.engines import numpy_batcher

from atombatch import SamplingParams
from atombatch.core import CoreClient

HANG = 1.0
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def kill_after(pid: int, seconds: float) -> threading.Event:
    """SIGKILL `pid` after `seconds` unless the event is set first: a test whose event loop is
    stuck for good fails (late) instead of hanging the suite."""
    cancel = threading.Event()

    def watchdog() -> None:
        if not cancel.wait(seconds):
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    threading.Thread(target=watchdog, daemon=True).start()
    return cancel


async def test_submits_to_a_stopped_core_do_not_freeze_the_front() -> None:
    """A stopped core takes nothing off its socket: past ZeroMQ's queue (1 000 messages) a send
    cannot go out. Waiting for room while the process lives held the event loop for good (the
    hang check never ran again); a send refused for `hang_timeout` seconds is the core's hang
    too: it is killed and what was in flight fails."""
    exited: list[int | None] = []
    client = CoreClient(functools.partial(numpy_batcher, max_waiting=None), hang_timeout=HANG,
                        on_core_exit=exited.append)
    await client.start()
    pid = client.core_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    watchdog = kill_after(pid, 20.0)
    started = time.monotonic()
    ids = [client.submit([5, 6, 7], SHORT) for _ in range(1500)]
    submitted = time.monotonic() - started
    watchdog.set()
    assert submitted < HANG + 5, f"the front's loop was held {submitted:.1f} s"
    for request_id in ids[-1000::100]:  # (the last 1 024 unclaimed are kept)
        outs = [out async for out in client.outputs(request_id)]
        assert outs[-1].finish_reason == "error" and "hung" in (outs[-1].error or "")
    assert exited == [-signal.SIGKILL]
    await client.close()
    await asyncio.sleep(0.2)
    assert gone(pid)

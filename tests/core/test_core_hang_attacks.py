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

import pytest
from support.engines import numpy_batcher, slow_prefill_batcher
from support.served import running
from support.structured import batcher as structured_batcher

from atombatch import SamplingParams
from atombatch.api.structured import StructuredOutput
from atombatch.core import CoreClient
from atombatch.errors import CapacityError, ConfigError, UnavailableError

HANG = 1.0
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)



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
    ids = []
    with pytest.raises(UnavailableError):  # once it is found hung, not running
        for _ in range(1500):
            ids.append(client.submit([5, 6, 7], SHORT))
    submitted = time.monotonic() - started
    watchdog.set()
    assert submitted < HANG + 5, f"the front's loop was held {submitted:.1f} s"
    for request_id in ids[-1000::100]:  # (the last 1 024 unclaimed are kept)
        outs = [out async for out in client.outputs(request_id)]
        assert outs[-1].finish_reason == "error" and "hung" in (outs[-1].error or "")
    assert exited == [-signal.SIGKILL]
    await client.close()
    await asyncio.sleep(0.2)
    assert not running(pid)


async def test_a_check_that_finds_messages_waiting_reads_them() -> None:
    """The core is silent in a 1.9 s prefill chunk (shorter than `hang_timeout`), and the check
    that follows two silent seconds runs after another callback of the same loop iteration held
    the loop past `hang_timeout`: the chunk's messages arrived meanwhile, unread. Asking the
    socket whether something waits (a ZeroMQ poll) consumed the descriptor's signal, so the
    reader never ran again: the stream stalled for good, the core alive, and no later check
    killed it (something always waited). The check reads instead."""
    client = CoreClient(functools.partial(slow_prefill_batcher, 1900.0, step_ms=50.0),
                        hang_timeout=3.0)
    check, seen, blocked = client._check_alive, [-1], []

    def check_after_a_stall() -> None:
        if not blocked and client._in_flight_choices and client._frames == seen[0]:
            blocked.append(True)  # nothing read since the last check: the core is in a chunk
            time.sleep(3.5)       # another callback holds the loop first (no select between)
        seen[0] = client._frames
        check()

    client._check_alive = check_after_a_stall  # type: ignore[method-assign]
    async with client:
        tokens: list[int] = []

        async def consume() -> str | None:
            async for out in client.stream(list(range(3, 99)), SHORT):
                tokens.extend(out.new_token_ids)
            return out.finish_reason

        reason = await asyncio.wait_for(consume(), 30)
        assert blocked and reason == "length" and len(tokens) == 4 and client.running


@pytest.mark.parametrize("overlap", [False, True])
async def test_a_decode_call_that_never_returns_is_found(overlap: bool) -> None:
    """Not a stopped process: the core runs, and its decode call (on the loop's thread, or on
    the pipeline's device thread while the loop waits to land it) never returns. The sender and
    receiver threads live on but have nothing to say: the core is silent, found, killed."""
    exited: list[int | None] = []
    client = CoreClient(functools.partial(slow_prefill_batcher, 1.0, step_ms=1e8,
                                          overlap=overlap),
                        hang_timeout=HANG, on_core_exit=exited.append)
    async with client:
        pid = client.core_pid
        assert pid is not None
        started = time.monotonic()
        outs = [out async for out in client.stream([5, 6, 7], SHORT)]
        waited = time.monotonic() - started
        assert outs[0].new_token_ids and outs[-1].finish_reason == "error"  # the first token
        assert "hung" in (outs[-1].error or "") and HANG <= waited < HANG + 5, waited
        assert exited == [-signal.SIGKILL]
    await asyncio.sleep(0.2)
    assert not running(pid)


async def test_an_idle_core_is_never_killed_after_refusals_aborts_and_groups() -> None:
    """The check counts silence only while choices are in flight: every way a request can end
    (a grammar the core fails to compile, an n > 1 group aborted twice, submits refused for
    capacity, requests aborted while queued) brings the count back to zero, so an idle core
    outlives `hang_timeout` several times over."""
    client = CoreClient(functools.partial(structured_batcher, max_waiting=2), hang_timeout=HANG)
    async with client:
        bad = client.submit([5, 6], SamplingParams(max_tokens=8,
                                                   structured=StructuredOutput.regex("a(")))
        last = [out async for out in client.outputs(bad)][-1]
        assert last.finish_reason == "error" and "regex" in (last.error or "")
        group = client.submit([5, 6], SamplingParams(max_tokens=50, n=3, ignore_eos=True))
        stream = client.outputs(group)
        await stream.__anext__()
        client.abort(group)
        client.abort(group)
        assert [out async for out in stream][-1].finish_reason == "abort"
        ids = []
        with pytest.raises(CapacityError):
            for _ in range(20):
                ids.append(client.submit([5, 6], SamplingParams(max_tokens=50, ignore_eos=True)))
        assert len(ids) == 4 + 2  # lanes + max_waiting
        for request_id in ids:
            client.abort(request_id)
        for request_id in ids:
            assert [out async for out in client.outputs(request_id)][-1].finished
        assert client._in_flight_choices == 0
        await asyncio.sleep(3 * HANG + 0.5)
        assert client.running


def test_sigterm_to_a_server_whose_core_hangs_exits_within_the_timeout() -> None:
    """uvicorn waits for open streams on SIGTERM (no graceful timeout): a stream on a hung core
    would hold the shutdown for good, but the check runs on during it, so the stream ends with
    the error and the server exits, its core gone, about `--core-hang-timeout` after."""
    import httpx
    from support.served import served

    with served("--runtime", "null", "--null-step-ms", "20", "--batch-size", "2",
                "--core-hang-timeout", "2") as (url, pid):
        core_pid = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0][
            "atombatch"]["engine_core"]["pid"]
        body = {"prompt": [5, 6], "max_tokens": 900, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as doomed:
            lines = doomed.iter_lines()
            next(lines)
            os.kill(core_pid, signal.SIGSTOP)
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # not yet found
            os.kill(pid, signal.SIGTERM)
            stopped = time.monotonic()
            rest = "\n".join(lines)
        assert "hung" in rest and '"code":"engine_unavailable"' in rest
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            assert time.monotonic() - stopped < 2 + 10, "the server did not exit"
            time.sleep(0.1)
        assert not running(core_pid)


@pytest.mark.parametrize("overlap", [False, True])
async def test_chunks_shorter_than_the_timeout_are_never_taken_for_hung(overlap: bool) -> None:
    """Every device call (a 400-token prompt's chunks, a companion's decode steps; with
    `overlap`, decodes pipelined on the device thread and chunks planned ahead) takes 400 ms,
    well under `hang_timeout` = 1 s: a healthy core. Its heartbeat went out at the first step
    at least a second after the last (every 1.2 s here), and the check counted silence from
    the check that last heard it: one check interval without a message (bound to come) killed
    it. The heartbeat now goes out every quarter second, and silence counts from the last
    message read."""
    client = CoreClient(functools.partial(slow_prefill_batcher, 400.0, step_ms=400.0,
                                          overlap=overlap), hang_timeout=HANG)
    async with client:
        long = client.submit([3 + i % 250 for i in range(400)], SHORT)
        companion = client.submit([5, 6], SamplingParams(temperature=0, max_tokens=6,
                                                         ignore_eos=True))
        for request_id in (long, companion):
            outs = [out async for out in client.outputs(request_id)]
            assert outs[-1].finish_reason == "length", outs[-1].error
        assert client.running
        if overlap:
            assert client.stats().overlapped_steps > 0


@pytest.mark.parametrize("value", [True, "5", None])
def test_hang_timeout_must_be_a_number(value: object) -> None:
    """`True` was taken for one second, and a string or None raised a bare TypeError."""
    with pytest.raises(ConfigError, match="hang_timeout"):
        CoreClient(functools.partial(numpy_batcher), hang_timeout=value)  # type: ignore[arg-type]


async def test_a_core_paused_for_less_than_the_timeout_carries_on() -> None:
    """SIGSTOP, then SIGCONT 1 s later with `hang_timeout` = 2 s: the silence stays under the
    timeout, so nothing is killed, and the stream's tokens are those of a run never paused."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    async with CoreClient(functools.partial(numpy_batcher), hang_timeout=2.0) as client:
        want = [t async for out in client.stream([5, 6, 7], params) for t in out.new_token_ids]
        pid = client.core_pid
        assert pid is not None
        got: list[int] = []
        started = time.monotonic()
        async for out in client.stream([5, 6, 7], params):
            if not got:
                os.kill(pid, signal.SIGSTOP)
                asyncio.get_running_loop().call_later(1.0, os.kill, pid, signal.SIGCONT)
            got.extend(out.new_token_ids)
        assert time.monotonic() - started > 1.0  # it was paused mid-stream
        assert got == want and len(got) == 60 and client.running

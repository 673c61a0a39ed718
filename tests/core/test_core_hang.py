"""A hung engine core (alive, but sending nothing: a device call that never returns, a stopped
process) is found by its front within `hang_timeout` (`CoreClient`, the server's
--core-hang-timeout): it is killed and its requests end with an error, as when a core dies,
and `close()` does not wait for it forever. Real core processes, stopped with SIGSTOP."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import time

import pytest
from support.engines import numpy_batcher, slow_prefill_batcher
from support.served import running

from atombatch import SamplingParams
from atombatch.core import CoreClient
from atombatch.errors import ConfigError

HANG = 1.0
LONG = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)



async def test_a_core_that_stops_answering_is_killed_and_its_requests_fail() -> None:
    exited: list[int | None] = []
    client = CoreClient(functools.partial(numpy_batcher), hang_timeout=HANG,
                        on_core_exit=exited.append)
    async with client:
        streams = [client.outputs(client.submit(p, LONG)) for p in ([5, 6, 7], [8, 9])]
        for stream in streams:
            assert (await stream.__anext__()).new_token_ids  # both run
        pid = client.core_pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        for stream in streams:
            rest = [out async for out in stream]
            assert rest[-1].finished and rest[-1].finish_reason == "error"
            assert "hung" in (rest[-1].error or "") and f"{HANG:g} s" in (rest[-1].error or "")
        waited = time.monotonic() - stopped
        # found after HANG s of silence, checked every second: well inside HANG + 5 s
        assert HANG <= waited < HANG + 5, waited
        assert exited == [-signal.SIGKILL] and not client.running
        await asyncio.sleep(0.2)
        assert not running(pid)


async def test_a_core_that_keeps_stepping_is_not_hung() -> None:
    """Decode steps far longer in all than `hang_timeout`: every step is heard, so nothing is
    killed (the silence, not the age of a request, is what counts)."""
    client = CoreClient(functools.partial(numpy_batcher), hang_timeout=0.3)
    async with client:
        started = time.monotonic()
        tokens: list[int] = []
        async for out in client.stream([5, 6, 7], LONG):
            tokens.extend(out.new_token_ids)
            await asyncio.sleep(0.01)  # a slow reader: the request lives well past 0.3 s
        assert len(tokens) == 120 and time.monotonic() - started > 1.0
        assert client.running


async def test_a_long_prompt_whose_chunks_send_nothing_is_not_hung() -> None:
    """A 1 600-token prompt in 32-token chunks of 60 ms each: 3 s without an output, three
    times `hang_timeout`; the core's heartbeats between the chunks keep it alive."""
    client = CoreClient(functools.partial(slow_prefill_batcher, 60.0), hang_timeout=1.0)
    async with client:
        started = time.monotonic()
        tokens: list[int] = []
        reason = None
        async for out in client.stream([3 + i % 250 for i in range(1600)], SamplingParams(
                temperature=0, max_tokens=4, ignore_eos=True)):
            tokens.extend(out.new_token_ids)
            reason = out.finish_reason or reason
        assert len(tokens) == 4 and reason == "length"
        assert time.monotonic() - started > 2.5 and client.running


@pytest.mark.parametrize("drain", [True, False])
async def test_close_does_not_wait_forever_for_a_stopped_core(drain: bool) -> None:
    client = CoreClient(functools.partial(numpy_batcher), hang_timeout=HANG)
    await client.start()
    stream = client.outputs(client.submit([5, 6, 7], LONG))
    assert (await stream.__anext__()).new_token_ids
    pid = client.core_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    await asyncio.wait_for(client.close(drain=drain), HANG + 10)
    assert time.monotonic() - started < HANG + 5
    rest = [out async for out in stream]
    assert rest[-1].finish_reason == "error" and "stopped answering" in (rest[-1].error or "")
    await asyncio.sleep(0.2)
    assert not running(pid)


async def test_close_of_an_idle_stopped_core_returns() -> None:
    client = CoreClient(functools.partial(numpy_batcher), hang_timeout=HANG)
    await client.start()
    pid = client.core_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    await asyncio.wait_for(client.close(), HANG + 10)
    await asyncio.sleep(0.2)
    assert not running(pid)


@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_hang_timeout_must_be_positive(value: float) -> None:
    with pytest.raises(ConfigError, match="hang_timeout"):
        CoreClient(functools.partial(numpy_batcher), hang_timeout=value)


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_the_server_refuses_a_hang_timeout_that_is_not_positive(value: str) -> None:
    done = subprocess.run([sys.executable, "-m", "atombatch.serve", "--runtime", "null",
                           "--port", "0", "--core-hang-timeout", value],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--core-hang-timeout" in done.stderr and "must be a positive number" in done.stderr

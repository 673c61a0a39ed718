"""`CoreClient` reads the core's socket in its event loop (a reader on ZeroMQ's edge-triggered
descriptor and one on the process sentinel). Here the core side is a real ZeroMQ socket this
test writes to, and the process a stand-in whose sentinel the test makes readable: the order in
which a core's last messages and its exit reach the front is then the test's to choose. The
last test runs a real core."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from support.engines import numpy_batcher

from atombatch import SamplingParams
from atombatch.api.structs import RequestOutput
from atombatch.core import CoreClient
from atombatch.core.client import READ_BATCH
from atombatch.core.messages import Step, Stopped, core_encoder
from atombatch.errors import UnavailableError


class _ExitedProcess:
    """What the client asks of its core process, for a process the test ends by closing a pipe."""

    def __init__(self, code: int) -> None:
        self.sentinel, self._end = os.pipe()
        self.exitcode = code
        self.pid = -1

    def exit(self) -> None:
        os.close(self._end)          # the sentinel turns readable, as a process's does at exit

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        pass

    def close_fds(self) -> None:
        for fd in (self.sentinel, self._end):
            with contextlib.suppress(OSError):
                os.close(fd)


class Front:
    def __init__(self, tmp_path: Path, exited: list[int | None]) -> None:
        self.client = CoreClient(functools.partial(numpy_batcher), on_core_exit=exited.append)
        address = f"ipc://{tmp_path}/out"
        client = self.client
        client._ctx = zmq.Context()
        client._from_core = client._ctx.socket(zmq.PULL)
        client._from_core.bind(address)
        client.ready = object()  # type: ignore[assignment]  # (start() spawns nothing then)
        self.process = _ExitedProcess(code=3)
        client._process = self.process
        self.ctx = zmq.Context()
        self.core = self.ctx.socket(zmq.PUSH)
        self.core.connect(address)

    def send(self, message: Any) -> None:
        self.core.send(core_encoder.encode(message))

    def open(self, request_id: str) -> AsyncIterator[RequestOutput]:
        self.client._open(request_id)
        self.client._choices[request_id] = 1
        self.client._in_flight_choices += 1
        return self.client.outputs(request_id)

    def close(self) -> None:
        self.client._cleanup()
        self.core.close(linger=0)
        self.ctx.term()
        self.process.close_fds()


def finished(request_id: str, token: int) -> Step:
    return Step(ids=[], tokens=b"", outputs=[RequestOutput(
        request_id=request_id, new_token_ids=(token,), finished=True, finish_reason="length")])


async def test_what_the_core_sent_before_it_exited_is_delivered_even_when_it_lands_after(
        tmp_path: Path) -> None:
    exited: list[int | None] = []
    front = Front(tmp_path, exited)
    try:
        await front.client.start()
        outputs = front.open("r")
        front.process.exit()             # the exit is seen first ...
        await asyncio.sleep(0.02)
        front.send(finished("r", 7))     # ... the core's last Step lands just after it
        outs = [out async for out in outputs]
        assert [(o.new_token_ids, o.finish_reason) for o in outs] == [((7,), "length")]
        await asyncio.sleep(0.5)
        assert exited == [3] and front.client.dead   # then the exit counts: it was not asked
    finally:
        front.close()


async def test_a_stopped_core_whose_last_message_lands_after_its_exit_did_not_crash(
        tmp_path: Path) -> None:
    exited: list[int | None] = []
    front = Front(tmp_path, exited)
    try:
        await front.client.start()
        front.client._closing = True      # close() sent Shutdown
        front.process.exit()
        await asyncio.sleep(0.02)
        front.send(Stopped())
        await asyncio.sleep(0.5)
        assert front.client._stopped and not front.client.dead and exited == []
    finally:
        front.close()


async def test_more_messages_than_one_read_takes_all_arrive(tmp_path: Path) -> None:
    """The descriptor signals an edge once; past READ_BATCH the client must read on without it."""
    front = Front(tmp_path, [])
    try:
        outputs = front.open("r")
        count = 3 * READ_BATCH + 5
        for token in range(count):
            front.send(Step(ids=["r"], tokens=np.array([token], np.int64).tobytes(), outputs=[]))
        front.send(finished("r", count))
        await asyncio.sleep(0.2)         # all of it queued before the reader exists
        await front.client.start()
        tokens = [t async for out in outputs for t in out.new_token_ids]
        assert tokens == list(range(count + 1))
    finally:
        front.close()


async def test_a_closed_client_cannot_start_again() -> None:
    client = CoreClient(functools.partial(numpy_batcher))
    async with client:
        outs = [o async for o in client.stream([5, 6, 7], SamplingParams(max_tokens=2))]
        assert outs[-1].finished
    with pytest.raises(UnavailableError, match="closed"):
        await client.start()
    assert not client.running


async def test_a_message_that_fails_to_be_handled_does_not_strand_the_ones_behind_it(
        tmp_path: Path) -> None:
    front = Front(tmp_path, [])
    try:
        await front.client.start()
        outputs = front.open("r")
        front.core.send(b"\xc1 no message the core sends")   # a core bug
        front.send(Step(ids=["r"], tokens=b"", outputs=[]))    # ids without their tokens
        front.send(finished("r", 9))
        outs = await asyncio.wait_for(_all(outputs), 5)
        assert [(o.new_token_ids, o.finish_reason) for o in outs] == [((9,), "length")]
        assert front.client.running
    finally:
        front.close()


async def _all(outputs: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [out async for out in outputs]


def test_a_client_whose_loop_closed_says_so_and_starts_again_in_the_next() -> None:
    """The readers live in the loop `start` ran in: once it closed, nothing reads the core."""
    client = CoreClient(functools.partial(numpy_batcher))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    async def first() -> None:
        await client.start()
        outs = [o async for o in client.stream([5, 6, 7], params)]
        assert outs[-1].finish_reason == "length"

    async def refused() -> None:
        with pytest.raises(UnavailableError, match="not running"):
            client.submit([5, 6, 7], params)

    async def again() -> list[int]:
        await client.start()
        tokens = [t async for o in client.stream([5, 6, 7], params) for t in o.new_token_ids]
        await client.close()
        return tokens

    try:
        asyncio.run(first())
        asyncio.run(refused())               # not a request sent to a core nobody reads
        tokens = asyncio.run(asyncio.wait_for(again(), 30))
        [alone] = numpy_batcher().generate([[5, 6, 7]], params)
        assert tokens == list(alone.token_ids)
    finally:
        client._kill()


def test_a_client_whose_loop_closed_can_still_be_closed_in_the_next() -> None:
    client = CoreClient(functools.partial(numpy_batcher))
    try:
        asyncio.run(client.start())
        asyncio.run(asyncio.wait_for(client.close(), 30))   # it used to wait for Stopped forever
        assert client._stopped
    finally:
        client._kill()

"""The ingress's race between a replica's response stream and the client's disconnect
(`atombatch.serve.ray.ingress._race`): whichever way it ends, no step is left behind whose error
asyncio prints as "Task exception was never retrieved" (seen once per request behind Ray Serve,
which cancels the request's task when the client closes)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from typing import Any

import pytest

from atombatch.serve.ray.ingress import _race


class Stream:
    """A replica's response: `parts`, then a wait that ends as Ray ends a cancelled request."""

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = list(parts)
        self.steps = 0
        self.upstream_cancelled = asyncio.Event()  # Ray cancelling the replica's request

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> bytes:
        self.steps += 1
        if self.parts:
            return self.parts.pop(0)
        with contextlib.suppress(asyncio.CancelledError):  # ours, or Ray's own end
            await self.upstream_cancelled.wait()
        raise RuntimeError("Request was cancelled.")  # Ray's RequestCancelledError


async def unretrieved(body: Any) -> list[dict[str, Any]]:
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: seen.append(context))
    try:
        await body()
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    return [c["message"] for c in seen if "never retrieved" in c.get("message", "") or
            "destroyed but it is pending" in c.get("message", "")]


async def test_a_cancelled_request_leaves_no_unretrieved_step() -> None:
    async def body() -> None:
        watcher = asyncio.get_running_loop().create_future()
        got: list[bytes] = []
        stream = Stream([b"a", b"b"])

        async def consume() -> None:
            async for part in _race(stream, watcher):
                got.append(part)

        task = asyncio.ensure_future(consume())
        while len(got) < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)  # the third step waits for the replica
        task.cancel()  # what Ray Serve does when the client closes ...
        with pytest.raises(asyncio.CancelledError):
            await task
        stream.upstream_cancelled.set()  # ... and then the replica's request ends in an error
        assert got == [b"a", b"b"]

    assert await unretrieved(body) == []


async def test_a_disconnect_ends_the_race_and_cancels_the_step() -> None:
    stream = Stream([b"a"])

    async def body() -> None:
        watcher = asyncio.get_running_loop().create_future()
        got = []
        async for part in _race(stream, watcher):
            got.append(part)
            watcher.set_result(None)  # the client went away after the first part
        assert got == [b"a"] and stream.steps == 2

    assert await unretrieved(body) == []

"""The engine core in its own process (`atombatch.core`): the same outputs as the in-process
engine, aborts and capacity at the front, and what happens when either side dies. Every test
runs a real core process (spawned) over real ZeroMQ IPC."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from support.engines import numpy_batcher

from atombatch import CapacityError, ConfigError, RequestError, SamplingParams
from atombatch.core import CoreClient
from atombatch.errors import UnavailableError

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [3] * 17, list(range(100, 163)), [9, 9, 1]]


def reference(params_list: list[SamplingParams]) -> list[list[int]]:
    """Each request run alone in-process: the independent reference."""
    out = []
    for prompt, params in zip(PROMPTS, params_list, strict=True):
        [done] = numpy_batcher().generate([prompt], params)
        out.append(list(done.token_ids))
    return out


async def collect(client: CoreClient, prompt: list[int], params: SamplingParams
                  ) -> tuple[dict[int, list[int]], dict[int, str | None]]:
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str | None] = {}
    async for out in client.stream(prompt, params):
        tokens.setdefault(out.index, []).extend(out.new_token_ids)
        if out.finish_reason is not None:
            reasons[out.index] = out.finish_reason
    return tokens, reasons


async def test_core_outputs_equal_each_request_run_alone() -> None:
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=33, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=7, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    want = reference(params)
    async with CoreClient(functools.partial(numpy_batcher)) as client:
        assert client.core_pid is not None and client.core_pid != os.getpid()
        results = await asyncio.gather(*(collect(client, p, s)
                                         for p, s in zip(PROMPTS, params, strict=True)))
        assert [tokens[0] for tokens, _ in results] == want
        assert all(reasons == {0: "length"} for _, reasons in results)
        # n > 1 fans out in the core; each choice streams under the request's id
        tokens, reasons = await collect(client, PROMPTS[0], SamplingParams(
            n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True))
        assert sorted(tokens) == [0, 1, 2] and all(len(t) == 6 for t in tokens.values())
        await asyncio.sleep(0.1)   # the stats ride on the next steps
        stats = client.stats()
        assert stats.finished.get("length", 0) >= 8 and stats.occupied_lanes == 0


async def test_the_core_freezes_its_startup_heap_out_of_the_collectors_scans() -> None:
    """A full collection of the startup heap holds the interpreter lock for tens of
    milliseconds, which the device thread would wait out: the core freezes what it built
    before its loop runs, and its `Ready` says how much (`freeze_heap`)."""
    async with CoreClient(functools.partial(numpy_batcher)) as client:
        assert client.ready is not None
        assert client.ready.frozen > 10_000  # numpy, zmq, msgspec, the engine: tens of thousands
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        assert len((await client.generate([4, 5], params)).token_ids) == 5


async def test_front_validates_and_bounds_before_the_core_sees_anything() -> None:
    async with CoreClient(functools.partial(numpy_batcher, max_waiting=2)) as client:
        with pytest.raises(RequestError, match="vocabulary 0..255"):
            client.submit([1, 999], SamplingParams(max_tokens=2))
        with pytest.raises(RequestError, match="exceeds max_seq_len=128"):
            client.submit([1] * 100, SamplingParams(max_tokens=29))
        with pytest.raises(RequestError, match="needs a tokenizer"):
            client.submit([1, 2], SamplingParams(max_tokens=2, stop=["x"]))
        long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        ids = [client.submit([4, 5], long) for _ in range(6)]   # 4 lanes + max_waiting 2
        with pytest.raises(CapacityError, match="max_waiting=2"):
            client.submit([4, 5], long)
        for request_id in ids:
            client.abort(request_id)
        for request_id in ids:
            outs = [out async for out in client.outputs(request_id)]
            assert outs[-1].finished and outs[-1].finish_reason == "abort"
        # the capacity is back once they ended
        [done] = [await client.generate([4, 5], SamplingParams(temperature=0, max_tokens=3))]
        assert len(done.token_ids) == 3
    with pytest.raises(UnavailableError):
        client.submit([1], SamplingParams(max_tokens=1))


async def test_leaving_a_stream_early_aborts_it_in_the_core() -> None:
    async with CoreClient(functools.partial(numpy_batcher)) as client:
        params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
        got = 0
        async for out in client.stream([7, 8, 9], params):
            got += len(out.new_token_ids)
            if got >= 3:
                break
        for _ in range(100):
            await asyncio.sleep(0.02)
            stats = client.stats()
            if stats.finished.get("abort") == 1 and stats.occupied_lanes == 0:
                break
        assert client.stats().finished.get("abort") == 1
        assert client.stats().occupied_lanes == 0 and client.stats().lane_blocks == 0


def test_a_factory_config_error_is_raised_at_start() -> None:
    from support.engines import failing_factory

    client = CoreClient(functools.partial(failing_factory, "--max-seq-len 9 breaks rule X"))
    with pytest.raises(ConfigError, match="breaks rule X"):
        client.start_process()


def test_a_config_error_that_arrives_after_the_exit_is_seen_is_still_the_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The core sends `Failed` and exits at once; the front can see the exit before its ZeroMQ
    thread has the message (it answered "exited with code 0 while starting" once under load).
    Here the front's socket shows nothing while the core lives and for 0.3 s after its exit was
    first seen, as when the message is still in transit."""
    import zmq
    from support.engines import failing_factory

    client = CoreClient(functools.partial(failing_factory, "--max-seq-len 9 breaks rule X"))
    real_poll = zmq.Socket.poll
    exit_seen: list[float] = []

    def late_poll(self: zmq.Socket, timeout: int | None = None, flags: int = zmq.POLLIN) -> int:
        process = client._process
        if self is not client._from_core or process is None:
            return real_poll(self, timeout, flags)
        wait = (timeout or 0) / 1000
        if process.is_alive():
            time.sleep(wait)
            return 0
        if not exit_seen:
            exit_seen.append(time.monotonic())
        hidden = exit_seen[0] + 0.3 - time.monotonic()
        if hidden >= wait:
            time.sleep(wait)
            return 0
        time.sleep(max(hidden, 0.0))
        return real_poll(self, int(1000 * (wait - max(hidden, 0.0))), flags)

    monkeypatch.setattr(zmq.Socket, "poll", late_poll)
    with pytest.raises(ConfigError, match="breaks rule X"):
        client.start_process()
    assert exit_seen


async def test_a_core_that_dies_fails_its_requests_and_stops_taking_new_ones() -> None:
    exited: list[int | None] = []
    client = CoreClient(functools.partial(numpy_batcher), on_core_exit=exited.append)
    async with client:
        params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
        request_id = client.submit([5, 6, 7], params)
        outputs = client.outputs(request_id)
        first = await outputs.__anext__()
        assert first.new_token_ids
        assert client.core_pid is not None
        os.kill(client.core_pid, signal.SIGKILL)
        rest = [out async for out in outputs]
        assert rest[-1].finished and rest[-1].finish_reason == "error"
        assert "engine core exited" in (rest[-1].error or "")
        assert not client.running and exited == [-signal.SIGKILL]
        with pytest.raises(UnavailableError, match="exited"):
            client.submit([1, 2], params)


FRONT = textwrap.dedent("""
    import asyncio, functools, sys
    sys.path.insert(0, {tests!r})
    from support.engines import numpy_batcher
    from atombatch import SamplingParams
    from atombatch.core import CoreClient

    async def main():
        client = CoreClient(functools.partial(numpy_batcher))
        await client.start()
        client.submit([5, 6, 7], SamplingParams(max_tokens=120, ignore_eos=True))
        print("core", client.core_pid, flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
""")


def test_a_front_that_dies_takes_its_core_down() -> None:
    tests = os.path.dirname(os.path.dirname(__file__))
    front = subprocess.Popen([sys.executable, "-c", FRONT.format(tests=tests)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert front.stdout is not None
        core_pid = int(front.stdout.readline().split()[-1])
        os.kill(core_pid, 0)            # the core runs
        front.kill()
        front.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(core_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(core_pid, signal.SIGKILL)
            pytest.fail("the core outlived its front by 10 s")
    finally:
        front.kill()
        front.wait(10)
        if front.stdout is not None:
            front.stdout.close()


async def test_concurrent_starts_spawn_one_core() -> None:
    client = CoreClient(functools.partial(numpy_batcher))
    before = set(_children())
    try:
        await asyncio.gather(client.start(), client.start(), asyncio.to_thread(
            client.start_process))
        spawned = set(_children()) - before
        cores = [pid for pid in spawned if "spawn_main" in _cmdline(pid)]  # (not ps itself)
        assert cores == [client.core_pid], [(pid, _cmdline(pid)) for pid in cores]
        [out] = [o async for o in client.stream([5, 6, 7], SamplingParams(
            temperature=0, max_tokens=3, ignore_eos=True))][-1:]
        assert out.finished
    finally:
        await client.close()


def _children() -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(os.getpid())], capture_output=True,
                         text=True)
    return [int(p) for p in out.stdout.split()]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().decode(errors="replace")
    except OSError:
        return ""

"""A core shared by several fronts (atombatch/core/shared.py): the loop of `run_shared_core` on a
thread over real ZeroMQ sockets and the NumPy runtime, with the test playing two fronts. Each
front gets its own requests' tokens and nothing else, one front cannot abort or shadow another's
request, a front that exits has its requests aborted while the other's finish, and a front that
leaves gets `Stopped` when its own requests are done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from support.engines import ART, numpy_batcher
from support.engines import submit_message as submit

from atombatch import ArtifactConfig, Batcher, SamplingParams
from atombatch.api.structs import RequestOutput
from atombatch.core.messages import (
    Abort,
    Consumed,
    Hello,
    Ready,
    Shutdown,
    Step,
    Stopped,
    core_decoder,
    front_encoder,
)
from atombatch.core.process import FRONT_QUEUE, CoreLoop, _Sender
from atombatch.core.shared import (
    ACK_EVERY,
    ACK_INTERVAL,
    FRONT_STALL_SECONDS,
    STALL_WINDOW,
    endpoints,
    split_step,
)
from atombatch.engine.batcher import EngineStats
from atombatch.runtime.null import NullRuntime

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)  # (contexts of 128)


class Front:
    """The two sockets of one front. It tells the core what it read (`Consumed`) as CoreClient
    does (every ACK_EVERY messages, or on a read ACK_INTERVAL after the last time)."""

    def __init__(self, ctx: Any, directory: str, front: int, queue: int | None = None) -> None:
        to_core, from_core = endpoints(directory, front)
        self.front = front
        self.to_core, self.from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        if queue is not None:  # what this side buffers unread (ZeroMQ's queue, the kernel's)
            self.from_core.setsockopt(zmq.RCVHWM, queue)
            self.from_core.setsockopt(zmq.RCVBUF, 4096)
        self.to_core.connect(to_core)
        self.from_core.connect(from_core)
        self.tokens: dict[str, list[int]] = {}
        self.done: dict[str, RequestOutput] = {}
        self.stopped = False
        self.count = 0                  # messages read since Ready
        self.acked, self.acked_at = 0, 0.0

    def send(self, message: Any) -> None:
        self.to_core.send(front_encoder.encode(message))

    def hello(self, pid: int) -> Ready:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            self.send(Hello(front=self.front, pid=pid))
            if self.from_core.poll(200):
                message = core_decoder.decode(self.from_core.recv())
                if isinstance(message, Ready):
                    return message
        raise AssertionError("no Ready")

    def read(self, until: set[str], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not until <= self.done.keys():
            assert time.monotonic() < deadline, f"front {self.front} waits for " \
                                                f"{until - self.done.keys()}"
            if self.from_core.poll(100):
                self.take(core_decoder.decode(self.from_core.recv()))

    def take(self, message: Any) -> None:
        self.count += 1
        now = time.monotonic()
        if self.count - self.acked >= ACK_EVERY or now - self.acked_at >= ACK_INTERVAL:
            self.acked, self.acked_at = self.count, now
            self.send(Consumed(self.count))
        if isinstance(message, Stopped):
            self.stopped = True
            return
        assert isinstance(message, Step)
        for request_id, token in zip(message.ids, np.frombuffer(message.tokens, np.int64),
                                     strict=True):
            self.tokens.setdefault(request_id, []).append(int(token))
        for out in message.outputs:
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                self.done[out.request_id] = out

    def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.from_core.poll(10):
                self.take(core_decoder.decode(self.from_core.recv()))


class SharedCore:
    """`run_shared_core`'s loop on a thread, bound where two fronts connect."""

    def __init__(self, directory: Path, fronts: int = 2, batcher: Batcher | None = None,
                 queue: int = FRONT_QUEUE, stall_after: float = FRONT_STALL_SECONDS) -> None:
        self.ctx = zmq.Context()
        self.inboxes, self.outboxes = [], []
        for front in range(fronts):
            to_core, from_core = endpoints(str(directory), front)
            inbox, outbox = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PUSH)
            outbox.setsockopt(zmq.SNDHWM, queue)  # as run_shared_core's
            if queue < FRONT_QUEUE:
                outbox.setsockopt(zmq.SNDBUF, 4096)
            inbox.bind(to_core)
            outbox.bind(from_core)
            self.inboxes.append(inbox)
            self.outboxes.append(outbox)
        self.routes: dict[str, int] = {}
        pids: dict[int, int] = {}
        self.sender = _Sender(self.outboxes, self.routes, pids)
        self.loop = CoreLoop(batcher or numpy_batcher(), self.inboxes, self.sender, os.getppid(),
                             routes=self.routes, front_pids=pids, stall_after=stall_after)
        self.runner = threading.Thread(target=self.loop.run, daemon=True)
        self.runner.start()
        small = queue if queue < FRONT_QUEUE else None
        self.fronts = [Front(self.ctx, str(directory), front, small) for front in range(fronts)]

    def close(self) -> None:
        self.loop.parent_pid = -1
        self.runner.join(10)
        self.sender.close()
        for front in self.fronts:
            front.to_core.close(linger=0)
            front.from_core.close(linger=0)
        for sock in self.inboxes + self.outboxes:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[SharedCore]:
    core = SharedCore(tmp_path)
    try:
        yield core
    finally:
        core.close()


def alone(prompt: list[int], params: SamplingParams) -> list[int]:
    [out] = numpy_batcher().generate([prompt], params)
    return list(out.token_ids)


def test_each_front_gets_its_own_tokens_and_cannot_touch_the_others(shared: SharedCore) -> None:
    a, b = shared.fronts
    assert a.hello(os.getpid()).rules == b.hello(os.getpid()).rules
    a.send(submit("x", [5, 6, 7], LONG))
    a.send(submit("a2", [9, 9, 1], LONG))
    b.send(submit("b1", [3, 1, 4, 1], GREEDY))
    deadline = time.monotonic() + 10
    while not a.tokens.get("x"):  # x is running
        assert time.monotonic() < deadline
        a.drain(0.01)
    b.send(submit("x", [8, 8], GREEDY))  # front a's id, still in flight: refused for b only
    b.send(Abort(["x", "a2"]))          # not b's requests: nothing happens to them
    a.read({"x", "a2"})
    b.read({"b1", "x"})
    assert b.done["x"].finish_reason == "error" and "already in flight" in (b.done["x"].error or "")
    assert a.done["x"].finish_reason == a.done["a2"].finish_reason == "length"
    assert b.done["b1"].finish_reason == "length"
    assert a.tokens["x"] == alone([5, 6, 7], LONG)
    assert a.tokens["a2"] == alone([9, 9, 1], LONG)
    assert b.tokens["b1"] == alone([3, 1, 4, 1], GREEDY)
    assert set(a.tokens) == {"x", "a2"} and set(b.tokens) == {"b1", "x"}
    assert b.tokens["x"] == []
    assert not shared.routes  # every finished id left the routes


def null_batcher() -> Batcher:
    """A device whose steps take 20 ms: a 500-token request runs for 10 s."""
    art = ArtifactConfig(model=ART.model, batch_size=4, max_seq_len=1024, block_size=1024,
                         num_blocks=5, prefill_chunk_size=128)
    return Batcher(NullRuntime(art, step_ms=20.0), max_waiting=None)


def test_a_front_that_exits_has_its_requests_aborted_the_other_finishes(tmp_path: Path) -> None:
    shared = SharedCore(tmp_path, batcher=null_batcher())
    try:
        _exits(shared)
    finally:
        shared.close()


def _exits(shared: SharedCore) -> None:
    doomed = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    victim = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a, b = shared.fronts
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        a.hello(stand_in.pid)     # front a "is" this process: the core watches it
        b.hello(os.getpid())
        a.send(submit("doomed", [5, 6, 7], doomed))
        b.send(submit("victim", [2, 7, 1], victim))
        deadline = time.monotonic() + 10
        while not a.tokens.get("doomed"):  # it runs
            assert time.monotonic() < deadline
            a.drain(0.01)
        stand_in.kill()
        stand_in.wait(10)
        b.read({"victim"})
        a.read({"doomed"})  # (its socket is still there: the abort reaches it)
    finally:
        if stand_in.poll() is None:
            stand_in.kill()
            stand_in.wait(10)
    assert a.done["doomed"].finish_reason == "abort"
    assert len(a.tokens["doomed"]) < 100
    assert b.done["victim"].finish_reason == "length"
    [out] = null_batcher().generate([[2, 7, 1]], victim)
    assert b.tokens["victim"] == list(out.token_ids)


def test_a_front_that_leaves_is_stopped_after_its_own_requests(shared: SharedCore) -> None:
    a, b = shared.fronts
    a.hello(os.getpid())
    b.hello(os.getpid())
    a.send(submit("a1", [5, 6, 7], GREEDY))
    b.send(submit("b1", [4, 4, 4], LONG))
    a.send(Shutdown(drain=True))
    a.read({"a1"})
    deadline = time.monotonic() + 10
    while not a.stopped:
        assert time.monotonic() < deadline, "front a was never told Stopped"
        a.drain(0.1)
    assert not b.stopped and "b1" not in b.done  # b's long request is still running
    b.read({"b1"})
    assert b.tokens["b1"] == alone([4, 4, 4], LONG)
    assert shared.runner.is_alive()  # the core serves on


def test_a_live_front_that_stops_reading_is_killed_and_its_requests_aborted(
        tmp_path: Path) -> None:
    # queues of 20 messages on either side (and small kernel buffers): a front that reads
    # nothing fills them within a few hundred 2 ms steps
    art = ArtifactConfig(model=ART.model, batch_size=4, max_seq_len=8192, block_size=8192,
                         num_blocks=5, prefill_chunk_size=128)
    shared = SharedCore(tmp_path, batcher=Batcher(NullRuntime(art, step_ms=2.0),
                                                  max_waiting=None), queue=20)
    stuck = SamplingParams(temperature=0, max_tokens=8000, ignore_eos=True)
    a, b = shared.fronts
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        a.hello(stand_in.pid)       # front a "is" this process, and never reads from here on
        b.hello(os.getpid())
        a.send(submit("stuck", [5, 6, 7], stuck))
        b.send(submit("reader", [2, 7, 1], stuck))
        deadline = time.monotonic() + 60
        while stand_in.poll() is None:  # b keeps reading meanwhile
            assert time.monotonic() < deadline, "the stuck front was not killed"
            b.drain(0.05)
        assert stand_in.returncode == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while shared.loop.batcher.stats().finished.get("abort", 0) < 1 or \
                "stuck" in shared.loop.live:  # its request: aborted (and its output sent)
            assert time.monotonic() < deadline
            b.drain(0.05)
        assert "reader" in shared.loop.live
        got = len(b.tokens["reader"])
        b.drain(0.3)
        assert len(b.tokens["reader"]) > got  # the reading front's stream goes on
        b.send(Abort(["reader"]))
        b.read({"reader"})
    finally:
        if stand_in.poll() is None:
            stand_in.kill()
            stand_in.wait(10)
        shared.close()


def stall_batcher(step_ms: float = 2.0) -> Batcher:
    """Four lanes and contexts of 8192: a 6000-token request holds its lane 12 s at 2 ms a step."""
    art = ArtifactConfig(model=ART.model, batch_size=4, max_seq_len=8192, block_size=8192,
                         num_blocks=5, prefill_chunk_size=128)
    return Batcher(NullRuntime(art, step_ms=step_ms), max_waiting=None)


def test_a_front_that_stops_reading_has_its_requests_aborted_and_serves_again(
        tmp_path: Path) -> None:
    """Front a (alive) submits 12 requests that would hold every lane for 36 s, then reads
    nothing: 1 s later (stall_after) the core aborts them, so front b's request gets a lane at
    once; when a reads again it finds each of its requests ended with an error naming the stall,
    and its next request is served."""
    shared = SharedCore(tmp_path, batcher=stall_batcher(), stall_after=1.0)
    try:
        _stalls(shared)
    finally:
        shared.close()


def _stalls(shared: SharedCore) -> None:
    held = SamplingParams(temperature=0, max_tokens=6000, ignore_eos=True)
    a, b = shared.fronts
    a.hello(os.getpid())
    b.hello(os.getpid())
    doomed = [f"a{k}" for k in range(12)]
    for k, request_id in enumerate(doomed):
        a.send(submit(request_id, [5, 6, k], held))
    batcher = shared.loop.batcher
    deadline = time.monotonic() + 10
    while batcher.stats().occupied_lanes < 4:  # a's requests hold every lane (a reads nothing)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert batcher.num_waiting == 8 and not shared.loop.stalled
    b.send(submit("victim", [2, 7, 1], GREEDY))
    b.read({"victim"}, timeout=20)  # else: 36 s of a's requests first (3 rounds of 12 s)
    assert b.done["victim"].finish_reason == "length"
    assert b.tokens["victim"] == list(stall_batcher().generate([[2, 7, 1]], GREEDY)[0].token_ids)
    assert shared.loop.stalled == {0}  # a only: b reads
    stats = batcher.stats()
    assert stats.finished.get("abort") == 12 and stats.occupied_lanes == 0
    assert stats.queue_length == 0 and not shared.loop.live
    # a reads again: every request of its own ended with an error that names the stall
    a.read(set(doomed), timeout=20)
    for request_id in doomed:
        out = a.done[request_id]
        assert out.finish_reason == "error" and "stopped reading" in (out.error or ""), out
        assert len(a.tokens[request_id]) < 6000
    deadline = time.monotonic() + 10
    while shared.loop.stalled:  # its Consumed reached the core
        assert time.monotonic() < deadline, "the front that reads again is still stalled"
        a.drain(0.05)
    a.send(submit("again", [5, 6, 7], GREEDY))
    a.read({"again"})
    assert a.done["again"].finish_reason == "length"
    assert a.tokens["again"] == list(stall_batcher().generate([[5, 6, 7]], GREEDY)[0].token_ids)
    assert set(b.done) == {"victim"}  # b saw nothing of a's


async def test_a_slow_front_that_reads_is_never_stalled(tmp_path: Path) -> None:
    """A CoreClient whose event loop is busy 0.5 s at a time (a front with more work than one
    CPU) falls hundreds of messages behind the core for seconds, but every read it makes says so
    (`Consumed`): with stall_after=1.5 s none of its requests is aborted."""
    import asyncio

    from atombatch.core import CoreClient
    from atombatch.core.shared import SharedCore as Where

    core = SharedCore(tmp_path, batcher=stall_batcher(step_ms=1.0), stall_after=1.5)
    for front in core.fronts:  # the client below is front 0
        front.to_core.close(linger=0)
        front.from_core.close(linger=0)
    core.fronts = []
    client = CoreClient(None, shared=Where(directory=str(tmp_path), fronts=2, front=0,
                                           core_pid=os.getpid()))
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True, n=2)
    busy = True
    behind_for = 0.0  # the longest time it stayed more than STALL_WINDOW messages behind

    def watch() -> None:
        nonlocal behind_for
        since = None
        while busy:
            now = time.monotonic()
            if core.sender.sent[0] - core.loop.acked[0] > STALL_WINDOW:
                since = now if since is None else since
                behind_for = max(behind_for, now - since)
            else:
                since = None
            time.sleep(0.02)

    def hog() -> None:  # the event loop does nothing else for 0.5 s
        time.sleep(0.5)
        if busy:
            loop.call_later(0.001, hog)

    watcher = threading.Thread(target=watch, daemon=True)

    try:
        await client.start()
        loop = asyncio.get_running_loop()
        ids = [client.submit([5, 6, k], params) for k in range(4)]  # 8 choices on 4 lanes
        watcher.start()
        loop.call_soon(hog)
        outs = [[out async for out in client.outputs(request_id)] for request_id in ids]
    finally:
        busy = False
        watcher.join(5)
        await client.close()
        core.close()
    for got in outs:  # served to the end...
        ends = [out.finish_reason for out in got if out.finish_reason is not None]
        assert ends == ["length", "length"], [out.error for out in got]
    assert core.loop.batcher.stats().finished.get("abort", 0) == 0 and not core.loop.stalled
    assert behind_for > 1.5  # ...though more than the window behind for longer than stall_after


def _stats() -> EngineStats:
    return numpy_batcher().stats()


def test_split_step_routes_rows_and_outputs_and_gives_every_front_the_stats() -> None:
    routes = {"p": 0, "q": 1, "r": 1}
    tokens = np.array([10, 11, 12, 13], np.int64).tobytes()
    done = RequestOutput(request_id="q", new_token_ids=(7,), finished=True,
                         finish_reason="length")
    step = Step(ids=["p", "q", "gone", "r"], tokens=tokens, outputs=[done])
    parts = dict(split_step(step, routes, 3))
    assert set(parts) == {0, 1}  # no stats: front 2 has nothing
    assert parts[0].ids == ["p"] and np.frombuffer(parts[0].tokens, np.int64).tolist() == [10]
    assert parts[1].ids == ["q", "r"]
    assert np.frombuffer(parts[1].tokens, np.int64).tolist() == [11, 13]
    assert parts[1].outputs == [done] and not parts[0].outputs
    assert routes == {"p": 0, "r": 1}  # q finished
    stats = _stats()
    parts = dict(split_step(Step(ids=[], tokens=b"", outputs=[], stats=stats), routes, 3))
    assert set(parts) == {0, 1, 2} and all(p.stats == stats for p in parts.values())


def test_a_leaving_front_hears_of_its_refused_submit_before_stopped(shared: SharedCore) -> None:
    a, b = shared.fronts
    a.hello(os.getpid())
    b.hello(os.getpid())
    b.send(submit("b1", [4, 4, 4], LONG))  # the core stays busy
    deadline = time.monotonic() + 10
    while not b.tokens.get("b1"):  # b's b1 is in flight before a sends its own (the two
        assert time.monotonic() < deadline  # fronts' sockets are read in no fixed order)
        if b.from_core.poll(100):
            b.take(core_decoder.decode(b.from_core.recv()))
    # an id in flight (b's): the core refuses it (an over-long prompt would not do: the core
    # trusts its fronts to have validated what they send, and checks nothing again)
    a.send(submit("b1", [1, 2, 3], GREEDY))
    a.send(Shutdown(drain=True))
    deadline = time.monotonic() + 10
    while not a.stopped:
        assert time.monotonic() < deadline, "front a was never told Stopped"
        if a.from_core.poll(100):
            a.take(core_decoder.decode(a.from_core.recv()))
    # its last word is Stopped: nothing of its own may come after it (the front stops reading)
    assert a.done["b1"].finish_reason == "error" and \
        "already in flight" in (a.done["b1"].error or "")
    b.read({"b1"})
    assert not shared.routes


async def test_two_shared_clients_without_request_ids_do_not_collide(tmp_path: Path) -> None:
    from atombatch.core import CoreClient
    from atombatch.core.shared import SharedCore as Where

    core = SharedCore(tmp_path)
    for front in core.fronts:  # the clients below are the fronts
        front.to_core.close(linger=0)
        front.from_core.close(linger=0)
    core.fronts = []
    clients = [CoreClient(None, shared=Where(directory=str(tmp_path), fronts=2, front=k,
                                             core_pid=os.getpid())) for k in range(2)]
    try:
        for client in clients:
            await client.start()
        ids = [client.submit([5, 6, 7], GREEDY) for client in clients]  # ids of their own
        for client, request_id in zip(clients, ids, strict=True):
            outs = [out async for out in client.outputs(request_id)]
            assert outs[-1].finish_reason == "length", outs[-1].error
            assert [t for out in outs for t in out.new_token_ids] == alone([5, 6, 7], GREEDY)
    finally:
        for client in clients:
            await client.close()
        core.close()

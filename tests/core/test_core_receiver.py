"""The engine core's receiver thread (`atombatch.core.process._Receiver`): what the front sent
reaches the loop in order, and a frame the core cannot read neither stops the core nor leaves
the front waiting for a request that will never finish. The loop of `run_core` runs in a thread
here, over real ZeroMQ sockets."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from support.engines import numpy_batcher
from support.engines import submit_message as submit

from atombatch import SamplingParams
from atombatch.core.messages import Abort, Shutdown, Step, Stopped, Submit, core_decoder, front_encoder
from atombatch.core.process import CoreLoop, _Receiver, _Sender

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


class Core:
    """A core loop on a thread, with the front's two sockets."""

    def __init__(self, tmp_path: Path) -> None:
        self.ctx = zmq.Context()
        inbox_address, outbox_address = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
        self.to_core, self.from_core = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.to_core.bind(inbox_address)
        self.from_core.bind(outbox_address)
        self.inbox, self.outbox = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PUSH)
        self.inbox.connect(inbox_address)
        self.outbox.connect(outbox_address)
        self.sender = _Sender(self.outbox)
        self.loop = CoreLoop(numpy_batcher(), self.inbox, self.sender, os.getppid())
        self.runner = threading.Thread(target=self.loop.run, daemon=True)

    def send(self, message: Any) -> None:
        self.to_core.send(front_encoder.encode(message))

        self.tokens: dict[str, list[int]] = {}

    def finished(self, ids: set[str], timeout: float = 30.0) -> dict[str, Any]:
        """Read the core's Steps until every id in `ids` finished: {id: its final output};
        the tokens each request got pile up in `tokens`."""
        done: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while not ids <= done.keys():
            assert time.monotonic() < deadline, f"still waiting for {ids - done.keys()}"
            if not self.from_core.poll(100):
                continue
            message = core_decoder.decode(self.from_core.recv())
            if isinstance(message, Step):
                for request_id, token in zip(message.ids, np.frombuffer(message.tokens, np.int64),
                                             strict=True):
                    self.tokens.setdefault(request_id, []).append(int(token))
                for out in message.outputs:
                    self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                    if out.finished:
                        done[out.request_id] = out
        return done

    def close(self) -> None:
        self.loop.parent_pid = -1          # stops the loop whatever it holds
        if self.runner.ident is not None:  # (a test may run the loop itself)
            self.runner.join(10)
        self.sender.close()
        for sock in (self.to_core, self.from_core, self.inbox, self.outbox):
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def core(tmp_path: Path) -> Iterator[Core]:
    c = Core(tmp_path)
    try:
        yield c
    finally:
        c.close()


def test_an_unreadable_submit_fails_that_request_and_the_core_carries_on(core: Core) -> None:
    # what a front with a bug could send: bytes that are no message, then a Submit whose
    # params break a rule the decoder checks (temperature < 0)
    core.to_core.send(b"\xc1 not msgpack")
    bad = msgspec.msgpack.encode({"type": "Submit", "request_id": "bad",
                                  "prompt": np.asarray([5], np.int64).tobytes(),
                                  "params": {"temperature": -1.0}})
    core.to_core.send(bad)
    core.send(submit("good", [5, 6, 7], GREEDY))
    core.runner.start()
    done = core.finished({"bad", "good"})
    assert done["bad"].finish_reason == "error" and "temperature" in (done["bad"].error or "")
    assert done["good"].finish_reason == "length"
    [alone] = numpy_batcher().generate([[5, 6, 7]], GREEDY)   # the request run alone
    assert core.tokens["good"] == list(alone.token_ids) and not core.tokens.get("bad")
    assert core.runner.is_alive()
    # the loop still takes messages: a Shutdown stops it cleanly
    core.send(Shutdown(drain=True))
    deadline = time.monotonic() + 10
    stopped = False
    while not stopped and time.monotonic() < deadline:
        if core.from_core.poll(100):
            stopped = isinstance(core_decoder.decode(core.from_core.recv()), Stopped)
    assert stopped
    core.runner.join(10)
    assert not core.runner.is_alive()


def test_submit_then_abort_then_submit_apply_in_order(core: Core) -> None:
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    core.send(submit("a", [5, 6, 7], long))
    core.send(Abort(["a"]))
    core.send(submit("b", [9, 9, 1], GREEDY))
    core.runner.start()
    done = core.finished({"a", "b"})
    assert done["a"].finish_reason == "abort", done["a"].error
    assert done["b"].finish_reason == "length"
    [alone] = numpy_batcher().generate([[9, 9, 1]], GREEDY)
    assert core.tokens["b"] == list(alone.token_ids) and len(core.tokens.get("a", [])) < 100


def _broken_poll(self: Any, timeout: int | None = None) -> list[Any]:
    """A poll that fails (what a ZeroMQ error other than the context ending looks like to the
    receiver)."""
    raise zmq.ZMQError(zmq.EFSM)


def test_a_receiver_that_dies_stops_the_core_instead_of_leaving_it_deaf(
        core: Core, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zmq.Poller, "poll", _broken_poll)  # the receiver's poll only
    failures: list[BaseException] = []

    def run() -> None:
        try:
            core.loop.run()
        except Exception as exc:
            failures.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(5)
    assert not runner.is_alive(), "the loop carried on with nothing to hear the front"
    assert failures and "receiver" in str(failures[0])


@contextlib.contextmanager
def front_receiver(tmp_path: Path) -> Iterator[tuple[Any, Any, list[Any]]]:
    """A shared core's receiver on one front's inbox, the front's socket to it and two stand-in
    front processes (sleepers: their pids are what the receiver watches)."""
    ctx = zmq.Context()
    inbox, to_core = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind(f"ipc://{tmp_path}/in-0")
    to_core.connect(f"ipc://{tmp_path}/in-0")
    receiver = _Receiver([inbox])
    fronts = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
              for _ in range(2)]
    try:
        yield receiver, to_core, fronts
    finally:
        for process in fronts:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        receiver.stop()
        inbox.close(linger=0)
        to_core.close(linger=0)
        ctx.term()


def test_a_restarted_fronts_hello_in_the_same_poll_as_its_predecessors_exit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared core's receiver (one inbox per front, a pidfd per front's process): the new
    front's Hello and the old front's exit arrive in one poll. The old one is gone once, and
    the new one stays watched (its pidfd must not be taken for the old one's)."""
    from atombatch.core.messages import Hello
    from atombatch.core.process import FrontGone

    gate = threading.Event()
    gate.set()
    real_poll = zmq.Poller.poll

    def gated_poll(self: Any, timeout: int | None = None) -> list[Any]:
        gate.wait()  # (a receiver that did not get the interpreter for a while)
        return real_poll(self, timeout)

    monkeypatch.setattr(zmq.Poller, "poll", gated_poll)
    got: list[Any] = []

    def take(timeout: float = 5.0) -> Any:
        message = receiver.received.get(timeout=timeout)
        got.append(message)
        return message

    with front_receiver(tmp_path) as (receiver, to_core, (old, new)):
        receiver.start()
        to_core.send(front_encoder.encode(Hello(front=0, pid=old.pid)))
        assert isinstance(take()[1], Hello)
        time.sleep(0.1)  # inside a poll: the next one waits at the gate
        gate.clear()
        time.sleep(0.2)
        old.kill()
        old.wait(10)
        to_core.send(front_encoder.encode(Hello(front=0, pid=new.pid)))
        time.sleep(0.2)  # both ready when the receiver polls again
        gate.set()
        first, second = take(), take()
        assert isinstance(first, FrontGone) and isinstance(second, tuple)
        assert second[1].pid == new.pid
        time.sleep(0.3)
        assert receiver.received.empty(), receiver.received.get()  # no second FrontGone
        assert receiver.running
        new.kill()
        new.wait(10)
        gone = take()  # the new front is still watched
        assert isinstance(gone, FrontGone) and gone.front == 0
        gate.set()


def test_what_lands_after_a_fronts_exit_is_dropped_until_the_next_hello(tmp_path: Path) -> None:
    """A frame a front sent just before it died can reach the receiver after its pidfd did:
    applied after `FrontGone`, its request would run to the end for nobody (and its outputs go
    to the front started next on that index)."""
    from atombatch.core.messages import Hello
    from atombatch.core.process import FrontGone

    prompt = np.array([5, 6], np.int64).tobytes()
    with front_receiver(tmp_path) as (receiver, to_core, (old, new)):
        receiver.start()
        to_core.send(front_encoder.encode(Hello(front=0, pid=old.pid)))
        assert isinstance(receiver.received.get(timeout=5)[1], Hello)
        old.kill()
        old.wait(10)
        assert isinstance(receiver.received.get(timeout=5), FrontGone)
        to_core.send(front_encoder.encode(Submit("late", prompt, GREEDY)))  # the dead one's
        to_core.send(front_encoder.encode(Hello(front=0, pid=new.pid)))     # the next front
        to_core.send(front_encoder.encode(Submit("fresh", prompt, GREEDY)))
        got = [receiver.received.get(timeout=5) for _ in range(2)]
        time.sleep(0.2)
        assert receiver.received.empty(), receiver.received.get()
        assert isinstance(got[0][1], Hello) and got[0][1].pid == new.pid
        assert got[1][1].request_id == "fresh"

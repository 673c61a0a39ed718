"""The engine core's process: build the engine, then step it and nothing else.

`run_core` is the process's target. It connects to the front's two IPC endpoints, builds the
`Batcher` with the factory it was given (so the weights load here, not in the front), reports
`Ready`, and loops: take what the front sent (without waiting while there is work), run one engine
step, send what it produced as one `Step`. It never parses HTTP, renders templates or formats
logprobs; everything it receives was validated by the front against the rules it reported, and
it checks none of it again (`Batcher.submit(..., validated=True)`: a request is validated once).

The loop's own thread does only what the next step needs: the engine step, and picking the
step's plain rows (three small array copies). Building the `Step` (a request id per plain token),
encoding it and handing it to ZeroMQ happen on a sender thread (`_Sender`) while the loop is
already in the next step's device call, which releases the interpreter lock as a device wait
does: so the cost of telling the front about step N overlaps step N + 1 on the device instead of
adding to every step (docs/overlap.md). The loop holds a step's message back until that device
call begins (`Batcher.on_device_call`): handed over at once, the sender would take the
interpreter lock at the loop's first release of it before the device call (a socket poll, a
NumPy kernel) and the loop would wait for it there. Before the loop waits for messages, and
when it stops, it hands over what it holds. Messages leave in the order the loop made them.
The engine's log events of a step go the same way and are rendered on the sender.

The other way, a receiver thread (`_Receiver`) takes the front's frames off the socket and
decodes them (a `Submit` carries its `SamplingParams`, checked as they decode) during the device
calls; the loop only applies what arrived, between two steps, without a socket poll per step.

It exits when the front asks (`Shutdown`), and also when the front is gone: its parent process
exited (checked every loop) or its socket peer vanished, aborting every request it held first.
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import shutil
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import zmq

from atombatch.api.structs import RequestOutput
from atombatch.core.lora import CoreLora, Loaded
from atombatch.core.messages import (
    Abort,
    Consumed,
    Failed,
    Hello,
    LoadLora,
    Producers,
    ProducerVerdicts,
    Ready,
    Shutdown,
    Step,
    Stopped,
    Submit,
    SummaryRequest,
    UnloadLora,
    core_encoder,
    front_decoder,
)
from atombatch.core.pd import CorePD, PDOptions
from atombatch.core.routing import CoreSummaries
from atombatch.core.shared import FRONT_STALL_SECONDS, STALL_WINDOW, endpoints, split_step
from atombatch.engine.aio import fail_all
from atombatch.engine.batcher import Batcher, log_events
from atombatch.errors import ConfigError
from atombatch.logs import logger

log = logger("atombatch.core")

FRONT_QUEUE = 10_000      # a shared core's messages queued for one front (one per step: 50 s at 5 ms)
STUCK_SENDS = 100         # sends refused in a row to a live front past FRONT_QUEUE: it is killed
STATS_INTERVAL = 0.05     # seconds between the engine stats a Step carries
IDLE_WAIT_MS = 100        # how long an idle core waits for a message before checking its parent
RECEIVE_POLL_MS = 50      # how often the receiver thread checks whether the loop has stopped
PD_POLL_MS = 2            # while every unfinished request waits on a KV producer
HEARTBEAT_S = 0.25        # a core with requests sends a stats-only Step this often between steps
_NO_TOKENS = np.zeros(0, np.int64)   # a Step without plain tokens (allocated once)
SOCKET_DIR_PREFIX = "atombatch-core-"  # the temporary directory of a client's IPC sockets


def freeze_heap() -> int:
    """Collect once, then move every object the process holds now (its modules, the runtime,
    the engine's tables) out of the cyclic collector's generations (`gc.freeze`); returns how
    many objects are frozen. A collection holds the interpreter lock for as long as it scans:
    before this, a full one in a sustained B64 run scanned the whole startup heap (~50k tracked
    objects) for 30 ms, six 5 ms device steps lost at once; after it, collections scan only
    what requests left since. A process that builds its serving state calls it once that is
    built (the engine core before its loop, the front once it listens; vLLM's engine core
    does the same)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run_core(factory: Callable[[], Batcher], inbox_address: str, outbox_address: str,
             parent_pid: int, pd: PDOptions | None = None) -> None:
    """The core process's main function (see the module docstring); with `pd`, the core holds
    the PD producer pool (atombatch/core/pd.py)."""
    # Ctrl-C reaches the whole process group: the front decides (drain, then Shutdown).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 5000)
    inbox.connect(inbox_address)
    outbox.connect(outbox_address)
    core_pd: CorePD | None = None
    try:
        try:
            batcher = factory()
        except Exception as exc:
            outbox.send(core_encoder.encode(Failed(error=str(exc),
                                                   config=isinstance(exc, ConfigError))))
            return
        batcher.prepare_structured()
        frozen = freeze_heap()
        outbox.send(core_encoder.encode(Ready(rules=batcher.rules(), policy=batcher.policy.label,
                                              max_waiting=batcher.max_waiting,
                                              stats=batcher.stats(), pid=os.getpid(),
                                              frozen=frozen,
                                              loras=sorted(batcher.lora_adapters))))
        batcher.leave_queue_bound_to_fronts()   # the front bounds the queue (Ready says how)
        core_pd = CorePD(pd, batcher.artifact) if pd is not None else None
        sender = _Sender(outbox)
        try:
            loop = CoreLoop(batcher, inbox, sender, parent_pid, pd=core_pd)
            loop.run()
        finally:
            sender.close()
        if loop.front_gone:  # a killed front removed nothing: its socket directory goes with us
            _remove_socket_dir(inbox_address)
    finally:
        if core_pd is not None:
            core_pd.close()
        inbox.close(linger=0)
        outbox.close()
        ctx.term()


def _remove_socket_dir(address: str) -> None:
    remove_socket_dir(os.path.dirname(address.removeprefix("ipc://")))


def remove_socket_dir(directory: str) -> None:
    """Remove a socket directory a client or launcher made (and nothing else)."""
    if os.path.basename(directory).startswith(SOCKET_DIR_PREFIX):
        shutil.rmtree(directory, ignore_errors=True)


class _Sender:
    """A thread that builds, encodes and sends the loop's messages, in the order queued.

    `put` takes a finished message or a `_PlainRows` to build a `Step` from; `close` sends what
    is queued, then stops the thread. A send that fails (the front is gone) is logged once; the
    loop finds out from its parent check.

    A shared core's sender has one outbox per front and the loop's `routes`: a `To` goes to its
    front, a `Step` is split by the front of each id (every front gets the step's stats), and
    anything else goes to every front (atombatch/core/shared.py).
    """

    def __init__(self, outbox: Any, routes: dict[str, int] | None = None,
                 front_pids: dict[int, int] | None = None) -> None:
        self.outbox = outbox
        self.routes = routes
        self.front_pids = {} if front_pids is None else front_pids
        # messages each front was sent since its last `Ready` (a shared core: the loop compares
        # them with what the front says it read, `Consumed`)
        self.sent = [0] * len(outbox) if routes is not None else []
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="atombatch-core-sender",
                                        daemon=True)
        self._thread.start()

    def put(self, message: Any) -> None:
        self._queue.put(message)

    def close(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        deliver = self._send if self.routes is None else \
            routed_delivery(self.outbox, self.routes, self.front_pids, self.sent)
        while True:
            message = self._queue.get()
            if message is None:
                return
            if isinstance(message, _Events):  # rendered here, off the loop's critical path
                try:
                    log_events(message.events)
                except Exception:
                    log.exception("core.log_failed")
                continue
            if isinstance(message, _PlainRows):
                message = message.step()
            deliver(message)

    def _send(self, message: Any) -> None:
        """The one front's socket (a core of its own)."""
        try:
            # copied: a zero-copy frame costs a round trip through pyzmq's GC thread
            self.outbox.send(core_encoder.encode(message))
        except zmq.ZMQError as exc:
            if not self._failed:
                self._failed = True
                log.warning("core.send_failed", error=str(exc))


class _Receiver:
    """A thread that takes the front's messages off the inbox and decodes them, so that work
    happens while the loop is in a device call (which releases the interpreter lock) instead of
    between two device calls. The loop reads the decoded messages from `received`, in order.

    With a list of inboxes (a shared core: one per front, atombatch/core/shared.py) every
    message arrives as `(front, message)`, a front's `Hello` makes the thread watch its process
    (a pidfd in the same poll), and a watched front that exits arrives as `FrontGone(front)`;
    what that front sent and lands after it, until the next `Hello` there, is dropped.

    The inbox sockets are this thread's alone from `start` until `stop` returns.
    """

    def __init__(self, inbox: Any, pids: dict[int, int] | None = None) -> None:
        self.tagged = isinstance(inbox, list | tuple)
        self.pids = {} if pids is None else pids   # front -> the pid of its live process
        self.inboxes: list[Any] = list(inbox) if self.tagged else [inbox]
        self.received: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="atombatch-core-receiver",
                                        daemon=True)
        self._watched: dict[int, tuple[int, int]] = {}   # pidfd -> (front, pid)
        self._replaced: list[int] = []   # pidfds of predecessors, closed after the poll round
        self._gone: set[int] = set()     # fronts whose process exited: dropped until a Hello

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            self._receive()
        except Exception:  # the loop sees the thread gone and stops the core
            log.exception("core.receiver_failed")
        finally:
            for fd in [*self._watched, *self._replaced]:
                os.close(fd)
            self._watched.clear()
            self._replaced.clear()

    def _receive(self) -> None:
        put, decode, tagged = self.received.put, front_decoder.decode, self.tagged
        poller = zmq.Poller()
        index = {}
        for front, inbox in enumerate(self.inboxes):
            poller.register(inbox, zmq.POLLIN)
            index[inbox] = front
        while not self._stopping.is_set():
            for source, _ in poller.poll(RECEIVE_POLL_MS):
                if isinstance(source, int):  # a watched front's process exited
                    watch = self._watched.pop(source, None)
                    if watch is None:  # replaced by a Hello earlier in this round
                        continue
                    poller.unregister(source)
                    os.close(source)
                    self.pids.pop(watch[0], None)
                    self._gone.add(watch[0])
                    put(FrontGone(watch[0]))
                    continue
                front = index[source]
                while True:
                    try:
                        frame = source.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except zmq.ZMQError as exc:  # the context is ending
                        log.warning("core.receive_failed", error=str(exc))
                        return
                    try:
                        message = decode(frame)
                    except Exception as exc:  # only a front bug sends this: it must not stop
                        log.exception("core.bad_message", size=len(frame))
                        refused = _refusal(frame, exc)
                        if refused is not None:  # else the front would wait for it for good
                            put((front, refused) if tagged else refused)
                        continue
                    if tagged:
                        if isinstance(message, Hello):
                            self._gone.discard(front)
                            self._watch(poller, front, message.pid)
                        elif front in self._gone:  # sent by a front that exited, landing late
                            continue
                        put((front, message))
                    else:
                        put(message)
            for fd in self._replaced:  # closed after the round: a new watch must not reuse
                os.close(fd)           # the number of one this round's events still name
            self._replaced.clear()

    def _watch(self, poller: Any, front: int, pid: int) -> None:
        """Watch front `front`'s process `pid` (its `Hello`; a restarted front says it again)."""
        for fd, (watched_front, watched_pid) in list(self._watched.items()):
            if watched_front == front:
                if watched_pid == pid:
                    return  # a repeated Hello
                # its predecessor (gone, or about to be): what it submitted is aborted before
                # the new front's first message (it says Hello before it submits anything)
                poller.unregister(fd)
                self._replaced.append(fd)
                del self._watched[fd]
                self.pids.pop(front, None)
                self.received.put(FrontGone(front))
        pidfd_open = getattr(os, "pidfd_open", None)
        if pidfd_open is None:  # (not Linux >= 5.3: a front that dies is not noticed)
            log.warning("core.front_unwatched", front=front, pid=pid)
            return
        try:
            fd = pidfd_open(pid)
        except OSError:  # already gone
            self._gone.add(front)
            self.received.put(FrontGone(front))
            return
        self._watched[fd] = (front, pid)
        self.pids[front] = pid
        poller.register(fd, zmq.POLLIN)


class FrontGone:
    """A shared core's front `front` exited: its requests are aborted."""

    __slots__ = ("front",)

    def __init__(self, front: int) -> None:
        self.front = front


class _Refused:
    """A `Submit` the receiver could not decode: the request ends with an error."""

    __slots__ = ("error", "request_id")

    def __init__(self, request_id: str, error: str) -> None:
        self.request_id, self.error = request_id, error


def _refusal(frame: bytes, exc: Exception) -> _Refused | None:
    """The `Submit` a frame that failed to decode was meant to be, if its id can still be read
    (the front waits for every request it sent to finish); None for anything else."""
    try:
        message = msgspec.msgpack.decode(frame)
    except Exception:
        return None
    if isinstance(message, dict) and message.get("type") == "Submit" and \
            isinstance(message.get("request_id"), str):
        return _Refused(message["request_id"], f"the engine core could not read the request: "
                                               f"{exc}")
    return None


class To:
    """A message for one front of a shared core only."""

    __slots__ = ("front", "message")

    def __init__(self, front: int, message: Any) -> None:
        self.front, self.message = front, message


class _Events:
    """A step's scheduler events, for the sender to log."""

    __slots__ = ("events",)

    def __init__(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        self.events = events


class _PlainRows:
    """A `Step` still to be built: the step's plain rows as the loop picked them."""

    __slots__ = ("lane_ids", "lanes", "outputs", "pd", "stats", "tokens")

    def __init__(self, lane_ids: list[Any], lanes: np.ndarray, tokens: np.ndarray,
                 outputs: list[RequestOutput], stats: Any, pd: Any = None) -> None:
        self.pd = pd
        self.lane_ids = lane_ids
        self.lanes = lanes
        self.tokens = tokens
        self.outputs = outputs
        self.stats = stats

    def step(self) -> Step:
        lane_ids = self.lane_ids
        return Step(ids=[lane_ids[lane] for lane in self.lanes.tolist()],
                    tokens=self.tokens.astype(np.int64, copy=False).tobytes(),
                    outputs=self.outputs, stats=self.stats, pd=self.pd)


class CoreLoop:
    """Step a `Batcher` while taking the front's messages between steps.

    `outbox` is anything with `put(message)`: the `_Sender` in the core process. With `routes`
    (a shared core: `inbox` is a list of sockets, one per front) the loop records which front
    submitted each request there, answers each front on its own (`To`) and lets a front leave
    (its `Shutdown`) or vanish (`FrontGone`) while the others go on; the sender routes each
    Step's rows by `routes` (atombatch/core/shared.py). A front that stops reading for
    `stall_after` seconds has its requests aborted (`check_stalls`).
    """

    def __init__(self, batcher: Batcher, inbox: Any, outbox: Any, parent_pid: int,
                 pd: CorePD | None = None, routes: dict[str, int] | None = None,
                 front_pids: dict[int, int] | None = None,
                 stall_after: float = FRONT_STALL_SECONDS) -> None:
        self.batcher = batcher
        self.pd = pd                          # the producer pool (PD on), else None
        self.summaries = CoreSummaries()
        self.receiver = _Receiver(inbox, front_pids)
        self.received = self.receiver.received  # the front's messages, decoded, in order
        self.lora = CoreLora(batcher, self.received.put)  # LoRA loads (docs/lora.md)
        self.outbox = outbox
        self.held: list[Any] = []             # messages for the sender, until a device call
        batcher.on_device_call = self.hand_over
        batcher.decide_late = True  # this loop steps again at once
        batcher.on_events = self.log_events
        self.parent_pid = parent_pid
        self.live: set[str] = set()           # ids the front submitted that have not finished
        self.errors: list[RequestOutput] = []  # submits the engine refused, sent with the next Step
        self.stopping: Shutdown | None = None
        self.front_gone = False                # run() returned because the front died
        self.stats_at = 0.0
        self.beat_at = 0.0                     # the last heartbeat (a Step with the stats only)
        self.routes = routes                   # request id -> its front (a shared core only;
                                               #   the sender removes a finished id)
        self.leaving: dict[int, bool] = {}     # fronts that said Shutdown (shared core)
        # a shared core's watch on fronts that stop reading (check_stalls)
        fronts = len(inbox) if routes is not None else 0
        self.sent: list[int] = getattr(outbox, "sent", [0] * fronts)  # the sender's counts
        self.acked = [0] * fronts              # what each front said it read (`Consumed`)
        self.moved_at = [0.0] * fronts         # when each last read, or was within the window
        self.stall_after = stall_after
        self.stalled: set[int] = set()         # fronts found stalled that have not read since
        self.stall_errors: dict[str, str] = {}  # requests aborted for their front's stall

    def ready(self) -> Ready:
        """What a front validates requests against (sent once it is up)."""
        batcher = self.batcher
        return Ready(rules=batcher.rules(), policy=batcher.policy.label,
                     max_waiting=batcher.max_waiting, stats=batcher.stats(),
                     pid=os.getpid(), loras=self.lora.loras())

    def hand_over(self) -> None:
        """Give the sender the messages held so far (at a device call, or before waiting)."""
        if self.held:
            put = self.outbox.put
            for message in self.held:
                put(message)
            self.held.clear()

    def log_events(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        """The engine's events go to the sender (logged in order, after the step's message)."""
        self.held.append(_Events(events))

    def run(self) -> None:
        self.receiver.start()
        try:
            self._run()
        finally:
            self.receiver.stop()
            self.lora.close()
            self.hand_over()

    def _run(self) -> None:
        batcher = self.batcher
        stale = False        # the front's stats predate the last step
        while True:
            busy = batcher.has_unfinished()
            wait = 0 if busy and not batcher.idle else PD_POLL_MS if busy else IDLE_WAIT_MS
            if wait:
                self.hand_over()
            self.take(wait)
            if not self.receiver.running and self.received.empty():
                # nothing the front sends would reach the loop again: exit (the front sees the
                # core gone and fails what it holds) rather than serve what is left unheard
                raise RuntimeError("the engine core's receiver thread stopped")
            if os.getppid() != self.parent_pid:  # the front died: nobody reads our outputs
                log.warning("core.front_gone", aborted=len(self.live))
                self.front_gone = True
                for request_id in list(self.live):
                    batcher.abort(request_id)
                return
            if self.leaving:
                self._let_leave()
            if self.stopping is not None and not batcher.has_unfinished():
                self.send(self.step_message([], [], _NO_TOKENS, force_stats=True))
                self.send(Stopped())
                return
            if not batcher.has_unfinished():
                if self.errors or stale:  # gone idle: the front sees the final counts
                    self.send(self.step_message([], [], _NO_TOKENS, force_stats=True))
                    stale = False
                continue
            now = time.monotonic()
            if now - self.beat_at >= HEARTBEAT_S:  # with requests, tell the front this loop
                self.beat_at = now  # runs, whatever the steps send (a long prompt's chunks and
                # waits on producers send nothing): CoreClient's hang_timeout counts silence
                self.send(self.step_message([], [], _NO_TOKENS, force_stats=True))
                self.hand_over()  # now: steps without a device call (KV imports) hand nothing
                if self.acked:
                    self.check_stalls(now)
            stale = True
            try:
                result = batcher.step_arrays()
            except Exception as exc:  # a bug, not a request failure: fail everything in flight
                log.exception("core.step_failed")
                outputs = fail_all(batcher, list(self.live), exc)
                self.send(self.step_message([], outputs, _NO_TOKENS))
                continue
            plain = result.plain
            if plain.any():  # copies: the step's arrays are views the next step overwrites
                rows = np.flatnonzero(plain)
                self.held.append(self.plain_rows(result.request_ids, result.lanes[rows],
                                                 result.tokens[rows], result.outputs))
            elif result.outputs or self.errors:
                self.send(self.step_message([], result.outputs, _NO_TOKENS))

    def plain_rows(self, lane_ids: list[Any], lanes: np.ndarray, tokens: np.ndarray,
                   outputs: list[RequestOutput]) -> _PlainRows:
        """What `step_message` says, with the ids still to be looked up (by the sender)."""
        outputs = self._outputs(outputs)
        stats = self._stats(False)
        return _PlainRows(lane_ids, lanes, tokens, outputs, stats, self._pd_stats(stats))

    def step_message(self, ids: list[Any], outputs: list[RequestOutput],
                     tokens: np.ndarray, force_stats: bool = False) -> Step:
        outputs = self._outputs(outputs)
        stats = self._stats(force_stats)
        return Step(ids=ids, tokens=tokens.astype(np.int64, copy=False).tobytes(),
                    outputs=outputs, stats=stats, pd=self._pd_stats(stats))

    def _pd_stats(self, stats: Any) -> Any:
        """The producer pool's snapshot, with every engine stats (PD only)."""
        return self.pd.stats() if self.pd is not None and stats is not None else None

    def _outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The step's outputs after the refused submits; finished ids leave `live`."""
        if self.errors:
            outputs = self.errors + outputs
            self.errors = []
        if self.stall_errors:
            outputs = [self._stall_end(out) for out in outputs]
        for out in outputs:
            if out.finished:
                self.live.discard(out.request_id)
        return outputs

    def _stall_end(self, out: RequestOutput) -> RequestOutput:
        """A request aborted because its front stalled ends with an error that says so."""
        error = self.stall_errors.get(out.request_id)
        if error is None:
            return out
        if out.finished:
            del self.stall_errors[out.request_id]
        if out.finish_reason != "abort":
            return out
        completion = out.completion
        if completion is not None:
            completion = msgspec.structs.replace(completion, finish_reason="error", error=error)
        return msgspec.structs.replace(out, finish_reason="error", error=error,
                                       completion=completion)

    def check_stalls(self, now: float) -> None:
        """A shared core's fronts that stopped reading (a stopped process, a hung event loop):
        more than `STALL_WINDOW` of the messages sent to a live front unacknowledged, and no
        `Consumed` from it for `stall_after` seconds. Its requests are aborted (lanes and blocks
        free for the other fronts' requests) and end with an error naming the stall; it is
        logged once, until it reads again. A front that reads at all is never stalled: each
        read of it moves its count within `ACK_INTERVAL`."""
        sent, acked, moved_at, pids = self.sent, self.acked, self.moved_at, self.receiver.pids
        for front in range(len(acked)):
            behind = sent[front] - acked[front]
            if front not in pids or behind <= STALL_WINDOW:
                moved_at[front] = now
            elif now - moved_at[front] >= self.stall_after:
                moved_at[front] = now  # (what it submits meanwhile gets as long)
                self._stall(front, behind)

    def _stall(self, front: int, behind: int) -> None:
        routes = self.routes
        assert routes is not None
        error = (f"the front serving this request (front {front}) stopped reading the engine "
                 f"core's messages: {behind} unread, none acknowledged for "
                 f"{self.stall_after:g} s (--front-stall-timeout); its requests were aborted so "
                 "the other fronts' requests get their lanes")
        mine = [request_id for request_id in self.live if routes.get(request_id) == front]
        if not mine and front not in self.stalled:  # it holds nothing (a front still starting,
            return                                  # with the stats queued): nothing to say
        aborted = 0
        for request_id in mine:
            if self.batcher.abort(request_id):
                self.stall_errors[request_id] = error
                aborted += 1
        if front not in self.stalled:
            self.stalled.add(front)
            log.error("core.front_stalled", front=front, pid=self.receiver.pids.get(front),
                      unread=behind, silent_s=self.stall_after, aborted=aborted)

    def _stats(self, force: bool) -> Any:
        """The engine's stats when due (every STATS_INTERVAL, and when going idle), else None."""
        now = time.monotonic()
        if force or now - self.stats_at >= STATS_INTERVAL or \
                not self.batcher.has_unfinished():  # going idle: the final counts
            self.stats_at = now
            return self.batcher.stats()
        return None

    def send(self, message: Any) -> None:
        self.held.append(message)

    def take(self, wait_ms: int) -> None:
        """Apply every message the front sent; wait up to `wait_ms` for the first."""
        if self.pd is not None and self.pd.report_due:  # the pool changed on its own (probe)
            self.pd.report_due = False
            self.send(self.step_message([], [], _NO_TOKENS, force_stats=True))
        received = self.received
        if not wait_ms:
            if received.empty():
                return
            message = received.get()
        else:
            try:
                message = received.get(timeout=wait_ms / 1000)
            except queue.Empty:
                return
        while True:
            if type(message) is tuple:  # (front, message): a shared core
                self.apply(message[1], message[0])
            else:
                self.apply(message)
            if received.empty():
                return
            message = received.get()

    def apply(self, message: Any, front: int = 0) -> None:
        """Carry out one message of the front (of front `front`, a shared core's)."""
        routes = self.routes
        if isinstance(message, Submit):
            self.submit(message, front)
        elif isinstance(message, Abort):
            for request_id in message.request_ids:
                if routes is None or routes.get(request_id) == front:  # its own requests only
                    self.batcher.abort(request_id)
        elif isinstance(message, Consumed):
            self.acked[front] = message.count
            self.moved_at[front] = time.monotonic()
            if front in self.stalled:
                self.stalled.discard(front)
                log.warning("core.front_resumed", front=front)
        elif isinstance(message, Shutdown):
            if routes is not None:  # one front leaves; the core serves the others
                self.leaving[front] = message.drain
                if not message.drain:
                    self._abort_front(front)
                return
            self.stopping = message
            if not message.drain:
                for request_id in list(self.live):
                    self.batcher.abort(request_id)
        elif isinstance(message, Hello):
            self.leaving.pop(front, None)
            self._unwatch(front)  # its count restarts at the Ready sent now
            self.send(To(front, self.ready()))
        elif isinstance(message, FrontGone):
            log.warning("core.front_gone", front=message.front)
            self.leaving.pop(message.front, None)
            self._unwatch(message.front)
            self._abort_front(message.front)
        elif isinstance(message, Producers | ProducerVerdicts):
            if self.pd is not None:  # answered with the pool's new state
                self.pd.apply(message)
                self.send(self.step_message([], [], _NO_TOKENS, force_stats=True))
        elif isinstance(message, SummaryRequest):
            summary = self.summaries.answer(self.batcher, message)
            self.send(summary if routes is None else To(front, summary))
        elif isinstance(message, LoadLora | UnloadLora | Loaded):
            if isinstance(message, LoadLora):
                done = self.lora.load(message, front if routes is not None else None)
            else:
                done = self.lora.unload(message) if isinstance(message, UnloadLora) else \
                    message.done
            if done is not None and routes is not None and done.error is None:
                # every front hears of the change first (seq 0 waits for nothing), so the one
                # that asked answers its client once all of them were told (docs/lora.md)
                self.send(msgspec.structs.replace(done, seq=0))
            if done is not None:
                self.send(done if routes is None else To(front, done))
        elif isinstance(message, _Refused):  # sent with the next Step, as a refused submit
            error = RequestOutput(request_id=message.request_id, new_token_ids=(),
                                  finished=True, finish_reason="error", error=message.error)
            if routes is None:
                self.errors.append(error)
            else:
                self._refuse(front, error)

    def _unwatch(self, front: int) -> None:
        """Front `front`'s stall watch starts again (a new front there, or none)."""
        if self.acked:
            self.acked[front] = 0
            self.moved_at[front] = time.monotonic()
            self.stalled.discard(front)

    def _refuse(self, front: int, error: RequestOutput) -> None:
        """A shared core's answer to a submit it did not take, to the front that sent it."""
        self.send(To(front, Step(ids=[], tokens=b"", outputs=[error])))

    def _abort_front(self, front: int) -> None:
        """Abort every request front `front` submitted (it left without draining, or died)."""
        routes = self.routes
        assert routes is not None
        mine = [request_id for request_id in self.live if routes.get(request_id) == front]
        for request_id in mine:
            self.batcher.abort(request_id)
        if mine:
            log.warning("core.front_aborted", front=front, aborted=len(mine))

    def _let_leave(self) -> None:
        """Fronts that said Shutdown and have nothing left in flight get their final stats and
        `Stopped`."""
        routes = self.routes
        assert routes is not None
        busy = {routes.get(request_id) for request_id in self.live}
        for front in [front for front in self.leaving if front not in busy]:
            del self.leaving[front]
            if self.errors:  # submits the engine refused go out first: Stopped is the last word
                self.send(self.step_message([], [], _NO_TOKENS))
            stats = self.batcher.stats()
            self.send(To(front, Step(ids=[], tokens=b"", outputs=[], stats=stats,
                                     pd=self._pd_stats(stats))))
            self.send(To(front, Stopped()))

    def submit(self, message: Submit, front: int = 0) -> None:
        routes = self.routes
        if routes is not None:
            request_id = message.request_id
            if request_id in self.live or request_id in routes:  # another front's, maybe
                self._refuse(front, RequestOutput(
                    request_id=request_id, new_token_ids=(), finished=True,
                    finish_reason="error", error=f"request id {request_id!r} is already in "
                                                 "flight in this engine core"))
                return
            routes[request_id] = front  # before any output of it can exist (errors included)
        tokens = np.frombuffer(message.prompt, dtype=np.int64)
        kv = None
        try:
            if self.pd is not None:  # validated before any producer is asked
                kv = self.pd.source(self.batcher, message, tokens)
            # validated by the front against the rules this core reported: not again
            self.batcher.submit(tokens, message.params, request_id=message.request_id, kv=kv,
                                lora=message.lora, validated=True)
        except Exception as exc:  # one bad request must not stop the loop
            if kv is not None:
                kv.close()
            self.errors.append(RequestOutput(request_id=message.request_id, new_token_ids=(),
                                             finished=True, finish_reason="error",
                                             error=str(exc)))
            return
        self.live.add(message.request_id)


# -- a core shared by several fronts (atombatch/core/shared.py) --------------------------------------
def run_shared_core(factory: Callable[[], Batcher], directory: str, fronts: int, parent_pid: int,
                    report: Any, pd: PDOptions | None = None,
                    stall_after: float = FRONT_STALL_SECONDS) -> None:
    """The shared core process's main function: bind every front's pair, build the engine, send
    the launcher `Ready` or `Failed` (msgpack bytes on the `report` pipe), then run the loop
    until the launcher stops it or exits (killed: the core removes `directory` itself). A front
    that reads nothing for `stall_after` seconds has its requests aborted (`check_stalls`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides (drain, then stop)
    ctx = zmq.Context()
    inboxes, outboxes = [], []
    core_pd: CorePD | None = None
    try:
        for front in range(fronts):
            to_core, from_core = endpoints(directory, front)
            inbox = ctx.socket(zmq.PULL)
            inbox.bind(to_core)
            outbox = ctx.socket(zmq.PUSH)
            outbox.setsockopt(zmq.SNDHWM, FRONT_QUEUE)  # then the front is stuck: killed
            outbox.setsockopt(zmq.LINGER, 1000)
            outbox.bind(from_core)
            inboxes.append(inbox)
            outboxes.append(outbox)
        try:
            batcher = factory()
        except Exception as exc:
            report.send_bytes(core_encoder.encode(Failed(error=str(exc),
                                                         config=isinstance(exc, ConfigError))))
            return
        core_pd = CorePD(pd, batcher.artifact) if pd is not None else None
        routes: dict[str, int] = {}
        pids: dict[int, int] = {}
        sender = _Sender(outboxes, routes, pids)
        try:
            loop = CoreLoop(batcher, inboxes, sender, parent_pid, pd=core_pd, routes=routes,
                            front_pids=pids, stall_after=stall_after)
            batcher.leave_queue_bound_to_fronts()  # each front its share (Ready says the total)
            batcher.prepare_structured()
            frozen = freeze_heap()
            report.send_bytes(core_encoder.encode(msgspec.structs.replace(loop.ready(),
                                                                          frozen=frozen)))
            loop.run()
        finally:
            sender.close()
        if loop.front_gone:  # the launcher was killed: nobody else removes the directory
            remove_socket_dir(directory)
    finally:
        if core_pd is not None:
            core_pd.close()
        for sock in inboxes:
            sock.close(linger=0)
        for sock in outboxes:
            sock.close()
        ctx.term()


def routed_delivery(outboxes: list[Any], routes: dict[str, int], front_pids: dict[int, int],
                    sent: list[int] | None = None) -> Callable[[Any], None]:
    """A shared core sender's delivery (`_Sender` with routes): send each message to the fronts
    it is for (a `To` to its front, a `Step` split by `routes`, anything else to every front).

    A send that would block means no front is connected there (it died, or is starting again:
    dropped), or a live front has `FRONT_QUEUE` messages unread: it stopped reading (a hung
    event loop). Its streams could only lose tokens from there, and its queue would grow in this
    process for good, so after `STUCK_SENDS` such sends in a row the front is killed: the core
    aborts its requests when its pidfd fires and the launcher starts it again (long before, the
    loop found it stalled and aborted its requests: `CoreLoop.check_stalls`).

    `sent[front]` counts the messages that front's socket took since its last `Ready` (the front
    counts what it reads from there on)."""
    encode = core_encoder.encode
    dropped = [0] * len(outboxes)
    if sent is None:
        sent = [0] * len(outboxes)

    def send(front: int, message: Any) -> None:
        try:
            outboxes[front].send(encode(message), zmq.NOBLOCK)
        except zmq.Again:  # no front connected there, or a live one that stopped reading
            dropped[front] += 1
            if dropped[front] == 1:
                log.warning("core.front_unreachable", front=front)
            pid = front_pids.get(front)
            if pid is not None and dropped[front] >= STUCK_SENDS:
                log.error("core.front_stuck", front=front, pid=pid, queued=FRONT_QUEUE)
                with contextlib.suppress(OSError):  # (gone meanwhile)
                    os.kill(pid, signal.SIGKILL)
                dropped[front] = 0
        except zmq.ZMQError as exc:
            log.warning("core.send_failed", front=front, error=str(exc))
        else:
            dropped[front] = 0
            sent[front] = 0 if type(message) is Ready else sent[front] + 1

    def deliver(message: Any) -> None:
        if isinstance(message, To):
            send(message.front, message.message)
        elif isinstance(message, Step):
            for front, part in split_step(message, routes, len(outboxes)):
                send(front, part)
        else:  # Stopped, a PD answer: every front
            for front in range(len(outboxes)):
                send(front, message)

    return deliver

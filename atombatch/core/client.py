"""`CoreClient`: the front's handle on an engine core process, with `AsyncBatcher`'s async API.

    client = CoreClient(functools.partial(build_batcher, ...))   # a picklable factory
    client.start_process()          # optional: spawn and wait for Ready now (ConfigError here)
    async with client:              # start() also spawns if start_process() was not called
        async for out in client.stream(prompt, params): ...

The factory runs in the child (spawned, so it must be picklable: a module-level function or a
`functools.partial` of one) and returns the `Batcher` the core steps. The front validates every
request against the rules the core reported (`RequestRules`) and bounds the queue itself
(lanes + `max_waiting` choices in flight answer `CapacityError`), so a refused request never
reaches the core. Outputs come back one message per engine step, read by the event loop itself
(a reader on the socket's file descriptor; no thread, so nothing competes with the loop for the
interpreter lock), at most `READ_BATCH` messages before other callbacks run.

If the core process exits unexpectedly, every request in flight ends with
`finish_reason="error"`, `running` turns False, `submit` raises `UnavailableError`, and
`on_core_exit` (if given) is called in the event loop, e.g. to stop the server.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq

from atombatch.api.options import DEFAULT_CORE_HANG_TIMEOUT
from atombatch.api.structs import RequestOutput, SamplingParams
from atombatch.api.validation import queue_limit, validate_request
from atombatch.artifact.config import ArtifactConfig
from atombatch.core.lora import LoraFront
from atombatch.core.messages import (
    Abort,
    Consumed,
    Failed,
    Hello,
    Ready,
    Shutdown,
    Step,
    Stopped,
    Submit,
    core_decoder,
    front_encoder,
)
from atombatch.core.pd import PDFront, PDOptions, pd_eligible
from atombatch.core.process import SOCKET_DIR_PREFIX, run_core
from atombatch.core.shared import (
    ACK_EVERY,
    ACK_INTERVAL,
    HELLO_INTERVAL,
    CorePeer,
    SharedCore,
    endpoints,
)
from atombatch.engine.aio import DEFAULT_MAX_UNCLAIMED, DEFAULT_MAX_UNCLAIMED_BYTES, OutputStreams
from atombatch.engine.batcher import Batcher, EngineStats, KVSource
from atombatch.errors import CapacityError, ConfigError, RequestError, UnavailableError
from atombatch.logs import logger

log = logger("atombatch.core")

READ_BATCH = 64   # core messages the event loop handles in one go before other callbacks run
EXIT_GRACE = 0.2  # seconds the socket is still read after the core exits (its last messages)
HANG_CHECK_S = 1.0  # how often the event loop checks that a core with requests in flight is heard


class _Leftovers:
    """What a started client owns outside the process: the core and the directory of its IPC
    sockets. `release` ends both; it runs on `close`, on a failed start, when the front sees the
    core die (the directory only), when the client is garbage-collected, and at interpreter exit
    (before multiprocessing's own exit handler would wait for the core forever)."""

    def __init__(self, directory: str) -> None:
        self.directory: str | None = directory
        self.process: Any = None

    def remove_directory(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def release(self) -> None:
        atexit.unregister(self.release)
        process, self.process = self.process, None
        if process is not None and process.is_alive():
            process.terminate()
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
        self.remove_directory()


class CoreClient(LoraFront, PDFront, OutputStreams):
    """Serve requests from an engine core in a child process (see the module docstring).

    Args:
        factory: picklable callable returning the `Batcher` to run; called in the child.
        startup_timeout: seconds the core may take to build its engine (weights, compilation).
        hang_timeout: seconds a core with requests in flight (or asked to stop) may send
            nothing at all (between device calls it sends a message at least every quarter
            second: keep this above the longest device call) before it counts as hung (a
            device call that never returns, a stopped process) and is killed: its requests end
            with `finish_reason="error"` and `on_core_exit` is called; `close()` waits no
            longer than that for a silent core.
        max_unclaimed, max_unclaimed_bytes, stream_interval: as `AsyncBatcher`'s.
        on_core_exit: called (in the event loop, with the exit code) when the core exits
            without being asked to.
        pd: PD through the core (atombatch/core/pd.py): the core holds the producer pool and
            every eligible request takes its KV from a producer.
        shared: connect to a core that several fronts share (atombatch/core/shared.py) instead
            of spawning one; `factory` is then unused (None). Closing the client leaves that
            core running (its launcher stops it).
    """

    def __init__(self, factory: Callable[[], Batcher] | None, *, startup_timeout: float = 600.0,
                 hang_timeout: float = DEFAULT_CORE_HANG_TIMEOUT,
                 max_unclaimed: int = DEFAULT_MAX_UNCLAIMED,
                 max_unclaimed_bytes: int = DEFAULT_MAX_UNCLAIMED_BYTES,
                 stream_interval: int = 1,
                 on_core_exit: Callable[[int | None], None] | None = None,
                 pd: PDOptions | None = None, shared: SharedCore | None = None) -> None:
        super().__init__(max_unclaimed, max_unclaimed_bytes, stream_interval)
        if factory is None and shared is None:
            raise ConfigError("CoreClient needs a factory (or shared=SharedCore(...))")
        self.shared = shared
        self.pd_options = pd
        self.factory = factory
        self.startup_timeout = startup_timeout
        if isinstance(hang_timeout, bool) or not isinstance(hang_timeout, int | float) or \
                not hang_timeout > 0:  # (a bool or a string would pass, or raise TypeError)
            raise ConfigError(f"hang_timeout={hang_timeout!r} must be a positive number of seconds")
        self.hang_timeout = hang_timeout
        self.on_core_exit = on_core_exit
        self.ready: Ready | None = None
        self._stats: EngineStats | None = None
        self._process: Any = None
        self._ctx: Any = None
        self._to_core: Any = None
        self._from_core: Any = None
        self._dir: str | None = None
        self._leftovers: _Leftovers | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading = False                 # the loop's readers are registered
        self._stopped = False                 # the core said Stopped
        self._choices: dict[str, int] = {}    # in-flight requests: n of each
        self._in_flight_choices = 0
        self._closing = False
        self._dead = False
        self._hung = False                    # the core went silent and was killed (hang_timeout)
        self._frames = 0                      # messages read from the core (its liveness)
        self._heard_at = 0.0                  # time.monotonic() of the last message read (or
                                              #   of the last check with nothing in flight)
        self._acks = shared is not None       # tell the (shared) core what was read: Consumed
        self._acked = 0                       # `_frames` as last told the core
        self._acked_at = 0.0
        self._next_id = 0
        self._starting = threading.Lock()     # one start_process at a time: one core

    # -- lifecycle ----------------------------------------------------------------------------------
    def start_process(self) -> Ready:
        """Spawn the core and wait until its engine is built (idempotent: a second caller,
        from any thread, waits for the first and gets its `Ready`).

        Raises:
            ConfigError: the factory raised one (its message), or the core died or timed out
                while starting.
        """
        with self._starting:
            return self._start_once()

    def _start_once(self) -> Ready:
        if self.ready is not None:
            return self.ready
        if self.shared is not None:
            try:
                return self._connect_shared(self.shared)
            except BaseException:
                self._cleanup()
                raise
        self._dir = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX)
        self._leftovers = _Leftovers(self._dir)
        weakref.finalize(self, self._leftovers.release)
        try:
            return self._start_process(self._dir, self._leftovers)
        except BaseException:  # a failed spawn, a timeout, Ctrl-C while the engine builds
            self._kill()
            raise

    def _connect_shared(self, shared: SharedCore) -> Ready:
        """Connect to this front's pair of a shared core and say Hello until it answers."""
        to_core, from_core = endpoints(shared.directory, shared.front)
        self._process = CorePeer(shared.core_pid)
        self._ctx = zmq.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.connect(to_core)
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.LINGER, 0)
        self._from_core.connect(from_core)
        hello = front_encoder.encode(Hello(front=shared.front, pid=os.getpid()))
        waited = 0.0
        while True:
            self._to_core.send(hello)
            if self._from_core.poll(int(HELLO_INTERVAL * 1000)):
                message = core_decoder.decode(self._from_core.recv())
                if isinstance(message, Ready):
                    break
                continue  # (nothing else is sent to a front before its Ready)
            waited += HELLO_INTERVAL
            if not self._process.is_alive():
                raise ConfigError(f"the engine core (pid {shared.core_pid}) exited")
            if waited > self.startup_timeout:
                raise ConfigError(f"the engine core did not answer within "
                                  f"startup_timeout={self.startup_timeout:g} s")
        self.ready = message
        self._stats = message.stats
        log.info("core.ready", pid=message.pid, front=shared.front, fronts=shared.fronts)
        return message

    def _start_process(self, directory: str, leftovers: _Leftovers) -> Ready:
        to_core, from_core = (f"ipc://{os.path.join(directory, name)}" for name in ("in", "out"))
        self._ctx = zmq.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.bind(to_core)
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.LINGER, 0)
        self._from_core.bind(from_core)
        spawn = multiprocessing.get_context("spawn")
        self._process = spawn.Process(target=run_core, name="atombatch-core",
                                      args=(self.factory, to_core, from_core, os.getpid(),
                                            self.pd_options))
        self._process.start()
        leftovers.process = self._process
        # registered after start(), so it runs before multiprocessing's exit handler, which
        # would wait for a core that waits for its front
        atexit.register(leftovers.release)
        waited = 0.0
        while not self._from_core.poll(100):
            waited += 0.1
            if not self._process.is_alive():
                # a core that fails sends `Failed`, then exits: the message can still be on its
                # way through the front's ZeroMQ thread when the exit is seen
                if self._from_core.poll(1000):
                    break
                code = self._process.exitcode
                self._cleanup()
                raise ConfigError(f"the engine core exited with code {code} while starting")
            if waited > self.startup_timeout:
                self._kill()
                raise ConfigError(f"the engine core did not start within "
                                  f"startup_timeout={self.startup_timeout:g} s")
        message = core_decoder.decode(self._from_core.recv())
        if isinstance(message, Failed):
            self._process.join(10)
            self._cleanup()
            raise ConfigError(message.error) if message.config else \
                ConfigError(f"the engine core failed to start: {message.error}")
        assert isinstance(message, Ready)
        self.ready = message
        self._stats = message.stats
        log.info("core.ready", pid=message.pid, artifact=message.rules.artifact.label)
        return message

    async def start(self) -> None:
        """Spawn the core (unless `start_process` did) and start receiving its outputs (in
        the running loop: after the loop it started in closed, `start` again in the next)."""
        if self._reading:
            if not self._loop_closed():
                return
            self._stop_reading()  # its readers went with their loop
        if self._dead or self._closing or (self.ready is not None and self._from_core is None):
            # its sockets are closed (or the core exited): a client runs one core
            raise UnavailableError("the engine core client was closed or its core exited: "
                                   "start a new CoreClient")
        if self.ready is None:
            await asyncio.to_thread(self.start_process)
        self._closing = False
        self._attach(asyncio.get_running_loop())

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the core's socket and watch its process from `loop`."""
        self._loop = loop
        self._reading = True
        loop.add_reader(self._from_core.getsockopt(zmq.FD), self._read)
        loop.add_reader(self._process.sentinel, self._on_process_exit)
        self._read()  # what arrived before the reader was there (the descriptor signals edges)
        self._heard_at = time.monotonic()
        loop.call_later(HANG_CHECK_S, self._check_alive)

    def _check_alive(self) -> None:
        """Event loop timer: a core with requests in flight sends a message between any two
        device calls at least every quarter second (a heartbeat between its steps' outputs);
        one silent for `hang_timeout` seconds since the last message read is hung (a device
        call that never returns, a stopped process). It is killed, and its exit then fails what
        was in flight, as when a core dies (`on_core_exit`: the server stops)."""
        loop = self._loop
        if not self._reading or self._closing or loop is None or self._process is None or \
                self._hung:
            return  # (close() watches the core itself; a hung one was killed already)
        now = time.monotonic()
        if not self._in_flight_choices:
            self._heard_at = now  # nothing to hear: not silent
        elif now - self._heard_at > self.hang_timeout:
            # what waits unread is read first: then this loop was what stood still, not the
            # core (read, not polled: a poll takes the descriptor's signal, and the reader
            # would not run again for what waits)
            self._read()
            if now - self._heard_at > self.hang_timeout:
                self._kill_hung()
                return
        loop.call_later(HANG_CHECK_S, self._check_alive)

    def _kill_hung(self, **why: Any) -> None:
        """SIGKILL a core found hung; its sentinel fires: `_on_process_exit` fails what was in
        flight (a shared core: its launcher then stops every front, as when a core dies)."""
        assert self._process is not None
        log.error("core.hung", pid=self.core_pid, silent_s=self.hang_timeout,
                  in_flight=self._in_flight_choices, **why)
        self._hung = True
        self._process.kill()

    def _send_stalled(self, waited: float) -> bool:
        """A core that took no message off its socket for `hang_timeout` seconds (its queue is
        full: a stopped process takes nothing) is hung: killed, rather than the event loop
        waiting in the send for good, where no hang check runs (a shared core's receiver
        drains every front's socket: one refused that long is hung for every front)."""
        if self._hung:  # killed already: its exit is on its way
            return True
        if waited <= self.hang_timeout:
            return False
        self._kill_hung(send_refused_s=round(waited, 1))
        return True

    def _loop_closed(self) -> bool:
        loop = self._loop
        return loop is not None and loop.is_closed()

    async def close(self, drain: bool = True) -> None:
        """Stop the core: with `drain`, in-flight requests finish first, else they are aborted."""
        if self._process is None:
            return
        self._closing = True
        if self._reading and self._loop_closed():  # started in a loop that is gone: read here
            self._stop_reading()
            self._attach(asyncio.get_running_loop())
        if not self._dead:
            with contextlib.suppress(zmq.ZMQError):
                self._send_to_core(Shutdown(drain=drain))
            # the loop delivers the last outputs, then reads Stopped; a core that sends nothing
            # for `hang_timeout` seconds meanwhile is hung (a stopped process, a device call
            # that never returns) and is killed below
            loop = asyncio.get_running_loop()
            heard, heard_at = self._frames, loop.time()
            while self._reading and not self._stopped:
                await asyncio.sleep(0.01)
                if self._frames != heard:
                    heard, heard_at = self._frames, loop.time()
                elif loop.time() - heard_at > self.hang_timeout:
                    log.error("core.hung", pid=self.core_pid, silent_s=self.hang_timeout,
                              in_flight=self._in_flight_choices)
                    self._hung = True
                    break
            if self.shared is None and not self._hung:  # a shared core serves on: its
                await asyncio.to_thread(self._process.join, 30)  # launcher stops it
        self._stop_reading()
        if self._hung:
            self._process.kill()  # (a shared core too: it is hung for every front)
        self._kill()
        if self._hung:  # what was in flight ends as when a core dies (finish_reason "error")
            self._fail_in_flight("the engine core stopped answering while closing (no "
                                 f"message for {self.hang_timeout:g} s): killed")

    def _kill(self) -> None:
        """End the core this client spawned (a shared core is left to its launcher)."""
        if self._process is not None and self.shared is None and self._process.is_alive():
            self._process.terminate()
            self._process.join(5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
        self._cleanup()

    def _cleanup(self) -> None:
        self._stop_reading()
        for sock in (self._to_core, self._from_core):
            if sock is not None:
                sock.close(linger=0)
        self._to_core = self._from_core = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if isinstance(self._process, CorePeer):
            self._process.close()
        if self._leftovers is not None:
            self._leftovers.release()
        self._dir = None

    # -- what a front asks of the engine (the same on AsyncBatcher) -------------------------------
    def _rules_ready(self) -> Ready:
        if self.ready is None:
            raise UnavailableError("the engine core is not started (call start() or "
                                   "start_process())")
        return self.ready

    @property
    def artifact(self) -> ArtifactConfig:
        return self._rules_ready().rules.artifact

    @property
    def max_waiting(self) -> int | None:
        return self._rules_ready().max_waiting

    @property
    def policy_label(self) -> str:
        return self._rules_ready().policy

    @property
    def running(self) -> bool:
        return self._reading and not self._dead and not self._closing and not self._hung and \
            not self._loop_closed()

    @property
    def dead(self) -> bool:
        """The core process exited without being asked to."""
        return self._dead

    @property
    def core_pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def stats(self) -> EngineStats:
        """The core's engine stats as of its last step (at most `STATS_INTERVAL` old)."""
        if self._stats is None:
            raise UnavailableError("the engine core is not started")
        return self._stats

    def validate(self, prompt: Sequence[int] | npt.NDArray[np.integer],
                 params: SamplingParams) -> npt.NDArray[np.int64]:
        return validate_request(self._rules_ready().rules, prompt, params, "the engine core")

    # -- requests -----------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int] | npt.NDArray[np.integer],
               params: SamplingParams | None = None, request_id: str | None = None,
               kv: KVSource | None = None, *, lora: str | None = None,
               validated: bool = False) -> str:
        """Validate and send a request to the core; outputs arrive through `outputs(id)`.
        `lora`: a LoRA adapter the core has loaded (`loras`), by name; None: the base model.
        `validated`: the caller checked it with `validate` already. The core trusts what it is
        sent and checks nothing again: each request is validated once.

        Raises:
            UnavailableError: not started, closing, or the core exited.
            RequestError: the request is invalid, or `kv` is given (a PD source lives in the
                process that decodes: give the client `pd=PDOptions(...)` instead).
            CapacityError: lanes + `max_waiting` choices are already in flight.
        """
        if not self.running:
            reason = "exited" if self._dead else "is not running"
            raise UnavailableError(f"the engine core {reason}")
        if kv is not None:
            raise RequestError("a KV source cannot cross into the engine core process: give "
                               "CoreClient pd=PDOptions(producers) and the core opens sources "
                               "itself (docs/pd.md)")
        params = params or SamplingParams()
        ready = self._rules_ready()
        tokens = np.asarray(prompt, dtype=np.int64) if validated else \
            validate_request(ready.rules, prompt, params, "the engine core")
        self.check_lora(lora)
        limit = queue_limit(ready.rules.artifact.batch_size, ready.max_waiting,
                            self.shared.fronts if self.shared is not None else 1)
        # with a shared core: this front's share of the core's queue
        if limit is not None and self._in_flight_choices + params.n > limit:
            if self.shared is not None:  # (the core's queue may have room: not this front)
                raise CapacityError(f"queue is full: this front has {self._in_flight_choices}"
                                    f" of its {limit} choices in flight (lanes + "
                                    f"max_waiting={ready.max_waiting} over "
                                    f"{self.shared.fronts} fronts)")
            waiting = max(0, self._in_flight_choices - ready.rules.artifact.batch_size)
            raise CapacityError(f"queue is full: {waiting} requests wait, "
                                f"max_waiting={ready.max_waiting}")
        if request_id is None:  # a shared core's fronts (and their restarts) count apart
            request_id = f"creq-{self._next_id}" if self.shared is None else \
                f"creq-{self.shared.front}.{os.getpid()}-{self._next_id}"
            self._next_id += 1
        self._open(request_id)
        if not self._in_flight_choices:  # silence counts from here (the hang check)
            self._heard_at = time.monotonic()
        self._choices[request_id] = params.n
        self._in_flight_choices += params.n
        pd = self.pd_options is not None and pd_eligible(params)
        self._send_to_core(Submit(request_id, tokens.tobytes(), params, pd, lora))  # never blocks
        return request_id

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op once it finished); the core frees its lane before its next
        step."""
        if request_id in self._queues and not self._dead and self._to_core is not None:
            self._send_to_core(Abort([request_id]))

    # -- outputs ------------------------------------------------------------------------------------
    def _read(self, limit: int | None = READ_BATCH) -> None:
        """Event loop: handle what the core sent, up to `limit` messages (None: all of it);
        past the limit the rest is read after the callbacks that are ready (HTTP, streams)."""
        sock = self._from_core
        count = 0
        while self._reading and sock is not None:
            if limit is not None and count == limit:
                # still more, and the descriptor will not signal again for it (edges only)
                assert self._loop is not None
                self._loop.call_soon(self._read)
                self._heard(count)
                return
            # drained: asked before the read, not learnt from a raised zmq.Again (whose making
            # cost ~4 % of a streaming front's CPU, once per wakeup); reading EVENTS also re-arms
            # the descriptor's edge, as a failed read does
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._heard(count)  # (the hang check's silence ends)
                return
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:  # (EVENTS said there was one: not expected, handled as drained)
                self._heard(count)
                return
            count += 1
            self._frames += 1
            try:
                message = core_decoder.decode(frame)
                if isinstance(message, Step):
                    self._on_step(message)
                elif isinstance(message, Stopped):
                    self._stopped = True
                    self._stop_reading()
                else:  # PD and routing answers (atombatch/core/pd.py)
                    self._on_message(message)
            except Exception:  # a bug; raised out of here, it would strand the messages behind
                # it (the descriptor signals no edge for what is already queued)
                log.exception("core.output_failed", size=len(frame))

    def _heard(self, count: int) -> None:
        """After a read of `count` messages: the hang check's silence ends, and a shared core
        hears what this front has read (`Consumed`, every `ACK_EVERY` messages or on a read
        `ACK_INTERVAL` after the last one; core/shared.py), which tells a front that reads
        from one that stopped."""
        if not count:
            return
        now = self._heard_at = time.monotonic()
        if self._acks and (self._frames - self._acked >= ACK_EVERY or
                           now - self._acked_at >= ACK_INTERVAL):
            self._acked, self._acked_at = self._frames, now
            self._send_to_core(Consumed(self._frames))

    def _on_process_exit(self) -> None:
        """Event loop: the core process ended. Its last messages first, then, unless it was
        asked to stop, every request in flight fails. The process can end before this side's
        ZeroMQ I/O thread has queued what it sent last (a Step, `Stopped`): the socket is read
        for `EXIT_GRACE` seconds more before the exit counts as unasked."""
        loop, process = self._loop, self._process
        if process is not None and loop is not None and not loop.is_closed():
            loop.remove_reader(process.sentinel)  # it stays readable: once is enough
        self._read(limit=None)
        if self._reading and not self._stopped and loop is not None:
            loop.call_later(EXIT_GRACE, self._exited)
        else:
            self._exited()

    def _exited(self) -> None:
        self._read(limit=None)
        self._stop_reading()
        if self._process is None or self._dead or self._from_core is None:
            return  # (no socket: closed meanwhile)
        self._process.join(1)
        if not self._stopped:
            self._core_exited(self._process.exitcode)

    def _stop_reading(self) -> None:
        if not self._reading:
            return
        self._reading = False
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if self._from_core is not None:
            loop.remove_reader(self._from_core.getsockopt(zmq.FD))
        if self._process is not None:
            loop.remove_reader(self._process.sentinel)

    def _on_step(self, step: Step) -> None:
        if step.stats is not None:
            self._stats = step.stats
            if step.pd is not None:
                self.pd_stats = step.pd
        if step.ids:
            queues = self._queues
            tokens = np.frombuffer(step.tokens, np.int64).tolist()
            if self.stream_interval > 1:
                for request_id, token in zip(step.ids, tokens, strict=True):
                    self._deliver(RequestOutput(request_id=request_id, new_token_ids=(token,),
                                                finished=False))
            else:  # a plain token travels as a bare int (atombatch/api/mailbox.py): no struct
                get = queues.get
                for request_id, token in zip(step.ids, tokens, strict=True):
                    box = get(request_id)
                    if box is not None:
                        box.put_plain(token)
        for out in step.outputs:
            if out.finished:
                self._finish(out.request_id)
            self._deliver(out)

    def _finish(self, request_id: str) -> None:
        n = self._choices.pop(request_id, 0)
        self._in_flight_choices -= n

    def _fail_in_flight(self, error: str) -> None:
        """Every request in flight ends with `finish_reason="error"` and `error`."""
        for request_id in list(self._queues):
            self._finish(request_id)
            self._deliver(RequestOutput(request_id=request_id, new_token_ids=(), finished=True,
                                        finish_reason="error", error=error))

    def _core_exited(self, code: int | None) -> None:
        self._dead = True
        self._fail_lora_calls()
        if self._leftovers is not None:  # nobody will connect to these sockets again
            self._leftovers.remove_directory()
        log.error("core.exited", exit_code=code, in_flight=len(self._queues))
        self._fail_in_flight(f"the engine core sent nothing for {self.hang_timeout:g} s with "
                             "requests in flight and was killed (hung)" if self._hung else
                             f"the engine core exited (code {code})")
        if self.on_core_exit is not None and not self._closing:
            self.on_core_exit(code)

"""The engine core's process: build the engine, then step it and nothing else.

`run_core` is the process's target. It connects to the front's two IPC endpoints, builds the
`Batcher` with the factory it was given (so the weights load here, not in the front), reports
`Ready`, and loops: take what the front sent (without waiting while there is work), run one engine
step, send what it produced as one `Step`. It never parses HTTP, renders templates or formats
logprobs; everything it receives was validated by the front against the rules it reported.

It exits when the front asks (`Shutdown`), and also when the front is gone: its parent process
exited (checked every loop) or its socket peer vanished, aborting every request it held first.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from atombatch.aio import fail_all
from atombatch.core.messages import (
    Abort,
    Failed,
    Producers,
    ProducerVerdicts,
    Ready,
    Shutdown,
    Step,
    Stopped,
    Submit,
    SummaryRequest,
    core_encoder,
    front_decoder,
)
from atombatch.core.pd import CorePD, PDOptions
from atombatch.core.routing import CoreSummaries
from atombatch.engine import Batcher
from atombatch.errors import ConfigError
from atombatch.logs import logger
from atombatch.structs import RequestOutput

log = logger("atombatch.core")

STATS_INTERVAL = 0.05     # seconds between the engine stats a Step carries
IDLE_WAIT_MS = 100        # how long an idle core waits for a message before checking its parent
PD_POLL_MS = 2            # while every unfinished request waits on a KV producer
_NO_TOKENS = np.zeros(0, np.int64)   # a Step without plain tokens (allocated once)


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
        outbox.send(core_encoder.encode(Ready(rules=batcher.rules(), policy=batcher.policy.label,
                                              max_waiting=batcher.max_waiting,
                                              stats=batcher.stats(), pid=os.getpid())))
        # The front bounds the queue (lanes + max_waiting choices in flight): a burst of submits
        # that arrives between two steps must not be refused here for lanes not yet assigned.
        batcher.max_waiting = None
        core_pd = CorePD(pd, batcher.artifact) if pd is not None else None
        CoreLoop(batcher, inbox, outbox, parent_pid, pd=core_pd).run()
    finally:
        if core_pd is not None:
            core_pd.close()
        inbox.close(linger=0)
        outbox.close()
        ctx.term()


class CoreLoop:
    """Step a `Batcher` while taking the front's messages between steps."""

    def __init__(self, batcher: Batcher, inbox: Any, outbox: Any, parent_pid: int,
                 pd: CorePD | None = None) -> None:
        self.batcher = batcher
        self.pd = pd                          # the producer pool (PD on), else None
        self.summaries = CoreSummaries()
        self.inbox = inbox
        self.outbox = outbox
        self.parent_pid = parent_pid
        self.live: set[str] = set()           # ids the front submitted that have not finished
        self.errors: list[RequestOutput] = []  # submits the engine refused, sent with the next Step
        self.stopping: Shutdown | None = None
        self.stats_at = 0.0

    def run(self) -> None:
        batcher = self.batcher
        stale = False        # the front's stats predate the last step
        while True:
            busy = batcher.has_unfinished()
            wait = 0 if busy and not batcher.idle else PD_POLL_MS if busy else IDLE_WAIT_MS
            self.take(wait)
            if os.getppid() != self.parent_pid:  # the front died: nobody reads our outputs
                log.warning("core.front_gone", aborted=len(self.live))
                for request_id in list(self.live):
                    batcher.abort(request_id)
                return
            if self.stopping is not None and not batcher.has_unfinished():
                self.send(self.step_message([], [], _NO_TOKENS, force_stats=True))
                self.outbox.send(core_encoder.encode(Stopped()))
                return
            if not batcher.has_unfinished():
                if self.errors or stale:  # gone idle: the front sees the final counts
                    self.send(self.step_message([], [], _NO_TOKENS, force_stats=True))
                    stale = False
                continue
            stale = True
            try:
                result = batcher.step_arrays()
            except Exception as exc:  # a bug, not a request failure: fail everything in flight
                log.exception("core.step_failed")
                outputs = fail_all(batcher, list(self.live), exc)
                self.send(self.step_message([], outputs, _NO_TOKENS))
                continue
            plain = result.plain
            if plain.any():
                rows = np.flatnonzero(plain)
                lane_ids = result.request_ids
                ids = [lane_ids[lane] for lane in result.lanes[rows].tolist()]
                tokens = result.tokens[rows]
            else:
                ids, tokens = [], _NO_TOKENS
            if ids or result.outputs or self.errors:
                self.send(self.step_message(ids, result.outputs, tokens))

    def step_message(self, ids: list[Any], outputs: list[RequestOutput],
                     tokens: np.ndarray, force_stats: bool = False) -> Step:
        if self.errors:
            outputs = self.errors + outputs
            self.errors = []
        for out in outputs:
            if out.finished:
                self.live.discard(out.request_id)
        now = time.monotonic()
        stats = None
        if force_stats or now - self.stats_at >= STATS_INTERVAL or \
                not self.batcher.has_unfinished():  # going idle: the final counts
            stats = self.batcher.stats()
            self.stats_at = now
        pd = self.pd.stats() if self.pd is not None and stats is not None else None
        return Step(ids=ids, tokens=tokens.astype(np.int64, copy=False).tobytes(),
                    outputs=outputs, stats=stats, pd=pd)

    def send(self, message: Step) -> None:
        # copied: a zero-copy frame costs a round trip through pyzmq's GC thread
        self.outbox.send(core_encoder.encode(message))

    def take(self, wait_ms: int) -> None:
        """Apply every message the front sent; wait up to `wait_ms` for the first."""
        if self.pd is not None and self.pd.report_due:  # the pool changed on its own (probe)
            self.pd.report_due = False
            self.send(self.step_message([], [], _NO_TOKENS, force_stats=True))
        if not self.inbox.poll(wait_ms):
            return
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = front_decoder.decode(frame)
            if isinstance(message, Submit):
                self.submit(message)
            elif isinstance(message, Abort):
                for request_id in message.request_ids:
                    self.batcher.abort(request_id)
            elif isinstance(message, Shutdown):
                self.stopping = message
                if not message.drain:
                    for request_id in list(self.live):
                        self.batcher.abort(request_id)
            elif isinstance(message, Producers | ProducerVerdicts):
                if self.pd is not None:  # answered with the pool's new state
                    self.pd.apply(message)
                    self.send(self.step_message([], [], _NO_TOKENS, force_stats=True))
            elif isinstance(message, SummaryRequest):
                self.outbox.send(core_encoder.encode(self.summaries.answer(self.batcher,
                                                                           message)))

    def submit(self, message: Submit) -> None:
        tokens = np.frombuffer(message.prompt, dtype=np.int64)
        kv = None
        try:
            if self.pd is not None:  # validated before any producer is asked
                kv = self.pd.source(self.batcher, message, tokens)
            self.batcher.submit(tokens, message.params, request_id=message.request_id, kv=kv)
        except Exception as exc:  # one bad request must not stop the loop
            if kv is not None:
                kv.close()
            self.errors.append(RequestOutput(request_id=message.request_id, new_token_ids=(),
                                             finished=True, finish_reason="error",
                                             error=str(exc)))
            return
        self.live.add(message.request_id)

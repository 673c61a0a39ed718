"""Decode steps launched back to back: the device runs step N+1 while the host finishes step N.

Between two synchronous decode calls the host picks the tokens, appends them, checks the stop
conditions, builds the outputs, schedules and builds the next inputs: 100-300 us at B64 on the
machines we measure (cold caches after the device wait), all of it device idle time. With
`Batcher(overlap=True)` a steady decode (every busy lane decoding, nothing to admit, stage or
prefill, no grammar) runs as a pipeline of `Flight`s on a `DeviceThread`:

- While the device runs step N, the engine's thread lands step N-1 (its tokens, stops and
  outputs) and builds step N+1's inputs *ahead*, before step N's tokens exist: every lane one
  position further, its blocks grown for it, its token still unknown (`StepKernel.build_ahead`).
- When step N returns, the device thread takes its argmax (and draws the rows that sample,
  once the engine has landed step N-1: their penalties count every token before), writes those
  tokens into step N+1's `input_ids` (each row's source row is in the flight's `gather`) and
  calls the device again at once: what stands between two device calls is the argmax (the
  draws) and that copy. For a float32 step below `RowArgmax.min_elements` logits the argmax and
  the picked logits are one compiled call on the runtime's array (`blocks.argmax_call`): the
  checks, numpy's dispatch and a second pass cost 40-50 us more after a device wait.

A lane that stops on a stop id in step N has already been given a row in step N+1: the device
computes it (the KV of the request's last token, in its own blocks) and the landing drops it
(the lane no longer decodes: ROW_SKIPPED). A lane whose output limit step N reaches gets no row.
Nothing the host does while a flight is in the air lets the device read what another request
wrote: blocks a finished or aborted request gives back while its row is in the air are only
written again by later device calls (device calls run in order).

A request that arrives while the pipeline runs, with an idle lane for it, is admitted while step
N is on the device (`Scheduler.plan_prefill_ahead`: only onto a lane no flight in the air has a
row for, with blocks from the free list or evicted CACHED ones, never by preempting); its first
prefill chunk is the flight after step N. Arrivals that wait together (a wave: lanes that ended
in one step, refilled at once) are decided together, as a chain: each next one's chunk is
planned to run right after the one before it (`then`, up to kv_manager.MAX_CHAIN) while step N
is still on the device, so the thread runs the wave's chunks back to back with no decision of
the host between them (`Batcher._chain_wave`; a chunk at a time, each waited for the engine
thread to land the one before it, on a host whose cores the front and its clients keep busy).
The decode of the other lanes is the flight after the last chunk: decided with the chunk (the
chain) while step N is still on the device when nothing else may prefill first (`then`,
`Scheduler.plan_chunk_decode`: its rows take step N's tokens, gathered in after the chunk), else
built once step N has landed (`Scheduler.plan_after_prefill`, from tokens that are known). A
greedy request decodes in that step too (every greedy request of a chain), its token its chunk's
argmax, written in by the device thread (`join_row`); one that samples joins the decode after
that. A hybrid model (sliding slots) admits the same way: the decode built after a chunk gives
the chunk's lane no padding row (it would write the fresh window's position 0), or is not built
when no other slot is free for its padding rows (a greedy request joining it needs none in a
full batch); its prefix cache (slot checkpoints) keeps the whole pipeline off. Behind a full
batch the queue's head is staged into the spare the same way, and a request fully staged takes a
lane that freed (`Scheduler.rotate_ahead`) and joins the next step built. Later chunks, block
ops, a grammar or any step that is not one of these waits until the pipeline is empty (the
engine then schedules as usual, one device call per `step()`).

The thread hand-offs are bare locks and a C queue of the landed flights (a `threading.Event` or
`Condition` costs the critical path ~20 us more), and the device thread does everything the
critical path needs itself: the engine thread, which holds the interpreter lock for its Python,
is never between two device calls.
"""

from __future__ import annotations

import _thread
import contextlib
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from atombatch.engine.request import StepPlan
from atombatch.errors import RequestError, StateError
from atombatch.kernel import blocks as core
from atombatch.sampling.argmax import RowArgmax

NUM_FLIGHTS = 3   # the one landed (its arrays read by the caller), the one on the device, the next


class Flight:
    """One decode call of the pipeline, with the buffers it owns: its inputs (a `DecodeInputs`),
    its argmax and the logit each row picked (the logits themselves belong to the runtime,
    which the next call writes), and `gather`: the row of the previous flight whose token each of
    its rows takes (-1: padding, token 0).

    A `prefill` flight is a request's prefill chunk planned while a decode was on the device
    (`Scheduler.plan_prefill_ahead`): the thread calls it after that decode (or after the chunk
    before it in a wave's chain) and keeps its logits for the landing (a copy, whenever another
    call runs after it). Its `index` is that of the decode before the chunks."""

    def __init__(self, index: int, plan: StepPlan, batch_size: int,
                 prefill: bool = False) -> None:
        self.index = index
        self.plan = plan
        self.prefill = prefill
        self.greedy = np.zeros(batch_size, dtype=np.int64)
        self.best = np.zeros(batch_size, dtype=np.float32)
        self.gather = np.full(batch_size, -1, dtype=np.int32)
        self.error: BaseException | None = None
        self.next: Flight | None = None   # the flight the device thread launched after this one
        # the rows that sample, (row, lane, request, sampler), set by the engine with the plan;
        # the device thread draws them and leaves (result or exception, the rows it drew)
        self.special: list[Any] = []
        self.drawn: tuple[Any, list[Any]] | None = None
        self.logits: Any = None           # the call's logits, until its rows are drawn
        self.owner: Any = None            # a prefill flight's request (the one it was planned for)
        # what follows a prefill flight, decided with it (the thread runs it next without
        # waiting for `decide`): the next chunk of a wave's chain, or the decode after the
        # chunks, built while the decode before them was on the device
        self.then: Flight | None = None
        # a decode flight after a chunk: the decode before the chunk, whose tokens feed its rows
        # (None: those are known)
        self.source: Flight | None = None
        # a prefill flight whose request decodes in the decode after it (its chain's): that
        # flight and the request's row there (-1: none), whose token is the chunk's greedy pick
        self.join_into: Flight | None = None
        self.join_row = -1
        # a decode flight: how many requests of the chunks before it joined it (a stat, counted
        # when it lands: `EngineStats.overlapped_joins`)
        self.joins = 0


class DeviceThread:
    """The thread that makes the pipeline's device calls (see the module docstring).

    The protocol, for every flight the thread runs: the engine calls `decide` exactly once (with
    the flight to launch after it, or None), unless it is a prefill flight whose `then` was set
    before it was decided (the thread launches that after it), and `land` exactly once (which
    waits for it and returns it; `flight.next` is the flight the thread launched after it, if
    any). `launch` starts a pipeline when none runs."""

    def __init__(self, decode: Callable[[Any], Any], argmax: RowArgmax,
                 vocab_size: int, draw: Callable[[Any, list[Any]], Any],
                 prefill: Callable[[Any], Any]) -> None:
        # `decode`, `prefill` and `draw` are the engine's methods, held weakly: the running
        # thread must not keep the engine (its runtime, its KV cache) alive once nobody else
        # holds it; the engine stops the thread when it goes (`stop`, from a `weakref.finalize`)
        self._decode = weakref.WeakMethod(decode)  # type: ignore[arg-type]
        self._prefill = weakref.WeakMethod(prefill)  # type: ignore[arg-type]
        self._argmax = argmax
        self._draw = weakref.WeakMethod(draw)  # type: ignore[arg-type]
        self._vocab = vocab_size
        self._stopped = False
        self._start = _thread.allocate_lock()    # released: a flight to run (`launch`)
        self._decided = _thread.allocate_lock()  # released: `decide` said what comes next
        # the flights the thread finished, in order, until `land` takes them: after a chunk
        # with its decode decided (`then`) the thread may finish the chunk before the engine has
        # taken the decode before it (a C queue: a put or a get costs what a bare lock does)
        self._landed: queue.SimpleQueue[Flight] = queue.SimpleQueue()
        for lock in (self._start, self._decided):
            lock.acquire()
        self._first: Flight | None = None
        self._next: Flight | None = None
        self.running = False     # a flight was launched and not landed yet
        self._thread = threading.Thread(target=self._run, name="atombatch-device", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread at its next wait (its engine is gone: nothing will launch, decide or
        land again)."""
        self._stopped = True
        for lock in (self._start, self._decided):
            if lock.locked():
                with contextlib.suppress(RuntimeError):  # released meanwhile: it wakes anyway
                    lock.release()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def launch(self, flight: Flight) -> None:
        if self.running:
            raise StateError("a decode pipeline is already running: land it first")
        self.running = True
        self._first = flight
        self._start.release()

    def decide(self, flight: Flight | None) -> None:
        """What the thread runs after the flight on the device now: `flight`, or nothing."""
        self._next = flight
        self._decided.release()

    def land(self) -> Flight:
        """Wait for the flight on the device; returns it (its `next` runs now, if any)."""
        done = self._landed.get()
        self.running = done.next is not None
        return done

    def _run(self) -> None:
        while True:
            self._start.acquire()
            if self._stopped:
                return
            flight = self._first
            while flight is not None:
                self._call(flight)
                after = flight.then
                if after is None:
                    self._decided.acquire()  # (the engine has landed the step before this one)
                    after, self._next = self._next, None
                if self._stopped:
                    return
                if flight.special and flight.error is None:
                    self._sample(flight)
                if not flight.prefill:  # a prefill's logits are the landing's (none runs next)
                    flight.logits = None
                if flight.error is not None:
                    after = None
                elif after is not None:
                    try:
                        if flight.prefill:  # the next call may write the runtime's buffer
                            flight.logits = np.array(flight.logits)
                            self._after_chunk(flight, after)
                        elif not after.prefill:  # this call's tokens feed the next call's rows
                            core.gather_tokens(flight.greedy, after.gather,
                                               after.plan.inputs.input_ids)
                    except Exception as exc:  # a bug: the engine fails the step's requests
                        flight.error = _bare(exc)
                        after = None
                flight.next = after
                self._landed.put(flight)
                flight = after

    @staticmethod
    def _after_chunk(chunk: Flight, after: Flight) -> None:
        """The tokens a chunk gives the decode after it (after its chain's last chunk, when it is
        one of a chain): the chunk's greedy pick for its request's row (what
        `Batcher._complete_prefill` picks when the chunk lands), and, right before that decode,
        the tokens of the decode before the chunks (when that was still on the device as the
        step was built)."""
        joined = chunk.join_into
        if joined is not None and chunk.join_row >= 0:
            joined.plan.inputs.input_ids[chunk.join_row, 0] = int(np.argmax(chunk.logits))
        if not after.prefill and after.source is not None:
            core.gather_tokens(after.source.greedy, after.gather, after.plan.inputs.input_ids)

    def _sample(self, flight: Flight) -> None:
        """Draw the flight's sampled rows (their outputs hold every token before this step:
        the engine landed it before deciding), after the rows whose picked logit is not finite
        (the landing fails those); each drawn token replaces the argmax the next call takes."""
        best = flight.best
        rows = [entry for entry in flight.special if np.isfinite(best[entry[0]])]
        if not rows:
            return
        try:
            draw = self._draw()
            if draw is None:
                raise StateError("the engine is gone")
            result = draw(flight.logits, rows)
        except Exception as exc:  # a sampler bug fails these requests, not the engine
            flight.drawn = (_bare(exc), rows)
            return
        flight.drawn = (result, rows)
        masked = set(result.masked_rows)
        for i, (row, _, _, _) in enumerate(rows):
            if i not in masked and i not in result.failed:
                flight.greedy[row] = int(result.tokens[i])

    def _call(self, flight: Flight) -> None:
        flight.error = None
        flight.drawn = None
        inputs = flight.plan.inputs
        if flight.prefill:
            try:
                prefill = self._prefill()
                if prefill is None:
                    raise StateError("the engine is gone")
                flight.logits = prefill(inputs)
            except BaseException as exc:  # as a decode's: the landing fails the request
                flight.logits = None
                flight.error = _bare(exc)
            return
        try:
            decode = self._decode()
            if decode is None:
                raise StateError("the engine is gone")
            raw = decode(inputs)
            del decode
            if core.argmax_call(raw, inputs.num_rows, self._vocab, self._argmax.min_elements,
                                flight.greedy, flight.best):
                flight.logits = raw  # (a small float32 step, picked in one compiled call)
                return
            logits, source = decode_logits(raw, inputs.num_rows, self._vocab)
            self._argmax.pick(logits, source, flight.greedy, flight.best, flight.plan.rows)
            flight.logits = logits
        except BaseException as exc:  # not only Exceptions: the engine raises it again on landing
            flight.error = _bare(exc)


def decode_logits(raw: Any, rows: int, vocab: int) -> tuple[Any, Any]:
    """A decode call's logits as C-contiguous float32 [rows, vocab] (checked), and what the greedy
    argmax reads: the runtime's own array when it is wider than float32 (a float32 copy would tie
    entries it tells apart)."""
    logits = raw
    if not isinstance(logits, np.ndarray) or logits.dtype != np.float32 or \
            not logits.flags.c_contiguous:
        logits = np.ascontiguousarray(logits, dtype=np.float32)
    if logits.shape != (rows, vocab):
        raise RequestError(f"decode returned logits of shape {logits.shape}; the step ran "
                           f"{rows} rows of vocab_size={vocab}")
    wide = raw is not logits and isinstance(raw, np.ndarray) and raw.dtype.kind == "f" and \
        raw.dtype.itemsize > 4
    return logits, raw if wide else logits


def _bare(exc: BaseException) -> BaseException:
    """`exc` without its tracebacks: their frames hold the engine (its runtime, its KV) for as
    long as the flight keeps the error; the landing reports the message."""
    exc.__context__ = exc.__cause__ = None
    return exc.with_traceback(None)


def make_flights(first: StepPlan, batch_size: int, blocks_per_seq: int,
                 buckets: Any, inputs_type: Callable[..., Any]) -> list[Flight]:
    """The pipeline's flights: the first runs from the scheduler's own decode plan (what a
    synchronous step builds), the others from buffers of their own."""
    flights = [Flight(0, first, batch_size)]
    for index in range(1, NUM_FLIGHTS):
        plan = StepPlan(kind="decode", inputs=inputs_type(batch_size, blocks_per_seq, buckets))
        flights.append(Flight(index, plan, batch_size))
    return flights

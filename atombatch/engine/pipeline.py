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
N is on the device (`AheadScheduler.plan_prefill_ahead`: only onto a lane no flight in the air has a
row for, with blocks from the free list or evicted CACHED ones, never by preempting); its first
prefill chunk is the flight after step N. Arrivals that wait together (a wave: lanes that ended
in one step, refilled at once) are decided together, as a chain: each next one's chunk is
planned to run right after the one before it (`then`, up to kv_manager.MAX_CHAIN) while step N
is still on the device, so the thread runs the wave's chunks back to back with no decision of
the host between them (`PipelineRunner._chain_wave`; a chunk at a time, each waited for the engine
thread to land the one before it, on a host whose cores the front and its clients keep busy).
The decode of the other lanes is the flight after the last chunk: decided with the chunk (the
chain) while step N is still on the device when nothing else may prefill first (`then`,
`AheadScheduler.plan_chunk_decode`: its rows take step N's tokens, gathered in after the chunk), else
built once step N has landed (`AheadScheduler.plan_after_prefill`, from tokens that are known). A
greedy request decodes in that step too (every greedy request of a chain), its token its chunk's
argmax, written in by the device thread (`join_row`); one that samples joins the decode after
that. A hybrid model (sliding slots) admits the same way: the decode built after a chunk gives
the chunk's lane no padding row (it would write the fresh window's position 0), or is not built
when no other slot is free for its padding rows (a greedy request joining it needs none in a
full batch); its prefix cache (slot checkpoints) keeps the whole pipeline off. Behind a full
batch the queue's head is staged into the spare the same way, and a request fully staged takes a
lane that freed (`AheadScheduler.rotate_ahead`) and joins the next step built. Later chunks, block
ops, a grammar or any step that is not one of these waits until the pipeline is empty (the
engine then schedules as usual, one device call per `step()`).

The thread hand-offs are bare locks and a C queue of the landed flights (a `threading.Event` or
`Condition` costs the critical path ~20 us more), and the device thread does everything the
critical path needs itself: the engine thread, which holds the interpreter lock for its Python,
is never between two device calls.

What lives here, the whole pipeline in one module (the synchronous engine, atombatch/engine/step.py
and atombatch/engine/scheduler.py, reads as if it did not exist):

- `PipelineRunner`, the step runner `Batcher` is: it launches a decode it may fly
  (`_run_decode` -> `_take_off`), decides what follows each flight (`_decide`, `_chain`,
  `_chain_wave`, `_chunk_ahead`) and lands it (`_land_flight`, `_land`, `_land_prefill`); with
  the pipeline empty its `_step` runs `StepRunner._run_step`.
- `AheadScheduler`, the scheduler's decisions taken ahead (`plan_ahead`, `plan_prefill_ahead`,
  `rotate_ahead`, `plan_after_prefill`, `plan_chunk_decode`), each one `Scheduler.schedule`
  would take at that point, through the same methods.
- `Flight`, `DeviceThread` and `make_flights`: the calls and their buffers.
"""

from __future__ import annotations

import _thread
import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from atombatch.api.structs import RequestOutput
from atombatch.engine.kv_manager import MAX_CHAIN
from atombatch.engine.request import Request, RequestState, StepPlan
from atombatch.engine.scheduler import Scheduler
from atombatch.engine.step import StepRunner, decode_logits
from atombatch.errors import StateError
from atombatch.kernel import blocks as core
from atombatch.sampling.argmax import RowArgmax
from atombatch.sampling.sampler import RequestSampler, SampleResult

NUM_FLIGHTS = 3   # the one landed (its arrays read by the caller), the one on the device, the next

S = RequestState


class Flight:
    """One decode call of the pipeline, with the buffers it owns: its inputs (a `DecodeInputs`),
    its argmax and the logit each row picked (the logits themselves belong to the runtime,
    which the next call writes), and `gather`: the row of the previous flight whose token each of
    its rows takes (-1: padding, token 0).

    A `prefill` flight is a request's prefill chunk planned while a decode was on the device
    (`AheadScheduler.plan_prefill_ahead`): the thread calls it after that decode (or after the chunk
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
        `StepRunner._complete_prefill` picks when the chunk lands), and, right before that decode,
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


class PipelineRunner(StepRunner):
    """The step runner with the decode pipeline (`Batcher(overlap=True)`; the module docstring):
    a decode the pipeline may fly takes off on the device thread instead of running in the step
    (`_run_decode`), and a `_step()` then lands the flight on the device (`_land_flight`) and
    decides what follows it (`_decide`, with the `AheadScheduler`'s plans). When the pipeline is
    empty a step runs as `StepRunner`'s.
    """

    def __init__(self, *args: Any, overlap: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # overlap: steady decodes run as a pipeline on a device thread; `step()` then returns
        # the step that landed while the next one runs
        self.overlap = overlap
        self._flights: list[Flight] | None = None     # built on the first take-off
        self._device_thread: DeviceThread | None = None
        self._flight: Flight | None = None             # the pipeline's flight on the device
        self._dropped: list[Flight] = []               # land unreported (see `_land_flight`)
        self._overlapped = 0                           # flights launched after a flight
        self._overlapped_prefills = 0                  # of which prefill chunks planned ahead
        self._overlapped_joins = 0                     # requests that joined the decode after
                                                       # their chunk (counted as it lands)
        self._prefill_flights: list[Flight] = []       # the pipeline's chunks (`_decide`)
        self._max_chain = MAX_CHAIN                    # chunks a wave chains at once (`_decide`)
        self._chained = 0                              # chunks launched in a wave's chain
        # With `decide_late`, what follows the flight on the device is decided at the start of
        # the next `step()` instead of right after the landing, so that requests submitted
        # between the two steps (a closed loop's next request, once its predecessor's last
        # token is out) are admitted in the step after the one on the device, not one later.
        # Only for a consumer that steps again at once (the engine core's loop, a benchmark's):
        # the device idles from the end of the flight on it until the next `step()` decides.
        self.decide_late = False
        self._undecided: Flight | None = None
        self._held: StepPlan | None = None             # planned ahead, runs at the next step
        self._held_for: Request | None = None          # the request it was planned for
        # the scheduler, which plans ahead (`Batcher` builds an `AheadScheduler`)
        self._ahead = cast(AheadScheduler, self.scheduler)

    def _in_flight(self) -> bool:
        """A flight is on the device, or a chunk planned ahead waits for its block ops."""
        return self._flight is not None or self._held is not None

    def _step(self) -> list[RequestOutput]:
        """Land the flight on the device (the device thread has launched the next one, if it was
        decided); when the pipeline is empty, or ended with a prefill (no decode rows to report),
        a synchronous step (`StepRunner._run_step`) runs now."""
        self._decoded = False
        outputs, self._pending = self._pending, []
        running, self._undecided = self._undecided, None
        if running is not None:  # `decide_late`: with what was submitted since the landing
            self._decide(running)
        if self._flight is not None and (not self._land_flight(outputs) or
                                         self._flight is not None):
            return outputs
        if self._flights is not None and self._kernel.inputs is not self.scheduler.decode_inputs:
            # the pipeline is empty and its last step's arrays were read: steps build into the
            # scheduler's own decode buffer again
            self._kernel.use(self.scheduler.decode_inputs, 0)
        # a chunk held for its block ops runs for the request it was planned for (one aborted
        # meanwhile may have its id taken by a new request already)
        plan, self._held = self._held, None
        owner, self._held_for = self._held_for, None
        return self._run_step(outputs, plan, owner)

    def _run_decode(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        """A decode the pipeline may fly takes off (`_take_off`); any other runs in the step."""
        if self.overlap and self._can_fly():
            self._take_off(plan)
            return
        StepRunner._run_decode(self, plan, outputs)

    # -- launch ------------------------------------------------------------------------------------
    def _can_fly(self) -> bool:
        """Whether decodes may run as a pipeline now: no grammar (its mask for step N+1 needs
        step N's token) and nothing between two steps that the engine does itself (n > 1 forks,
        PD links, grammar compiles). The scheduler checks the rest (`AheadScheduler.plan_ahead`)."""
        return not self._compiling and not self._groups and not self._kv and \
            not any(sampler.grammar is not None for sampler in self._samplers.values())

    def _sampled_rows(self, plan: StepPlan) -> list[tuple[int, int, Request, RequestSampler]]:
        """(row, lane, request, sampler) of a flight's rows that sample: the device thread
        draws their tokens (`_draw`) before the logits are the next call's."""
        if not self._samplers:
            return []
        by_lane = self.scheduler.by_lane
        samplers = self._samplers
        special = []
        for row, lane in enumerate(plan.inputs.row_lanes[:plan.rows].tolist()):
            request = by_lane[lane]
            if request is not None and request.lane_flags & core.LANE_SAMPLE:
                special.append((row, lane, request, samplers[request.request_id]))
        return special

    def _take_off(self, plan: StepPlan) -> None:
        """Launch `plan` (the scheduler's decode plan, built) as the pipeline's first flight."""
        if self._flights is None:
            kv = self.scheduler.kv
            artifact = self.artifact
            self._flights = make_flights(plan, artifact.batch_size, artifact.blocks_per_seq,
                                         kv.decode_inputs.buckets, type(kv.decode_inputs))
            self._device_thread = DeviceThread(self._decode_call, self._argmax,
                                               self.spec.vocab_size, self._draw,
                                               self._prefill_call)
            self._prefill_flights = [Flight(-1, plan, artifact.batch_size, prefill=True)
                                     for _ in range(MAX_CHAIN + 1)]
            weakref.finalize(self, self._device_thread.stop)  # the thread ends with the engine
        flight = self._flights[0]
        if flight.plan is not plan:
            raise StateError("the pipeline's first flight must run the scheduler's decode plan")
        flight.special = self._sampled_rows(plan)
        flight.joins = 0
        device = self._device_thread
        assert device is not None
        hook = self.on_device_call
        if hook is not None:
            hook()
        device.launch(flight)
        self._flight = flight
        self._decide(flight)

    def _decide(self, running: Flight) -> None:
        """Tell the device thread what follows `running`: the next decode step, built ahead,
        when the pipeline may go on; else the first prefill chunk of the request the scheduler
        admits now (`AheadScheduler.plan_prefill_ahead`; a wave of them as one chain, `_chain_wave`);
        else nothing (it lands `running` and stops). After a prefill chunk, the decode of the
        lanes that decode (`AheadScheduler.plan_after_prefill`; a greedy request joins it, one that
        samples joins the step after). A chunk whose block ops are due is held for the next
        `step()`, which runs the ops and then the chunk."""
        following = None
        try:
            if self._can_fly():
                assert self._flights is not None
                candidate = self._flights[(running.index + 1) % NUM_FLIGHTS]
                candidate.source, candidate.joins = None, 0
                scheduler = self._ahead
                if running.prefill:  # the decode before it landed: the lanes' tokens are known
                    landed = self._flights[running.index].plan.inputs
                    joins = [running.owner] if self._joins(running.owner) else []
                    rows = scheduler.plan_after_prefill(candidate.plan, landed, running.plan,
                                                        candidate.gather, joins)
                    if rows is not None:
                        candidate.special = self._sampled_rows(candidate.plan)
                        running.join_into, running.join_row = candidate, rows[0] if rows else -1
                        candidate.joins = sum(row >= 0 for row in rows)
                        following = candidate
                else:
                    if scheduler.staging is not None:  # a staged request takes a freed lane
                        scheduler.rotate_ahead(running.plan, self.clock())
                    if scheduler.plan_ahead(candidate.plan, running.plan, candidate.gather):
                        candidate.special = self._sampled_rows(candidate.plan)
                        following = candidate
                if following is None and (scheduler.waiting or scheduler.staging is not None):
                    following = self._chunk_ahead(running)
                    if following is not None and not running.prefill:
                        self._chain(running, [following], candidate)
                        if following.then is None:
                            self._chain_wave(running, following, candidate)
        finally:  # exactly once per flight, even when building failed: the thread waits for it
            assert self._device_thread is not None
            self._device_thread.decide(following)

    def _chain(self, running: Flight, chain: list[Flight], candidate: Flight) -> None:
        """Decide the decode after `chain` (chunks planned ahead to run after `running`, a decode
        on the device now) together with it, when the scheduler can build it now
        (`AheadScheduler.plan_chunk_decode`): the thread then runs the chunks and the decode back to
        back, whether or not the engine has landed `running` by then. Each greedy request of
        the chain decodes in it (`join_row`: the device thread writes its chunk's argmax in)."""
        joins = [chunk.owner for chunk in chain if self._joins(chunk.owner)]
        scheduler = self._ahead
        rows = scheduler.plan_chunk_decode(candidate.plan, running.plan, chain[-1].plan,
                                           candidate.gather, joins, len(chain))
        if rows is None:
            return
        candidate.special = self._sampled_rows(candidate.plan)
        candidate.source = running
        row_of = {id(owner): row for owner, row in zip(joins, rows, strict=True)}
        for chunk in chain:
            row = row_of.get(id(chunk.owner), -1)
            if row >= 0:
                chunk.join_into, chunk.join_row = candidate, row
                candidate.joins += 1
        chain[-1].then = candidate

    def _chain_wave(self, running: Flight, first: Flight, candidate: Flight) -> None:
        """A wave of arrivals (lanes that ended together, refilled together) as one chain:
        while requests wait, idle lanes are clear of `running` (the decode on the device) and
        the policy gives them prefill turns, the next request's chunk is planned to run right
        after the last one (`then`), up to `_max_chain` chunks, and the decode of the other
        lanes after the last of them when the scheduler can build it then (`_chain`, which the
        chain's greedy requests join). The device thread runs the whole chain without waiting
        for the host, which lands the chunks while that decode runs; a chunk at a time, each
        would wait for the engine thread to land the one before it, on a host whose cores the
        front and its clients keep busy."""
        chain = [first]
        while len(chain) < self._max_chain and self.scheduler.waiting and \
                self._held is None and chain[-1].owner.lane >= 0:
            chunk = self._chunk_ahead(chain[-1], running, chain)
            if chunk is None:
                return
            chain[-1].then = chunk
            chain.append(chunk)
            self._chain(running, chain, candidate)
            if chunk.then is not None:
                return

    def _joins(self, request: Request | None) -> bool:
        """Whether the first token of `request` (its last chunk on the device) is the chunk's
        greedy pick, which the device thread can write into the decode after it: no sampler
        (no temperature, penalties, bias, grammar or minimum length) and no prompt logprobs."""
        return request is not None and \
            (not self._samplers or request.request_id not in self._samplers)

    def _chunk_ahead(self, running: Flight, decode: Flight | None = None,
                     chain: Sequence[Flight] = ()) -> Flight | None:
        """The next prefill chunk, planned while `running` is on the device, as a flight (a
        prefill flight not in the air); None when there is none, or when its block ops are due
        (then it is held for the next `step()`). With a `chain`, the chunks planned to run
        after `decode` (`_chain_wave`), `running` is the last of them."""
        scheduler = self._ahead
        plan = scheduler.plan_prefill_ahead(running.plan, self.clock(), self._prefills_ahead,
                                            None if decode is None else decode.plan, len(chain))
        if plan is None:
            return None
        owner = self.scheduler.requests[plan.request_id]
        if plan.saves or plan.restores or plan.copies:
            self._held, self._held_for = plan, owner
            return None
        flight = next(f for f in self._prefill_flights
                      if f is not running and all(f is not t for t in chain))
        flight.plan, flight.owner, flight.then = plan, owner, None
        flight.join_into, flight.join_row = None, -1
        flight.index = running.index  # the decode before the chunks (landed once they land)
        return flight

    def _prefills_ahead(self, request: Request) -> bool:
        """Whether `request`'s prefill may be planned while a decode runs: not when its chunks
        return every position's logits (prompt logprobs) or it has a sampler the engine would
        prepare for first (a grammar)."""
        if self._outputs.prompt_collector(request) is not None:
            return False
        sampler = self._samplers.get(request.request_id) if self._samplers else None
        return sampler is None or sampler.grammar is None

    # -- landing -----------------------------------------------------------------------------------
    def _land_flight(self, outputs: list[RequestOutput]) -> bool:
        """Wait for the flight on the device and complete it; the flight the device thread
        launched after it (if any) is the pipeline's now, and the one after that is decided.
        Returns whether the flight was a prefill."""
        device = self._device_thread
        assert device is not None
        hook = self.on_device_call  # the device is busy: hand the last outputs over now
        if hook is not None:
            hook()
        flight = device.land()
        self._flight = flight.next
        if flight.then is not None and flight.next is not flight.then:
            # the thread stopped the chain (this flight failed): what was decided with it never
            # launched, and lands no more (dropped with it or not)
            unlaunched: Flight | None = flight.then
            while unlaunched is not None:
                if unlaunched in self._dropped:
                    self._dropped.remove(unlaunched)
                unlaunched = unlaunched.then
        if flight.next is not None:
            self._overlapped += 1
            self._overlapped_prefills += flight.next.prefill
            self._chained += flight.prefill and flight.next.prefill and \
                flight.next is flight.then
        if not flight.prefill:  # (a chain's decode counts its joins once it ran)
            self._overlapped_joins += flight.joins if flight not in self._dropped else 0
            flight.joins = 0
        owner = flight.owner
        try:
            if flight.prefill:
                self._land_prefill(flight, outputs)
            else:
                self._land(flight, outputs)
        except BaseException:
            # the step did not land whole: nothing is built on it, and the step on the device,
            # fed from its tokens, lands unreported (its lanes run those positions again, and
            # this step's too; on a hybrid model they recompute: `_recompute_spoiled`), with the
            # decode decided with it when it is a chunk (`_chain`)
            if flight not in self._dropped:
                self._recompute_spoiled(flight.plan, owner)
            running = self._flight
            if running is not None:
                self._dropped.append(running)
                if running.then is None:
                    device.decide(None)
                decided = running.then  # and what was decided with it (a chunk, a chain)
                while decided is not None:
                    self._dropped.append(decided)
                    decided = decided.then
            raise
        running = self._flight
        if running is not None and running in self._dropped:
            if running.then is None:  # (decided with a chunk that was dropped)
                device.decide(None)
        elif running is not None and running.then is None:
            if self.decide_late:
                self._undecided = running
            else:
                self._decide(running)
        self.idle = False
        if self.scheduler.events:
            self._flush_events()
        if self._flight is None and not self.scheduler.has_work():
            self._device_end = 0.0
        return flight.prefill

    def _land_prefill(self, flight: Flight, outputs: list[RequestOutput]) -> None:
        """A prefill flight's chunk, completed as `_run_prefill` completes one (from its logits:
        the runtime's when nothing ran after it, else the device thread's copy)."""
        plan, logits, owner = flight.plan, flight.logits, flight.owner
        flight.logits = flight.owner = None
        if flight in self._dropped:  # its request prefills that chunk again
            self._dropped.remove(flight)
            self._recompute_spoiled(flight.plan, owner)
            return
        if flight.error is not None and not isinstance(flight.error, Exception):
            raise flight.error
        request = self.scheduler.requests.get(plan.request_id)
        if request is None or request is not owner:  # aborted while its chunk ran (its id may
            self.scheduler.chunk_ran(plan)           # be a new request's, even admitted)
            return
        if flight.error is not None:
            self._fail(request, f"prefill failed: {flight.error}", outputs)
            return
        self._complete_prefill(plan, request, np.asarray(logits).reshape(-1), outputs)

    def _land(self, flight: Flight, outputs: list[RequestOutput]) -> None:
        """A flight's step, completed as `_run_decode` completes one (from the argmax and the
        picked logits the device thread kept: the logits are the next call's now)."""
        scheduler = self.scheduler
        kernel = self._kernel
        plan = flight.plan
        if flight in self._dropped:
            self._dropped.remove(flight)
            kernel.use(plan.inputs, 0)
            self._recompute_spoiled(plan)
            return
        kernel.use(plan.inputs, plan.rows)
        if flight.error is not None:
            if not isinstance(flight.error, Exception):  # out of `step()`, as from a decode call
                raise flight.error
            for failed in scheduler.decode_requests(plan):
                self._fail(failed, f"decode step failed: {flight.error}", outputs)
            return
        attention = kernel.pick_values(flight.best, flight.greedy, self.spec.vocab_size)
        if attention:
            lanes = plan.inputs.row_lanes
            for row in kernel.attention[:attention].tolist():
                lane = int(lanes[row])
                request = scheduler.by_lane[lane]
                if request is None or request.state is not RequestState.DECODING:
                    continue  # ended while its row was on the device
                if kernel.status[row] == core.ROW_NONFINITE:
                    self._fail(request, f"decode returned non-finite logits on lane {lane}",
                               outputs)
        if flight.drawn is not None:  # the rows the device thread sampled
            result, drawn = flight.drawn
            flight.drawn = None
            live = [i for i, (_, lane, request, _) in enumerate(drawn)
                    if scheduler.by_lane[lane] is request and
                    request.state is RequestState.DECODING]
            if isinstance(result, SampleResult) and len(live) < len(drawn):
                result = _rows_of(result, live)
            self._apply_draw(result, [drawn[i] for i in live], kernel.tokens, outputs)
        done = scheduler.complete_decode(plan, self.clock())
        self._decoded = True
        for request in done:
            outputs.append(self._output(request))

    # -- the device thread's calls -----------------------------------------------------------------
    def _decode_call(self, inputs: Any) -> Any:
        """The device thread's decode call (timed as `_device_call` times the engine's own)."""
        return self._timed_call(self._rows_of_call(self.runtime.decode), inputs)

    def _prefill_call(self, inputs: Any) -> Any:
        """The device thread's prefill call (a chunk planned ahead, `_decide`)."""
        return self._timed_call(self._rows_of_call(self.runtime.prefill), inputs)


class AheadScheduler(Scheduler):
    """The scheduler with the pipeline's planning: what `schedule` would decide next, decided
    while the step before it is still on the device (a decode built ahead, a prefill chunk
    admitted ahead, a staged request rotated into a freed lane, the decode after a chunk).

    The synchronous `Scheduler` knows nothing of it: every decision here is one `schedule` would
    make at that point (the same admission, policy turn and block growth, through the same
    methods), taken only when nothing it changes can touch what the flight in the air computes.
    `Batcher` builds this one; it plans synchronously exactly as the base, and plans ahead only
    while the pipeline flies (`overlap`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # `_build_ahead`'s lanes whose request joins the step at its prompt's length (-1: none)
        self._join_at = np.full(self.artifact.batch_size, -1, dtype=np.int32)

    def plan_ahead(self, plan: StepPlan, running: StepPlan, gather: Any) -> bool:
        """Build into `plan` the decode step after `running` (on the device now, its tokens not
        known yet) when it is the step `schedule` would choose then: every busy lane decodes,
        nothing is admitted, staged or prefilled (`_only_decode`, or what waits has no prefill
        turn before a decode: `_decode_due`), no block op is due, and the
        free list (no eviction) has the blocks the lanes' next positions need. `gather[row]`: the row
        of `running` whose token feeds the row (`StepKernel.build_ahead`). False: not built (the
        engine lands `running` and schedules as usual)."""
        kv = self.kv
        lanes = kv.lanes
        if kv.has_ops or not lanes.num_busy or lanes.num_busy != lanes.num_decoding() or \
                kv.checkpoints is not None or not (self._only_decode() or self._decode_due()):
            return False
        return self._build_ahead(plan, running.inputs, running.rows, gather)

    def _build_ahead(self, plan: StepPlan, previous: Any, previous_rows: int,
                     gather: Any, joins: Sequence[Request] = ()) -> bool:
        """Grow the decoding lanes from the free list (a step on the device: one position
        further, unless `previous_rows` is 0) and build the step into `plan`; `joins`: requests
        whose last chunk runs before it (a wave's chain: several), which decode their first
        token in it (`StepKernel.build_ahead`'s `joins`) when their lane takes the block for
        that position."""
        kv = self.kv
        kernel = kv.kernel
        if kernel.grow(1 if previous_rows else 0):
            return False  # blocks taken for some lanes stay theirs: the next step needs them
        join_at = None
        if joins:
            join_at = self._join_at
            for join in joins:
                position = len(join.prompt)  # where its first token goes (`_start_decode`)
                if position < self.artifact.max_seq_len and \
                        not kernel.grow_lane(join.lane, position + 1):
                    join_at[join.lane] = position
        try:
            rows = kernel.build_ahead(plan.inputs, previous, previous_rows, gather,
                                      kv.padding_block_ahead(), join_at)
        finally:
            if join_at is not None:
                join_at.fill(-1)
        if rows <= 0:
            return False
        plan.rows = rows
        if self.lora is not None:
            self.lora.fill_decode(plan.inputs, rows)
        self._decode_planned()
        return True

    def rotate_ahead(self, running: StepPlan, now: float) -> bool:
        """A request fully staged into the spare takes an idle lane while `running` is on the
        device (what `schedule` does first), when no row of `running` is that lane's and a new
        spare comes from the free list (or an eviction without a host cache: no block op). It
        decodes from the next step built (`StepKernel.build_ahead`: a lane that joins). Returns
        whether it moved."""
        kv = self.kv
        staging = self.staging
        if staging is None or staging.state is not S.STAGED or not kv.lanes.num_idle or \
                kv.has_ops or kv.checkpoints is not None or kv.slots is not None:
            return False
        if not self._lane_is_clear(running) or \
                not (kv.pool.num_spare or kv.pool.num_free or kv.host is None):
            return False
        self._step_time = now
        self._lane_for_staged(staging, now)
        return True

    def _lane_is_clear(self, running: StepPlan) -> bool:
        """The lane the next admission takes (the lowest idle one) has no row in `running` (a
        lane that stopped in the step before keeps a row there)."""
        if running.kind != "decode":
            return True  # a chunk: no row of any lane is in the air
        lane = self.by_lane.index(None)
        return lane not in running.inputs.row_lanes[:running.rows].tolist()

    def plan_prefill_ahead(self, running: StepPlan, now: float,
                           accept: Callable[[Request], bool], decode: StepPlan | None = None,
                           chained: int = 0) -> StepPlan | None:
        """Plan the next prefill chunk while `running` (a decode step built before the last one
        landed, or the last chunk of a chain planned after one: `chained`) is on the device,
        when it is what `schedule` would do next and nothing it does can touch what `running`
        computes: the head of the queue admitted to an idle lane that has no row in `running`
        (`_lane_is_clear`), or, behind a full batch, staged into the
        spare (its first chunk, or its next one). Every busy lane decodes, no sliding-slot
        checkpoints (their saves and restores are slot ops), no block op due, and the pool holds
        the whole prefill without preempting anyone (a preempted lane may have a row in the
        air). Evicting CACHED blocks is safe: no row of `running` writes a cached block, and the
        chunk's own writes run after `running` (device calls run in order); so is staging into
        the spare, which `running`'s padding rows may write: they too run before the chunk.
        A hybrid lane's sliding slot likewise: `running`'s padding rows may write it at position
        0, before the chunk writes its window from position 0; no decode step runs between the
        chunk and the end of that prefill (a later chunk is not planned ahead, and the decode
        after a last chunk gives the slot no padding row: `StepKernel.build_ahead`).

        A wave of arrivals is planned as a chain (`chained` > 0: that many last chunks, each on
        its own lane, are planned to run after `decode`, the decode step on the device, and
        `running` is the last of them): the next request is admitted to an idle lane that has
        no row in `decode` (never staged), as the head of the queue would be once they landed.

        `accept(request)`: the engine's own conditions (no prompt logprobs, no grammar). Returns
        the plan (with the block ops it needs, which the engine then runs before the prefill),
        or None, changing nothing."""
        kv = self.kv
        lanes = kv.lanes
        # `running` may itself be a chunk planned ahead (every decode before it has landed):
        # its lane is the one busy lane that may not decode; its next chunk waits for it
        in_air = self.requests.get(running.request_id) if running.kind == "prefill" else None
        prefilling = chained if chained else \
            in_air is not None and in_air.state is S.PREFILLING and in_air.lane >= 0
        if kv.has_ops or kv.checkpoints is not None or \
                lanes.num_busy != lanes.num_decoding() + prefilling or \
                (in_air is not None and not running.last_chunk) or \
                (chained and (decode is None or not lanes.num_idle)):
            return None
        staging = self.staging
        if lanes.num_idle:  # admission to a lane (a staged request would take it first)
            request = self._first_ready()
            if staging is not None or request is None or \
                    not self._lane_is_clear(running if decode is None else decode):
                return None
        elif staging is not None:  # its next chunk into the spare and its STAGED blocks
            request = staging if staging.state is S.STAGING and staging is not in_air else None
        else:
            request = self._first_ready()
            if request is not None and not self._can_stage(request):
                return None
        if request is None or request.importing or \
                not self._prefill_turn(request, lanes.num_decoding()) or not accept(request):
            return None
        if kv.available() < kv.blocks_for_prefill(request) or \
                (self.artifact.oversubscribed and kv.available() - kv.committed(self.by_lane) <
                 kv.blocks_for_prefill(request)):
            return None
        self._step_time = now
        if lanes.num_idle:
            lane = self.by_lane.index(None)
            self._admit(now, limit=1)
            if request.lane != lane:
                raise StateError(f"admitting ahead gave {request.request_id} lane "
                                 f"{request.lane}, not the idle lane {lane} it checked")
        elif staging is None:
            self._start_staging(request)
        if running.kind == "prefill":  # its inputs are on the device: build into the other buffer
            kv.swap_prefill_inputs()
        plan = self._plan_prefill(request)
        if plan is None:
            raise StateError(f"{request.request_id}'s chunk could not be planned ahead although "
                             f"the pool held its prefill")
        if kv.has_ops:
            kv.take_ops(plan)
        return plan

    def plan_after_prefill(self, plan: StepPlan, landed: Any, prefill: StepPlan,
                           gather: Any, joins: Sequence[Request] = ()) -> list[int] | None:
        """Build into `plan` the decode step after `prefill` (a chunk planned ahead, on the
        device now; every decode step before it has landed) when it is the step `schedule` would
        choose once the chunk lands: the chunk ends its request's prefill, every other busy lane
        decodes and nothing is admitted, staged or prefilled, no block op is due, and the free
        list has the blocks. `landed`: a decode buffer other than `plan`'s (not read).
        `plan_chunk_decode` is this with a decode step still on the device before the chunk.

        `joins`: the requests the engine says may decode in the step (their first token is
        their chunk's greedy pick): each does, at its prompt's length, when its lane takes the
        block that needs from the free list: its row's token is the chunk's argmax, which the
        caller writes in once the chunk has run (before the step runs). A request that does not
        joins the step after (`StepKernel.build_ahead`, whose padding rows leave a hybrid lane's
        fresh window alone, or give up). Returns each of `joins`' rows in the step (-1: none),
        or None when the step was not built."""
        if not self._decode_may_follow(prefill, self.requests.get(prefill.request_id)):
            return None
        return self._build_joined(plan, landed, 0, gather, joins)

    def plan_chunk_decode(self, plan: StepPlan, running: StepPlan, prefill: StepPlan,
                          gather: Any, joins: Sequence[Request] = (),
                          chained: int = 1) -> list[int] | None:
        """`plan_after_prefill` for a chunk planned ahead while `running` (a decode step) is
        still on the device: the chunk runs after `running` and the step built here after the
        chunk, so the device goes from one to the next without waiting for the host to land
        `running` (its rows' tokens are gathered in as `plan_ahead`'s are: `gather[row]` is
        their row in `running`). `chained`: the chunks planned to run between `running` and
        this step, `prefill` the last of them (a wave's chain, each of them the last chunk of
        its request on a lane of its own; `joins` may name any of their requests). Returns as
        `plan_after_prefill` does."""
        if running.kind != "decode" or \
                not self._decode_may_follow(prefill, self.requests.get(prefill.request_id),
                                            chained):
            return None
        return self._build_joined(plan, running.inputs, running.rows, gather, joins)

    def _decode_may_follow(self, prefill: StepPlan, request: Request | None,
                           chained: int = 1) -> bool:
        """Whether the step after `prefill` (a chunk planned ahead) may be built before the
        chunk lands: the chunk ends its request's prefill, every other busy lane decodes and
        nothing is admitted, staged or prefilled (or what waits has no prefill turn before a
        decode: `_decode_due`), no block op is due."""
        kv = self.kv
        lanes = kv.lanes
        if kv.has_ops or kv.checkpoints is not None or not prefill.last_chunk or \
                request is None or not lanes.num_decoding():
            return False
        if request.state is S.PREFILLING:  # its lane (and those of the chunks chained before
            # it) are the busy lanes that do not decode
            return lanes.num_busy == lanes.num_decoding() + chained and \
                (self._only_decode() or self._decode_due())
        # once staged, it waits for a lane while the others decode
        return request is self.staging and request.state is S.STAGING and \
            lanes.num_busy == lanes.num_decoding() and not lanes.num_idle

    def _build_joined(self, plan: StepPlan, previous: Any, previous_rows: int, gather: Any,
                      joins: Sequence[Request]) -> list[int] | None:
        joining = [request for request in joins if request.state is S.PREFILLING and
                   request.lane >= 0 and not request.recomputing and request.max_tokens > 1]
        if not self._build_ahead(plan, previous, previous_rows, gather, joining):
            return None
        if not joining:
            return [-1] * len(joins)
        rows = {lane: row for row, lane in enumerate(plan.inputs.row_lanes[:plan.rows].tolist())}
        joined = {id(request) for request in joining}
        # (no row: its lane could not take the block for its first position)
        return [rows.get(request.lane, -1) if id(request) in joined else -1 for request in joins]

    def _only_decode(self) -> bool:
        """`schedule` would decode the busy lanes and admit, stage or prefill nothing: no queue,
        or a queue with no idle lane for it and no staging to start (a request fully staged
        into the spare waits for a lane as well)."""
        staging = self.staging
        if staging is not None and (staging.state is not S.STAGED or self.kv.lanes.num_idle):
            return False
        if not self.waiting:
            return True
        if self.kv.lanes.num_idle:
            return False
        head = self._first_ready()
        return staging is not None or head is None or not self._can_stage(head)

    def _decode_due(self) -> bool:
        """Requests wait for a lane, but `schedule` would decode now: the policy gives the head
        of the queue no prefill turn yet (stall-free after its chunks per decode), or nothing
        waiting is ready to prefill."""
        if self.staging is not None:
            return False
        head = self._first_ready()
        return head is None or not self._prefill_turn(head, self.kv.lanes.num_decoding())


def _rows_of(result: SampleResult, rows: list[int]) -> SampleResult:
    """`result` for the given rows of it, in that order."""
    position = {row: i for i, row in enumerate(rows)}
    return SampleResult(tokens=result.tokens[rows], logprobs=[result.logprobs[i] for i in rows],
                        masked_rows=[position[i] for i in result.masked_rows if i in position],
                        failed={position[i]: why for i, why in result.failed.items()
                                if i in position})

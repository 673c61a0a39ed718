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
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from atombatch.engine.request import Request, RequestState, StepPlan
from atombatch.engine.scheduler import Scheduler
from atombatch.errors import RequestError, StateError
from atombatch.kernel import blocks as core
from atombatch.sampling.argmax import RowArgmax

NUM_FLIGHTS = 3   # the one landed (its arrays read by the caller), the one on the device, the next

S = RequestState


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


class AheadScheduler(Scheduler):
    """The scheduler with the pipeline's planning: what `schedule` would decide next, decided
    while the step before it is still on the device (a decode built ahead, a prefill chunk
    admitted ahead, a staged request rotated into a freed lane, the decode after a chunk).

    The synchronous `Scheduler` knows nothing of it: every decision here is one `schedule` would
    make at that point (the same admission, policy turn and block growth, through the same
    methods), taken only when nothing it changes can touch what the flight in the air computes.
    A `Batcher(overlap=True)` builds this one; it plans synchronously exactly as the base.
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

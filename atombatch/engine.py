"""`Batcher`: the engine facade that servers, benchmarks and routers embed.

It runs the scheduler's plans on a runtime, samples, streams `RequestOutput`s and turns every
failure into a per-request error while the other lanes go on.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import msgspec
import numpy as np
import numpy.typing as npt
import structlog

from atombatch.config import ArtifactConfig, check_serving
from atombatch.errors import (
    CapacityError,
    ConfigError,
    KVTransferError,
    RequestError,
    StateError,
    TransientDeviceError,
)
from atombatch.prefix import HostCache
from atombatch.runtime.base import Runtime
from atombatch.sampling import sample
from atombatch.scheduler import PDImport, Policy, Request, RequestState, Scheduler, StepPlan
from atombatch.structs import Completion, RequestOutput, RequestTimings, SamplingParams

log = structlog.wrap_logger(
    logging.getLogger("atombatch"),
    wrapper_class=structlog.stdlib.BoundLogger,
    processors=[
        structlog.stdlib.filter_by_level,
        structlog.processors.add_log_level,
        structlog.processors.JSONRenderer(),
    ],
)

_WARN_EVENTS = frozenset({"request.failed"})

# Requests without a lane that a Batcher keeps by default; past it `submit` raises CapacityError.
# Each waiting request holds its prompt (at most max_seq_len int64 ids) and a little bookkeeping.
DEFAULT_MAX_WAITING = 4096


class KVSource(Protocol):
    """Where a PD request's KV comes from (see `atombatch.pd`); polled without blocking.

    A source may also have `expect(artifact, prompt, require_full)`: `submit` calls it so the
    source can check the header on arrival, before it accepts any layer.
    """

    def poll(self) -> tuple[Any, list[Any]]: ...
    def done(self) -> bool: ...
    def close(self) -> None: ...


class KVLink:
    """The engine's side of one PD request: its source and what arrived so far."""

    __slots__ = ("arrived", "header", "last_progress", "seen", "source")

    def __init__(self, source: KVSource, now: float) -> None:
        self.source = source
        self.header: Any = None
        self.arrived: list[Any] = []     # validated layers not yet written
        self.seen: set[int] = set()      # layer indices received
        self.last_progress = now


class EngineStats(msgspec.Struct, frozen=True):
    """A snapshot a server can export (gauges and counters)."""

    occupied_lanes: int                 # lanes holding a request now
    decoding_lanes: int                 # of those, decoding
    queue_length: int                   # requests without a lane (waiting + staging/staged)
    free_blocks: int
    spare_blocks: int
    staged_blocks: int
    lane_blocks: int
    cached_blocks: int
    steps: int                          # device calls so far
    imports: int                        # KV import steps (PD)
    prefill_chunks: int
    staged_chunks: int                  # prefill chunks or KV imports run into the spare
    decode_steps: int
    generated_tokens: int
    rotations: int                      # staged requests that took over a finished lane's slot
    preemptions: int
    prefix_hits: int                    # lanes started from a cached prefix
    prefix_misses: int
    prefix_hit_tokens: int              # prompt tokens whose prefill the cache saved
    host_restores: int                  # blocks written back from the host cache
    evictions: int                      # CACHED blocks evicted from the device
    finished: dict[str, int]            # requests by finish reason
    lane_histogram: tuple[int, ...]     # decode steps by number of decoding lanes (index = lanes)


class Batcher:
    """Continuous batching over one compiled artifact.

    Args:
        runtime: any `Runtime` (NumpyRuntime, SimRuntime, RebelRuntime).
        prefix_cache: keep finished sequences' KV for prefix reuse (non-hybrid only).
        host_cache_bytes: host-memory bytes for evicted prefix blocks (needs prefix_cache).
        policy: prefill/decode interleaving: "prefill-first", "decode-first", "interleave:N".
        seed: derives the RNG of requests that give no seed of their own.
        clock: seconds; defaults to the runtime's `clock` (virtual time) or `time.perf_counter`.
        max_waiting: bound on requests without a lane; `submit` raises `CapacityError` past it
            (default `DEFAULT_MAX_WAITING`; None removes the bound, for callers that bound their
            own submissions).
        pd_timeout: seconds a PD request may wait for its producer's next message (header or
            layer) before it fails; the wait for the header includes the producer's own queue,
            so this must exceed the longest queueing a producer can have.

    A Batcher is driven by one consumer: `step()` raises `StateError` when another thread is
    already inside it (two interleaved steps would corrupt the lane tables); `submit` and `abort`
    called from another thread wait until a running step ends. `AsyncBatcher` is the way to
    share one engine between many clients.

    Raises:
        ConfigError: the artifact and the options break a rule of docs/rules.md.
    """

    def __init__(self, runtime: Runtime, *, prefix_cache: bool = False, host_cache_bytes: int = 0,
                 policy: Policy | str = "prefill-first", seed: int = 0,
                 clock: Callable[[], float] | None = None,
                 max_waiting: int | None = DEFAULT_MAX_WAITING,
                 pd_timeout: float = 300.0) -> None:
        artifact: ArtifactConfig = runtime.artifact
        check_serving(artifact, prefix_cache=prefix_cache, host_cache_bytes=host_cache_bytes)
        self.runtime = runtime
        self.artifact = artifact
        self.spec = artifact.model
        self.host_cache = HostCache(host_cache_bytes, artifact.block_size) \
            if host_cache_bytes else None
        self.scheduler = Scheduler(artifact, policy, eos_token_ids=self.spec.eos_token_ids,
                                   prefix_cache=prefix_cache, host_cache=self.host_cache)
        self.clock: Callable[[], float] = clock or getattr(runtime, "clock", None) or \
            time.perf_counter
        if max_waiting is not None and (isinstance(max_waiting, bool) or
                                        not isinstance(max_waiting, int) or max_waiting < 1):
            raise ConfigError(f"max_waiting={max_waiting!r} must be an int >= 1 (or None: unbounded)")
        self.max_waiting = max_waiting
        self._step_lock = threading.Lock()
        self._seed_seq = np.random.SeedSequence(seed)
        self._next_id = 0
        self._pending: list[RequestOutput] = []
        self.idle = True  # the last step ran no device call (nothing runnable: e.g. PD waits)
        self.pd_timeout = pd_timeout
        self._kv: dict[str, KVLink] = {}

    # -- requests ---------------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        return self.scheduler.policy

    def validate(self, prompt: Sequence[int] | npt.NDArray[np.integer],
                 params: SamplingParams) -> npt.NDArray[np.int64]:
        """Check a request against the artifact without queueing it; returns the prompt array.

        Raises:
            RequestError: naming the offending value and the rule.
        """
        try:
            tokens = np.asarray(prompt)
        except (ValueError, TypeError) as exc:  # ragged nesting, mixed types
            raise RequestError(f"prompt must be a flat sequence of token ids: {exc}") from None
        if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
            raise RequestError(f"prompt must be a flat sequence of token ids, got shape "
                               f"{tokens.shape} of {tokens.dtype}")
        if tokens.size == 0:
            raise RequestError("prompt is empty: a request needs at least one token")
        vocab = self.spec.vocab_size
        bad = np.flatnonzero((tokens < 0) | (tokens >= vocab))
        if bad.size:
            i = int(bad[0])
            raise RequestError(f"token id {int(tokens[i])} at prompt index {i} is outside the "
                               f"vocabulary 0..{vocab - 1}")
        if params.max_tokens < 1:
            raise RequestError(f"max_tokens={params.max_tokens} must be >= 1")
        total = tokens.size + params.max_tokens
        if total > self.artifact.max_seq_len:
            raise RequestError(f"prompt of {tokens.size} tokens + max_tokens={params.max_tokens} "
                               f"= {total} exceeds max_seq_len={self.artifact.max_seq_len}")
        if not params.temperature >= 0.0 or not np.isfinite(params.temperature):
            raise RequestError(f"temperature={params.temperature} must be a finite number >= 0")
        if params.top_k < 0:
            raise RequestError(f"top_k={params.top_k} must be >= 0 (0 turns it off)")
        if not 0.0 < params.top_p <= 1.0:
            raise RequestError(f"top_p={params.top_p} must be in (0, 1]")
        if params.seed is not None and not 0 <= params.seed < 2**64:
            raise RequestError(f"seed={params.seed} must be in 0..2**64-1")
        for stop in params.stop_token_ids:
            if not 0 <= stop < vocab:
                raise RequestError(f"stop token id {stop} is outside the vocabulary 0..{vocab - 1}")
        return tokens.astype(np.int64, copy=True)

    def submit(self, prompt: Sequence[int] | npt.NDArray[np.integer],
               params: SamplingParams | None = None, request_id: str | None = None,
               kv: KVSource | None = None) -> str:
        """Queue a request; returns its id.

        With `kv`, a producer computes the prompt's KV and first token (prefill/decode
        disaggregation): the request is admitted once the source's header has arrived and matches
        the artifact, its layers are imported as they come, and decoding starts from the
        producer's first token. Any fault of the source fails this request alone.

        Raises:
            RequestError: the request is invalid (nothing is queued).
            CapacityError: `max_waiting` requests are already waiting.
        """
        params = params or SamplingParams()
        tokens = self.validate(prompt, params)
        if self.max_waiting is not None and self.scheduler.num_waiting >= self.max_waiting:
            raise CapacityError(f"queue is full: {self.scheduler.num_waiting} requests wait, "
                                f"max_waiting={self.max_waiting}")
        if request_id is None:
            request_id = f"req-{self._next_id}"
        elif request_id in self.scheduler.requests:
            raise RequestError(f"request_id={request_id!r} is already in flight")
        self._next_id += 1
        seed = params.seed if params.seed is not None else \
            int(self._seed_seq.spawn(1)[0].generate_state(1)[0])
        request = Request(request_id, tokens, params, self.clock(), np.random.default_rng(seed))
        if kv is not None:
            expect = getattr(kv, "expect", None)
            if expect is not None:  # let the source check the header on arrival
                expect(self.artifact, tokens, self._require_full_prefix)
            request.pd = PDImport()
        with self._step_lock:  # from another thread: waits for a running step to end
            if kv is not None:
                self._kv[request_id] = KVLink(kv, request.arrival)
            self.scheduler.add(request)
        log.debug("request.submitted", request_id=request_id, prompt_len=len(tokens),
                  max_tokens=params.max_tokens)
        return request_id

    def abort(self, request_id: str) -> bool:
        """End a queued, prefilling, staged or decoding request; its lane and blocks free at once.

        Returns False when the request is unknown or already finished. Its final output (reason
        "abort") comes out of the next `step()`.
        """
        with self._step_lock:  # from another thread: waits for a running step to end
            request = self.scheduler.abort(request_id)
            if request is None:
                return False
            self._pending.append(self._final_output(request, ()))
            self._flush_events()
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    # -- stepping ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one device call (a prefill chunk or a decode step); returns what it produced.

        Raises:
            StateError: another thread is inside `step()` of this Batcher (one consumer only).
        """
        if not self._step_lock.acquire(blocking=False):
            raise StateError("Batcher.step() is already running in another thread: a Batcher "
                             "has one consumer (share it through AsyncBatcher; docs/rules.md)")
        try:
            return self._step()
        finally:
            self._step_lock.release()

    def _step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self._kv:
            self._poll_kv(outputs)
        plan = self.scheduler.schedule(self.clock())
        self.idle = plan is None
        if plan is None:
            self._flush_events()
            return outputs
        if plan.saves or plan.restores or plan.copies:
            self._run_block_ops(plan, outputs)
        if plan.kind == "prefill":
            self._run_prefill(plan, outputs)
        elif plan.kind == "import":
            self._run_import(plan, outputs)
        else:
            self._run_decode(plan, outputs)
        self._flush_events()
        return outputs

    def _run_block_ops(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        """Cache-management KV moves the plan needs before its device call, in a safe order:
        evicted blocks to the host first, then host restores, then device copies. A failed
        restore or copy fails the request it was for (its KV would be garbage); a failed save
        only loses that host copy."""
        runtime = self.runtime
        for entry in plan.saves:
            assert self.host_cache is not None
            try:
                self.host_cache.put(entry, runtime.read_block(entry.block))
            except Exception as exc:
                log.warning("host_cache.save_failed", block=entry.block, error=str(exc))
        failed: dict[str, str] = {}
        for block, data, request_id in plan.restores:
            try:
                runtime.write_block(block, data)
            except Exception as exc:
                failed.setdefault(request_id, f"restoring block {block} from the host failed: "
                                              f"{exc}")
        for src, dst, request_id in plan.copies:
            try:
                runtime.copy_block(src, dst)
            except Exception as exc:
                failed.setdefault(request_id, f"copying cached block {src} to {dst} failed: "
                                              f"{exc}")
        for request_id, message in failed.items():
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self._fail(request, message, outputs)

    def _run_prefill(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        scheduler = self.scheduler
        request = scheduler.requests.get(plan.request_id)
        if request is None:  # failed by this plan's block ops: nothing to compute for it
            return
        try:
            logits = self._device_call(self.runtime.prefill, plan.inputs)
            token = None
            if plan.last_chunk and not request.recomputing:
                row = np.asarray(logits).reshape(-1)
                if not np.isfinite(row).all():
                    raise RequestError(f"prefill returned non-finite logits for "
                                       f"{plan.request_id} at position {plan.chunk_start}")
                token = sample(row, request.params, request.rng)
        except Exception as exc:  # the runtime failed this request; the others go on
            self._fail(request, f"prefill failed: {exc}", outputs)
            return
        for done in scheduler.complete_prefill(plan, token, self.clock()):
            outputs.append(self._output(done))

    # -- prefill/decode disaggregation --------------------------------------------------------------
    def _poll_kv(self, outputs: list[RequestOutput]) -> None:
        """Collect what producers sent; validate it; fail requests whose source broke or stalled."""
        from atombatch.pd import checks as pdmod

        now = self.clock()
        scheduler = self.scheduler
        for request_id, link in list(self._kv.items()):
            request = scheduler.requests.get(request_id)
            if request is None or request.pd is None:  # finished, preempted or fully imported
                self._close_kv(request_id)
                continue
            progress = request.pd
            try:
                header, layers = link.source.poll()
                if header is not None and link.header is None:
                    pdmod.validate_header(header, self.artifact, request.prompt,
                                          require_full=self._require_full_prefix)
                    link.header = header
                    progress.header_ok = True
                    progress.covered_len = header.covered_len
                    progress.first_token = header.first_token
                    progress.num_layers = header.num_layers
                    link.last_progress = now
                if layers:
                    if link.header is None:
                        raise KVTransferError(f"request {request_id}: layers arrived "
                                                    "before the header")
                    for layer in layers:
                        pdmod.validate_layer(link.header, layer, link.seen)
                        link.seen.add(layer.layer)
                    link.arrived.extend(layers)
                    link.last_progress = now
                if link.header is not None and link.source.done() and \
                        len(link.seen) != link.header.num_layers:
                    raise KVTransferError(
                        f"request {request_id}: the producer finished after "
                        f"{len(link.seen)} of {link.header.num_layers} layers")
                if not link.source.done() and now - link.last_progress > self.pd_timeout:
                    raise KVTransferError(
                        f"request {request_id}: no KV from the producer for "
                        f"{now - link.last_progress:.1f} s (pd_timeout={self.pd_timeout} s)")
            except Exception as exc:
                self._fail(request, f"KV import failed: {exc}", outputs)
                continue
            progress.pending = len(self._writable(link))

    def _writable(self, link: KVLink) -> list[Any]:
        """Layers that may be written now. A hybrid model's sliding layers wait for the whole
        payload, so no decode step (which writes every lane's slot) falls between their writes."""
        if not self.spec.is_hybrid or link.header is None:
            return link.arrived
        if len(link.seen) == link.header.num_layers:
            return link.arrived
        kinds = self.spec.layer_kinds
        return [layer for layer in link.arrived if kinds[layer.layer] != "sliding_attention"]

    @property
    def _require_full_prefix(self) -> bool:
        return self.artifact.single_block or self.spec.is_hybrid

    def _run_import(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        scheduler = self.scheduler
        request = scheduler.requests.get(plan.request_id)
        link = self._kv.get(plan.request_id)
        if request is None or link is None:
            return
        layers = self._writable(link)
        try:
            for layer in layers:
                k, v = layer.float32()
                self.runtime.write_layer_kv(layer.layer, k, v, plan.blocks, plan.slot)
        except Exception as exc:
            self._fail(request, f"KV import failed: {exc}", outputs)
            return
        written = {id(layer) for layer in layers}
        link.arrived = [layer for layer in link.arrived if id(layer) not in written]
        for done in scheduler.complete_import(plan, len(layers), self.clock()):
            outputs.append(self._output(done))
        if request.pd is None:
            self._close_kv(plan.request_id)

    def _close_kv(self, request_id: str) -> None:
        link = self._kv.pop(request_id, None)
        if link is not None:
            try:
                link.source.close()
            except Exception as exc:  # a broken transport must not take the engine down
                log.warning("kv.close_failed", request_id=request_id, error=str(exc))

    def _run_decode(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        scheduler = self.scheduler
        try:
            logits = np.asarray(self._device_call(self.runtime.decode, plan.inputs))
        except Exception as exc:
            for request_id in plan.request_ids:
                request = scheduler.requests.get(request_id)
                if request is not None:
                    self._fail(request, f"decode step failed: {exc}", outputs)
            return
        tokens: dict[int, int] = {}
        # One pass over all rows for the checks every lane needs and for greedy picks.
        finite = np.asarray(np.isfinite(logits).all(axis=1))
        greedy = logits.argmax(axis=1)
        for lane, request_id in zip(plan.lanes, plan.request_ids, strict=True):
            request = scheduler.requests.get(request_id)
            if request is None:  # failed by this plan's block ops
                continue
            try:
                if not finite[lane]:
                    raise RequestError(f"decode returned non-finite logits on lane {lane}")
                if request.params.temperature == 0.0:
                    tokens[lane] = int(greedy[lane])
                else:
                    tokens[lane] = sample(logits[lane], request.params, request.rng)
            except Exception as exc:
                self._fail(request, str(exc), outputs)
        for done in scheduler.complete_decode(plan, tokens, self.clock()):
            outputs.append(self._output(done))

    def _device_call(self, call: Callable[[Any], Any], inputs: Any) -> Any:
        """One prefill or decode call, repeated once when the runtime says the fault was
        transient (`TransientDeviceError`: nothing was written that the repeat would not
        overwrite). Any other failure, or a second one, propagates and fails the step's
        requests: they shared one device call."""
        try:
            return call(inputs)
        except TransientDeviceError as exc:
            log.warning("device.retry", call=getattr(call, "__name__", "call"), error=str(exc))
            return call(inputs)

    def _fail(self, request: Request, message: str, outputs: list[RequestOutput]) -> None:
        self.scheduler.fail(request, message)
        outputs.append(self._final_output(request, ()))

    def _output(self, request: Request) -> RequestOutput:
        new = (request.output[-1],)
        if request.state is RequestState.FINISHED:
            return self._final_output(request, new)
        return RequestOutput(request_id=request.request_id, new_token_ids=new, finished=False)

    def _final_output(self, request: Request, new: tuple[int, ...]) -> RequestOutput:
        if request.request_id in self._kv:
            self._close_kv(request.request_id)
        completion = self._completion(request)
        return RequestOutput(request_id=request.request_id, new_token_ids=new, finished=True,
                             finish_reason=request.finish_reason, error=request.error,
                             completion=completion)

    def _completion(self, request: Request) -> Completion:
        now = self.clock()
        timings = None
        if request.admitted_at is not None:
            first = request.first_token_at if request.first_token_at is not None else now
            times = request.token_times
            timings = RequestTimings(
                arrival=request.arrival, admitted=request.admitted_at, first_token=first,
                finished=now, queue_wait=request.admitted_at - request.arrival,
                ttft=first - request.arrival, e2e=now - request.arrival,
                inter_token=tuple(b - a for a, b in itertools.pairwise(times)))
        return Completion(request_id=request.request_id, prompt_len=len(request.prompt),
                          token_ids=tuple(request.output), finish_reason=request.finish_reason or
                          "error", error=request.error, timings=timings,
                          preemptions=request.preemptions)

    def _flush_events(self) -> None:
        events = self.scheduler.events
        if not events:
            return
        for name, fields in events:
            if name in _WARN_EVENTS:
                log.warning(name, **fields)
            else:
                log.info(name, **fields)
        events.clear()

    # -- conveniences -------------------------------------------------------------------------------
    def generate(self, prompts: Iterable[Sequence[int] | npt.NDArray[np.integer]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Submit every prompt, run until all finish; completions in prompt order.

        Prompts are all validated first (a bad one raises before anything is queued), then fed
        to the queue as `max_waiting` allows.
        """
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(prompts)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise RequestError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        for prompt, sp in zip(prompts, per_prompt, strict=True):
            self.validate(prompt, sp)
        ids: list[str] = []
        done: dict[str, Completion] = {}
        while len(done) < len(prompts):
            while len(ids) < len(prompts) and (self.max_waiting is None or
                                               self.scheduler.num_waiting < self.max_waiting):
                ids.append(self.submit(prompts[len(ids)], per_prompt[len(ids)]))
            for out in self.step():
                if out.finished and out.completion is not None:
                    done[out.request_id] = out.completion
        return [done[i] for i in ids]

    def stats(self) -> EngineStats:
        s = self.scheduler
        free, spare, staged, lane, cached = s.pool.counts()
        c = s.counters
        return EngineStats(
            occupied_lanes=s.lanes.num_busy, decoding_lanes=s.lanes.num_decoding(),
            queue_length=s.num_waiting, free_blocks=free, spare_blocks=spare,
            staged_blocks=staged, lane_blocks=lane, cached_blocks=cached, steps=c.steps,
            imports=c.imports,
            prefill_chunks=c.prefill_chunks, staged_chunks=c.staged_chunks,
            decode_steps=c.decode_steps, generated_tokens=c.generated_tokens,
            rotations=c.rotations, preemptions=c.preemptions, prefix_hits=c.prefix_hits,
            prefix_misses=c.prefix_misses, prefix_hit_tokens=c.prefix_hit_tokens,
            host_restores=c.host_restores, evictions=c.evictions, finished=dict(c.finished),
            lane_histogram=tuple(c.lane_histogram))

    def check_invariants(self) -> None:
        """Raise `StateError` if any ownership invariant of docs/rules.md is broken."""
        self.scheduler.check_invariants()

    def record_trace(self) -> list[Any]:
        """Start recording a `StepRecord` per device call; returns the list that fills up."""
        self.scheduler.trace = []
        return self.scheduler.trace

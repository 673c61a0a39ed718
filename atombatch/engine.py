"""`Batcher`: the engine facade that servers, benchmarks and routers embed.

It runs the scheduler's plans on a runtime, samples, streams `RequestOutput`s and turns every
failure into a per-request error while the other lanes go on.
"""

from __future__ import annotations

import functools
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

from atombatch import blocks as core
from atombatch.config import ArtifactConfig, check_serving
from atombatch.detokenizer import Detokenizer, bad_word_ids
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
from atombatch.sampling import (
    LOGPROBS_MODES,
    LogprobsMode,
    PromptLogprobs,
    RequestSampler,
    sample_rows,
)
from atombatch.scheduler import PDImport, Policy, Request, RequestState, Scheduler, StepPlan
from atombatch.structs import (
    GREEDY_EPS,
    Completion,
    RequestOutput,
    RequestTimings,
    SamplingParams,
    TokenLogprobs,
)
from atombatch.validation import RequestRules, validate_request

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


class _Extras:
    """What the engine keeps for a request beyond the scheduler's record (only for requests that
    need it: sampling options, a tokenizer, logprobs or n > 1)."""

    __slots__ = ("detok", "index", "logprobs", "prompt", "prompt_result", "public_id", "sampler",
                 "stop_reason")

    def __init__(self, public_id: str, index: int) -> None:
        self.public_id = public_id            # the id submit() returned
        self.index = index                    # the choice (n > 1)
        self.sampler: RequestSampler | None = None
        self.detok: Detokenizer | None = None
        self.logprobs: list[TokenLogprobs] | None = None
        self.stop_reason: str | int | None = None
        self.prompt: PromptLogprobs | None = None     # prompt logprobs being collected
        self.prompt_result: tuple[TokenLogprobs | None, ...] | None = None  # once delivered


class _Group:
    """The choices of one request with n > 1."""

    __slots__ = ("first_row", "held", "live", "members", "prompt_logprobs", "prompt_result")

    def __init__(self) -> None:
        self.members: list[Request] = []     # every choice, index order
        self.held: list[Request] = []        # choices waiting for choice 0's prefill
        self.live = 0                        # choices not finished yet
        self.first_row: npt.NDArray[np.float32] | None = None  # choice 0's first-token logits,
                                             #   kept while choices wait to fork from it
        self.prompt_logprobs: int | None = None   # the request's prompt_logprobs (choice 0 asks)
        self.prompt_result: tuple[TokenLogprobs | None, ...] | None = None  # once computed


class EngineStats(msgspec.Struct, frozen=True):
    """A snapshot a server can export (gauges and counters)."""

    occupied_lanes: int                 # lanes holding a request now
    decoding_lanes: int                 # of those, decoding
    queue_length: int                   # requests without a lane (waiting + staging/staged, and
                                        #   n > 1 choices waiting for choice 0's prefill)
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
    prompt_forks: int                   # n > 1 choices started from a device copy of choice 0's
                                        #   prompt KV (prefix cache off)
    fork_saved_tokens: int              # prompt tokens those choices did not prefill
    finished: dict[str, int]            # requests by finish reason
    lane_histogram: tuple[int, ...]     # decode steps by number of decoding lanes (index = lanes)
    bucket_steps: dict[int, int]        # decode steps by compiled decode batch size that ran


class StepResult:
    """What one `Batcher.step_arrays()` produced: the decode step's tokens as arrays, and a
    `RequestOutput` for everything else.

    `lanes`, `tokens` and `plain` are indexed by the decode step's rows (empty when the step ran
    no decode): row `i` decoded lane `lanes[i]` and produced `tokens[i]`. A `plain` row's token is
    reported only here: its request (`request_ids[lane]`) is running with nothing else to say (no
    text, logprobs or n > 1 choices) and did not finish. Every other row, and every first token,
    finish or error of the step, is in `outputs`, exactly as `step()` would return it. The arrays
    are views the next step overwrites: copy what must outlive it. `request_ids` is a copy of the
    engine's lane table (by lane) at the end of the step.
    """

    __slots__ = ("lanes", "outputs", "plain", "request_ids", "tokens")

    def __init__(self, outputs: list[RequestOutput], lanes: npt.NDArray[np.int32],
                 tokens: npt.NDArray[np.int64], plain: npt.NDArray[np.bool_],
                 request_ids: list[str | None]) -> None:
        self.outputs = outputs
        self.lanes = lanes
        self.tokens = tokens
        self.plain = plain
        self.request_ids = request_ids


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
        tokenizer: a `tokenizers.Tokenizer`; with it outputs carry text, and `stop` strings
            and `bad_words` work (see docs/sampling.md).
        logprobs_mode: "raw" (log-softmax of the model's logits, vLLM's default) or
            "processed" (of the distribution the token was drawn from: after penalties, bias,
            masks, temperature and top-k/top-p/min-p).

    A Batcher is driven by one consumer: `step()` raises `StateError` when another thread is
    already inside it (two interleaved steps would corrupt the lane tables); `submit` and `abort`
    called from another thread wait until a running step ends (and a step waits for them).
    `AsyncBatcher` is the way to
    share one engine between many clients.

    Raises:
        ConfigError: the artifact and the options break a rule of docs/rules.md.
    """

    def __init__(self, runtime: Runtime, *, prefix_cache: bool = False, host_cache_bytes: int = 0,
                 policy: Policy | str = "prefill-first", seed: int = 0,
                 clock: Callable[[], float] | None = None,
                 max_waiting: int | None = DEFAULT_MAX_WAITING,
                 pd_timeout: float = 300.0, tokenizer: Any | None = None,
                 logprobs_mode: LogprobsMode = "raw", detokenize: bool = True) -> None:
        artifact: ArtifactConfig = runtime.artifact
        if logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode={logprobs_mode!r} is not one of "
                              f"{', '.join(LOGPROBS_MODES)}")
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
        self._step_lock = threading.Lock()      # the engine's state: step, submit, abort
        self._consumer = threading.Lock()       # held by the one thread inside step()
        self._seed_seq = np.random.SeedSequence(seed)
        self._next_id = 0
        self._pending: list[RequestOutput] = []
        self.idle = True  # the last step ran no device call (nothing runnable: e.g. PD waits)
        self.pd_timeout = pd_timeout
        self._kv: dict[str, KVLink] = {}
        self.tokenizer = tokenizer
        # False: only requests with stop strings are detokenized here (their text decides when
        # they stop); the others' outputs carry ids alone and a front decodes them
        self.detokenize = detokenize
        self.logprobs_mode: LogprobsMode = logprobs_mode
        self._extras: dict[str, _Extras] = {}      # by scheduler request id
        self._samplers: dict[str, RequestSampler] = {}  # requests that are not plain greedy
        self._groups: dict[str, _Group] = {}       # n > 1 requests by the id submit() returned
        self._decoded = False                      # the last step completed a decode
        self._kernel = self.scheduler.kv.kernel    # the decode-step kernel (never replaced)
        self._greedy = np.zeros(artifact.batch_size, dtype=np.int64)  # decode argmax, by row
        # n > 1 without a prefix cache: choices 1..n-1 start from a device copy of choice 0's
        # prompt KV (see `_release_held`); hybrid models also need the runtime's `copy_slot`
        self._forks = not prefix_cache and not self.artifact.single_block and \
            (not self.spec.is_hybrid or callable(getattr(runtime, "copy_slot", None)))
        kv_methods = getattr(runtime, "kv_methods", None)  # RebelRuntime: what the SDK has
        if isinstance(kv_methods, dict):
            needed = ("_fetch_kv_cache", "_update_kv_cache") if self.spec.is_hybrid else ()
            self._forks = self._forks and all(kv_methods.get(name, False)
                                              for name in ("_copy_kv_cache", *needed))

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
        return validate_request(self.rules(), prompt, params, type(self.runtime).__name__)

    def rules(self) -> RequestRules:
        """What `validate` checks against, as a value a front in another process can hold."""
        return RequestRules(
            self.artifact, has_tokenizer=self.tokenizer is not None,
            every_position_logits=bool(getattr(self.runtime, "every_position_logits", False)),
            every_position_hint=getattr(self.runtime, "every_position_hint", None))

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
        n = params.n
        if kv is not None and (n > 1 or params.logprobs is not None or params.bad_words):
            raise RequestError("n > 1, logprobs and bad_words need the engine to sample the first "
                               "token (a producer has no tokenizer to ban bad words with); a "
                               "request with a KV source gets it from its producer")
        if kv is not None and params.prompt_logprobs is not None:
            raise RequestError(f"prompt_logprobs={params.prompt_logprobs} needs the logits of "
                               "every prompt position, which a PD producer does not send: submit "
                               "the request without a KV source (docs/pd.md)")
        if self.max_waiting is not None and self.num_waiting + n > self.max_waiting:
            raise CapacityError(f"queue is full: {self.num_waiting} requests wait, "
                                f"max_waiting={self.max_waiting}")
        if request_id is None:
            request_id = f"req-{self._next_id}"
        elif request_id in self.scheduler.requests or request_id in self._groups or \
                (n > 1 and any(f"{request_id}#{i}" in self.scheduler.requests for i in range(n))):
            raise RequestError(f"request_id={request_id!r} is already in flight")
        elif request_id.rpartition("#")[0] in self._groups:
            # `<id>#<index>` names the choices of an n > 1 request; some wait outside the scheduler
            raise RequestError(f"request_id={request_id!r} is reserved for the choices of the "
                               f"n > 1 request {request_id.rpartition('#')[0]!r} in flight")
        self._next_id += 1
        if params.prompt_logprobs == -1:  # the whole vocabulary (it fits MAX_LOGPROBS)
            params = msgspec.structs.replace(params, prompt_logprobs=self.spec.vocab_size)
        arrival = self.clock()
        if kv is not None:
            expect = getattr(kv, "expect", None)
            if expect is not None:  # let the source check the header on arrival
                expect(self.artifact, tokens, self._require_full_prefix)
        with self._step_lock:  # from another thread: waits for a running step to end
            if n == 1:
                request = self._new_request(request_id, request_id, 0, tokens, params, arrival)
                if kv is not None:
                    request.pd = PDImport()
                    self._kv[request_id] = KVLink(kv, request.arrival)
                self.scheduler.add(request)
            else:
                # Choice 0 prefills first; the others wait for it and start from its prompt's
                # KV: cached blocks with a prefix cache, a device copy without (see
                # `_release_held`); where neither works they prefill alongside.
                group = _Group()
                wait = self.scheduler.prefix is not None or self._forks
                group.prompt_logprobs = params.prompt_logprobs
                for index in range(n):
                    seed = None if params.seed is None else (params.seed + index) % 2**64
                    # choice 0 computes the prompt logprobs for the request (they are the same
                    # for every choice); the others may then start from its prompt's KV
                    child = msgspec.structs.replace(
                        params, n=1, seed=seed,
                        prompt_logprobs=params.prompt_logprobs if index == 0 else None)
                    request = self._new_request(f"{request_id}#{index}", request_id, index,
                                                tokens, child, arrival)
                    group.members.append(request)
                    if index and wait:
                        group.held.append(request)
                    else:
                        self.scheduler.add(request)
                group.live = n
                self._groups[request_id] = group
        log.debug("request.submitted", request_id=request_id, prompt_len=len(tokens),
                  max_tokens=request.max_tokens, n=n)
        return request_id

    def _new_request(self, internal_id: str, public_id: str, index: int,
                     tokens: npt.NDArray[np.int64], params: SamplingParams,
                     arrival: float) -> Request:
        seed = params.seed if params.seed is not None else \
            int(self._seed_seq.spawn(1)[0].generate_state(1)[0])
        rng = np.random.default_rng(seed)
        request = Request(internal_id, tokens, params, arrival, rng, self.artifact.max_seq_len)
        extras = None
        detok = self.tokenizer is not None and (self.detokenize or bool(params.stop))
        if internal_id != public_id or detok or \
                params.logprobs is not None or params.prompt_logprobs is not None or \
                not params.plain_greedy:
            extras = _Extras(public_id, index)
            self._extras[internal_id] = extras
        if extras is None:
            return request
        request.lane_flags = core.LANE_OWN_OUTPUT
        if not params.plain_greedy:
            request.lane_flags |= core.LANE_SAMPLE
            words = bad_word_ids(self.tokenizer, params.bad_words) if params.bad_words else ()
            extras.sampler = RequestSampler(params, tokens, self.spec.vocab_size,
                                            self.spec.eos_token_ids, rng, words)
            self._samplers[internal_id] = extras.sampler
        if detok:
            extras.detok = Detokenizer(self.tokenizer, tokens, params)
        if params.logprobs is not None:
            extras.logprobs = []
        if params.prompt_logprobs is not None:
            extras.prompt = PromptLogprobs(tokens, min(params.prompt_logprobs,
                                                       self.spec.vocab_size))
        return request

    def abort(self, request_id: str) -> bool:
        """End a queued, prefilling, staged or decoding request; its lane and blocks free at once.

        Returns False when the request is unknown or already finished. Its final output (reason
        "abort") comes out of the next `step()`.
        """
        with self._step_lock:  # from another thread: waits for a running step to end
            group = self._groups.get(request_id)
            if group is not None:
                for member in group.members:
                    if member.state is RequestState.FINISHED:
                        continue
                    if member in group.held:
                        self._abort_held(group, member)
                    elif self.scheduler.abort(member.request_id) is None:
                        continue
                    self._pending.append(self._final_output(member, ()))
                self._flush_events()
                return True
            group = self._groups.get(request_id.rpartition("#")[0])
            held = next((m for m in group.held if m.request_id == request_id), None) \
                if group is not None else None
            if group is not None and held is not None:  # one choice, still waiting for choice 0
                self._abort_held(group, held)
                self._pending.append(self._final_output(held, ()))
                return True
            request = self.scheduler.abort(request_id)
            if request is None:
                return False
            self._pending.append(self._final_output(request, ()))
            self._flush_events()
        return True

    @property
    def num_waiting(self) -> int:
        """Requests without a lane: the scheduler's queue plus n > 1 choices held for choice 0's
        prefill (what `max_waiting` bounds)."""
        held = sum(len(g.held) for g in self._groups.values()) if self._groups else 0
        return self.scheduler.num_waiting + held

    @staticmethod
    def _abort_held(group: _Group, member: Request) -> None:
        group.held.remove(member)
        member.set_state(RequestState.FINISHED)
        member.finish_reason = "abort"

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or \
            any(group.held for group in self._groups.values())

    # -- stepping ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one device call (a prefill chunk or a decode step); returns what it produced.

        Raises:
            StateError: another thread is inside `step()` of this Batcher (one consumer only).
        """
        self._enter_step()
        try:
            outputs = self._step()
            if self._decoded:
                self._kernel.emit(outputs, RequestOutput)
            return outputs
        finally:
            self._leave_step()

    def step_arrays(self) -> StepResult:
        """`step()` for embedders that batch (benchmarks, a server loop that streams in bulk):
        the tokens of requests that are simply decoding on come back as arrays, without a
        `RequestOutput` per token (see `StepResult`).

        Raises:
            StateError: another thread is inside `step()` of this Batcher (one consumer only).
        """
        self._enter_step()
        try:
            outputs = self._step()
            kernel = self._kernel
            rows = kernel.num_rows if self._decoded else 0
            # a copy of the lane table: an abort from another thread between this step and the
            # consumer reading the result must not erase whose tokens these are
            return StepResult(outputs, kernel.inputs.row_lanes[:rows], kernel.tokens[:rows],
                              kernel.plain[:rows], list(kernel.ids))
        finally:
            self._leave_step()

    def _enter_step(self) -> None:
        """Become the one consumer inside a step, then take the engine lock (a submit or abort
        from another thread waits for the step, and the step waits for them). Plain calls,
        not a context manager: a decode step allocates nothing it can avoid."""
        if not self._consumer.acquire(blocking=False):
            raise StateError("Batcher.step() is already running in another thread: a Batcher "
                             "has one consumer (share it through AsyncBatcher; docs/rules.md)")
        try:
            self._step_lock.acquire()
        except BaseException:
            self._consumer.release()
            raise

    def _leave_step(self) -> None:
        self._step_lock.release()
        self._consumer.release()

    def _step(self) -> list[RequestOutput]:
        self._decoded = False
        outputs, self._pending = self._pending, []
        if self._groups:  # choice 0 may have ended outside a step (an abort of its own id)
            self._release_held(outputs, fork=True)
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
        if self._groups:
            self._release_held(outputs, fork=False)
        if self.scheduler.events:
            self._flush_events()
        return outputs

    def _release_held(self, outputs: list[RequestOutput], fork: bool) -> None:
        """Start the choices that waited for choice 0 once it has its first token (or ended).

        With a prefix cache, choice 0's full prompt blocks are published in the cache first, so
        the others start there (re-running only the last chunk). Without one (`self._forks`),
        each takes an idle lane with a device copy of choice 0's prompt KV and samples its own
        first token from choice 0's first-token logits: no prefill at all. Forks run only at the
        start of a step (`fork`), so their copies run before any device call can change a block.
        The choices wait for a lane while choice 0 decodes or is staged (its prompt positions stay
        as they are); a hybrid model's sliding slot changes with choice 0's first decode, so
        there they fork right away or not at all. Choices that cannot fork are queued: they
        prefill on their own."""
        for group in self._groups.values():
            if not group.held:
                continue
            first = group.members[0]
            if not first.output and first.state is not RequestState.FINISHED:
                continue
            if self._forks:
                forkable = group.first_row is not None and \
                    first.state in (RequestState.DECODING, RequestState.STAGED) and \
                    (not self.spec.is_hybrid or len(first.output) == 1)
                if forkable and fork:
                    self._fork_held(group, first, outputs)
                if forkable and group.held:
                    continue  # wait for a lane (or blocks) to free up
            elif first.state is RequestState.DECODING:
                self.scheduler.share_prompt(first)
            self._hand_over_prompt_logprobs(group)
            for request in group.held:
                self.scheduler.add(request)
            group.held.clear()
            group.first_row = None

    def _fork_held(self, group: _Group, first: Request, outputs: list[RequestOutput]) -> None:
        """Start held choices on idle lanes from copies of choice 0's prompt KV, while the
        scheduler finds a lane and blocks for them."""
        row = group.first_row
        assert row is not None
        now = self.clock()
        while group.held:
            child = group.held[0]
            copies = self.scheduler.fork_prompt(first, child, now)
            if copies is None:
                break
            group.held.pop(0)
            try:
                for src, dst in copies:
                    self.runtime.copy_block(src, dst)
                if self.spec.is_hybrid:
                    self.runtime.copy_slot(first.lane, child.lane)  # type: ignore[attr-defined]
                token = self._sample_one(child, row)
            except Exception as exc:  # this choice fails; choice 0 and the others go on
                self._fail(child, f"starting from choice 0's prompt KV failed: {exc}", outputs)
                continue
            for done in self.scheduler.start_forked(child, token, now):
                outputs.append(self._output(done))
        if not group.held:
            group.first_row = None

    def _hand_over_prompt_logprobs(self, group: _Group) -> None:
        """Choice 0 ended before its first token: the first choice that now prefills on its own
        computes the request's prompt logprobs instead."""
        if group.prompt_logprobs is None or group.prompt_result is not None or not group.held:
            return
        if group.members[0].output:
            return
        child = group.held[0]
        child.params = msgspec.structs.replace(child.params,
                                               prompt_logprobs=group.prompt_logprobs)
        extras = self._extras[child.request_id]
        extras.prompt = PromptLogprobs(child.prompt, min(group.prompt_logprobs,
                                                         self.spec.vocab_size))

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
            collector = self._prompt_collector(request)
            if collector is None:
                logits = self._device_call(self.runtime.prefill, plan.inputs)
                row = np.asarray(logits).reshape(-1)
            else:
                row = self._prefill_every_position(plan, collector)
            token = None
            if plan.last_chunk and not request.recomputing:
                if not np.isfinite(row).all():
                    raise RequestError(f"prefill returned non-finite logits for "
                                       f"{plan.request_id} at position {plan.chunk_start}")
                token = self._sample_one(request, row)
                self._keep_first_row(request, row)
        except Exception as exc:  # the runtime failed this request; the others go on
            self._fail(request, f"prefill failed: {exc}", outputs)
            return
        for done in scheduler.complete_prefill(plan, token, self.clock()):
            outputs.append(self._output(done))

    def _prompt_collector(self, request: Request) -> PromptLogprobs | None:
        """The prompt logprobs this request still collects (none once its first token is out:
        a preempted request's recompute needs none)."""
        if not self._extras or request.recomputing:
            return None
        extras = self._extras.get(request.request_id)
        return extras.prompt if extras is not None else None

    def _prefill_every_position(self, plan: StepPlan,
                                collector: PromptLogprobs) -> npt.NDArray[np.floating]:
        """Run a prefill chunk for every position's logits; feed the real positions to the
        prompt logprobs; return the last real token's row (what the first token samples from)."""
        prefill: Any = self.runtime.prefill  # the optional keyword (see runtime/base.py)
        call = functools.partial(prefill, every_position=True)
        logits = np.asarray(self._device_call(call, plan.inputs))
        q, vocab = self.artifact.prefill_chunk_size, self.spec.vocab_size
        if logits.size != q * vocab:
            raise RequestError(f"prefill(every_position=True) returned logits of shape "
                               f"{logits.shape}; the chunk has {q} positions of {vocab} ids")
        real = logits.reshape(q, vocab)[:plan.chunk_len]
        if not np.isfinite(real).all():
            raise RequestError(f"prefill returned non-finite logits for {plan.request_id} in "
                               f"positions {plan.chunk_start}..{plan.chunk_start + plan.chunk_len - 1}")
        collector.add_chunk(real, plan.chunk_start)
        return real[-1]

    def _prompt_logprobs_out(self, request: Request,
                             extras: _Extras) -> tuple[TokenLogprobs | None, ...] | None:
        """The prompt logprobs, built once when the request's first token is out (None on
        every other output)."""
        collector = extras.prompt
        if collector is None or not request.output:
            return None
        extras.prompt = None
        if not collector.complete:  # cannot happen (no prefix-cache read, no PD): never guess
            log.warning("prompt_logprobs.incomplete", request_id=request.request_id)
            return None
        result = extras.prompt_result = collector.result()
        group = self._groups.get(extras.public_id) if self._groups else None
        if group is not None:
            group.prompt_result = result
        return result

    def _keep_first_row(self, request: Request, row: npt.NDArray[np.floating]) -> None:
        """Choice 0 of an n > 1 request keeps its first-token logits while other choices wait
        to fork from its prompt KV: each samples its own first token from that row."""
        if not self._groups or not request.request_id.endswith("#0"):
            return
        group = self._groups.get(request.request_id[:-2])
        if group is not None and group.held and self._forks:
            group.first_row = np.array(row, dtype=np.float32)

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

    def _skip_first_draw(self, request_id: str) -> None:
        """The producer sampled the first token from `default_rng(seed)` (docs/pd.md): advance
        this request's generator past that draw, so its later tokens are the ones a colocated
        run with the same seed samples."""
        sampler = self._samplers.get(request_id) if self._samplers else None
        if sampler is not None and sampler.params.temperature >= GREEDY_EPS:
            sampler.rng.random()

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
        had_first = bool(request.output)
        done_list = scheduler.complete_import(plan, len(layers), self.clock())
        if not had_first and request.output:  # the producer's first token was taken
            self._skip_first_draw(request.request_id)
        for done in done_list:
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
        """One decode step. The kernel picks every greedy row and checks every row's logits in
        one call, and appends every token in another; Python touches only the rows it hands
        back (sampled requests, failures, finishes, requests whose outputs carry extras)."""
        scheduler = self.scheduler
        kernel = self._kernel
        try:
            raw = logits = self._device_call(self.runtime.decode, plan.inputs)
            if not isinstance(logits, np.ndarray) or logits.dtype != np.float32 or \
                    not logits.flags.c_contiguous:
                logits = np.ascontiguousarray(logits, dtype=np.float32)
            vocab = self.spec.vocab_size
            if logits.shape != (plan.inputs.num_rows, vocab):
                raise RequestError(f"decode returned logits of shape {logits.shape}; the step ran "
                                   f"{plan.inputs.num_rows} rows of vocab_size={vocab}")
            # greedy is the argmax of the runtime's own logits (as in prefill): a float32 copy
            # of wider ones would tie entries they tell apart
            wide = raw is not logits and isinstance(raw, np.ndarray) and \
                raw.dtype.kind == "f" and raw.dtype.itemsize > 4
            greedy = self._greedy[:logits.shape[0]]  # allocated once: the step allocates nothing
            np.argmax(raw if wide else logits, axis=1, out=greedy)
        except Exception as exc:
            for failed in scheduler.decode_requests(plan):
                self._fail(failed, f"decode step failed: {exc}", outputs)
            return
        attention = kernel.pick(logits, greedy)
        if attention:
            lanes = plan.inputs.row_lanes
            special: list[tuple[int, int, Request, RequestSampler]] = []
            for row in kernel.attention[:attention].tolist():
                lane = int(lanes[row])
                request = scheduler.by_lane[lane]
                if request is None:  # failed by this plan's block ops
                    continue
                if kernel.status[row] == core.ROW_NONFINITE:
                    self._fail(request, f"decode returned non-finite logits on lane {lane}",
                               outputs)
                else:
                    special.append((row, lane, request, self._samplers[request.request_id]))
            if special:
                self._sample_special(logits, special, kernel.tokens, outputs)
        done = scheduler.complete_decode(plan, self.clock())
        self._decoded = True  # the kernel's plain rows are this step's (step() emits them)
        for request in done:
            outputs.append(self._output(request))

    def _sample_special(self, logits: npt.NDArray[np.floating],
                        special: list[tuple[int, int, Request, RequestSampler]],
                        tokens: npt.NDArray[np.int64], outputs: list[RequestOutput]) -> None:
        """Sample the (row, lane, request, sampler) entries of one decode step at once; each
        token goes to `tokens[row]`."""
        rows = [row for row, _, _, _ in special]
        try:
            result = sample_rows(logits[rows], [s for _, _, _, s in special],
                                 [r.output for _, _, r, _ in special], self.logprobs_mode)
        except Exception as exc:  # a sampler bug fails these requests, not the engine
            for _, _, request, _ in special:
                self._fail(request, f"sampling failed: {exc}", outputs)
            return
        masked = set(result.masked_rows)
        for i, (row, _, request, _) in enumerate(special):
            if i in masked:
                self._fail(request, "every token is masked (allowed_token_ids, bad_words, "
                           "logit_bias and min_tokens exclude the whole vocabulary)", outputs)
                continue
            tokens[row] = int(result.tokens[i])
            self._keep_logprobs(request, result.logprobs[i])

    def _sample_one(self, request: Request, row: npt.NDArray[np.floating]) -> int:
        """The first token of a request from its prefill's last logits."""
        sampler = self._samplers.get(request.request_id) if self._samplers else None
        if sampler is None:
            return int(np.argmax(row))
        result = sample_rows(row.reshape(1, -1), [sampler], [request.output], self.logprobs_mode)
        if result.masked_rows:
            raise RequestError("every token is masked (allowed_token_ids, bad_words, logit_bias "
                               "and min_tokens exclude the whole vocabulary)")
        self._keep_logprobs(request, result.logprobs[0])
        return int(result.tokens[0])

    def _keep_logprobs(self, request: Request, logprobs: TokenLogprobs | None) -> None:
        if logprobs is None:
            return
        extras = self._extras[request.request_id]
        assert extras.logprobs is not None
        extras.logprobs.append(logprobs)

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
        extras = self._extras.get(request.request_id) if self._extras else None
        if extras is None:
            if request.state is RequestState.FINISHED:
                return self._final_output(request, new)
            return RequestOutput(request_id=request.request_id, new_token_ids=new, finished=False)
        text = None
        if extras.detok is not None:
            text = extras.detok.add(new, len(request.output))
            if extras.detok.stopped is not None:  # the text ends before the stop string
                self.scheduler.stop_string(request)
                if request.finish_reason == "stop":
                    extras.stop_reason = extras.detok.stopped
        if request.state is RequestState.FINISHED:
            return self._final_output(request, new, text)
        logprobs = None
        if extras.logprobs is not None:
            logprobs = tuple(extras.logprobs[len(request.output) - 1:len(request.output)])
        prompt_logprobs = self._prompt_logprobs_out(request, extras) \
            if extras.prompt is not None else None
        return RequestOutput(request_id=extras.public_id, new_token_ids=new, finished=False,
                             index=extras.index, text=text, logprobs=logprobs,
                             prompt_logprobs=prompt_logprobs)

    def _final_output(self, request: Request, new: tuple[int, ...],
                      text: str | None = None) -> RequestOutput:
        if request.request_id in self._kv:
            self._close_kv(request.request_id)
        extras = self._extras.pop(request.request_id, None) if self._extras else None
        self._samplers.pop(request.request_id, None)
        if extras is None:
            completion = self._completion(request)
            return RequestOutput(request_id=request.request_id, new_token_ids=new, finished=True,
                                 finish_reason=request.finish_reason, error=request.error,
                                 completion=completion)
        if extras.detok is not None:
            text = (text or "") + extras.detok.flush()
        prompt_logprobs = self._prompt_logprobs_out(request, extras) \
            if extras.prompt is not None else None
        completion = self._completion(request, extras)
        logprobs = None
        if extras.logprobs is not None:
            logprobs = tuple(extras.logprobs[len(request.output) - len(new):])
        finished = True
        group = self._groups.get(extras.public_id) if extras.public_id != request.request_id \
            else None
        if group is not None:
            group.live -= 1
            finished = group.live == 0
            if finished:
                del self._groups[extras.public_id]
        return RequestOutput(request_id=extras.public_id, new_token_ids=new, finished=finished,
                             finish_reason=request.finish_reason, error=request.error,
                             completion=completion, index=extras.index, text=text,
                             logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _completion(self, request: Request, extras: _Extras | None = None) -> Completion:
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
        stop_reason = extras.stop_reason if extras is not None else None
        if stop_reason is None and request.finish_reason == "stop" and request.output and \
                request.output[-1] in request.params.stop_token_ids:
            stop_reason = request.output[-1]  # a stop id (EOS leaves it None, as in vLLM)
        if extras is None:
            return Completion(request_id=request.request_id, prompt_len=len(request.prompt),
                              token_ids=tuple(request.output), finish_reason=request.finish_reason
                              or "error", error=request.error, timings=timings,
                              preemptions=request.preemptions, stop_reason=stop_reason)
        return Completion(request_id=extras.public_id, prompt_len=len(request.prompt),
                          token_ids=tuple(request.output), finish_reason=request.finish_reason or
                          "error", error=request.error, timings=timings,
                          preemptions=request.preemptions, index=extras.index,
                          text=extras.detok.text if extras.detok is not None else None,
                          logprobs=tuple(extras.logprobs) if extras.logprobs is not None else None,
                          stop_reason=stop_reason, prompt_logprobs=self._prompt_result(extras))

    def _prompt_result(self, extras: _Extras) -> tuple[TokenLogprobs | None, ...] | None:
        """A completion's prompt logprobs: its own, or (n > 1) the request's, from choice 0."""
        if extras.prompt_result is not None:
            return extras.prompt_result
        group = self._groups.get(extras.public_id) if self._groups else None
        return group.prompt_result if group is not None else None

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

        A prompt whose params have `n > 1` contributes its n completions one after the other,
        in choice order (`Completion.index` 0..n-1), so the list is flat: one entry per choice.
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
        mine: set[str] = set()
        done: dict[tuple[str, int], Completion] = {}
        want = sum(sp.n for sp in per_prompt)
        while len(done) < want:
            while len(ids) < len(prompts) and (
                    self.max_waiting is None or self.num_waiting == 0 or
                    self.num_waiting + per_prompt[len(ids)].n <= self.max_waiting):
                ids.append(self.submit(prompts[len(ids)], per_prompt[len(ids)]))
                mine.add(ids[-1])
            for out in self.step():
                if out.completion is not None and out.request_id in mine:  # not others' requests
                    done[out.request_id, out.index] = out.completion
        return [done[i, index] for i, sp in zip(ids, per_prompt, strict=True)
                for index in range(sp.n)]

    def stats(self) -> EngineStats:
        s = self.scheduler
        free, spare, staged, lane, cached = s.pool.counts()
        c = s.counters
        return EngineStats(
            occupied_lanes=s.lanes.num_busy, decoding_lanes=s.lanes.num_decoding(),
            queue_length=self.num_waiting, free_blocks=free, spare_blocks=spare,
            staged_blocks=staged, lane_blocks=lane, cached_blocks=cached, steps=c.steps,
            imports=c.imports,
            prefill_chunks=c.prefill_chunks, staged_chunks=c.staged_chunks,
            decode_steps=c.decode_steps, generated_tokens=c.generated_tokens,
            rotations=c.rotations, preemptions=c.preemptions, prefix_hits=c.prefix_hits,
            prefix_misses=c.prefix_misses, prefix_hit_tokens=c.prefix_hit_tokens,
            host_restores=c.host_restores, evictions=c.evictions, prompt_forks=c.prompt_forks,
            fork_saved_tokens=c.fork_saved_tokens, finished=dict(c.finished),
            lane_histogram=tuple(c.lane_histogram), bucket_steps=dict(c.bucket_steps))

    def check_invariants(self) -> None:
        """Raise `StateError` if any ownership invariant of docs/rules.md is broken."""
        self.scheduler.check_invariants()

    def record_trace(self) -> list[Any]:
        """Start recording a `StepRecord` per device call; returns the list that fills up."""
        self.scheduler.trace = []
        return self.scheduler.trace

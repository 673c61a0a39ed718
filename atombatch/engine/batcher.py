"""`Batcher`: the engine facade that servers, benchmarks and routers embed.

It runs the scheduler's plans on a runtime, samples, streams `RequestOutput`s and turns every
failure into a per-request error while the other lanes go on.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.api.options import DEFAULT_MAX_WAITING, ENGINE_DEFAULTS, EngineOptions
from atombatch.api.reports import EngineStats
from atombatch.api.structs import (
    GREEDY_EPS,
    Completion,
    RequestOutput,
    SamplingParams,
)
from atombatch.api.validation import RequestRules, queue_limit, validate_request
from atombatch.artifact import plan as memory_plan
from atombatch.artifact.config import ArtifactConfig
from atombatch.engine.checkpoints import run_slot_ops, slot_ops_supported
from atombatch.engine.groups import Group, Move, num_held
from atombatch.engine.kv_manager import MAX_CHAIN
from atombatch.engine.lora import adapter_in_use, adapter_named, check_max_loras, next_lora_id
from atombatch.engine.outputs import Extras, OutputBuilder
from atombatch.engine.pd_intake import KVLink, KVSource, PDIntake
from atombatch.engine.pipeline import NUM_FLIGHTS, DeviceThread, Flight, decode_logits, make_flights
from atombatch.engine.scheduler import PDImport, Policy, Request, RequestState, Scheduler, StepPlan
from atombatch.errors import (
    CapacityError,
    ConfigError,
    RequestError,
    StateError,
    TransientDeviceError,
)
from atombatch.kernel import blocks as core
from atombatch.kernel.prefix import HostCache, adapter_root
from atombatch.logs import enabled as log_enabled
from atombatch.logs import log
from atombatch.runtime.base import Capabilities, Runtime
from atombatch.sampling.argmax import RowArgmax
from atombatch.sampling.detokenizer import bad_word_ids
from atombatch.sampling.grammar import ConstraintFailed, Grammars, RequestGrammar
from atombatch.sampling.sampler import (
    LOGPROBS_MODES,
    LogprobsMode,
    PromptLogprobs,
    RequestSampler,
    SampleResult,
    sample_rows,
)

if TYPE_CHECKING:
    from atombatch.artifact.lora import LoraAdapter

__all__ = ["DEFAULT_MAX_WAITING", "Batcher", "EngineStats", "Extras", "Group", "KVLink",
           "KVSource", "StepResult"]

_WARN_EVENTS = frozenset({"request.failed"})
# A request's lane events are debug: rendered, each costs the device loop ~37 us (issue 21: the
# core's own Python per step stays small); its finish (with its timings) stays info.
_DEBUG_EVENTS = frozenset({"lane.assigned", "request.admitted", "lane.released"})
_ALL_MASKED = ("every token is masked (structured output, allowed_token_ids, bad_words, "
               "logit_bias and min_tokens exclude the whole vocabulary)")


_D = ENGINE_DEFAULTS  # every keyword's default (atombatch/artifact/config.py)


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
        prefix_cache: keep finished sequences' KV for prefix reuse (hybrid models: with
            sliding-slot checkpoints, docs/prefix-cache.md).
        host_cache_bytes: host-memory bytes for evicted prefix blocks and, on hybrid models,
            sliding-slot checkpoints (needs prefix_cache).
        policy: prefill/decode interleaving: "stall-free:K" (the default, `DEFAULT_POLICY`),
            "prefill-first", "decode-first", "interleave:N", "fill-first:N" (docs/scheduling.md).
        seed: derives the RNG of requests that give no seed of their own.
        clock: seconds; defaults to the runtime's `clock` (virtual time) or `time.perf_counter`.
        max_waiting: bound on requests without a lane; `submit` raises `CapacityError` past it
            (default `DEFAULT_MAX_WAITING`; None removes the bound, for callers that bound their
            own submissions).
        pd_timeout: seconds a PD request may wait for its producer's next message (header or
            layer) before it fails; the wait for the header includes the producer's own queue,
            so this must exceed the longest queueing a producer can have.
        pd_deadline: seconds a PD request's whole import may take from submit (default: twice
            `pd_timeout`); past it the request fails and frees its lane.
        tokenizer: a `tokenizers.Tokenizer`; with it outputs carry text, and `stop` strings
            and `bad_words` work (see docs/sampling.md).
        logprobs_mode: "raw" (log-softmax of the model's logits, vLLM's default) or
            "processed" (of the distribution the token was drawn from: after penalties, bias,
            masks, temperature and top-k/top-p/min-p).
        detokenize: False leaves text to a front (only requests with stop strings are decoded
            here).
        argmax_threads: threads a decode step's greedy argmax splits its rows over when its
            logits are large (atombatch/sampling/argmax.py; default: half the cores, at most 4, and 1 on
            four cores or fewer).
        overlap: run steady decodes as a pipeline on a device thread, each step's inputs
            built while the step before it runs (atombatch/engine/pipeline.py); `step()` then returns
            the step that landed while the next one is on the device.
        max_loras: on a runtime with LoRA adapters, the distinct adapters whose requests hold
            lanes at once (vLLM's `--max-loras`; the base model is not one); a request whose
            adapter does not fit waits while others are admitted (docs/lora.md). None: no cap.
        max_lora_rank: the largest adapter rank `load_lora` accepts (vLLM's
            `--max-lora-rank`); None: the loader's bound.

    A Batcher is driven by one consumer: `step()` raises `StateError` when another thread is
    already inside it (two interleaved steps would corrupt the lane tables); `submit` and `abort`
    called from another thread wait until a running step ends (and a step waits for them).
    `AsyncBatcher` is the way to
    share one engine between many clients.

    Raises:
        ConfigError: the artifact and the options break a rule of docs/rules.md.
    """

    def __init__(self, runtime: Runtime, *, prefix_cache: bool = _D.prefix_cache,
                 host_cache_bytes: int = _D.host_cache_bytes,
                 policy: Policy | str = _D.policy, seed: int = _D.seed,
                 clock: Callable[[], float] | None = None,
                 max_waiting: int | None = _D.max_waiting,
                 pd_timeout: float = _D.pd_timeout, pd_deadline: float | None = _D.pd_deadline,
                 tokenizer: Any | None = None,
                 logprobs_mode: LogprobsMode = _D.logprobs_mode, detokenize: bool = _D.detokenize,
                 argmax_threads: int | None = _D.argmax_threads,
                 overlap: bool = _D.overlap, log_requests: bool = _D.log_requests,
                 max_loras: int | None = _D.max_loras,
                 max_lora_rank: int | None = _D.max_lora_rank) -> None:
        artifact: ArtifactConfig = runtime.artifact
        check_max_loras(max_loras)
        if not isinstance(overlap, bool):
            raise ConfigError(f"overlap={overlap!r} must be True or False")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode={logprobs_mode!r} is not one of "
                              f"{', '.join(LOGPROBS_MODES)}")
        memory_plan.check_serving(artifact, prefix_cache=prefix_cache,
                                  host_cache_bytes=host_cache_bytes)
        self.runtime = runtime
        self.artifact = artifact
        self.spec = artifact.model
        self.capabilities = caps = Capabilities(runtime)  # what it offers beyond `Runtime`
        checkpoint_bytes = 0
        if self.spec.is_hybrid and prefix_cache:  # sliding-slot checkpoints (docs/prefix-cache.md)
            slot_ops_supported(runtime, caps)
            checkpoint_bytes = caps.slot_bytes or memory_plan.checkpoint_bytes(artifact)
        self.host_cache = HostCache(host_cache_bytes, artifact.block_size) \
            if host_cache_bytes else None
        self.scheduler = Scheduler(artifact, policy, eos_token_ids=self.spec.eos_token_ids,
                                   prefix_cache=prefix_cache, host_cache=self.host_cache,
                                   checkpoint_bytes=checkpoint_bytes,
                                   lora=caps.lora and (not caps.lora_loadable or
                                                       bool(self.lora_adapters)),
                                   max_loras=max_loras if caps.lora else None)
        # the rows' adapter ids (atombatch/engine/lora.py); None until a request names an
        # adapter on a runtime that loads them (until then every row is the base model's, and
        # the runtime is called as one without LoRA), and on a runtime without LoRA
        self._lora = self.scheduler.lora
        self.clock: Callable[[], float] = clock or caps.clock or time.perf_counter
        if max_waiting is not None and (isinstance(max_waiting, bool) or
                                        not isinstance(max_waiting, int) or max_waiting < 1):
            raise ConfigError(f"max_waiting={max_waiting!r} must be an int >= 1 (or None: unbounded)")
        self.max_waiting = max_waiting
        # what submit admits without a lane (None: unbounded, or left to the core's fronts)
        self._waiting_limit = queue_limit(0, max_waiting)
        # Called right before every device call: the engine core hands the previous step's
        # outputs to its sender thread there, so that work runs while the device does.
        self.on_device_call: Callable[[], None] | None = None
        # Given each step's scheduler events instead of logging them here: the engine core
        # renders them on its sender thread (a rendered event costs the loop ~37 us).
        self.on_events: Callable[[list[tuple[str, dict[str, Any]]]], None] | None = None
        # a request's info events are logged (False: quiet_requests, the server's
        # --disable-log-requests)
        self.log_requests = log_requests
        # Wall time in device calls, and between one call's end and the next call's start while
        # work was pending (0.0: none pending since the last call); see `EngineStats.device_s`.
        self._device_s = self._host_gap_s = self._device_end = 0.0
        self._host_gaps = 0
        self._step_lock = threading.Lock()      # the engine's state: step, submit, abort
        self._consumer = threading.Lock()       # held by the one thread inside step()
        self._seed_seq = np.random.SeedSequence(seed)
        self._next_id = 0
        self._pending: list[RequestOutput] = []
        self.idle = True  # the last step ran no device call (nothing runnable: e.g. PD waits)
        self._pd = PDIntake(artifact, pd_timeout, pd_deadline)  # the KV links of PD requests
        self._pd_deadline_given = pd_deadline
        self.tokenizer = tokenizer
        # False: only requests with stop strings are detokenized here (their text decides when
        # they stop); the others' outputs carry ids alone and a front decodes them
        self.detokenize = detokenize
        self.logprobs_mode: LogprobsMode = logprobs_mode
        self._options = EngineOptions(  # as built; `options` reads the live ones back in
            prefix_cache=prefix_cache, host_cache_bytes=host_cache_bytes,
            policy=self.scheduler.policy.label, seed=seed, max_waiting=max_waiting,
            pd_timeout=pd_timeout, pd_deadline=pd_deadline, logprobs_mode=logprobs_mode,
            detokenize=detokenize, argmax_threads=argmax_threads, overlap=overlap,
            log_requests=log_requests, max_loras=max_loras, max_lora_rank=max_lora_rank)
        self._samplers: dict[str, RequestSampler] = {}  # requests that are not plain greedy
        self._grammars: Grammars | None = None     # structured output (built on first use)
        # structured requests whose grammar compiles: (the compile, the choices waiting for it)
        self._compiling: dict[str, tuple[concurrent.futures.Future[Any], list[Request]]] = {}
        self._groups: dict[str, Group] = {}        # n > 1 requests by the id submit() returned
        self._outputs = OutputBuilder(self._groups, self.spec.vocab_size)
        self._decoded = False                      # the last step completed a decode
        self._kernel = self.scheduler.kv.kernel    # the decode-step kernel (never replaced)
        self._greedy = np.zeros(artifact.batch_size, dtype=np.int64)  # decode argmax, by row
        self._argmax = RowArgmax(argmax_threads)  # split over threads when the logits are large
        # overlap: steady decodes run as a pipeline on a device thread (atombatch/engine/pipeline.py);
        # `step()` then returns the step that landed while the next one runs
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
        # n > 1 without a prefix cache: choices 1..n-1 start from a device copy of choice 0's
        # prompt KV (see `_release_held`); hybrid models also need the runtime's `copy_slot`
        needed = ("_fetch_kv_cache", "_update_kv_cache") if self.spec.is_hybrid else ()
        self._forks = not prefix_cache and not self.artifact.single_block and \
            (not self.spec.is_hybrid or caps.copy_slot) and caps.has_kv("_copy_kv_cache", *needed)

    @classmethod
    def from_options(cls, runtime: Runtime, options: EngineOptions, *,
                     policy: Policy | None = None, clock: Callable[[], float] | None = None,
                     tokenizer: Any | None = None) -> Batcher:
        """A Batcher built from one `EngineOptions` (what the server's command line makes, and
        what an embedder can keep, pickle or send), with what is not data beside it: `policy`
        (a `Policy` object, instead of `options.policy`'s label), `clock`, `tokenizer`."""
        fields = msgspec.structs.asdict(options)
        if policy is not None:
            fields["policy"] = policy
        return cls(runtime, clock=clock, tokenizer=tokenizer, **fields)

    @property
    def options(self) -> EngineOptions:
        """The plain-data options this engine runs with (`from_options` builds its twin)."""
        return msgspec.structs.replace(self._options, pd_timeout=self._pd.timeout,
                                       pd_deadline=self._pd_deadline_given,
                                       detokenize=self.detokenize,
                                       log_requests=self.log_requests)

    def use_tokenizer(self, tokenizer: Any, *, detokenize: bool) -> None:
        """Give the engine a tokenizer after it was built (a server that loads its codec
        later): stop strings, bad words and structured output then work, and `detokenize=False`
        leaves every other request's text to the front (docs/architecture.md). Call it before
        the first request: a request in flight keeps the text maker it started with.
        """
        self.tokenizer = tokenizer
        self.detokenize = detokenize

    @property
    def pd_timeout(self) -> float:
        """Seconds a PD request may wait for its producer's next message (see `__init__`)."""
        return self._pd.timeout

    @pd_timeout.setter
    def pd_timeout(self, seconds: float) -> None:
        self._pd.timeout = seconds

    @property
    def pd_deadline(self) -> float:
        """Seconds a PD request's whole import may take from submit (see `__init__`)."""
        return self._pd.deadline

    @pd_deadline.setter
    def pd_deadline(self, seconds: float | None) -> None:
        self._pd.deadline = seconds
        self._pd_deadline_given = seconds

    @property
    def _kv(self) -> dict[str, KVLink]:
        """The KV links of PD requests in flight, by request id."""
        return self._pd.links

    @property
    def _extras(self) -> dict[str, Extras]:
        """What requests' outputs need beyond ids, by scheduler request id."""
        return self._outputs.extras

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
            every_position_logits=self.capabilities.every_position_logits,
            every_position_hint=self.capabilities.every_position_hint)

    def submit(self, prompt: Sequence[int] | npt.NDArray[np.integer],
               params: SamplingParams | None = None, request_id: str | None = None,
               kv: KVSource | None = None, *, lora: str | None = None,
               validated: bool = False) -> str:
        """Queue a request; returns its id.

        `validated`: the prompt and params already passed `validate` against this engine's
        rules (a front's input processor checked them: an `AsyncBatcher`, the engine core
        process); they are not checked again, so a request is validated once.

        With `kv`, a producer computes the prompt's KV and first token (prefill/decode
        disaggregation): the request is admitted once the source's header has arrived and matches
        the artifact, its layers are imported as they come, and decoding starts from the
        producer's first token. Any fault of the source fails this request alone.

        `lora`: the name of a loaded LoRA adapter (`lora_adapters`) the request runs under
        (None: the base model); its prefix-cache entries are its adapter's alone.

        Raises:
            RequestError: the request is invalid (nothing is queued).
            CapacityError: `max_waiting` requests are already waiting.
        """
        params = params or SamplingParams()
        tokens = np.array(prompt, dtype=np.int64) if validated else \
            self.validate(prompt, params)
        adapter = None if lora is None else \
            adapter_named(self.lora_adapters, lora, self.capabilities.lora_loadable)
        n = params.n
        if kv is not None and (n > 1 or params.logprobs is not None or params.bad_words):
            raise RequestError("n > 1, logprobs and bad_words need the engine to sample the first "
                               "token (a producer has no tokenizer to ban bad words with); a "
                               "request with a KV source gets it from its producer")
        if kv is not None and params.prompt_logprobs is not None:
            raise RequestError(f"prompt_logprobs={params.prompt_logprobs} needs the logits of "
                               "every prompt position, which a PD producer does not send: submit "
                               "the request without a KV source (docs/pd.md)")
        if self._waiting_limit is not None and self.num_waiting + n > self._waiting_limit:
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
        compile_job = None
        if params.structured is not None:  # compiles on the grammar thread while it queues
            compile_job = self.grammars().compile(params.structured)
        arrival = self.clock()
        if kv is not None:
            self._pd.expect(kv, tokens)  # let the source check the header on arrival
        with self._step_lock:  # from another thread: waits for a running step to end
            if adapter is not None:
                # the adapter loaded now under that name: an unload + load in between (another
                # thread) gave the name other weights, and the request's cache root must be theirs
                adapter = self.lora_adapters.get(adapter.name)
                if adapter is None:
                    raise RequestError(f"lora={lora!r} was unloaded before the request was "
                                       "queued")
                if self._lora is None:  # the first request under an adapter
                    self._lora = self.scheduler.enable_lora()
            if n == 1:
                request = self._new_request(request_id, request_id, 0, tokens, params, arrival,
                                            adapter)
                if kv is not None:
                    request.pd = PDImport()
                    self._pd.open(request_id, kv, request.arrival, adapter)
                self.scheduler.add(request)
            else:
                # Choice 0 prefills first; the others wait for it and start from its prompt's
                # KV: cached blocks with a prefix cache, a device copy without (see
                # `_release_held`); where neither works they prefill alongside.
                group = Group(params.prompt_logprobs)
                wait = self.scheduler.prefix is not None or self._forks
                for index in range(n):
                    request = self._new_request(f"{request_id}#{index}", request_id, index,
                                                tokens, Group.child_params(params, index),
                                                arrival, adapter)
                    group.add(request, held=bool(index and wait))
                    if not (index and wait):
                        self.scheduler.add(request)
                self._groups[request_id] = group
            if compile_job is not None:
                choices = group.members if n > 1 else [request]
                for choice in choices:
                    choice.compiling = True
                self._compiling[request_id] = (compile_job, list(choices))
        if log_enabled(logging.DEBUG):
            log.debug("request.submitted", request_id=request_id, prompt_len=len(tokens),
                      max_tokens=request.max_tokens, n=n)
        return request_id

    @property
    def lora_adapters(self) -> Mapping[str, LoraAdapter]:
        """The LoRA adapters requests may name (`submit(lora=)`), by name; empty on a runtime
        without LoRA."""
        adapters = getattr(self.runtime, "lora_adapters", None) if self.capabilities.lora else None
        return adapters if adapters is not None else {}

    def load_lora(self, name: str, path: str, *, max_loaded: int | None = None) -> LoraAdapter:
        """Load the PEFT adapter in directory `path` under `name` (vLLM's `lora_name`) on a
        runtime that takes adapters at run time; returns it. The files are read and checked
        before the engine is locked; a step waits only for the runtime to take the weights.

        `max_loaded` (a server's `--max-cpu-loras`): refused when that many adapters are loaded
        already, counted under the engine's lock (fronts sharing a core each see only their
        own loads).

        Raises:
            ConfigError: the adapter's files break a rule (named), or the runtime cannot load
                adapters.
            RequestError: `name` is loaded already, or `max_loaded` adapters are.
        """
        if not self.capabilities.lora_loadable:
            raise ConfigError("this runtime cannot load LoRA adapters at run time (a compiled "
                              "artifact's adapters are fixed when it is compiled: docs/lora.md)")
        if not isinstance(name, str) or not name:
            raise RequestError(f"lora_name={name!r} must be a non-empty string")
        if name in self.lora_adapters:
            raise RequestError(f"lora_name={name!r} is loaded already")
        self._check_loaded(max_loaded)
        from atombatch.artifact.lora import load_peft  # reads files: only when asked
        # the id is the one free when the runtime takes the adapter (a load of another name
        # meanwhile, another thread's, may have taken the one free now); the files' checks
        # and the identity do not depend on it
        adapter, weights = load_peft(path, name=name, lora_int_id=1, spec=self.spec,
                                     max_lora_rank=self._options.max_lora_rank)
        with self._step_lock:
            if name in self.lora_adapters:
                raise RequestError(f"lora_name={name!r} was loaded meanwhile by another caller")
            self._check_loaded(max_loaded)
            lora_id = next_lora_id(self.lora_adapters)
            adapter = msgspec.structs.replace(adapter, lora_int_id=lora_id)
            self.runtime.add_lora(adapter, weights)  # type: ignore[attr-defined]
        log.info("lora.loaded", name=name, lora_int_id=lora_id, rank=adapter.r)
        return adapter

    def _check_loaded(self, max_loaded: int | None) -> None:
        loaded = len(self.lora_adapters)
        if max_loaded is not None and loaded >= max_loaded:
            raise RequestError(f"{loaded} LoRA adapters are loaded, at most max_cpu_loras="
                               f"{max_loaded} (--max-cpu-loras): unload one first")

    def unload_lora(self, name: str) -> None:
        """Unload adapter `name` (a loadable runtime's); refused while a request runs under it.

        Raises:
            ConfigError: the runtime cannot unload adapters.
            RequestError: no adapter is loaded under `name`.
            StateError: an unfinished request uses it.
        """
        if not self.capabilities.lora_loadable:
            raise ConfigError("this runtime cannot unload LoRA adapters (its adapters are "
                              "compiled into the artifact: docs/lora.md)")
        with self._step_lock:
            adapter = adapter_named(self.lora_adapters, name, True)
            held = [m for group in self._groups.values() for m in group.held]
            adapter_in_use(name, adapter.lora_int_id, self.scheduler.requests.values(), held)
            self.runtime.remove_lora(name)  # type: ignore[attr-defined]
        log.info("lora.unloaded", name=name, lora_int_id=adapter.lora_int_id)

    def prepare_structured(self) -> None:
        """Build what structured output needs now: llguidance's tokenizer takes about a second
        for a 152k vocabulary with the interpreter lock held, which on first use would stall
        the steps of every request in flight. A server calls this before it serves; nothing
        happens without a tokenizer, and one llguidance cannot read is left for the first
        constrained request to report."""
        if self.tokenizer is None:
            return
        try:
            self.grammars().tokenizer  # noqa: B018 (built and kept on first access)
        except (ConfigError, RequestError) as exc:
            log.warning("structured.unavailable", error=str(exc))

    def grammars(self) -> Grammars:
        """The structured-output compiler and masks (built with the first structured request).

        Raises:
            RequestError: the Batcher has no tokenizer.
        """
        if self._grammars is None:
            if self.tokenizer is None:
                raise RequestError("structured output needs a tokenizer: build the Batcher with "
                                   "tokenizer=... (docs/sampling.md)", param="structured")
            self._grammars = Grammars(self.tokenizer, self.spec.vocab_size,
                                      self.spec.eos_token_ids)
        return self._grammars

    def _poll_compiles(self, outputs: list[RequestOutput]) -> None:
        """Give the choices whose grammar compiled their matchers (they may now be admitted);
        fail those whose grammar did not compile."""
        done = [rid for rid, (job, _) in self._compiling.items() if job.done()]
        for request_id in done:
            job, choices = self._compiling.pop(request_id)
            try:
                matcher = job.result()
            except Exception as exc:
                message = str(exc) if isinstance(exc, RequestError) else \
                    f"structured output failed to compile: {exc}"
                for choice in choices:
                    self._fail_waiting(choice, message, outputs)
                continue
            grammars = self.grammars()
            for index, choice in enumerate(choices):
                choice.compiling = False
                sampler = self._samplers.get(choice.request_id)
                if sampler is None or choice.state is RequestState.FINISHED:
                    continue
                structured = choice.params.structured
                assert structured is not None
                sampler.grammar = RequestGrammar(matcher if index == 0 else matcher.deep_copy(),
                                                 structured, grammars)

    def _prefetch_masks(self, plan: StepPlan, prefilled: Request | None = None) -> None:
        """Start the grammar masks of the step's constrained rows (of a decode step, or the
        prefill's first token) on the mask thread: they are computed while the device runs the
        step, and sampling only waits for them."""
        samplers = self._samplers
        if not any(s.grammar is not None for s in samplers.values()):
            return
        requests: list[Request | None]
        if prefilled is not None:
            requests = [prefilled]
        else:
            by_lane = self.scheduler.by_lane
            requests = [by_lane[lane] for lane in plan.inputs.row_lanes[:plan.rows].tolist()]
        grammars = []
        for request in requests:
            sampler = samplers.get(request.request_id) if request is not None else None
            if sampler is not None and sampler.grammar is not None:
                assert request is not None
                sampler.grammar.advance(request.output)
                grammars.append(sampler.grammar)
        if grammars:
            assert self._grammars is not None
            self._grammars.prefetch(grammars)

    def _fail_waiting(self, request: Request, message: str,
                      outputs: list[RequestOutput]) -> None:
        """Fail a request that has not run yet: queued in the scheduler, or an n > 1 choice held
        for choice 0."""
        if request.state is RequestState.FINISHED:
            return
        if request.request_id in self.scheduler.requests:
            self._fail(request, message, outputs)
            return
        group = self._groups.get(request.request_id.rpartition("#")[0])
        if group is not None and request in group.held:
            group.held.remove(request)
        request.set_state(RequestState.FINISHED)
        request.finish_reason = "error"
        request.error = message
        outputs.append(self._final_output(request, ()))

    def _new_request(self, internal_id: str, public_id: str, index: int,
                     tokens: npt.NDArray[np.int64], params: SamplingParams,
                     arrival: float, adapter: Any = None) -> Request:
        plain = params.plain_greedy
        rng = None
        if not plain:  # only a sampler draws: a greedy request costs no generator (~20 us)
            seed = params.seed if params.seed is not None else \
                int(self._seed_seq.spawn(1)[0].generate_state(1)[0])
            rng = np.random.default_rng(seed)
        request = Request(internal_id, tokens, params, arrival, rng, self.artifact.max_seq_len)
        if adapter is not None:
            request.lora_id = adapter.lora_int_id
            request.lora_root = adapter_root(adapter.identity)
        request.resolve_stops(self.spec.eos_token_ids)
        extras = self._outputs.track(request, public_id, index, self.tokenizer, self.detokenize)
        if extras is None:
            return request
        request.lane_flags = core.LANE_OWN_OUTPUT
        if rng is not None:
            request.lane_flags |= core.LANE_SAMPLE
            words = bad_word_ids(self.tokenizer, params.bad_words) if params.bad_words else ()
            extras.sampler = RequestSampler(params, tokens, self.spec.vocab_size,
                                            self.spec.eos_token_ids, rng, words,
                                            stop_ids=request.stop_ids)
            self._samplers[internal_id] = extras.sampler
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
                        group.abort_held(member)
                    elif self.scheduler.abort(member.request_id) is None:
                        continue
                    self._pending.append(self._final_output(member, ()))
                self._flush_events()
                return True
            group = self._groups.get(request_id.rpartition("#")[0])
            held = group.held_choice(request_id) if group is not None else None
            if group is not None and held is not None:  # one choice, still waiting for choice 0
                group.abort_held(held)
                self._pending.append(self._final_output(held, ()))
                return True
            request = self.scheduler.abort(request_id)
            if request is None:
                return False
            self._pending.append(self._final_output(request, ()))
            self._flush_events()
        return True

    @property
    def waiting_limit(self) -> int | None:
        """The choices without a lane `submit` admits (`queue_limit(0, max_waiting)`); None:
        unbounded, or bounded by the engine core's fronts (`leave_queue_bound_to_fronts`)."""
        return self._waiting_limit

    def leave_queue_bound_to_fronts(self) -> None:
        """The engine core's fronts bound the queue (lanes + `max_waiting` choices in flight,
        split among them: `queue_limit`), so `submit` stops refusing on its own: a burst of
        submits between two steps must not be refused for lanes not yet assigned.
        `max_waiting` keeps saying the bound the fronts apply."""
        self._waiting_limit = None

    @property
    def num_waiting(self) -> int:
        """Requests without a lane: the scheduler's queue plus n > 1 choices held for choice 0's
        prefill (what `max_waiting` bounds)."""
        return self.scheduler.num_waiting + num_held(self._groups)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or self._flight is not None or \
            self._held is not None or any(group.held for group in self._groups.values())

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
        running, self._undecided = self._undecided, None
        if running is not None:  # `decide_late`: with what was submitted since the landing
            self._decide(running)
        # the pipeline runs: land its flight, launch the next; when it ended with a prefill (no
        # decode rows to report), the next call starts now, in this step
        if self._flight is not None and (not self._land_flight(outputs) or
                                         self._flight is not None):
            return outputs
        if self._flights is not None and self._kernel.inputs is not self.scheduler.decode_inputs:
            # the pipeline is empty and its last step's arrays were read: steps build into the
            # scheduler's own decode buffer again
            self._kernel.use(self.scheduler.decode_inputs, 0)
        if self._compiling:
            self._poll_compiles(outputs)
        if self._groups:  # choice 0 may have ended outside a step (an abort of its own id)
            self._release_held(outputs, fork=True)
        if self._kv:
            self._poll_kv(outputs)
        # a chunk held for its block ops runs for the request it was planned for (one aborted
        # meanwhile may have its id taken by a new request already)
        plan, self._held = self._held, None
        owner, self._held_for = self._held_for, None
        if plan is None:
            plan = self.scheduler.schedule(self.clock())
        self.idle = plan is None
        if plan is None:
            self._device_end = 0.0  # the device waits for work, not for the host
            self._flush_events()
            return outputs
        if plan.saves or plan.restores or plan.copies or plan.slot_saves or plan.slot_restores:
            self._run_block_ops(plan, outputs, owner)
        if plan.kind == "prefill":
            self._run_prefill(plan, outputs, owner)
        elif plan.kind == "import":
            self._run_import(plan, outputs)
        else:
            self._run_decode(plan, outputs)
        if self._groups:
            self._release_held(outputs, fork=False)
        if self.scheduler.events:
            self._flush_events()
        if not self.scheduler.has_work():
            self._device_end = 0.0
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
        hybrid = self.spec.is_hybrid
        for group in self._groups.values():
            if not group.held:
                continue
            move = group.next_move(self._forks, hybrid)
            if move is Move.WAIT:
                continue
            if move is Move.FORK:
                if fork:
                    self._fork_held(group, outputs)
                if group.held:
                    continue  # wait for a lane (or blocks) to free up
            elif move is Move.SHARE:
                self.scheduler.share_prompt(group.members[0])
            queued, heir = group.release()
            if heir is not None:
                assert group.prompt_logprobs is not None
                self._outputs.take_over_prompt_logprobs(heir, group.prompt_logprobs)
            for request in queued:
                self.scheduler.add(request)

    def _fork_held(self, group: Group, outputs: list[RequestOutput]) -> None:
        """Start held choices on idle lanes from copies of choice 0's prompt KV, while the
        scheduler finds a lane and blocks for them."""
        first = group.members[0]
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
            except ConstraintFailed as exc:
                self._fail(child, str(exc), outputs, exc.param)
                continue
            except Exception as exc:  # this choice fails; choice 0 and the others go on
                self._fail(child, f"starting from choice 0's prompt KV failed: {exc}", outputs)
                continue
            for done in self.scheduler.start_forked(child, token, now):
                outputs.append(self._output(done))
        if not group.held:
            group.first_row = None

    def _run_block_ops(self, plan: StepPlan, outputs: list[RequestOutput],
                       owner: Request | None = None) -> None:
        """Cache-management KV moves the plan needs before its device call, in a safe order:
        evicted blocks to the host first, then host restores, then device copies. A failed
        restore or copy fails the request it was for (its KV would be garbage; with `owner`,
        the request a held plan was made for, only that one); a failed save only loses that
        host copy."""
        runtime = self.runtime
        for entry in plan.saves:
            assert self.host_cache is not None
            try:
                self.host_cache.put(entry, runtime.read_block(entry.block))
            except Exception as exc:
                self.host_cache.refuse(entry)
                log.warning("host_cache.save_failed", block=entry.block, error=str(exc))
        failed: dict[str, str] = {}
        if plan.slot_saves or plan.slot_restores:  # hybrid: saves first (atombatch/engine/checkpoints.py)
            run_slot_ops(runtime, plan, self.scheduler.kv.checkpoints, failed)
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
            if request is not None and (owner is None or request is owner):
                self._fail(request, message, outputs)

    def _run_prefill(self, plan: StepPlan, outputs: list[RequestOutput],
                     owner: Request | None = None) -> None:
        scheduler = self.scheduler
        request = scheduler.requests.get(plan.request_id)
        if request is None or (owner is not None and request is not owner):
            return  # failed by this plan's block ops (held: or aborted): nothing to compute
        try:
            self._prefill_and_complete(plan, request, outputs)
        except BaseException:  # the chunk runs again (`_recompute_spoiled`)
            self._recompute_spoiled(plan, request)
            raise

    def _prefill_and_complete(self, plan: StepPlan, request: Request,
                              outputs: list[RequestOutput]) -> None:
        """`_run_prefill`'s device call and its completion."""
        try:
            collector = self._outputs.prompt_collector(request)
            if self._grammars is not None and plan.last_chunk and not request.recomputing:
                self._prefetch_masks(plan, request)
            if collector is None:
                logits = self._device_call(self._rows_of_call(self.runtime.prefill),
                                           plan.inputs)
                row = np.asarray(logits).reshape(-1)
            else:
                row = self._prefill_every_position(plan, collector)
        except ConstraintFailed as exc:  # its grammar failed before the chunk ran
            self._fail(request, str(exc), outputs, exc.param)
            return
        except Exception as exc:  # the runtime failed this request; the others go on
            self._fail(request, f"prefill failed: {exc}", outputs)
            return
        self._complete_prefill(plan, request, row, outputs)

    def _complete_prefill(self, plan: StepPlan, request: Request,
                          row: npt.NDArray[np.floating], outputs: list[RequestOutput]) -> None:
        """A prefill chunk ran and `row` is its last real position's logits: sample the first
        token after the last chunk, then the scheduler's transitions."""
        scheduler = self.scheduler
        try:
            token = None
            if plan.last_chunk and not request.recomputing:
                # the decode step's rule (`StepKernel.pick`): a NaN or +inf fails the request,
                # an -inf is a token that cannot be drawn (the max is NaN if any logit is,
                # +inf if any is, -inf only when every one is)
                if not np.isfinite(row.max()):
                    raise RequestError(f"prefill returned non-finite logits for "
                                       f"{plan.request_id} at position {plan.chunk_start}")
                token = self._sample_one(request, row)
                self._keep_first_row(request, row)
        except ConstraintFailed as exc:  # its first token broke its constraint
            self._fail(request, str(exc), outputs, exc.param)
            return
        except Exception as exc:  # the runtime failed this request; the others go on
            self._fail(request, f"prefill failed: {exc}", outputs)
            return
        for done in scheduler.complete_prefill(plan, token, self.clock()):
            outputs.append(self._output(done))

    def _prefill_every_position(self, plan: StepPlan,
                                collector: PromptLogprobs) -> npt.NDArray[np.floating]:
        """Run a prefill chunk for every position's logits; feed the real positions to the
        prompt logprobs; return the last real token's row (what the first token samples from)."""
        prefill: Any = self._rows_of_call(self.runtime.prefill)  # the optional keyword
                                                                  # (see runtime/base.py)
        call = functools.partial(prefill, every_position=True)
        logits = np.asarray(self._device_call(call, plan.inputs))
        q, vocab = self.artifact.prefill_chunk_size, self.spec.vocab_size
        if logits.size != q * vocab:
            raise RequestError(f"prefill(every_position=True) returned logits of shape "
                               f"{logits.shape}; the chunk has {q} positions of {vocab} ids")
        real = logits.reshape(q, vocab)[:plan.chunk_len]
        if not np.isfinite(real.max(axis=1)).all():  # NaN or +inf (-inf: cannot be drawn)
            raise RequestError(f"prefill returned non-finite logits for {plan.request_id} in "
                               f"positions {plan.chunk_start}..{plan.chunk_start + plan.chunk_len - 1}")
        collector.add_chunk(real, plan.chunk_start)
        return real[-1]

    def _keep_first_row(self, request: Request, row: npt.NDArray[np.floating]) -> None:
        """Choice 0 of an n > 1 request keeps its first-token logits while other choices wait
        to fork from its prompt KV: each samples its own first token from that row."""
        if not self._groups or not request.request_id.endswith("#0"):
            return
        group = self._groups.get(request.request_id[:-2])
        if group is not None and self._forks:
            group.keep_first_row(row)

    # -- prefill/decode disaggregation --------------------------------------------------------------
    def _poll_kv(self, outputs: list[RequestOutput]) -> None:
        """Collect what producers sent; fail requests whose source broke or stalled."""
        for request, message in self._pd.poll(self.scheduler.requests, self.clock()):
            self._fail(request, message, outputs)

    def _skip_first_draw(self, request_id: str) -> None:
        """The producer sampled the first token from `default_rng(seed)` (docs/pd.md): advance
        this request's generator past that draw, so its later tokens are the ones a colocated
        run with the same seed samples."""
        sampler = self._samplers.get(request_id) if self._samplers else None
        if sampler is not None and sampler.params.temperature >= GREEDY_EPS:
            sampler.rng.random()

    def _run_import(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        scheduler = self.scheduler
        request = scheduler.requests.get(plan.request_id)
        link = self._pd.links.get(plan.request_id)
        if request is None or link is None:
            return
        try:
            written = self._pd.write(link, plan, self.runtime)
        except Exception as exc:
            self._fail(request, f"KV import failed: {exc}", outputs)
            return
        had_first = bool(request.output)
        done_list = scheduler.complete_import(plan, written, self.clock())
        if not had_first and request.output:  # the producer's first token was taken
            self._skip_first_draw(request.request_id)
        for done in done_list:
            outputs.append(self._output(done))
        if request.pd is None:
            self._pd.close(plan.request_id)

    def _run_decode(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        """One decode step. The kernel picks every greedy row and checks every row's logits in
        one call, and appends every token in another; Python touches only the rows it hands
        back (sampled requests, failures, finishes, requests whose outputs carry extras)."""
        if self.overlap and self._can_fly():
            self._take_off(plan)
            return
        if self._grammars is not None:
            self._prefetch_masks(plan)
        try:
            self._decode_and_complete(plan, outputs)
        except BaseException:  # the step's lanes run it again (`_recompute_spoiled`)
            self._recompute_spoiled(plan)
            raise

    def _decode_and_complete(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        """`_run_decode`'s device call and its completion."""
        scheduler = self.scheduler
        kernel = self._kernel
        try:
            raw = self._device_call(self._rows_of_call(self.runtime.decode), plan.inputs)
            logits, source = decode_logits(raw, plan.inputs.num_rows, self.spec.vocab_size)
            greedy = self._greedy[:logits.shape[0]]  # allocated once: the step allocates nothing
            self._argmax(source, greedy)
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

    # -- the pipeline (overlap=True; atombatch/engine/pipeline.py) -----------------------------------------
    def _can_fly(self) -> bool:
        """Whether decodes may run as a pipeline now: no grammar (its mask for step N+1 needs
        step N's token) and nothing between two steps that the engine does itself (n > 1 forks,
        PD links, grammar compiles). The scheduler checks the rest (`Scheduler.plan_ahead`)."""
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
        admits now (`Scheduler.plan_prefill_ahead`; a wave of them as one chain, `_chain_wave`);
        else nothing (it lands `running` and stops). After a prefill chunk, the decode of the
        lanes that decode (`Scheduler.plan_after_prefill`; a greedy request joins it, one that
        samples joins the step after). A chunk whose block ops are due is held for the next
        `step()`, which runs the ops and then the chunk."""
        following = None
        try:
            if self._can_fly():
                assert self._flights is not None
                candidate = self._flights[(running.index + 1) % NUM_FLIGHTS]
                candidate.source, candidate.joins = None, 0
                scheduler = self.scheduler
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
        (`Scheduler.plan_chunk_decode`): the thread then runs the chunks and the decode back to
        back, whether or not the engine has landed `running` by then. Each greedy request of
        the chain decodes in it (`join_row`: the device thread writes its chunk's argmax in)."""
        joins = [chunk.owner for chunk in chain if self._joins(chunk.owner)]
        rows = self.scheduler.plan_chunk_decode(candidate.plan, running.plan, chain[-1].plan,
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
        plan = self.scheduler.plan_prefill_ahead(running.plan, self.clock(), self._prefills_ahead,
                                                 None if decode is None else decode.plan,
                                                 len(chain))
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

    def _recompute_spoiled(self, plan: StepPlan, owner: Request | None = None) -> None:
        """`plan` ran on the device (or may have) and its positions will run again: a step that
        raised (synchronous, or a flight whose landing raised) or a flight dropped after it.
        Full-attention layers write a position in place, so running it again changes nothing.
        A sliding-window layer keeps a lane's window in a shift buffer of the newest
        `sliding_window` positions (as the device does), and writing a position again shifts
        out one the window still needs: on a hybrid model every request whose slot the step
        wrote (a chunk's owner; a decode's rows, padding rows included, which write the slot of
        a lane ending in the step before) is preempted without keeping its KV, and recomputes
        from its prompt and tokens."""
        if not self.spec.is_hybrid:
            return
        scheduler = self.scheduler
        if plan.kind == "prefill":
            live = scheduler.requests.get(plan.request_id)
            victims = [live] if live is not None and (owner is None or live is owner) else []
        elif plan.kind == "decode":
            inputs = plan.inputs
            victims = [scheduler.by_lane[lane]
                       for lane in inputs.row_lanes[:inputs.num_rows].tolist()]
        else:
            return
        for request in victims:
            if request is not None and request.state in (RequestState.PREFILLING,
                                                         RequestState.DECODING,
                                                         RequestState.STAGING):
                scheduler.preempt(request, keep_kv=False)

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

    def _decode_call(self, inputs: Any) -> Any:
        """The device thread's decode call (timed as `_device_call` times the engine's own)."""
        return self._timed_call(self._rows_of_call(self.runtime.decode), inputs)

    def _prefill_call(self, inputs: Any) -> Any:
        """The device thread's prefill call (a chunk planned ahead, `_decide`)."""
        return self._timed_call(self._rows_of_call(self.runtime.prefill), inputs)

    def _sample_special(self, logits: npt.NDArray[np.floating],
                        special: list[tuple[int, int, Request, RequestSampler]],
                        tokens: npt.NDArray[np.int64], outputs: list[RequestOutput]) -> None:
        """Sample the (row, lane, request, sampler) entries of one decode step at once; each
        token goes to `tokens[row]`."""
        result: SampleResult | Exception
        try:
            result = self._draw(logits, special)
        except Exception as exc:  # a sampler bug fails these requests, not the engine
            result = exc
        self._apply_draw(result, special, tokens, outputs)

    def _draw(self, logits: npt.NDArray[np.floating],
              special: list[tuple[int, int, Request, RequestSampler]]) -> SampleResult:
        """The tokens of a step's sampled rows (`sample_rows`); the pipeline's device thread
        calls it too, before the logits are the next call's."""
        rows = [row for row, _, _, _ in special]
        return sample_rows(logits[rows], [s for _, _, _, s in special],
                           [r.output for _, _, r, _ in special], self.logprobs_mode)

    def _apply_draw(self, result: SampleResult | Exception,
                    special: list[tuple[int, int, Request, RequestSampler]],
                    tokens: npt.NDArray[np.int64], outputs: list[RequestOutput]) -> None:
        """`_draw`'s result into `tokens[row]` and the kept logprobs; a failed draw or row
        fails its request."""
        if isinstance(result, Exception):
            for _, _, request, _ in special:
                self._fail(request, f"sampling failed: {result}", outputs)
            return
        masked = set(result.masked_rows)
        for i, (row, _, request, _) in enumerate(special):
            if i in result.failed:
                self._fail(request, result.failed[i], outputs, _constraint_param(request))
                continue
            if i in masked:  # its own masks left nothing: the client's doing
                self._fail(request, _ALL_MASKED, outputs, _masking_param(request))
                continue
            tokens[row] = int(result.tokens[i])
            self._outputs.keep_logprobs(request, result.logprobs[i])

    def _sample_one(self, request: Request, row: npt.NDArray[np.floating]) -> int:
        """The first token of a request from its prefill's last logits."""
        sampler = self._samplers.get(request.request_id) if self._samplers else None
        if sampler is None:
            return int(np.argmax(row))
        result = sample_rows(row.reshape(1, -1), [sampler], [request.output], self.logprobs_mode)
        if result.failed:
            raise ConstraintFailed(result.failed[0], param=_constraint_param(request))
        if result.masked_rows:
            raise ConstraintFailed(_ALL_MASKED, param=_masking_param(request))
        self._outputs.keep_logprobs(request, result.logprobs[0])
        return int(result.tokens[0])

    def _rows_of_call(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """`call` (the runtime's prefill or decode), given its rows' LoRA adapter ids on a
        runtime with adapters (atombatch/engine/lora.py); as it is on any other."""
        lora = self._lora
        return call if lora is None else lora.through(call)

    def _device_call(self, call: Callable[[Any], Any], inputs: Any) -> Any:
        """One prefill or decode call, repeated once when the runtime says the fault was
        transient (`TransientDeviceError`: nothing was written that the repeat would not
        overwrite). Any other failure, or a second one, propagates and fails the step's
        requests: they shared one device call."""
        hook = self.on_device_call
        if hook is not None:
            hook()
        return self._timed_call(call, inputs)

    def _timed_call(self, call: Callable[[Any], Any], inputs: Any) -> Any:
        clock = time.perf_counter
        started = clock()
        if self._device_end:  # the host's time since the last call, while work was pending
            self._host_gap_s += started - self._device_end
            self._host_gaps += 1
        try:
            return call(inputs)
        except TransientDeviceError as exc:
            log.warning("device.retry", call=getattr(call, "__name__", "call"), error=str(exc))
            return call(inputs)
        finally:
            self._device_end = end = clock()
            self._device_s += end - started

    def _fail(self, request: Request, message: str, outputs: list[RequestOutput],
              param: str | None = None) -> None:
        """Fail one request; `param` names the request field that caused it (a constraint)."""
        self.scheduler.fail(request, message)
        request.error_param = param
        outputs.append(self._final_output(request, ()))

    def _output(self, request: Request) -> RequestOutput:
        """The output of a request's last token (its final one if it finished); a first token's
        carries the prompt tokens the prefix cache saved (`cached_tokens`)."""
        new = (request.output[-1],)
        outputs = self._outputs
        extras = outputs.extras.get(request.request_id) if outputs.extras else None
        if extras is None:
            if request.state is RequestState.FINISHED:
                return self._final_output(request, new)
            return RequestOutput(request_id=request.request_id, new_token_ids=new, finished=False,
                                 cached_tokens=max(request.cached_tokens, 0)
                                 if len(request.output) == 1 else None)
        text, stopped = outputs.text(request, extras)
        if stopped:  # the stop rule with a stop string: wins over max_tokens and EOS (as in vLLM)
            self.scheduler.stop_string(request)
            outputs.stopped_by_string(request, extras)
        if request.state is RequestState.FINISHED:
            return self._final_output(request, new, text)
        out = outputs.running(request, extras, text)
        if len(request.output) == 1:
            out = msgspec.structs.replace(out, cached_tokens=max(request.cached_tokens, 0))
        return out

    def _final_output(self, request: Request, new: tuple[int, ...],
                      text: str | None = None) -> RequestOutput:
        if request.request_id in self._pd.links:
            self._pd.close(request.request_id)
        self._samplers.pop(request.request_id, None)
        return self._outputs.final(request, new, text, self.clock())

    def _flush_events(self) -> None:
        events = self.scheduler.events
        if not events:
            return
        kept = events[:] if self.log_requests else quiet_requests(events)
        if self.on_events is not None:
            self.on_events(kept)
        else:
            log_events(kept)
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
                    self._waiting_limit is None or self.num_waiting == 0 or
                    self.num_waiting + per_prompt[len(ids)].n <= self._waiting_limit):
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
        running, waiting = self._lora_stats() if self._lora is not None else ((), ())
        return EngineStats(
            **s.counters.snapshot(),  # every scheduler counter, under its own name
            occupied_lanes=s.lanes.num_busy, decoding_lanes=s.lanes.num_decoding(),
            queue_length=self.num_waiting, free_blocks=free, spare_blocks=spare,
            staged_blocks=staged, lane_blocks=lane, cached_blocks=cached,
            checkpoint_bytes=s.kv.checkpoints.store.used_bytes if s.kv.checkpoints else 0,
            device_s=self._device_s, host_gap_s=self._host_gap_s, host_gaps=self._host_gaps,
            overlapped_steps=self._overlapped, overlapped_prefills=self._overlapped_prefills,
            overlapped_joins=self._overlapped_joins, chained_chunks=self._chained,
            prefix_cache=s.prefix is not None, evictable_blocks=s.pool.num_evictable,
            lora_running=running, lora_waiting=waiting)

    def _lora_stats(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The adapters of the requests holding a lane and of those waiting for one (a runtime
        with LoRA; `stats` is read a few times a second, never per step)."""
        names = {a.lora_int_id: name for name, a in self.lora_adapters.items()}
        running: set[str] = set()
        waiting: set[str] = set()
        for request in list(self.scheduler.requests.values()):
            if request.lora_id:
                (running if request.lane >= 0 else waiting).add(
                    names.get(request.lora_id, str(request.lora_id)))
        return tuple(sorted(running)), tuple(sorted(waiting))

    def check_invariants(self) -> None:
        """Raise `StateError` if any ownership invariant of docs/rules.md is broken."""
        self.scheduler.check_invariants()

    def record_trace(self) -> list[Any]:
        """Start recording a `StepRecord` per device call; returns the list that fills up."""
        self.scheduler.trace = []
        return self.scheduler.trace


def quiet_requests(events: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """`events` without a request's info events (`request.finished` with its timings,
    `request.preempted`, ...): what `Batcher.log_requests = False` logs. A failed request
    (a warning) and the debug events stay."""
    return [(name, fields) for name, fields in events
            if not name.startswith("request.") or name in _WARN_EVENTS or name in _DEBUG_EVENTS]


def prefix_cache_refusal(runtime: Runtime, *, host_cache_bytes: int = 0) -> str | None:
    """Why `Batcher(runtime, prefix_cache=True, host_cache_bytes=...)` would be refused (the
    message of its `ConfigError`), or None when the prefix cache can run there: what a server's
    default (on wherever supported, as vLLM) asks before building its engine."""
    artifact: ArtifactConfig = runtime.artifact
    try:
        memory_plan.check_serving(artifact, prefix_cache=True, host_cache_bytes=host_cache_bytes)
        if artifact.model.is_hybrid:
            slot_ops_supported(runtime, Capabilities(runtime))
    except ConfigError as exc:
        return str(exc)
    return None


def log_events(events: list[tuple[str, dict[str, Any]]]) -> None:
    """Log the scheduler's events (name, fields) at their levels; a level `log` does not render
    costs one check per flush, not one filtered event each."""
    info, debug = log_enabled(logging.INFO), log_enabled(logging.DEBUG)
    for name, fields in events:
        if name in _WARN_EVENTS:
            log.warning(name, **fields)
        elif name in _DEBUG_EVENTS:
            if debug:
                log.debug(name, **fields)
        elif info:
            log.info(name, **fields)


def _rows_of(result: SampleResult, rows: list[int]) -> SampleResult:
    """`result` for the given rows of it, in that order."""
    position = {row: i for i, row in enumerate(rows)}
    return SampleResult(tokens=result.tokens[rows], logprobs=[result.logprobs[i] for i in rows],
                        masked_rows=[position[i] for i in result.masked_rows if i in position],
                        failed={position[i]: why for i, why in result.failed.items()
                                if i in position})


def _masking_param(request: Request) -> str:
    """The request field whose mask left nothing to sample (named in the client's error)."""
    params = request.params
    if params.structured is not None:
        return params.structured.param
    if params.allowed_token_ids is not None:
        return "allowed_token_ids"
    return "bad_words" if params.bad_words else "logit_bias" if params.logit_bias else \
        "min_tokens"


def _constraint_param(request: Request) -> str:
    """The request field of the constraint its output broke (named in the client's error)."""
    structured = request.params.structured
    return structured.param if structured is not None else "structured"

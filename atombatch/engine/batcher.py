"""`Batcher`: the engine facade that servers, benchmarks and routers embed.

Its own methods are the engine's surface: `submit`, `abort`, `step` / `step_arrays`, `generate`,
`stats` and the request rules (`validate`, `rules`). What a step does is underneath it, each in
one module: the synchronous step in atombatch/engine/step.py (`StepRunner`: plan, block ops, the
device call, sampling, completion, outputs, every failure a per-request error) and the decode
pipeline in atombatch/engine/pipeline.py (`PipelineRunner`, which `Batcher` is: with
`overlap=True` steady decodes run ahead on a device thread, planned by the `AheadScheduler`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.api.options import DEFAULT_MAX_WAITING, ENGINE_DEFAULTS, EngineOptions
from atombatch.api.reports import EngineStats
from atombatch.api.speculative import SpeculativeConfig
from atombatch.api.structs import Completion, RequestOutput, SamplingParams
from atombatch.api.validation import RequestRules, queue_limit, validate_request
from atombatch.artifact import plan as memory_plan
from atombatch.artifact.config import ArtifactConfig
from atombatch.engine.checkpoints import slot_ops_supported
from atombatch.engine.groups import Group, num_held
from atombatch.engine.lora import adapter_in_use, adapter_named, check_max_loras, next_lora_id
from atombatch.engine.outputs import Extras
from atombatch.engine.pd_intake import KVLink, KVSource, PDIntake
from atombatch.engine.pipeline import AheadScheduler, PipelineRunner
from atombatch.engine.scheduler import PDImport, Policy, Request, RequestState
from atombatch.engine.speculative import Speculator
from atombatch.engine.speculative import check_supported as check_speculative
from atombatch.engine.step import log_events, quiet_requests
from atombatch.errors import CapacityError, ConfigError, RequestError, StateError
from atombatch.kernel import blocks as core
from atombatch.kernel.prefix import HostCache, adapter_root
from atombatch.logs import enabled as log_enabled
from atombatch.logs import log
from atombatch.runtime.base import Capabilities, Runtime
from atombatch.sampling.detokenizer import bad_word_ids
from atombatch.sampling.grammar import Grammars
from atombatch.sampling.sampler import LOGPROBS_MODES, LogprobsMode, RequestSampler

if TYPE_CHECKING:
    from atombatch.artifact.lora import LoraAdapter

__all__ = ["DEFAULT_MAX_WAITING", "Batcher", "EngineStats", "Extras", "Group", "KVLink",
           "KVSource", "StepResult", "log_events", "quiet_requests"]


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


class Batcher(PipelineRunner):
    """Continuous batching over one compiled artifact.

    The facade: the methods below are the engine's surface. The step they drive is
    `StepRunner`'s (atombatch/engine/step.py) and the decode pipeline `PipelineRunner`'s
    (atombatch/engine/pipeline.py), the classes this one extends.

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
        speculative: n-gram drafts verified in one prefill-graph call where a step would decode
            one lone lane (`SpeculativeConfig`, atombatch/engine/speculative.py,
            docs/speculative.md); needs every position's logits, refused with `overlap` and on
            hybrid models.

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
                 max_lora_rank: int | None = _D.max_lora_rank,
                 speculative: SpeculativeConfig | None = _D.speculative) -> None:
        artifact: ArtifactConfig = runtime.artifact
        check_max_loras(max_loras)
        if not isinstance(overlap, bool):
            raise ConfigError(f"overlap={overlap!r} must be True or False")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode={logprobs_mode!r} is not one of "
                              f"{', '.join(LOGPROBS_MODES)}")
        memory_plan.check_serving(artifact, prefix_cache=prefix_cache,
                                  host_cache_bytes=host_cache_bytes)
        spec = artifact.model
        caps = Capabilities(runtime)  # what it offers beyond `Runtime`
        checkpoint_bytes = 0
        if spec.is_hybrid and prefix_cache:  # sliding-slot checkpoints (docs/prefix-cache.md)
            slot_ops_supported(runtime, caps)
            checkpoint_bytes = caps.slot_bytes or memory_plan.checkpoint_bytes(artifact)
        host_cache = HostCache(host_cache_bytes, artifact.block_size) if host_cache_bytes else None
        # the synchronous scheduler with the pipeline's planning ahead, used only while the
        # pipeline flies (`overlap`, which a benchmark may also turn on after building)
        adapters = getattr(runtime, "lora_adapters", None) if caps.lora else None
        scheduler = AheadScheduler(artifact, policy, eos_token_ids=spec.eos_token_ids,
                                   prefix_cache=prefix_cache, host_cache=host_cache,
                                   checkpoint_bytes=checkpoint_bytes,
                                   lora=caps.lora and (not caps.lora_loadable or bool(adapters)),
                                   max_loras=max_loras if caps.lora else None)
        if max_waiting is not None and (isinstance(max_waiting, bool) or
                                        not isinstance(max_waiting, int) or max_waiting < 1):
            raise ConfigError(f"max_waiting={max_waiting!r} must be an int >= 1 (or None: unbounded)")
        # n > 1 without a prefix cache: choices 1..n-1 start from a device copy of choice 0's
        # prompt KV (see `_release_held`); hybrid models also need the runtime's `copy_slot`
        needed = ("_fetch_kv_cache", "_update_kv_cache") if spec.is_hybrid else ()
        forks = not prefix_cache and not artifact.single_block and \
            (not spec.is_hybrid or caps.copy_slot) and caps.has_kv("_copy_kv_cache", *needed)
        super().__init__(runtime, scheduler, capabilities=caps, host_cache=host_cache,
                         clock=clock or caps.clock or time.perf_counter,
                         pd=PDIntake(artifact, pd_timeout, pd_deadline), tokenizer=tokenizer,
                         detokenize=detokenize, logprobs_mode=logprobs_mode,
                         argmax_threads=argmax_threads, forks=forks, overlap=overlap)
        # a request's info events are logged (False: quiet_requests, the server's
        # --disable-log-requests)
        self.log_requests = log_requests
        if speculative is not None:
            if not isinstance(speculative, SpeculativeConfig):
                raise ConfigError(f"speculative={speculative!r} must be a SpeculativeConfig")
            check_speculative(speculative, artifact, caps.every_position_logits, overlap)
            self._speculator = Speculator(speculative, runtime, artifact, scheduler.counters)
        self.max_waiting = max_waiting
        # what submit admits without a lane (None: unbounded, or left to the core's fronts)
        self._waiting_limit = queue_limit(0, max_waiting)
        self._step_lock = threading.Lock()      # the engine's state: step, submit, abort
        self._consumer = threading.Lock()       # held by the one thread inside step()
        self._seed_seq = np.random.SeedSequence(seed)
        self._next_id = 0
        self._pd_deadline_given = pd_deadline
        self._options = EngineOptions(  # as built; `options` reads the live ones back in
            prefix_cache=prefix_cache, host_cache_bytes=host_cache_bytes,
            policy=scheduler.policy.label, seed=seed, max_waiting=max_waiting,
            pd_timeout=pd_timeout, pd_deadline=pd_deadline, logprobs_mode=logprobs_mode,
            detokenize=detokenize, argmax_threads=argmax_threads, overlap=overlap,
            log_requests=log_requests, max_loras=max_loras, max_lora_rank=max_lora_rank,
            speculative=speculative)

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
        return self.scheduler.has_work() or bool(self._pending) or self._in_flight() or \
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


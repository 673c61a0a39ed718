"""The synchronous step: plan -> block ops -> one device call -> sampling -> the scheduler's
completion -> outputs.

`StepRunner` holds what a step works on (the runtime, the scheduler and its decode-step kernel,
the requests' samplers, n > 1 groups, PD links and grammar compiles, the output builder) and runs
one step at a time, each one device call (docs/architecture.md, "One step"). It reads as the
engine did before the pipeline existed: `PipelineRunner` (atombatch/engine/pipeline.py) is the
layer that runs steady decodes ahead on a device thread, and `Batcher` (atombatch/engine/batcher.py)
the facade that embedders call (submit, abort, step, generate, stats).

A step fails only the requests it touched: an exception of a device call fails that call's
requests, a row whose logits are not finite (or that its masks leave empty) fails its request,
every other request carries on.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.api.structs import GREEDY_EPS, RequestOutput
from atombatch.artifact.config import ArtifactConfig
from atombatch.engine.checkpoints import run_slot_ops
from atombatch.engine.groups import Group, Move
from atombatch.engine.lora import LoraRows
from atombatch.engine.outputs import Extras, OutputBuilder
from atombatch.engine.pd_intake import KVLink, PDIntake
from atombatch.engine.scheduler import Request, RequestState, Scheduler, StepPlan
from atombatch.engine.speculative import Speculator
from atombatch.errors import RequestError, TransientDeviceError
from atombatch.kernel import blocks as core
from atombatch.kernel.prefix import HostCache
from atombatch.logs import enabled as log_enabled
from atombatch.logs import log
from atombatch.runtime.base import Capabilities, Runtime
from atombatch.sampling.argmax import RowArgmax
from atombatch.sampling.grammar import ConstraintFailed, Grammars, RequestGrammar
from atombatch.sampling.sampler import (
    LogprobsMode,
    PromptLogprobs,
    RequestSampler,
    SampleResult,
    sample_rows,
)

__all__ = ["StepRunner", "decode_logits", "log_events", "quiet_requests"]

_WARN_EVENTS = frozenset({"request.failed"})
# A request's lane events are debug: rendered, each costs the device loop ~37 us (issue 21: the
# core's own Python per step stays small); its finish (with its timings) stays info.
_DEBUG_EVENTS = frozenset({"lane.assigned", "request.admitted", "lane.released"})
_ALL_MASKED = ("every token is masked (structured output, allowed_token_ids, bad_words, "
               "logit_bias and min_tokens exclude the whole vocabulary)")


class StepRunner:
    """Runs one device call per `_step()` and turns its results into `RequestOutput`s.

    The state is the engine's: `Batcher` builds it (its keyword arguments are documented there)
    and adds the intake (submit, abort, validation) on top.
    """

    def __init__(self, runtime: Runtime, scheduler: Scheduler, *, capabilities: Capabilities,
                 host_cache: HostCache | None, clock: Callable[[], float], pd: PDIntake,
                 tokenizer: Any | None, detokenize: bool, logprobs_mode: LogprobsMode,
                 argmax_threads: int | None, forks: bool) -> None:
        self.runtime = runtime
        self.artifact: ArtifactConfig = runtime.artifact
        self.spec = self.artifact.model
        self.capabilities = capabilities  # what the runtime offers beyond `Runtime`
        self.host_cache = host_cache
        self.scheduler = scheduler
        self.clock: Callable[[], float] = clock
        # Called right before every device call: the engine core hands the previous step's
        # outputs to its sender thread there, so that work runs while the device does.
        self.on_device_call: Callable[[], None] | None = None
        # Given each step's scheduler events instead of logging them here: the engine core
        # renders them on its sender thread (a rendered event costs the loop ~37 us).
        self.on_events: Callable[[list[tuple[str, dict[str, Any]]]], None] | None = None
        # a request's info events are logged (False: quiet_requests; a server's default, as
        # vLLM's without --enable-log-requests)
        self.log_requests = True
        # Wall time in device calls, and between one call's end and the next call's start while
        # work was pending (0.0: none pending since the last call); see `EngineStats.device_s`.
        self._device_s = self._host_gap_s = self._device_end = 0.0
        self._host_gaps = 0
        self._pending: list[RequestOutput] = []   # final outputs of aborts, for the next step
        self.idle = True  # the last step ran no device call (nothing runnable: e.g. PD waits)
        self._pd = pd  # the KV links of PD requests
        self.tokenizer = tokenizer
        # False: only requests with stop strings are detokenized here (their text decides when
        # they stop); the others' outputs carry ids alone and a front decodes them
        self.detokenize = detokenize
        self.logprobs_mode: LogprobsMode = logprobs_mode
        self._samplers: dict[str, RequestSampler] = {}  # requests that are not plain greedy
        self._grammars: Grammars | None = None     # structured output (built on first use)
        # structured requests whose grammar compiles: (the compile, the choices waiting for it)
        self._compiling: dict[str, tuple[concurrent.futures.Future[Any], list[Request]]] = {}
        self._groups: dict[str, Group] = {}        # n > 1 requests by the id submit() returned
        self._outputs = OutputBuilder(self._groups, self.spec.vocab_size)
        self._decoded = False                      # the last step completed a decode
        self._kernel = scheduler.kv.kernel         # the decode-step kernel (never replaced)
        self._greedy = np.zeros(self.artifact.batch_size, dtype=np.int64)  # argmax, by row
        self._argmax = RowArgmax(argmax_threads)  # split over threads when the logits are large
        # n > 1 without a prefix cache: choices 1..n-1 start from a device copy of choice 0's
        # prompt KV (see `_release_held`)
        self._forks = forks
        # the rows' adapter ids (atombatch/engine/lora.py); None until a request names an
        # adapter on a runtime that loads them (until then every row is the base model's, and
        # the runtime is called as one without LoRA), and on a runtime without LoRA
        self._lora: LoraRows | None = scheduler.lora
        self._speculator: Speculator | None = None  # n-gram drafts (engine/speculative.py)
        # the decode pipeline's switch (`PipelineRunner` sets it): no speculation while it is on
        self.overlap = False

    @property
    def _kv(self) -> dict[str, KVLink]:
        """The KV links of PD requests in flight, by request id."""
        return self._pd.links

    @property
    def _extras(self) -> dict[str, Extras]:
        """What requests' outputs need beyond ids, by scheduler request id."""
        return self._outputs.extras

    # -- the step -----------------------------------------------------------------------------------
    def _step(self) -> list[RequestOutput]:
        """One synchronous step: what `abort` left to report, then `_run_step`."""
        self._decoded = False
        outputs, self._pending = self._pending, []
        return self._run_step(outputs)

    def _run_step(self, outputs: list[RequestOutput], plan: StepPlan | None = None,
                  owner: Request | None = None) -> list[RequestOutput]:
        """Poll what runs beside the engine (grammar compiles, n > 1 choices held for choice 0,
        PD sources), schedule one device call (unless `plan` was decided already: a chunk the
        pipeline held for its block ops, run for `owner`, the request it was planned for), run
        its block ops, the call, its sampling and the scheduler's completion; `outputs` gets
        what the step produced."""
        if self._compiling:
            self._poll_compiles(outputs)
        if self._groups:  # choice 0 may have ended outside a step (an abort of its own id)
            self._release_held(outputs, fork=True)
        if self._kv:
            self._poll_kv(outputs)
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
                logits = self._call_prefill(plan.inputs)
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
        logits = np.asarray(self._call_prefill(plan.inputs, every_position=True))
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

    def _run_decode(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        """One decode step. The kernel picks every greedy row and checks every row's logits in
        one call, and appends every token in another; Python touches only the rows it hands
        back (sampled requests, failures, finishes, requests whose outputs carry extras)."""
        if self._speculator is not None and plan.rows == 1 and not self.overlap and \
                self._speculator.verify(self, plan, outputs):  # a draft verified instead
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
            # the step's one decode call
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

    # -- the device calls (the decode's is in `_decode_and_complete`; the pipeline's own are
    # `PipelineRunner._decode_call` and `_prefill_call`) ---------------------------------------
    def _call_prefill(self, inputs: Any, every_position: bool = False) -> Any:
        """The synchronous step's prefill call: the one place it calls `runtime.prefill`
        (`every_position`: every position's logits, for prompt logprobs)."""
        prefill: Any = self._rows_of_call(self.runtime.prefill)
        if every_position:  # the optional keyword (see runtime/base.py)
            return self._device_call(functools.partial(prefill, every_position=True), inputs)
        return self._device_call(prefill, inputs)

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

    # -- sampling -----------------------------------------------------------------------------------
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

    # -- grammars (structured output) -------------------------------------------------------------
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
            grammars = self._grammars
            assert grammars is not None  # (built by the submit that started the compile)
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

    # -- n > 1: the choices held for choice 0 -----------------------------------------------------
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

    # -- prefill/decode disaggregation -----------------------------------------------------------
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

    # -- outputs and failures -------------------------------------------------------------------
    def _fail(self, request: Request, message: str, outputs: list[RequestOutput],
              param: str | None = None) -> None:
        """Fail one request; `param` names the request field that caused it (a constraint)."""
        self.scheduler.fail(request, message)
        request.error_param = param
        outputs.append(self._final_output(request, ()))

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


def quiet_requests(events: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """`events` without a request's info events (`request.finished` with its timings,
    `request.preempted`, ...): what `Batcher.log_requests = False` logs. A failed request
    (a warning) and the debug events stay."""
    return [(name, fields) for name, fields in events
            if not name.startswith("request.") or name in _WARN_EVENTS or name in _DEBUG_EVENTS]


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

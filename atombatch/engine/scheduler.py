"""The sans-I/O scheduler: queue + lanes + blocks in, one device call (a `StepPlan`) out.

Theory of operation
-------------------
Every step is exactly one device call: one prefill chunk (batch 1) or one decode step (all B lanes).
`schedule(now)` decides which, writes that call's input arrays in place, and returns a `StepPlan`;
the engine runs it and hands the sampled tokens back through `complete_prefill` / `complete_decode`
(or `fail`). The scheduler never calls a runtime, never reads a clock and never sleeps, so the same
decisions drive the NumPy reference, the simulator and the device, and tests can replay them.

Requests move through the states of `TRANSITIONS` (`atombatch.engine.request`, the only place that
defines them):

    WAITING ──► PREFILLING ──► DECODING ──► FINISHED          (a lane was idle)
       │            ▲              │
       │            │              └──► WAITING              (preempted: recompute later)
       └──► STAGING ┴──► STAGED ──► DECODING                 (all lanes busy: fill the spare)

Block rotation (docs/rules.md): while every lane decodes, the head of the queue is prefilled into the
spare block (STAGING) and emits its first token (STAGED). When a lane finishes, that request takes
the lane and keeps its filled blocks; the finished lane's block becomes the new spare. No KV moves.
Hybrid models (sliding slots belong to lanes) never stage; a hybrid lane that has started its
prefill is prefilled to the end before the next decode step, because a decode step writes every
lane's sliding slot and would clobber a half-built window.

Which blocks and rows a request uses (growth, the prefix and host caches, staging blocks, padding,
the device input buffers and the decode-step kernel) is the KV manager's (`atombatch.engine.kv_manager`);
this module decides who runs. When the pool runs dry the most recently admitted request is
preempted: its blocks are freed and it is re-prefilled later from prompt + generated tokens.

Interleaving of prefill and decode is a `Policy`: prefill-first, decode-first, or one prefill chunk
per N decode steps.

This is the synchronous scheduler. The decode pipeline (`Batcher(overlap=True)`) takes some of these
decisions while the step before is still on the device: that is `AheadScheduler`
(`atombatch.engine.pipeline`), a subclass whose `*_ahead` methods go through the same admission,
policy turn and growth; `_decode_planned` is the one hook it shares.

Prefill/decode disaggregation: a request submitted with a KV source (`Request.pd`) is admitted only
once its header has been validated, and instead of prefill chunks it gets "import" steps that write
the layers which have arrived into its lane's blocks (or into the spare while every lane decodes, or
into block 0 in single-block mode). When the last layer is in, the producer's first token is its
first output; a partial prefix (allowed only outside single-block and hybrid modes) resumes as a
native prefill at the chunk boundary below the covered length.

LoRA adapters (docs/lora.md): a request's adapter id rides on its lane (`LoraRows.by_lane`, set
by `_bind`, reset by `_release`) and every plan built writes its call's `lora_int_ids` beside its
inputs. Under `max_loras`, admission (`_first_ready`, the one place every admission asks) skips a
request whose adapter would exceed the cap and takes the next one; after `lora_bypass_limit`
admissions past it, nothing passes it until it fits.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from typing import Any

from atombatch.api.policy import DEFAULT_POLICY, POLICY_KINDS, Policy
from atombatch.api.structs import FinishReason
from atombatch.artifact.config import ArtifactConfig
from atombatch.engine.kv_manager import KVManager
from atombatch.engine.lora import LoraRows, fits, running_adapters
from atombatch.engine.request import (
    ITERATION_TOKEN_BUCKETS,
    TRANSITIONS,
    Counters,
    PDImport,
    Request,
    RequestState,
    StepPlan,
    StepRecord,
    check_stop,
)
from atombatch.errors import CapacityError, StateError
from atombatch.kernel import blocks as core
from atombatch.kernel.prefix import HostCache

S = RequestState

__all__ = ["POLICY_KINDS", "TRANSITIONS", "Counters", "PDImport", "Policy", "Request",
           "RequestState", "Scheduler", "StepPlan", "StepRecord"]


class Scheduler:
    """Who runs: admission, staging, the prefill/decode policy, preemption and completion.

    Which blocks and rows they use is `self.kv` (`KVManager`); its structures are also reachable
    here (`pool`, `lanes`, `prefix`, ...) for embedders and tests that read them.
    """

    def __init__(self, artifact: ArtifactConfig, policy: Policy | str = DEFAULT_POLICY,
                 eos_token_ids: Iterable[int] = (), prefix_cache: bool = False,
                 host_cache: HostCache | None = None, checkpoint_bytes: int = 0, *,
                 lora: bool = False, max_loras: int | None = None) -> None:
        self.artifact = artifact
        self.policy = Policy.parse(policy)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.counters = Counters(lane_histogram=[0] * (artifact.batch_size + 1))
        self.events: list[tuple[str, dict[str, Any]]] = []  # drained by the engine for logging
        self.kv = KVManager(artifact, self.counters, self.events, prefix_cache, host_cache,
                            checkpoint_bytes)
        self.waiting: deque[Request] = deque()
        self.staging: Request | None = None          # the request using the spare, if any
        self.by_lane: list[Request | None] = [None] * artifact.batch_size
        self.requests: dict[str, Request] = {}       # every unfinished request
        self.trace: list[StepRecord] | None = None   # set to [] to record a step trace
        self._admit_counter = 0
        self._decodes_since_prefill = 0
        self._prefills_since_decode = 0
        self._step_time = 0.0
        self._decode_plan = StepPlan(kind="decode", inputs=self.kv.decode_inputs)
        # LoRA (`atombatch.engine.lora`): the rows' adapter ids (None: the runtime has no LoRA),
        # the cap on distinct adapters running (`--max-loras`), the waiting request it holds
        # back (admissions past it are counted: `lora_bypassed`) and how many it may see
        self.lora = LoraRows(artifact.batch_size) if lora else None
        self.max_loras = max_loras
        self._lora_held: Request | None = None
        self.lora_bypass_limit = artifact.batch_size

    def enable_lora(self) -> LoraRows:
        """Start writing the rows' adapter ids (the first request under an adapter: every lane
        bound so far runs the base model, id 0)."""
        if self.lora is None:
            self.lora = LoraRows(self.artifact.batch_size)
        return self.lora

    # -- the KV manager's structures, for readers -------------------------------------------------
    @property
    def pool(self) -> Any:
        return self.kv.pool

    @property
    def lanes(self) -> Any:
        return self.kv.lanes

    @property
    def slots(self) -> Any:
        return self.kv.slots

    @property
    def prefix(self) -> Any:
        return self.kv.prefix

    @property
    def host(self) -> HostCache | None:
        return self.kv.host

    @property
    def spare(self) -> int:
        return self.kv.spare

    @property
    def decode_inputs(self) -> Any:
        return self.kv.decode_inputs

    @property
    def prefill_inputs(self) -> Any:
        return self.kv.prefill_inputs

    @property
    def kernel(self) -> Any:
        return self.kv.kernel

    # -- queries --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + (self.staging is not None)

    def has_work(self) -> bool:
        return bool(self.requests)

    def _event(self, name: str, **fields: Any) -> None:
        self.events.append((name, fields))

    # -- admission --------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise StateError(f"request id {request.request_id!r} is already in flight")
        request.resolve_limit(self.artifact.max_seq_len)  # built without the artifact's context
        request.resolve_stops(self.eos_token_ids)          # (and the model's EOS ids)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.kv.prefix is not None and request.chain is None:
            # the prompt is hashed once, under its adapter's root (docs/lora.md)
            request.chain = self.kv.prefix.chain(request.prompt, request.lora_root)

    def _admit(self, now: float, limit: int | None = None) -> None:
        """Give idle lanes to the head of the queue (a staging request first), FCFS: at most
        `limit` requests when given."""
        kv = self.kv
        while kv.lanes.num_idle and limit != 0:
            if limit is not None:
                limit -= 1
            if self.staging is not None:
                self._lane_for_staged(self.staging, now)
                continue
            request = self._first_ready()
            if request is None:
                return
            if self.artifact.oversubscribed and kv.available() - kv.committed(self.by_lane) < \
                    kv.blocks_for_prefill(request):
                return  # head of line waits for blocks; finishing or preempted lanes free them
            self.waiting.remove(request)
            if self.max_loras is not None:
                self._admitted_past(request)
            lane = kv.lanes.assign()
            self._bind(request, lane, now)
            request.set_state(S.PREFILLING)
            kv.attach(request)
            self._event("lane.assigned", request_id=request.request_id, lane=lane)

    def _first_ready(self) -> Request | None:
        """The oldest waiting request that can run (a PD request without its header cannot;
        nor, under `max_loras`, one whose adapter would exceed the cap: the ones behind it go
        first, until `lora_bypass_limit` of them did)."""
        if self.max_loras is None:
            for request in self.waiting:
                if request.ready:
                    return request
            return None
        self._lora_held = held = None
        running: set[int] | None = None
        for request in self.waiting:
            if not request.ready:
                continue
            if request.lora_id:
                if running is None:
                    running = running_adapters(self.by_lane)
                    if self.staging is not None and self.staging.lora_id:
                        running.add(self.staging.lora_id)
                if not fits(request, running, self.max_loras):
                    if held is None:
                        self._lora_held = held = request
                    continue
            if held is not None and held.lora_bypassed >= self.lora_bypass_limit:
                return None  # it has waited long enough: nothing passes it any more
            return request
        return None

    def _admitted_past(self, request: Request) -> None:
        """`request` is admitted while an older one waits for its adapter (`max_loras`)."""
        held = self._lora_held
        if held is not None and held is not request:
            held.lora_bypassed += 1

    def _bind(self, request: Request, lane: int, now: float) -> None:
        request.lane = lane
        self.by_lane[lane] = request
        if self.lora is not None:
            self.lora.by_lane[lane] = request.lora_id
        if self.kv.slots is not None:
            self.kv.slots.reset(lane)
        request.admit_order = self._admit_counter
        self._admit_counter += 1

    def share_prompt(self, request: Request) -> int:
        """Publish a decoding lane's full prompt blocks in the prefix cache (see
        `KVManager.share_prompt`); returns how many blocks were published."""
        return self.kv.share_prompt(request)

    def fork_prompt(self, source: Request, child: Request, now: float
                    ) -> list[tuple[int, int]] | None:
        """Start `child` (an n > 1 choice with `source`'s prompt, not queued yet) on an idle lane
        from a device copy of `source`'s prompt KV: fresh blocks take over the blocks holding
        positions 0..len(prompt)-1. Those positions are never rewritten while `source` holds its
        blocks (its decode writes only at its own, later positions; padding rows target FREE or
        SPARE blocks), so the copy is valid at any time `source` decodes or is staged; what the
        copies bring beyond the prompt is overwritten by `child`'s own decode before it is read.
        A hybrid model's sliding slot is the engine's to copy, before `source`'s first decode.

        Returns the (src, dst) block copies, which must run before the next device call, with
        `child` PREFILLING at the end of its prompt (then `start_forked`); or None, changing
        nothing, when no lane or not enough blocks are free now.
        """
        kv = self.kv
        if kv.single_block or source.state not in (S.DECODING, S.STAGED) or not source.output:
            return None
        if kv.lanes.num_idle <= (self.staging is not None):  # a staged request goes first
            return None
        prompt_len = len(child.prompt)
        need = kv.lanes.blocks_for(prompt_len + 1)
        if kv.available() - kv.committed(self.by_lane) < need:
            return None
        lane = kv.lanes.assign()
        child.lane = lane
        copies = kv.fork_blocks(source, child)
        if copies is None:
            kv.lanes.release(lane)
            child.lane = -1
            return None
        self.requests[child.request_id] = child
        self._bind(child, lane, now)
        if kv.slots is not None:  # _bind emptied the slot: it holds the copied prompt
            kv.slots.advance(lane, prompt_len)
        child.set_state(S.PREFILLING)
        self._step_time = now
        self._mark_admitted(child)
        child.prefill_pos = prompt_len
        self.counters.prompt_forks += 1
        self.counters.fork_saved_tokens += prompt_len
        self._event("prompt.forked", request_id=child.request_id, source=source.request_id,
                    lane=lane, copies=copies)
        return copies

    def start_forked(self, child: Request, token: int, now: float) -> list[Request]:
        """A forked choice's KV copies ran; `token` is its first token (sampled from the
        source's first-token logits). Returns it as a request with output."""
        if child.state is not S.PREFILLING:
            return []  # failed meanwhile
        return self._first_token(child, token, now)

    def _lane_for_staged(self, request: Request, now: float) -> None:
        """A lane became idle: the staging request takes it with its filled blocks."""
        kv = self.kv
        lane = kv.lanes.assign()
        self._bind(request, lane, now)
        kv.take_staged_blocks(request, lane)
        self.staging = None
        if request.state is S.STAGED:
            request.set_state(S.DECODING)
            self._start_decode(request)
        else:
            request.set_state(S.PREFILLING)
        self.counters.rotations += 1
        self._event("block.rotated", request_id=request.request_id, lane=lane,
                    blocks=kv.lanes.blocks(lane), spare=kv.spare)

    def _start_decode(self, request: Request) -> None:
        seq_len = len(request.prompt) + len(request.output) - 1
        if self._ensure_blocks_held(request, seq_len + 1):
            self.kv.start_decode(request)

    # -- planning ---------------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan | None:
        """Decide the next device call and fill its inputs; None when there is nothing to run."""
        self._step_time = now
        lanes = self.kv.lanes
        if not self.waiting and self.staging is None and lanes.num_busy and \
                lanes.num_busy == lanes.num_decoding():
            # A steady decode: nothing to admit, stage or prefill (what the loop below finds).
            plan = self._plan_decode()
            if plan is not None and self.kv.has_ops:
                self.kv.take_ops(plan)
            return plan
        plan = None
        for _ in range(3):  # a prefill that preempted its own request re-plans once more
            self._admit(now)
            prefill = self._next_prefill()
            decoding = self.kv.lanes.num_decoding()
            if prefill is not None and self._prefill_turn(prefill, decoding):
                plan = self._plan_prefill(prefill)
                if plan is not None:
                    break
            if self.kv.lanes.num_decoding():
                plan = self._plan_decode()
                break
            if prefill is None:
                break
        if plan is not None and self.kv.has_ops:
            self.kv.take_ops(plan)
        return plan

    def _prefill_turn(self, request: Request, decoding: int) -> bool:
        if not decoding:
            return True
        if self.kv.hybrid and request.lane >= 0 and request.prefill_pos > 0:
            return True  # a half-built sliding window must not see a decode step
        if request.importing:
            return True  # an import is a copy of arrived layers, not compute: never held back
        kind = self.policy.kind
        if kind == "prefill-first" or (kind == "fill-first" and request.state is not S.STAGING):
            return True
        if kind == "decode-first":
            return False
        if kind == "stall-free":
            return self._prefills_since_decode < self.policy.prefill_chunks
        return self._decodes_since_prefill >= self.policy.decode_steps

    def _next_prefill(self) -> Request | None:
        """The lane prefill that came first, else the staging request, else start staging."""
        best: Request | None = None
        lanes = self.kv.lanes
        if lanes.num_busy != lanes.num_decoding():  # some lane prefills (or imports)
            for request in self.by_lane:
                if request is not None and request.state is S.PREFILLING and \
                        self._runnable(request) and \
                        (best is None or request.admit_order < best.admit_order):
                    best = request
            if self.kv.hybrid and best is not None and best.prefill_pos == 0:
                # a hybrid lane whose slot holds anything (a started prefill, a restored
                # checkpoint) goes first: it must end its prefill before any decode step
                for request in self.by_lane:
                    if request is not None and request.state is S.PREFILLING and \
                            request.prefill_pos > 0 and self._runnable(request):
                        return request
        if best is not None:
            return best
        if self.staging is not None:
            staging = self.staging
            return staging if staging.state is S.STAGING and self._runnable(staging) else None
        head = self._first_ready()
        if head is not None and self._can_stage(head):
            self._start_staging(head)
            return head
        return None

    def _start_staging(self, request: Request) -> None:
        """The queue's head starts filling the spare (every lane decodes)."""
        self.waiting.remove(request)
        if self.max_loras is not None:
            self._admitted_past(request)
        request.set_state(S.STAGING)
        self.staging = request
        spare = self.kv.stage(request)
        self._event("request.staging", request_id=request.request_id, block=spare,
                    resume=request.prefill_pos)

    @staticmethod
    def _runnable(request: Request) -> bool:
        """A prefill chunk can run, or an import has layers waiting to be written."""
        return not request.importing or request.pd.pending > 0  # type: ignore[union-attr]

    def _can_stage(self, head: Request) -> bool:
        """Stage only while every lane decodes (so no lane needs the spare for padding)."""
        kv = self.kv
        if kv.hybrid or kv.single_block or kv.pool.num_spare == 0:
            return False
        if kv.lanes.num_idle or kv.lanes.num_decoding() != kv.lanes.batch_size:
            return False
        if self.artifact.oversubscribed:
            # Lanes' growth competes with staging for a scarce pool: staging would hold the
            # spare while a preempted lane needs it as its padding target. Queue instead.
            return False
        # Blocks beyond the spare only from what running lanes will never need.
        extra = kv.blocks_for_prefill(head) - 1
        return extra == 0 or kv.available() - kv.growth_reserve(self.by_lane) >= extra

    def _mark_admitted(self, request: Request) -> None:
        """Its first device work is being planned: the queue wait ends here."""
        if request.admitted_at is None:
            request.admitted_at = self._step_time
            self._event("request.admitted", request_id=request.request_id, lane=request.lane,
                        queue_wait=self._step_time - request.arrival)

    def _plan_prefill(self, request: Request) -> StepPlan | None:
        self._mark_admitted(request)
        if request.importing:
            return self._plan_import(request)
        tokens = request.prefill_tokens
        start = request.prefill_pos
        extent = min(start + self.artifact.prefill_chunk_size, self.artifact.max_seq_len)
        if request.state is S.STAGING:
            if not self.kv.grow_staged(request, extent):
                return None
        elif not self._ensure_blocks_held(request, extent):
            return None
        real = self.kv.build_prefill(request, tokens, start)
        if self.lora is not None:
            self.lora.fill_prefill(self.kv.prefill_inputs, request.lora_id)
        self._decodes_since_prefill = 0
        self._prefills_since_decode += 1
        return StepPlan(kind="prefill", inputs=self.kv.prefill_inputs,
                        request_id=request.request_id, chunk_start=start, chunk_len=real,
                        last_chunk=start + real >= len(tokens),
                        staged=request.state is S.STAGING)

    def _plan_import(self, request: Request) -> StepPlan | None:
        """Write the layers that have arrived into the request's blocks (positions 0..covered)."""
        pd = request.pd
        assert pd is not None
        extent = min(pd.covered_len + 1, self.artifact.max_seq_len)
        if request.state is S.STAGING:
            if not self.kv.grow_staged(request, extent):
                return None
        elif not self._ensure_blocks_held(request, extent):
            return None
        row, slot = self.kv.row_of(request)
        self._decodes_since_prefill = 0
        return StepPlan(kind="import", inputs=None, request_id=request.request_id,
                        staged=request.state is S.STAGING, blocks=row, slot=slot)

    def complete_import(self, plan: StepPlan, layers: int, now: float) -> list[Request]:
        """`layers` more layers of a PD request were written; returns requests with output."""
        request = self.requests.get(plan.request_id)
        self._record("import", 1, plan.request_id)
        self.counters.imports += 1
        self.counters.staged_chunks += plan.staged
        if request is None or request.pd is None or request.state not in (S.PREFILLING,
                                                                            S.STAGING):
            return []
        pd = request.pd
        pd.done_layers += layers
        pd.pending -= layers
        if not pd.complete:
            return []
        self._event("kv.imported", request_id=request.request_id, lane=request.lane,
                    blocks=list(plan.blocks), covered=pd.covered_len, layers=pd.num_layers)
        if pd.covered_len < len(request.prompt):
            # partial prefix: the rest is prefilled natively from a chunk boundary
            q = self.artifact.prefill_chunk_size
            request.prefill_pos = (pd.covered_len // q) * q
            request.pd = None
            return []
        assert pd.first_token is not None
        request.prefill_pos = len(request.prompt)
        if request.lane >= 0 and self.kv.slots is not None:
            self.kv.slots.advance(request.lane, len(request.prompt))
        request.pd = None
        return self._first_token(request, pd.first_token, now)

    def _ensure_blocks_held(self, request: Request, num_positions: int) -> bool:
        """Grow a lane's row to cover positions 0..num_positions-1, preempting while the pool is
        dry. Returns False when `request` itself was preempted to make room."""
        while not self.kv.grow_lane(request, num_positions):
            victim = self._preemption_victim()
            self.preempt(victim)
            if victim is request:
                return False
        return True

    def _preemption_victim(self) -> Request:
        candidates = [r for r in self.by_lane if r is not None]
        if not candidates:
            raise CapacityError("the block pool is dry and no lane holds blocks to preempt")
        return max(candidates, key=lambda r: r.admit_order)

    def _plan_decode(self) -> StepPlan | None:
        kv = self.kv
        short = kv.grow_decoding()  # lanes at a block boundary take FREE blocks, in one call
        if short:
            # The free list ran dry: evict or preempt for these lanes, in lane order (as if each
            # had grown alone), then every decoding lane holds its next position's block.
            for lane in kv.kernel.attention[:short].tolist():
                request = self.by_lane[lane]
                if request is not None and request.state is S.DECODING:
                    self._ensure_blocks_held(request, kv.lanes.seq_len(lane) + 1)
            if kv.grow_decoding():
                raise StateError("decoding lanes are still short of blocks after eviction and "
                                 "preemption")
        if not kv.lanes.num_decoding():
            return None
        plan = self._decode_plan  # one object, reused: a decode step allocates no plan
        plan.rows = kv.build_decode()
        if self.lora is not None:
            self.lora.fill_decode(plan.inputs, plan.rows)
        plan.saves = plan.restores = plan.copies = plan.slot_saves = plan.slot_restores = ()
        self._decodes_since_prefill += 1  # (`_decode_planned`, inline: the steady decode)
        self._prefills_since_decode = 0
        return plan

    def _decode_planned(self) -> None:
        """A decode step was built (here, or ahead by the pipeline: `AheadScheduler`): the
        policy's counters move on."""
        self._decodes_since_prefill += 1
        self._prefills_since_decode = 0

    def decode_requests(self, plan: StepPlan) -> list[Request]:
        """The requests of a decode plan's rows that are still running, in row order."""
        out = []
        for lane in plan.inputs.row_lanes[:plan.rows].tolist():
            request = self.by_lane[lane]
            if request is not None and request.state is S.DECODING:
                out.append(request)
        return out

    # -- results ----------------------------------------------------------------------------------
    def complete_prefill(self, plan: StepPlan, token: int | None, now: float) -> list[Request]:
        """A prefill chunk ran; `token` is the sample from its logits when it was the last chunk.

        Returns the requests that produced output (a first token, or a finish).
        """
        request = self.requests.get(plan.request_id)
        self.chunk_ran(plan)
        if request is None or request.state not in (S.PREFILLING, S.STAGING):
            return []  # aborted while the chunk ran
        request.prefill_pos = plan.chunk_start + plan.chunk_len
        if request.lane >= 0 and self.kv.slots is not None:
            self.kv.slots.advance(request.lane, plan.chunk_len)
            self.kv.after_prefill_chunk(request)
        if not plan.last_chunk:
            return []
        if request.recomputing:
            request.set_state(S.DECODING)  # resumed after preemption: token already known
            self._start_decode(request)
            return []
        if token is None:
            raise StateError(f"last prefill chunk of {request.request_id} needs a sampled token")
        return self._first_token(request, token, now)

    def chunk_ran(self, plan: StepPlan) -> None:
        """Count a prefill chunk that ran (`complete_prefill` does; alone, for a chunk whose
        request ended while it ran: its id may be a new request's by then)."""
        self._record("prefill", 1, plan.request_id)
        counters = self.counters
        counters.prefill_chunks += 1
        counters.staged_chunks += plan.staged
        counters.iteration_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, plan.chunk_len)] += 1
        counters.iteration_tokens_sum += plan.chunk_len

    def _first_token(self, request: Request, token: int, now: float) -> list[Request]:
        self._append_token(request, token, now)
        if self._check_stop(request, token):
            return [request]
        if request.state is S.STAGING:
            request.set_state(S.STAGED)
        else:
            request.set_state(S.DECODING)
            self._start_decode(request)
        return [request]

    def complete_decode(self, plan: StepPlan, now: float) -> list[Request]:
        """A decode step ran and `kernel.tokens[row]` holds each row's token (picked or sampled;
        rows the engine failed are skipped). The kernel appends them all; this handles only the
        rows it hands back: finished requests and those whose outputs the engine builds, which
        are returned."""
        kernel = self.kv.kernel
        attention = kernel.complete(now)
        bucket = plan.inputs.num_rows
        counters = self.counters
        counters.steps += 1
        if self.trace is not None:
            self.trace.append(StepRecord(kind="decode", lanes=plan.rows, rows=bucket))
        counters.decode_steps += 1
        counters.lane_histogram[plan.rows] += 1
        counters.bucket_steps[bucket] = counters.bucket_steps.get(bucket, 0) + 1
        completed = kernel.completed
        counters.generated_tokens += completed
        counters.iteration_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, completed)] += 1
        counters.iteration_tokens_sum += completed
        if self.kv.checkpoints is not None:
            self.kv.after_decode(self.by_lane)
        if not attention:
            return []
        out = []
        rows = kernel.attention[:attention].tolist()
        lanes = plan.inputs.row_lanes
        status = kernel.status
        for row in rows:
            request = self.by_lane[lanes[row]]
            assert request is not None
            self.apply_row_status(request, status[row])
            out.append(request)
        return out

    def apply_row_status(self, request: Request, code: int) -> None:
        """What the step kernel said of a request's row (a row it handed back to Python): a
        stop id, its output limit, or a token the stop check must see (stop strings)."""
        if code == core.ROW_STOP:
            self.finish(request, "stop")
        elif code == core.ROW_LENGTH:
            self.finish(request, "length")
        elif code == core.ROW_CHECK:
            self._check_stop(request, request.output[-1])

    def _record(self, kind: str, lanes: int, request_id: str = "", rows: int = 0) -> None:
        self.counters.steps += 1
        if self.trace is not None:
            self.trace.append(StepRecord(kind=kind, lanes=lanes, request_id=request_id,
                                         rows=rows))

    def _append_token(self, request: Request, token: int, now: float) -> None:
        request.output.append(token)
        request.token_times.append(now)
        if request.first_token_at is None:
            request.first_token_at = now
        self.counters.generated_tokens += 1

    def _check_stop(self, request: Request, token: int) -> bool:
        """Finish the request if `check_stop` (the one stop rule) says `token` ends it."""
        reason = check_stop(request, token, self.eos_token_ids)
        if reason is None:
            return False
        self.finish(request, reason)
        return True

    def stop_string(self, request: Request) -> None:
        """The request's detokenized text matched a stop string with its last token: finish it
        by `check_stop`, whose "stop" then also replaces a "length" finish of that token (the
        kernel or `_check_stop` saw only ids and the limit)."""
        reason = check_stop(request, request.output[-1], self.eos_token_ids, stop_string=True)
        assert reason is not None  # a stop string always stops
        if request.state is not S.FINISHED:
            self.finish(request, reason)
        elif request.finish_reason == "length" and reason != "length":
            finished = self.counters.finished
            finished["length"] -= 1
            if not finished["length"]:
                del finished["length"]
            finished[reason] = finished.get(reason, 0) + 1
            request.finish_reason = reason

    # -- endings ----------------------------------------------------------------------------------
    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a request in any live state: free its lane and blocks; the lane is reusable at once."""
        if request.state is S.FINISHED:
            return
        self._release(request, keep_kv=reason != "error")
        request.set_state(S.FINISHED)
        request.finish_reason = reason
        request.error = error
        self.requests.pop(request.request_id, None)
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        self._event("request.finished" if reason != "error" else "request.failed",
                    request_id=request.request_id, reason=reason, error=error,
                    tokens=len(request.output))

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, "abort")
        return request

    def fail(self, request: Request, error: str) -> None:
        self.finish(request, "error", error)

    def preempt(self, request: Request, keep_kv: bool = True) -> None:
        """Free a running request's lane and blocks; it goes back to the queue head to recompute.

        Its computed KV stays in the prefix cache, unless `keep_kv` is False (the caller knows
        the lane's KV is wrong) or a restore or copy for it is still pending in this step: those
        blocks do not hold their KV yet, so they are dropped with their ops instead of being
        cached (and possibly evicted and saved before they are written)."""
        pending = self.kv.drop_pending_ops(request.request_id)
        self._release(request, keep_kv=keep_kv and not pending)
        request.set_state(S.WAITING)
        request.prefill_pos = 0
        request.pd = None  # its imported KV is gone: recompute natively
        request.preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(request)
        self._event("request.preempted", request_id=request.request_id,
                    generated=len(request.output))

    def _release(self, request: Request, keep_kv: bool = True) -> None:
        """Give back a request's lane or staging blocks (the KV manager caches what it may)."""
        if request.state in (S.STAGING, S.STAGED):
            self.kv.release_staged(request)
            self.staging = None
        elif request.lane >= 0:
            lane = request.lane
            held = self.kv.release_lane(request, keep_kv)
            self.by_lane[lane] = None
            if self.lora is not None:
                self.lora.by_lane[lane] = 0
            request.lane = -1
            self._event("lane.released", request_id=request.request_id, lane=lane, blocks=held)
        elif request.state is S.WAITING:
            self.waiting.remove(request)

    # -- invariants -------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """The invariants of docs/rules.md over pool, lanes and requests; raises `StateError` if
        broken."""
        self.kv.check(self.by_lane, self.staging, live=bool(self.requests))
        for lane, request in enumerate(self.by_lane):
            if request is not None and (request.lane != lane or
                                        self.requests.get(request.request_id) is not request):
                raise StateError(f"lane={lane} holds request {request.request_id}, which is not "
                                 "live on that lane")

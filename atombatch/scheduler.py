"""The sans-I/O scheduler: queue + lanes + blocks in, one device call (a `StepPlan`) out.

Theory of operation
-------------------
Every step is exactly one device call: one prefill chunk (batch 1) or one decode step (all B lanes).
`schedule(now)` decides which, writes that call's input arrays in place, and returns a `StepPlan`;
the engine runs it and hands the sampled tokens back through `complete_prefill` / `complete_decode`
(or `fail`). The scheduler never calls a runtime, never reads a clock and never sleeps, so the same
decisions drive the NumPy reference, the simulator and the device, and tests can replay them.

Requests move through the states of `TRANSITIONS` (below, the only place that defines them):

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

Partitioned artifacts grow sequences block by block. When the pool runs dry the most recently
admitted request is preempted: its blocks are freed and it is re-prefilled later from prompt +
generated tokens. The spare is never handed to growth, so a padding target always exists.

Interleaving of prefill and decode is a `Policy`: prefill-first, decode-first, or one prefill chunk
per N decode steps.

Prefix cache: a finished (or preempted) sequence's blocks become CACHED, indexed by the digest of
the tokens they hold (`atombatch.prefix`). A new lane looks its prompt up: blocks wholly before the
resume position (the longest cached prefix, rounded down to a prefill chunk boundary and short of
the last prompt token) are shared read-only (pinned); the block the prefill resumes in is adopted
when nobody else uses it, or copied (a `copy_block` op) when it is shared. Evicted blocks go to the
host cache when there is one, and a lookup continues into it (a `write_block` op restores them).
Runtime ops the plan needs (save, restore, copy) travel on the `StepPlan` and run before its call.

Prefill/decode disaggregation: a request submitted with a KV source (`Request.pd`) is admitted only
once its header has been validated, and instead of prefill chunks it gets "import" steps that write
the layers which have arrived into its lane's blocks (or into the spare while every lane decodes, or
into block 0 in single-block mode). When the last layer is in, the producer's first token is its
first output; a partial prefix (allowed only outside single-block and hybrid modes) resumes as a
native prefill at the chunk boundary below the covered length.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch import blocks as core
from atombatch.config import ArtifactConfig
from atombatch.errors import CapacityError, ConfigError, StateError
from atombatch.prefix import ROOT, Entry, HostCache, Match, PrefixIndex, TokenChain
from atombatch.structs import FinishReason, SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"        # queued: no lane, no blocks
    STAGING = "staging"        # no lane; prefilling into the spare (STAGED blocks)
    STAGED = "staged"          # no lane; prefill done, first token out, waiting for a lane
    PREFILLING = "prefilling"  # has a lane; prefill chunks in progress
    DECODING = "decoding"      # has a lane; one token per decode step
    FINISHED = "finished"      # terminal


S = RequestState
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.WAITING: frozenset({S.PREFILLING, S.STAGING, S.FINISHED}),
    S.STAGING: frozenset({S.STAGED, S.PREFILLING, S.WAITING, S.FINISHED}),
    S.STAGED: frozenset({S.DECODING, S.FINISHED}),
    S.PREFILLING: frozenset({S.DECODING, S.WAITING, S.FINISHED}),
    S.DECODING: frozenset({S.WAITING, S.FINISHED}),
    S.FINISHED: frozenset(),
}


POLICY_KINDS = ("prefill-first", "decode-first", "interleave", "fill-first")


class Policy(msgspec.Struct, frozen=True):
    """How prefill chunks and decode steps interleave.

    `kind`: "prefill-first" (any pending prefill chunk runs before the next decode step),
    "decode-first" (prefill only when no lane decodes), "interleave" (at most one prefill chunk
    per `decode_steps` decode steps while lanes decode; idle devices always prefill), or
    "fill-first" (a lane's own prefill runs at once, so lanes fill up; chunks into the spare,
    which only shorten a future request's wait, run one per `decode_steps` decode steps).
    """

    kind: str = "prefill-first"
    decode_steps: int = 4

    def __post_init__(self) -> None:
        if self.kind not in POLICY_KINDS:
            raise ConfigError(f"policy kind={self.kind!r} is not one of {', '.join(POLICY_KINDS)}")
        if self.decode_steps < 1:
            raise ConfigError(f"decode_steps={self.decode_steps} must be >= 1")

    @classmethod
    def parse(cls, text: str | Policy) -> Policy:
        """`"prefill-first"`, `"decode-first"`, `"interleave"` or `"interleave:N"`."""
        if isinstance(text, Policy):
            return text
        kind, _, n = text.partition(":")
        return cls(kind=kind, decode_steps=int(n) if n else 4)

    @property
    def label(self) -> str:
        if self.kind in ("interleave", "fill-first"):
            return f"{self.kind}:{self.decode_steps}"
        return self.kind


class PDImport:
    """Progress of a request's KV import; the engine fills in what the producer sent."""

    __slots__ = ("covered_len", "done_layers", "first_token", "header_ok", "num_layers", "pending")

    def __init__(self) -> None:
        self.header_ok = False          # the header arrived and matched the artifact
        self.covered_len = 0            # prompt tokens whose KV the producer sends
        self.first_token: int | None = None  # the producer's sample after the whole prompt
        self.num_layers = 0             # layers to import
        self.done_layers = 0            # layers written into the request's blocks
        self.pending = 0                # layers arrived, not yet written

    @property
    def complete(self) -> bool:
        return self.header_ok and self.done_layers == self.num_layers


class Request:
    """The scheduler's mutable record of one request."""

    __slots__ = ("admit_order", "admitted_at", "arrival", "blocks", "chain", "error",
                 "finish_reason", "first_token_at", "lane", "output", "params", "pd",
                 "preemptions", "prefill_pos", "prompt", "request_id", "rng", "shared", "state",
                 "token_times")

    def __init__(self, request_id: str, prompt: npt.NDArray[np.int64], params: SamplingParams,
                 arrival: float, rng: np.random.Generator) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.arrival = arrival
        self.rng = rng
        self.state = S.WAITING
        self.lane = -1
        self.blocks: list[int] = []      # STAGED blocks while staging (lane blocks live in LaneTable)
        self.output: list[int] = []
        self.prefill_pos = 0             # positions of `prefill_tokens` already written
        self.admit_order = -1
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.token_times: list[float] = []
        self.preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.pd: PDImport | None = None  # set for a request whose KV a producer sends
        self.shared = 0                  # leading row entries that are pinned CACHED blocks
        self.chain: TokenChain | None = None  # prefix cache: its tokens' block digests

    @property
    def ready(self) -> bool:
        """Admissible: native, or a PD request whose header has been validated."""
        return self.pd is None or self.pd.header_ok

    @property
    def importing(self) -> bool:
        return self.pd is not None and not self.pd.complete

    def set_state(self, new: RequestState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise StateError(f"request {self.request_id}: illegal transition "
                             f"{self.state.value} -> {new.value}")
        self.state = new

    @property
    def prefill_tokens(self) -> npt.NDArray[np.int64]:
        """What a (re)prefill must write: the prompt, plus all but the last generated token."""
        if len(self.output) <= 1:
            return self.prompt
        return np.concatenate([self.prompt, np.asarray(self.output[:-1], dtype=np.int64)])

    @property
    def recomputing(self) -> bool:
        """A preempted request whose next token is already known (no sampling after prefill)."""
        return len(self.output) > 0


class StepPlan(msgspec.Struct):
    """One device call, decided by the scheduler, executed by the engine."""

    kind: str                                # "prefill" | "decode" | "import"
    inputs: Any                              # PrefillInputs or DecodeInputs, filled in place
    request_id: str = ""                     # prefill: the request whose chunk this is
    chunk_start: int = 0                     # prefill: first position of the chunk
    chunk_len: int = 0                       # prefill: real tokens in the chunk
    last_chunk: bool = False                 # prefill: the chunk ends the prompt (sample after it)
    staged: bool = False                     # prefill: into the spare (no lane yet)
    lanes: tuple[int, ...] = ()              # decode: lanes that decode, in row order (rows
                                             #   0..len-1 of the bucket; the other rows are padding)
    request_ids: tuple[str, ...] = ()        # decode: their requests, row by row
    blocks: tuple[int, ...] = ()             # import: the request's block row (positions 0..)
    slot: int = 0                            # import: its sliding slot (hybrid)
    saves: tuple[Entry, ...] = ()            # first: copy these evicted blocks to the host cache
    restores: tuple[tuple[int, Any, str], ...] = ()  # then: write host data into a block
                                                     #   (block, data, for request id)
    copies: tuple[tuple[int, int, str], ...] = ()    # then: copy_block(src, dst, for request id)


class StepRecord(msgspec.Struct, frozen=True):
    """A compact trace entry: what each step ran (compared across runtimes)."""

    kind: str                                # "prefill" | "decode" | "import"
    lanes: int                               # decode: decoding lanes; prefill: 1
    request_id: str = ""                     # prefill: whose chunk
    rows: int = 0                            # decode: rows of the compiled batch that ran


class Counters(msgspec.Struct):
    """Monotonic counters a server can export."""

    steps: int = 0
    imports: int = 0
    prefill_chunks: int = 0
    staged_chunks: int = 0                  # prefill chunks or imports into the spare
    decode_steps: int = 0
    generated_tokens: int = 0
    rotations: int = 0
    preemptions: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    prefix_hit_tokens: int = 0
    host_restores: int = 0
    evictions: int = 0
    prompt_forks: int = 0                   # n > 1 choices started from a copy of choice 0's KV
    fork_saved_tokens: int = 0              # prompt tokens those choices did not prefill
    finished: dict[str, int] = msgspec.field(default_factory=dict)
    lane_histogram: list[int] = msgspec.field(default_factory=list)  # decode steps by busy lanes
    bucket_steps: dict[int, int] = msgspec.field(default_factory=dict)  # decode steps by rows run


class Scheduler:
    """Admission, lane assignment, chunking, block growth, rotation and preemption."""

    def __init__(self, artifact: ArtifactConfig, policy: Policy | str = "prefill-first",
                 eos_token_ids: Iterable[int] = (), prefix_cache: bool = False,
                 host_cache: HostCache | None = None) -> None:
        self.artifact = artifact
        self.policy = Policy.parse(policy)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        bps = artifact.blocks_per_seq
        self.pool = core.BlockPool(artifact.num_blocks)
        self.lanes = core.LaneTable(artifact.batch_size, bps, artifact.block_size)
        self.hybrid = artifact.model.is_hybrid
        self.slots = (core.SlidingSlots(artifact.batch_size, artifact.model.sliding_window)
                      if self.hybrid else None)
        self.decode_inputs = core.DecodeInputs(artifact.batch_size, bps,
                                               artifact.decoder_batch_sizes)
        self.prefill_inputs = core.PrefillInputs(artifact.prefill_chunk_size, bps)
        self.single_block = artifact.single_block
        self.spare = -1 if self.single_block else self.pool.reserve_spare()
        self.waiting: deque[Request] = deque()
        self.staging: Request | None = None          # the request using the spare, if any
        self.staged_spare = -1                       # the spare block that request fills
        self.by_lane: list[Request | None] = [None] * artifact.batch_size
        self.requests: dict[str, Request] = {}       # every unfinished request
        self.counters = Counters(lane_histogram=[0] * (artifact.batch_size + 1))
        self.trace: list[StepRecord] | None = None   # set to [] to record a step trace
        self.events: list[tuple[str, dict[str, Any]]] = []  # drained by the engine for logging
        self._admit_counter = 0
        self._decodes_since_prefill = 0
        self._step_time = 0.0
        self.prefix = PrefixIndex(artifact.block_size) if prefix_cache else None
        self.host = host_cache
        self._saves: list[Entry] = []
        self._restores: list[tuple[int, Any, str]] = []
        self._copies: list[tuple[int, int, str]] = []
        self._unpin: list[int] = []

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
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.prefix is not None and request.chain is None:
            request.chain = self.prefix.chain(request.prompt)  # the prompt is hashed once, here

    def _blocks_for_prefill(self, request: Request) -> int:
        """Blocks a request holds once its whole prefill (padded last chunk) is written."""
        q = self.artifact.prefill_chunk_size
        n = len(request.prompt) + max(len(request.output) - 1, 0)
        padded = min(-(-n // q) * q, self.artifact.max_seq_len)
        if request.importing:
            padded = max(padded, request.pd.covered_len + 1)  # type: ignore[union-attr]
        return max(self.lanes.blocks_for(padded), self.lanes.blocks_for(n + 1))

    def _available(self) -> int:
        """Blocks growth may take: FREE plus evictable CACHED (the spare is never counted)."""
        return self.pool.num_free + self.pool.num_evictable

    def _growth_reserve(self) -> int:
        """Blocks the busy lanes still need to reach their longest possible length."""
        limit = self.artifact.max_seq_len
        need = 0
        for request in self.by_lane:
            if request is not None:
                final = min(len(request.prompt) + (request.params.max_tokens or limit), limit)
                need += max(self.lanes.blocks_for(final) - self.lanes.num_held(request.lane), 0)
        return need

    def _committed(self) -> int:
        """Blocks that admitted, still-prefilling lanes will take before they decode."""
        return sum(max(self._blocks_for_prefill(r) - self.lanes.num_held(r.lane), 0)
                   for r in self.by_lane if r is not None and r.state is S.PREFILLING)

    def _take_block(self, state: int, owner: int) -> int:
        """A FREE block (evicting the LRU cached block if needed), never the spare."""
        if self.pool.num_free == 0 and self.pool.num_evictable:
            self._evict()
        return self.pool.allocate(state, owner)

    def _evict(self) -> int:
        """The LRU unpinned CACHED block -> FREE; its KV goes to the host cache if there is one."""
        block = self.pool.evict()
        self.counters.evictions += 1
        if self.prefix is not None:
            entry = self.prefix.remove(block)
            if self.host is not None:
                self._saves.append(entry)
        self._event("block.evicted", block=block)
        return block

    def _admit(self, now: float) -> None:
        """Give idle lanes to the head of the queue (a staging request first), FCFS."""
        while self.lanes.num_idle:
            if self.staging is not None:
                self._lane_for_staged(self.staging, now)
                continue
            request = self._first_ready()
            if request is None:
                return
            if self.artifact.oversubscribed and \
                    self._available() - self._committed() < self._blocks_for_prefill(request):
                return  # head of line waits for blocks; finishing or preempted lanes free them
            self.waiting.remove(request)
            lane = self.lanes.assign()
            self._bind(request, lane, now)
            request.set_state(S.PREFILLING)
            if self.single_block:
                # Origin PR mode: the lone lane takes block 0 and gives it back on finish.
                self.lanes.push_block(lane, self.pool.allocate(core.LANE, lane))
            elif self.prefix is not None and self._reads_prefix_cache(request):
                self._attach_prefix(request)
            self._event("lane.assigned", request_id=request.request_id, lane=lane)

    @staticmethod
    def _reads_prefix_cache(request: Request) -> bool:
        """A fresh lane may start from cached KV, unless it imports its KV (PD) or asks for
        prompt logprobs before its first token: cached positions have no logits (as in vLLM,
        such a request prefills everything; its blocks are still cached when it ends)."""
        if request.importing:
            return False
        return request.params.prompt_logprobs is None or request.recomputing

    def _first_ready(self) -> Request | None:
        """The oldest waiting request that can run (a PD request without its header cannot)."""
        for request in self.waiting:
            if request.ready:
                return request
        return None

    def _bind(self, request: Request, lane: int, now: float) -> None:
        request.lane = lane
        self.by_lane[lane] = request
        if self.slots is not None:
            self.slots.reset(lane)
        request.admit_order = self._admit_counter
        self._admit_counter += 1

    def _chain(self, request: Request, length: int) -> TokenChain:
        """The request's digest chain over its first `length` tokens (prompt, then output):
        generated tokens are hashed here, when the cache first needs them, never twice."""
        assert self.prefix is not None
        chain = request.chain
        if chain is None:
            chain = request.chain = self.prefix.chain(request.prompt)
        if chain.length < length:
            prompt_len = len(request.prompt)
            chain.extend(request.output[chain.length - prompt_len:length - prompt_len])
        return chain

    def _lookup(self, request: Request, length: int) -> Match:
        """Longest cached prefix of the request's first `length` tokens, on the device and then
        on the host, walking the request's stored digests. A host entry whose digest is (still
        or again) on the device is replaced by the device block: a child can outlive its evicted
        parent there, and a restore must never duplicate a cached digest."""
        assert self.prefix is not None
        chain = self._chain(request, length)
        match = self.prefix.match(chain, length)
        if self.host is not None and self.host.extend(chain, length, match):
            match.entries = [self.prefix.find(e.digest) or e if e.block < 0 else e
                             for e in match.entries]
        return match

    def _attach_prefix(self, request: Request) -> None:
        """Start a fresh lane from the longest cached prefix of what it must prefill."""
        assert self.prefix is not None
        tokens = request.prefill_tokens
        match = self._lookup(request, len(tokens))
        q, bs, lane = self.artifact.prefill_chunk_size, self.artifact.block_size, request.lane
        resume = (min(match.tokens, len(tokens) - 1) // q) * q
        if resume == 0:
            self.counters.prefix_misses += 1
            return
        entries = match.entries[: -(-resume // bs)]
        pinned = [e.block for e in entries if e.block >= 0]
        for block in pinned:  # nothing below may evict what this lane is about to use
            self.pool.acquire(block)
        restored = 0
        for j, entry in enumerate(entries):
            below = (j + 1) * bs <= resume  # wholly before the resume position: read-only
            block = entry.block
            if block < 0:  # only on the host: restore into a fresh block
                block = self._take_block(core.LANE, lane)
                self._restores.append((block, entry.data, request.request_id))
                restored += 1
                if below:
                    self._share_restored(block, entry)
            elif not below:  # the prefill resumes inside it: this lane needs its own copy
                self.pool.release(block)
                if self.pool.refcount(block) == 0:
                    self.prefix.remove(block)
                    self.pool.adopt(block, lane)
                else:
                    copy = self._take_block(core.LANE, lane)
                    self._copies.append((block, copy, request.request_id))
                    self.pool.acquire(block)
                    self._unpin.append(block)  # released once the copy op is on a plan
                    block = copy
            self.lanes.push_block(lane, block)
            if below:
                request.shared += 1
        request.prefill_pos = resume
        self.counters.prefix_hits += 1
        self.counters.prefix_hit_tokens += resume
        self.counters.host_restores += restored
        self._event("prefix.hit", request_id=request.request_id, lane=lane, tokens=resume,
                    shared=request.shared, restored=restored,
                    blocks=self.lanes.blocks(lane))

    def _attach_prefix_staged(self, request: Request, spare: int) -> None:
        """Staging from a cached prefix: share the device blocks wholly before the resume
        position, restore host copies into fresh STAGED blocks, and fill the spare (the block the
        prefill resumes in) from the cached block by a device copy or a host restore."""
        assert self.prefix is not None
        tokens = request.prefill_tokens
        match = self._lookup(request, len(tokens))
        q, bs = self.artifact.prefill_chunk_size, self.artifact.block_size
        resume = (min(match.tokens, len(tokens) - 1) // q) * q
        request.blocks = []
        self.staged_spare = spare
        if resume == 0:
            self.counters.prefix_misses += 1
            request.blocks.append(spare)
            return
        below = resume // bs
        entries = match.entries[: -(-resume // bs)]
        for entry in entries:  # pinned first: nothing below may evict them
            if entry.block >= 0:
                self.pool.acquire(entry.block)
        restored = 0
        for entry in entries[:below]:
            block = entry.block
            if block < 0:  # a host copy: restored, cached and shared like a device entry
                block = self._take_block(core.STAGED, -2)
                self._restores.append((block, entry.data, request.request_id))
                self._share_restored(block, entry)
                restored += 1
            request.blocks.append(block)
            request.shared += 1
        if resume % bs:  # the prefill resumes inside a cached block: fill the spare from it
            source = entries[below]
            if source.block >= 0:
                self._copies.append((source.block, spare, request.request_id))
                self._unpin.append(source.block)
            else:
                self._restores.append((spare, source.data, request.request_id))
                restored += 1
        request.blocks.append(spare)
        request.prefill_pos = resume
        self.counters.prefix_hits += 1
        self.counters.prefix_hit_tokens += resume
        self.counters.host_restores += restored
        self._event("prefix.hit", request_id=request.request_id, lane=-1, tokens=resume,
                    shared=request.shared, restored=restored, blocks=list(request.blocks))

    def _share_restored(self, block: int, entry: Entry) -> None:
        """A block restored from the host for positions before the resume point joins the device
        cache and is pinned by the request that restored it."""
        assert self.prefix is not None
        self.pool.cache(block)
        inserted = self.prefix.insert_digest(block, entry.digest, entry.parent, entry.tokens,
                                             entry.full)
        assert inserted is not None, "a host entry on the device was not replaced by _lookup"
        self.pool.acquire(block)

    def share_prompt(self, request: Request) -> int:
        """Publish a decoding lane's full prompt blocks in the prefix cache, pinned by that lane
        (they become its leading shared blocks), so requests with the same prompt (the other
        choices of an n > 1 request) start from them. Decode never writes a full prompt block.
        Returns how many blocks were published."""
        if self.prefix is None or request.lane < 0 or request.state is not S.DECODING:
            return 0
        bs = self.artifact.block_size
        row = self.lanes.blocks(request.lane)
        full_blocks = min(len(request.prompt) // bs, len(row))
        chain = self._chain(request, full_blocks * bs)  # the prompt's digests: nothing re-hashed
        published = 0
        for j in range(request.shared, full_blocks):
            block = row[j]
            inserted = self.prefix.insert_digest(block, chain.digests[j], chain.parent(j),
                                                 chain.tokens[j * bs:(j + 1) * bs], True)
            if inserted is None:  # an identical block is cached already: stop here
                break
            self.pool.cache(block)
            self.pool.acquire(block)
            request.shared += 1
            published += 1
        if published:
            self._event("prefix.published", request_id=request.request_id, blocks=published)
        return published

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
        if self.single_block or source.state not in (S.DECODING, S.STAGED) or not source.output:
            return None
        if self.lanes.num_idle <= (self.staging is not None):  # a staged request goes first
            return None
        prompt_len = len(child.prompt)
        copied = self.lanes.blocks_for(prompt_len)
        row = list(self.lanes.blocks(source.lane)) if source.lane >= 0 else list(source.blocks)
        need = self.lanes.blocks_for(prompt_len + 1)  # its first decode writes at prompt_len
        if len(row) < copied or self._available() - self._committed() < need:
            return None
        self.requests[child.request_id] = child
        lane = self.lanes.assign()
        self._bind(child, lane, now)
        child.set_state(S.PREFILLING)
        self._step_time = now
        self._mark_admitted(child)
        copies = []
        for src in row[:copied]:
            dst = self._take_block(core.LANE, lane)
            self.lanes.push_block(lane, dst)
            copies.append((src, dst))
        child.prefill_pos = prompt_len
        if self.slots is not None:
            self.slots.advance(lane, prompt_len)
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
        lane = self.lanes.assign()
        self._bind(request, lane, now)
        for j, block in enumerate(request.blocks):
            if j >= request.shared:  # shared prefix blocks stay pinned CACHED
                self.pool.assign(block, lane)
            self.lanes.push_block(lane, block)
        request.blocks = []
        self.staging = None
        if self.pool.num_spare == 0:
            self.spare = self._take_block(core.SPARE, -1)
        if request.state is S.STAGED:
            request.set_state(S.DECODING)
            self._start_decode(request)
        else:
            request.set_state(S.PREFILLING)
        self.counters.rotations += 1
        self._event("block.rotated", request_id=request.request_id, lane=lane,
                    blocks=self.lanes.blocks(lane), spare=self.spare)

    def _start_decode(self, request: Request) -> None:
        seq_len = len(request.prompt) + len(request.output) - 1
        if self._ensure_blocks_held(request, seq_len + 1):
            self.lanes.start_decode(request.lane, seq_len, request.output[-1])

    # -- planning ---------------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan | None:
        """Decide the next device call and fill its inputs; None when there is nothing to run."""
        self._step_time = now
        plan = None
        for _ in range(3):  # a prefill that preempted its own request re-plans once more
            self._admit(now)
            prefill = self._next_prefill()
            decoding = self.lanes.num_decoding()
            if prefill is not None and self._prefill_turn(prefill, decoding):
                plan = self._plan_prefill(prefill)
                if plan is not None:
                    break
            if self.lanes.num_decoding():
                plan = self._plan_decode()
                break
            if prefill is None:
                break
        if plan is not None and (self._saves or self._restores or self._copies or self._unpin):
            plan.saves, plan.restores, plan.copies = (tuple(self._saves), tuple(self._restores),
                                                      tuple(self._copies))
            self._saves.clear()
            self._restores.clear()
            self._copies.clear()
            for block in self._unpin:
                self.pool.release(block)
            self._unpin.clear()
        return plan

    def _prefill_turn(self, request: Request, decoding: int) -> bool:
        if not decoding:
            return True
        if self.hybrid and request.lane >= 0 and request.prefill_pos > 0:
            return True  # a half-built sliding window must not see a decode step
        if request.importing:
            return True  # an import is a copy of arrived layers, not compute: never held back
        kind = self.policy.kind
        if kind == "prefill-first" or (kind == "fill-first" and request.state is not S.STAGING):
            return True
        if kind == "decode-first":
            return False
        return self._decodes_since_prefill >= self.policy.decode_steps

    def _next_prefill(self) -> Request | None:
        """The lane prefill that came first, else the staging request, else start staging."""
        best: Request | None = None
        for request in self.by_lane:
            if request is not None and request.state is S.PREFILLING and self._runnable(request) \
                    and (best is None or request.admit_order < best.admit_order):
                best = request
        if best is not None:
            return best
        if self.staging is not None:
            staging = self.staging
            return staging if staging.state is S.STAGING and self._runnable(staging) else None
        head = self._first_ready()
        if head is not None and self._can_stage(head):
            request = head
            self.waiting.remove(request)
            request.set_state(S.STAGING)
            self.staging = request
            self.pool.stage(self.spare, -2)
            spare, self.spare = self.spare, -1
            if self.prefix is not None and self._reads_prefix_cache(request):
                self._attach_prefix_staged(request, spare)
            else:
                request.blocks = [spare]
                self.staged_spare = spare
            self._event("request.staging", request_id=request.request_id, block=spare,
                        resume=request.prefill_pos)
            return request
        return None

    @staticmethod
    def _runnable(request: Request) -> bool:
        """A prefill chunk can run, or an import has layers waiting to be written."""
        return not request.importing or request.pd.pending > 0  # type: ignore[union-attr]

    def _can_stage(self, head: Request) -> bool:
        """Stage only while every lane decodes (so no lane needs the spare for padding)."""
        if self.hybrid or self.single_block or self.pool.num_spare == 0:
            return False
        if self.lanes.num_idle or self.lanes.num_decoding() != self.lanes.batch_size:
            return False
        if self.artifact.oversubscribed:
            # Lanes' growth competes with staging for a scarce pool: staging would hold the
            # spare while a preempted lane needs it as its padding target. Queue instead.
            return False
        # Blocks beyond the spare only from what running lanes will never need.
        extra = self._blocks_for_prefill(head) - 1
        return extra == 0 or self._available() - self._growth_reserve() >= extra

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
        q = self.artifact.prefill_chunk_size
        start = request.prefill_pos
        extent = min(start + q, self.artifact.max_seq_len)
        need = self.lanes.blocks_for(extent)
        if request.state is S.STAGING:
            while len(request.blocks) < need:
                if self._available() == 0:
                    return None
                request.blocks.append(self._take_block(core.STAGED, -2))
            row: list[int] | npt.NDArray[np.int32] = request.blocks
            held = len(request.blocks)
            slot = 0
        else:
            if not self._ensure_blocks_held(request, extent):
                return None
            lane = request.lane
            row = self.lanes.blocks(lane)
            held = len(row)
            slot = lane
        real = self.prefill_inputs.build(tokens, start, row, held, slot)
        self._decodes_since_prefill = 0
        return StepPlan(kind="prefill", inputs=self.prefill_inputs, request_id=request.request_id,
                        chunk_start=start, chunk_len=real, last_chunk=start + real >= len(tokens),
                        staged=request.state is S.STAGING)

    def _plan_import(self, request: Request) -> StepPlan | None:
        """Write the layers that have arrived into the request's blocks (positions 0..covered)."""
        pd = request.pd
        assert pd is not None
        extent = min(pd.covered_len + 1, self.artifact.max_seq_len)
        if request.state is S.STAGING:
            while len(request.blocks) < self.lanes.blocks_for(extent):
                if self._available() == 0:
                    return None
                request.blocks.append(self._take_block(core.STAGED, -2))
            row, slot = tuple(request.blocks), 0
        else:
            if not self._ensure_blocks_held(request, extent):
                return None
            row, slot = tuple(self.lanes.blocks(request.lane)), request.lane
        self._decodes_since_prefill = 0
        return StepPlan(kind="import", inputs=None, request_id=request.request_id,
                        staged=request.state is S.STAGING, blocks=row, slot=slot)

    def complete_import(self, plan: StepPlan, layers: int, now: float) -> list[Request]:
        """`layers` more layers of a PD request were written; returns requests with output."""
        request = self.requests.get(plan.request_id)
        self._record(StepRecord(kind="import", lanes=1, request_id=plan.request_id))
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
        if request.lane >= 0 and self.slots is not None:
            self.slots.advance(request.lane, len(request.prompt))
        request.pd = None
        return self._first_token(request, pd.first_token, now)

    def _ensure_blocks_held(self, request: Request, num_positions: int) -> bool:
        """Grow a lane's row to cover positions 0..num_positions-1, preempting if the pool is dry.

        Returns False when `request` itself was preempted to make room.
        """
        lane = request.lane
        need = self.lanes.blocks_for(num_positions)
        while self.lanes.num_held(lane) < need:
            if self._available() == 0:
                victim = self._preemption_victim()
                self.preempt(victim)
                if victim is request:
                    return False
                continue
            self.lanes.push_block(lane, self._take_block(core.LANE, lane))
        return True

    def _preemption_victim(self) -> Request:
        candidates = [r for r in self.by_lane if r is not None]
        if not candidates:
            raise CapacityError("the block pool is dry and no lane holds blocks to preempt")
        return max(candidates, key=lambda r: r.admit_order)

    def _plan_decode(self) -> StepPlan | None:
        for lane, request in enumerate(self.by_lane):
            if request is not None and request.state is S.DECODING:
                self._ensure_blocks_held(request, self.lanes.seq_len(lane) + 1)
        lanes = tuple(lane for lane, r in enumerate(self.by_lane)
                      if r is not None and r.state is S.DECODING)
        if not lanes:
            return None
        padding = self._padding_block()
        if self.decode_inputs.build(self.lanes, padding) != len(lanes):
            # rows 0..n-1 are read back as `lanes`: lane and request state must agree
            raise StateError(f"the lane table has {self.lanes.num_decoding()} decoding lanes, the "
                             f"requests {len(lanes)}")
        self._decodes_since_prefill += 1
        return StepPlan(kind="decode", inputs=self.decode_inputs, lanes=lanes,
                        request_ids=tuple(self.by_lane[lane].request_id for lane in lanes))  # type: ignore[union-attr]

    def _padding_block(self) -> int:
        """A FREE or SPARE block for padding rows (never STAGED, LANE or CACHED); -1 if the bucket
        that runs has none."""
        decoding = self.lanes.num_decoding()
        if self.decode_inputs.bucket_for(decoding) == decoding:
            return -1
        if self.pool.num_spare:
            return self.spare
        block = self.pool.first_free()
        if block >= 0:
            return block
        if self.pool.num_evictable:
            return self._evict()
        raise StateError("no FREE or SPARE block is left as a padding target")

    # -- results ----------------------------------------------------------------------------------
    def complete_prefill(self, plan: StepPlan, token: int | None, now: float) -> list[Request]:
        """A prefill chunk ran; `token` is the sample from its logits when it was the last chunk.

        Returns the requests that produced output (a first token, or a finish).
        """
        request = self.requests.get(plan.request_id)
        self._record(StepRecord(kind="prefill", lanes=1, request_id=plan.request_id))
        self.counters.prefill_chunks += 1
        self.counters.staged_chunks += plan.staged
        if request is None or request.state not in (S.PREFILLING, S.STAGING):
            return []  # aborted while the chunk ran
        request.prefill_pos = plan.chunk_start + plan.chunk_len
        if request.lane >= 0 and self.slots is not None:
            self.slots.advance(request.lane, plan.chunk_len)
        if not plan.last_chunk:
            return []
        if request.recomputing:
            request.set_state(S.DECODING)  # resumed after preemption: token already known
            self._start_decode(request)
            return []
        if token is None:
            raise StateError(f"last prefill chunk of {request.request_id} needs a sampled token")
        return self._first_token(request, token, now)

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

    def complete_decode(self, plan: StepPlan, tokens: dict[int, int], now: float) -> list[Request]:
        """A decode step ran; `tokens[lane]` is each decoding lane's sample."""
        rows = plan.inputs.num_rows
        self._record(StepRecord(kind="decode", lanes=len(plan.lanes), rows=rows))
        self.counters.decode_steps += 1
        self.counters.lane_histogram[len(plan.lanes)] += 1
        self.counters.bucket_steps[rows] = self.counters.bucket_steps.get(rows, 0) + 1
        out = []
        for lane, request_id in zip(plan.lanes, plan.request_ids, strict=True):
            request = self.by_lane[lane]
            if request is None or request.request_id != request_id or \
                    request.state is not S.DECODING or lane not in tokens:
                continue
            token = tokens[lane]
            self.lanes.advance(lane, token)
            if self.slots is not None:
                self.slots.advance(lane, 1)
            self._append_token(request, token, now)
            self._check_stop(request, token)
            out.append(request)
        return out

    def _record(self, record: StepRecord) -> None:
        self.counters.steps += 1
        if self.trace is not None:
            self.trace.append(record)

    def _append_token(self, request: Request, token: int, now: float) -> None:
        request.output.append(token)
        request.token_times.append(now)
        if request.first_token_at is None:
            request.first_token_at = now
        self.counters.generated_tokens += 1

    def _check_stop(self, request: Request, token: int) -> bool:
        params = request.params
        if token in params.stop_token_ids or (not params.ignore_eos and
                                              token in self.eos_token_ids):
            self.finish(request, "stop")
            return True
        if params.max_tokens is not None and len(request.output) >= params.max_tokens:
            self.finish(request, "length")
            return True
        return False

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

    def preempt(self, request: Request) -> None:
        """Free a running request's lane and blocks; it goes back to the queue head to recompute.

        Its computed KV stays in the prefix cache, unless a restore or copy for it is still
        pending in this step: those blocks do not hold their KV yet, so they are dropped with
        their ops instead of being cached (and possibly evicted and saved before they are
        written)."""
        rid = request.request_id
        pending = any(op[2] == rid for op in self._restores) or \
            any(op[2] == rid for op in self._copies)
        if pending:
            assert self.prefix is not None
            kept = []
            for op in self._restores:
                if op[2] != rid:
                    kept.append(op)
                elif self.prefix.entry(op[0]) is not None:
                    # a restored block already in the cache index: it must still be written,
                    # and stay pinned until then so nothing evicts (and saves) it first
                    kept.append(op)
                    self.pool.acquire(op[0])
                    self._unpin.append(op[0])
            self._restores = kept
            self._copies = [op for op in self._copies if op[2] != rid]
        self._release(request, keep_kv=not pending)
        request.set_state(S.WAITING)
        request.prefill_pos = 0
        request.pd = None  # its imported KV is gone: recompute natively
        request.preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(request)
        self._event("request.preempted", request_id=request.request_id,
                    generated=len(request.output))

    def _release(self, request: Request, keep_kv: bool = True) -> None:
        """Give back a request's lane or staging blocks; with a prefix cache, keep what its KV
        computed (not after an error: that KV may be garbage)."""
        if request.state in (S.STAGING, S.STAGED):
            self._release_staged(request)
        elif request.lane >= 0:
            lane = request.lane
            if not keep_kv or request.importing:
                valid = 0
            elif self.lanes.state(lane) == core.LANE_DECODING:
                valid = self.lanes.seq_len(lane)  # positions whose KV is written
            else:
                valid = request.prefill_pos
            held = self.lanes.release(lane)
            self.by_lane[lane] = None
            request.lane = -1
            if self.prefix is not None:
                self._cache_blocks(request, held, valid)
            else:
                for block in held:
                    self.pool.free(block)
            request.shared = 0
            self._event("lane.released", request_id=request.request_id, lane=lane, blocks=held)
        elif request.state is S.WAITING:
            self.waiting.remove(request)

    def _cache_blocks(self, request: Request, held: list[int], valid: int) -> None:
        """Keep a released lane's KV in the prefix cache (shared blocks are just unpinned).

        The digests are the request's own, computed as its tokens arrived: nothing is hashed
        here but the generated tokens the chain has not seen yet."""
        prefix = self.prefix
        assert prefix is not None
        bs = self.artifact.block_size
        chain = self._chain(request, valid)  # positions 0..valid-1 hold its first valid tokens
        tokens, digests = chain.tokens, chain.digests
        for j, block in enumerate(held):
            if j < request.shared:
                self.pool.release(block)
                continue
            start = j * bs
            if start >= valid:
                self.pool.free(block)
                continue
            end = min(start + bs, valid)
            full = end - start == bs
            digest = digests[j] if full else chain.partial_digest(end)
            if prefix.insert_digest(block, digest, digests[j - 1] if j else ROOT,
                                    tokens[start:end], full) is None:
                self.pool.free(block)  # an identical block is cached already
            else:
                self.pool.cache(block)

    def _release_staged(self, request: Request) -> None:
        for j, block in enumerate(request.blocks):
            if j < request.shared:
                self.pool.release(block)
            elif block == self.staged_spare:  # the spare it staged into
                self.pool.unstage(block)
                self.spare = block
            else:
                self.pool.free(block)
        request.blocks = []
        request.shared = 0
        self.staging = None

    # -- invariants -------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """The invariants of docs/rules.md over pool, lanes and requests; raises `StateError` if broken."""
        pool, lanes = self.pool, self.lanes
        pool.check()
        owned: dict[int, str] = {}
        for lane in range(lanes.batch_size):
            request = self.by_lane[lane]
            state = lanes.state(lane)
            if (request is None) != (state == core.LANE_IDLE):
                raise StateError(f"lane={lane} state {state} disagrees with its request")
            row = lanes.blocks(lane)
            shared = request.shared if request is not None else 0
            for block in row[:shared]:
                if pool.state(block) != core.CACHED or pool.refcount(block) < 1:
                    raise StateError(f"lane={lane} shares block={block} but it is not pinned "
                                     "CACHED")
            for block in row[shared:]:
                if pool.state(block) != core.LANE or pool.owner(block) != lane:
                    raise StateError(f"lane={lane} holds block={block} in state "
                                     f"{core.STATE_NAMES[pool.state(block)]}")
                if block in owned:
                    raise StateError(f"block={block} is held by {owned[block]} and lane={lane}")
                owned[block] = f"lane={lane}"
        if self.staging is not None:
            shared = self.staging.shared
            for block in self.staging.blocks[:shared]:
                if pool.state(block) != core.CACHED or pool.refcount(block) < 1:
                    raise StateError(f"staging shares block={block} but it is not pinned CACHED")
            for block in self.staging.blocks[shared:]:
                if pool.state(block) != core.STAGED or block in owned:
                    raise StateError(f"staged block={block} is not exclusively STAGED")
                owned[block] = "staging"
        if len(owned) != pool.num_lane + pool.num_staged:
            raise StateError(f"{len(owned)} owned blocks, pool counts "
                             f"{pool.num_lane + pool.num_staged} LANE+STAGED")
        if not self.single_block and pool.num_spare + (self.staging is not None) != 1:
            raise StateError(f"{pool.num_spare} spare blocks with staging={self.staging is not None}")
        if self.prefix is not None and len(self.prefix) != pool.num_cached:
            raise StateError(f"prefix index holds {len(self.prefix)} blocks, pool "
                             f"{pool.num_cached} CACHED")
        if not self.requests and (lanes.num_busy or pool.num_lane or pool.num_staged or
                                  pool.num_evictable != pool.num_cached):
            raise StateError("no request is live but lanes or blocks are still owned")

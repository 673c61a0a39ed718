"""Which blocks and rows: the KV side of scheduling.

Theory of operation
-------------------
The scheduler (`atombatch.engine.scheduler`) decides *who runs*: admission, the prefill/decode policy,
staging, which request a dry pool preempts. This module decides *which blocks and rows* the
chosen work uses, and owns every structure that says so: the block pool, the lane table, the
sliding slots, the decode and prefill input buffers, the step kernel, the spare, the prefix index
and the host cache, and the runtime ops (host saves and restores, device copies) a step needs
before its device call. It never picks a request to run or to preempt: where growth finds the
pool dry it reports so, and the scheduler chooses a victim.

Growth: a lane's row covers positions 0..n-1 with `ceil(n / block_size)` blocks. FREE blocks are
taken first, then the LRU unpinned CACHED block is evicted (its KV goes to the host cache when
there is one). The spare is never handed to growth, so a padding target always exists. In a
steady decode step the step kernel grows every lane at once from the free list; only lanes it
cannot serve come back here.

Prefix cache: a finished (or preempted) sequence's blocks become CACHED, indexed by the digest of
the tokens they hold (`atombatch.kernel.prefix`). A new lane looks its prompt up: blocks wholly before the
resume position (the longest cached prefix, rounded down to a prefill chunk boundary and short of
the last prompt token) are shared read-only (pinned); the block the prefill resumes in is adopted
when nobody else uses it, or copied (a `copy_block` op) when it is shared. Evicted blocks go to the
host cache when there is one, and a lookup continues into it (a `write_block` op restores them).

Hybrid models: a hit also needs every sliding layer's window, which lives in the lane's slot. It is
restored from a host checkpoint of the slot saved at a chunk boundary (`atombatch.engine.checkpoints`):
the hit is trimmed back to the largest checkpointed boundary it covers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from atombatch.artifact.config import ArtifactConfig
from atombatch.engine.checkpoints import CheckpointStore, SlotCheckpoints
from atombatch.engine.request import Counters, Request, StepPlan
from atombatch.engine.request import RequestState as S
from atombatch.errors import StateError
from atombatch.kernel import blocks as core
from atombatch.kernel.prefix import Entry, HostCache, Match, PrefixIndex, TokenChain

MAX_CHAIN = 8                  # chunks a wave of arrivals chains into the pipeline at once
PREFILL_BUFFERS = MAX_CHAIN + 1  # prefill input buffers (`KVManager.swap_prefill_inputs`)


class KVManager:
    """Blocks, lanes, sliding slots, input buffers, the step kernel and the prefix/host caches."""

    def __init__(self, artifact: ArtifactConfig, counters: Counters,
                 events: list[tuple[str, dict[str, Any]]], prefix_cache: bool = False,
                 host_cache: HostCache | None = None, checkpoint_bytes: int = 0) -> None:
        self.artifact = artifact
        self.counters = counters                 # shared with the scheduler
        self.events = events                     # shared with the scheduler
        bps = artifact.blocks_per_seq
        self.pool = core.BlockPool(artifact.num_blocks)
        self.lanes = core.LaneTable(artifact.batch_size, bps, artifact.block_size)
        self.hybrid = artifact.model.is_hybrid
        self.slots = (core.SlidingSlots(artifact.batch_size, artifact.model.sliding_window)
                      if self.hybrid else None)
        self.decode_inputs = core.DecodeInputs(artifact.batch_size, bps,
                                               artifact.decoder_batch_sizes)
        self.prefill_inputs = core.PrefillInputs(artifact.prefill_chunk_size, bps)
        # the buffers chunks planned back to back take in turn (`swap_prefill_inputs`)
        self._prefill_ring: list[Any] = [self.prefill_inputs]
        self._prefill_at = 0
        self.kernel = core.StepKernel(self.pool, self.lanes, self.decode_inputs, self.slots)
        self.single_block = artifact.single_block
        self.spare = -1 if self.single_block else self.pool.reserve_spare()
        self.staged_spare = -1                   # the spare block a staging request fills
        self.prefix = (PrefixIndex(artifact.block_size, num_blocks=artifact.num_blocks)
                       if prefix_cache else None)
        self.host = host_cache
        # hybrid models: sliding-slot checkpoints, in the host cache's budget
        self.checkpoints: SlotCheckpoints | None = None
        if self.hybrid and self.prefix is not None:
            if host_cache is None or checkpoint_bytes <= 0:
                raise StateError("a hybrid prefix cache needs a host cache and the checkpoint "
                                 "size (plan.check_serving refuses it otherwise)")
            self.checkpoints = SlotCheckpoints(
                artifact.prefill_chunk_size, artifact.block_size,
                CheckpointStore(host_cache, checkpoint_bytes), self.prefix, counters)
        self._saves: list[Entry] = []
        self._restores: list[tuple[int, Any, str]] = []
        self._copies: list[tuple[int, int, str]] = []
        self._unpin: list[int] = []

    def _event(self, name: str, **fields: Any) -> None:
        self.events.append((name, fields))

    # -- capacity ---------------------------------------------------------------------------------
    def blocks_for_prefill(self, request: Request) -> int:
        """Blocks a request holds once its whole prefill (padded last chunk) is written."""
        q = self.artifact.prefill_chunk_size
        n = len(request.prompt) + max(len(request.output) - 1, 0)
        padded = min(-(-n // q) * q, self.artifact.max_seq_len)
        if request.importing:
            padded = max(padded, request.pd.covered_len + 1)  # type: ignore[union-attr]
        return max(self.lanes.blocks_for(padded), self.lanes.blocks_for(n + 1))

    def available(self) -> int:
        """Blocks growth may take: FREE plus evictable CACHED (the spare is never counted)."""
        return self.pool.num_free + self.pool.num_evictable

    def growth_reserve(self, running: Iterable[Request | None]) -> int:
        """Blocks the running lanes still need to reach their longest possible length."""
        need = 0
        for request in running:
            if request is not None:
                final = len(request.prompt) + request.max_tokens  # at most max_seq_len
                need += max(self.lanes.blocks_for(final) - self.lanes.num_held(request.lane), 0)
        return need

    def committed(self, running: Iterable[Request | None]) -> int:
        """Blocks that admitted, still-prefilling lanes will take before they decode."""
        return sum(max(self.blocks_for_prefill(r) - self.lanes.num_held(r.lane), 0)
                   for r in running if r is not None and r.state is S.PREFILLING)

    def take_block(self, state: int, owner: int) -> int:
        """A FREE block (evicting the LRU cached block if needed), never the spare."""
        if self.pool.num_free == 0 and self.pool.num_evictable:
            self.evict()
        return self.pool.allocate(state, owner)

    def evict(self) -> int:
        """The LRU unpinned CACHED block -> FREE; its KV goes to the host cache if there is one."""
        block = self.pool.evict()
        self.counters.evictions += 1
        if self.prefix is not None:
            if self.host is not None:
                self._saves.append(self.prefix.remove(block))  # checkpoints go to the host too
            else:
                entry = self.prefix.discard(block)  # no entry is made for it
                if entry is not None and entry.checkpoints and self.checkpoints is not None:
                    self.checkpoints.store.entry_gone(entry)
        # one event for a run of evictions (growth evicts block by block): logging one per block
        # cost more than the evictions themselves at a full cache
        events = self.events
        if events and events[-1][0] == "block.evicted":
            events[-1][1]["blocks"].append(block)
        else:
            self._event("block.evicted", blocks=[block])
        return block

    def evict_blocks(self, count: int) -> list[int]:
        """`evict` `count` times, in one pool call and one index pass (growth taking several
        blocks from a full cache): the same blocks, saves and event as one at a time."""
        blocks = self.pool.evict_many(count)
        self.counters.evictions += len(blocks)
        if self.prefix is not None:
            if self.host is not None:
                self._saves.extend([self.prefix.remove(block) for block in blocks])
            else:
                for entry in self.prefix.discard_blocks(blocks):  # no entry is made for them
                    if entry.checkpoints and self.checkpoints is not None:
                        self.checkpoints.store.entry_gone(entry)
        events = self.events
        if events and events[-1][0] == "block.evicted":
            events[-1][1]["blocks"].extend(blocks)
        else:
            self._event("block.evicted", blocks=blocks)
        return blocks

    # -- growth -----------------------------------------------------------------------------------
    def grow_lane(self, request: Request, num_positions: int) -> bool:
        """Grow a lane's row to cover positions 0..num_positions-1; False if the pool ran dry
        first (the blocks taken so far stay with the lane)."""
        lane = request.lane
        short = self.kernel.grow_lane(lane, num_positions)  # from the free list, in one call
        while short:  # the free list is dry: evict what is missing, then take it the same way
            evictable = self.pool.num_evictable
            if evictable == 0:
                return False
            self.evict_blocks(min(short, evictable))
            short = self.kernel.grow_lane(lane, num_positions)
        return True

    def grow_staged(self, request: Request, num_positions: int) -> bool:
        """Grow a staging request's STAGED blocks to cover positions 0..num_positions-1; False if
        the pool ran dry first."""
        need = self.lanes.blocks_for(num_positions)
        while len(request.blocks) < need:
            if self.available() == 0:
                return False
            request.blocks.append(self.take_block(core.STAGED, -2))
        return True

    def grow_decoding(self) -> int:
        """Every decoding lane takes the block its next position needs from the free list, in
        one kernel call; returns k: `kernel.attention[:k]` are the lanes (in lane order) the
        free list could not serve."""
        return self.kernel.grow()

    # -- a lane's life ----------------------------------------------------------------------------
    def attach(self, request: Request) -> None:
        """A request took an idle lane: in single-block mode it takes block 0, and with a prefix
        cache it starts from the longest cached prefix."""
        lane = request.lane
        if self.single_block:
            # Origin PR mode: the lone lane takes block 0 and gives it back on finish.
            self.lanes.push_block(lane, self.pool.allocate(core.LANE, lane))
        elif self.prefix is not None and self.reads_prefix_cache(request):
            self.attach_prefix(request)

    @staticmethod
    def reads_prefix_cache(request: Request) -> bool:
        """A fresh lane may start from cached KV, unless it imports its KV (PD) or asks for
        prompt logprobs before its first token: cached positions have no logits (as in vLLM,
        such a request prefills everything; its blocks are still cached when it ends)."""
        if request.importing:
            return False
        return request.params.prompt_logprobs is None or request.recomputing

    def start_decode(self, request: Request) -> None:
        """The lane decodes from the request's last token: the lane table and the kernel learn
        its length, its output list, its output limit and its stop ids."""
        lane = request.lane
        seq_len = len(request.prompt) + len(request.output) - 1
        self.lanes.start_decode(lane, seq_len, request.output[-1])
        if self.checkpoints is not None:
            self.checkpoints.start_decode(request, seq_len)
        # the kernel applies `check_stop` to these ids and this limit (see atombatch/engine/request.py)
        self.kernel.bind(lane, request.request_id, request.output, request.token_times,
                         request.max_tokens, request.stop_ids,
                         request.lane_flags)

    def fork_blocks(self, source: Request, child: Request) -> list[tuple[int, int]] | None:
        """Fresh LANE blocks for `child` (bound to an idle lane) to take over the blocks holding
        `source`'s prompt positions 0..len(prompt)-1; returns the (src, dst) block copies, or
        None, changing nothing, when the blocks are not there now."""
        lanes = self.lanes
        prompt_len = len(child.prompt)
        copied = lanes.blocks_for(prompt_len)
        row = list(lanes.blocks(source.lane)) if source.lane >= 0 else list(source.blocks)
        need = lanes.blocks_for(prompt_len + 1)  # its first decode writes at prompt_len
        if len(row) < copied or self.available() < need:
            return None
        lane = child.lane
        copies = []
        for src in row[:copied]:
            dst = self.take_block(core.LANE, lane)
            lanes.push_block(lane, dst)
            copies.append((src, dst))
        return copies

    def take_staged_blocks(self, request: Request, lane: int) -> None:
        """The staging request took `lane`: its filled blocks become the lane's row; a fresh
        spare is reserved when its spare was one of them."""
        for j, block in enumerate(request.blocks):
            if j >= request.shared:  # shared prefix blocks stay pinned CACHED
                self.pool.assign(block, lane)
            self.lanes.push_block(lane, block)
        request.blocks = []
        if self.pool.num_spare == 0:
            self.spare = self.take_block(core.SPARE, -1)

    def stage(self, request: Request) -> int:
        """A queued request starts filling the spare (STAGED); returns that block."""
        self.pool.stage(self.spare, -2)
        spare, self.spare = self.spare, -1
        if self.prefix is not None and self.reads_prefix_cache(request):
            self.attach_prefix_staged(request, spare)
        else:
            request.blocks = [spare]
            self.staged_spare = spare
        return spare

    def release_lane(self, request: Request, keep_kv: bool) -> list[int]:
        """Give back a request's lane and blocks; with a prefix cache, keep what its KV computed
        (not after an error: that KV may be garbage). Returns the blocks the lane held."""
        lane = request.lane
        if not keep_kv or request.importing:
            valid = 0
        elif self.lanes.state(lane) == core.LANE_DECODING:
            valid = self.lanes.seq_len(lane)  # positions whose KV is written
        else:
            valid = request.prefill_pos
        held = self.lanes.release(lane)
        self.kernel.unbind(lane)
        if self.prefix is not None:
            self.cache_blocks(request, held, valid)
            if self.checkpoints is not None:
                self.checkpoints.release(request, lane, self.chain(request, valid) if valid
                                         else None, valid)
        else:
            for block in held:
                self.pool.free(block)
        request.shared = 0
        return held

    def release_staged(self, request: Request) -> None:
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

    # -- device inputs ----------------------------------------------------------------------------
    def padding_block(self) -> int:
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
            return self.evict()
        raise StateError("no FREE or SPARE block is left as a padding target")

    def padding_block_ahead(self) -> int:
        """`padding_block` for a step built ahead (`AheadScheduler.plan_ahead`): the spare or a FREE
        block, never one that needs an eviction (its host save is a block op, which waits for
        the device); -1 when there is none."""
        if self.pool.num_spare:
            return self.spare
        return self.pool.first_free()

    def swap_prefill_inputs(self) -> None:
        """Build the next chunk into another prefill buffer (the current one is on the device,
        or planned to run: the pipeline plans a chunk while the one before it runs, and a wave
        of arrivals as a chain of chunks decided at once). The buffers form a ring of
        `PREFILL_BUFFERS`: a chain holds at most `PREFILL_BUFFERS - 1` chunks in the air, and
        the first of them is built into the current buffer only when no chunk is in the air."""
        ring = self._prefill_ring
        if len(ring) < PREFILL_BUFFERS:
            ring.append(core.PrefillInputs(self.artifact.prefill_chunk_size,
                                           self.artifact.blocks_per_seq))
            self._prefill_at = len(ring) - 1
        else:
            self._prefill_at = (self._prefill_at + 1) % len(ring)
        self.prefill_inputs = ring[self._prefill_at]

    def build_decode(self) -> int:
        """The decode inputs of every decoding lane, in place; returns the rows that decode."""
        return self.kernel.build(self.padding_block())

    def build_prefill(self, request: Request, tokens: npt.NDArray[np.int64], start: int) -> int:
        """The prefill inputs of the chunk at `start`, through the request's lane row or its
        STAGED blocks; returns its real tokens."""
        if request.state is S.STAGING:
            row: list[int] | npt.NDArray[np.int32] = request.blocks
            return self.prefill_inputs.build(tokens, start, row, len(row), 0)
        lane = request.lane  # the lane's int32 row as it is (no list of its blocks)
        return self.prefill_inputs.build(tokens, start, self.lanes.rows()[lane],
                                         self.lanes.num_held(lane), lane)

    def row_of(self, request: Request) -> tuple[tuple[int, ...], int]:
        """The blocks (positions 0..) and sliding slot an import writes for the request."""
        if request.state is S.STAGING:
            return tuple(request.blocks), 0
        return tuple(self.lanes.blocks(request.lane)), request.lane

    # -- runtime ops ------------------------------------------------------------------------------
    @property
    def has_ops(self) -> bool:
        return bool(self._saves or self._restores or self._copies or self._unpin or
                    (self.checkpoints is not None and self.checkpoints.has_ops))

    def take_ops(self, plan: StepPlan) -> None:
        """Move the pending runtime ops onto the plan that runs next; the blocks pinned until
        their copy was planned are released."""
        plan.saves, plan.restores, plan.copies = (tuple(self._saves), tuple(self._restores),
                                                  tuple(self._copies))
        self._saves.clear()
        self._restores.clear()
        self._copies.clear()
        if self.checkpoints is not None:
            plan.slot_saves, plan.slot_restores = self.checkpoints.take_ops()
        for block in self._unpin:
            self.pool.release(block)
        self._unpin.clear()

    def drop_pending_ops(self, request_id: str) -> bool:
        """A request is preempted in the step that planned a restore or copy for it: those blocks
        do not hold their KV yet, so their ops are dropped (a restored block already in the
        cache index must still be written, and stays pinned until then). Returns whether any
        op was pending: then its blocks must not be cached."""
        rid = request_id
        slot = self.checkpoints is not None and self.checkpoints.drop_restores(rid)
        pending = any(op[2] == rid for op in self._restores) or \
            any(op[2] == rid for op in self._copies)
        if slot and not pending:
            return True
        if not pending:
            return False
        assert self.prefix is not None
        kept = []
        for op in self._restores:
            if op[2] != rid:
                kept.append(op)
            elif self.prefix.entry(op[0]) is not None:
                kept.append(op)
                self.pool.acquire(op[0])
                self._unpin.append(op[0])
        self._restores = kept
        self._copies = [op for op in self._copies if op[2] != rid]
        return True

    # -- sliding-slot checkpoints (hybrid prefix cache) ------------------------------------------
    def after_prefill_chunk(self, request: Request) -> None:
        """A lane's chunk ended at `request.prefill_pos`: checkpoint its slot if planned there."""
        checkpoints = self.checkpoints
        if checkpoints is not None and request.lane >= 0:
            checkpoints.after_chunk(request, self.chain(request, request.prefill_pos))

    def after_decode(self, by_lane: list[Request | None]) -> None:
        """A decode step ran: lanes that reached a chunk boundary checkpoint their slots."""
        if self.checkpoints is not None:
            self.checkpoints.after_decode(by_lane, self.lanes.seq_len, self.chain)

    # -- prefix cache -----------------------------------------------------------------------------
    def chain(self, request: Request, length: int) -> TokenChain:
        """The request's digest chain over its first `length` tokens (prompt, then output):
        generated tokens are hashed here, when the cache first needs them, never twice."""
        assert self.prefix is not None
        chain = request.chain
        if chain is None:
            chain = request.chain = self.prefix.chain(request.prompt, request.lora_root)
        if chain.length < length:
            prompt_len = len(request.prompt)
            chain.extend(request.output[chain.length - prompt_len:length - prompt_len])
        return chain

    def lookup(self, request: Request, length: int) -> Match:
        """Longest cached prefix of the request's first `length` tokens, on the device and then
        on the host, walking the request's stored digests. A host entry whose digest is (still
        or again) on the device is replaced by the device block: a child can outlive its evicted
        parent there, and a restore must never duplicate a cached digest."""
        assert self.prefix is not None
        chain = self.chain(request, length)
        match = self.prefix.match(chain, length)
        if self.host is not None and self.host.extend(chain, length, match):
            for j, entry in match.host_entries():
                block = self.prefix.block_of(entry.digest)
                if block >= 0:
                    match.on_device(j, block)
        return match

    def attach_prefix(self, request: Request) -> None:
        """Start a fresh lane from the longest cached prefix of what it must prefill."""
        assert self.prefix is not None
        tokens = request.prefill_tokens
        match = self.lookup(request, len(tokens))
        q, bs, lane = self.artifact.prefill_chunk_size, self.artifact.block_size, request.lane
        resume = (min(match.tokens, len(tokens) - 1) // q) * q
        checkpoints = self.checkpoints
        if checkpoints is not None:  # hybrid: back to the boundary whose slot was checkpointed
            hit = checkpoints.trim(self.chain(request, resume), resume) if resume else None
            resume = hit.position if hit is not None else 0
            checkpoints.begin(request, lane, resume, match.tokens, len(tokens), hit)
            if resume and self.slots is not None:
                self.slots.advance(lane, resume)  # the restored slot holds that window
        self._looked_up(request, len(tokens), resume)
        if resume == 0:
            self.counters.prefix_misses += 1
            return
        used = -(-resume // bs)
        blocks = match.blocks[:used]  # int32: pinned and shared without a Python int each
        pinned = blocks[blocks >= 0] if match.has_host else blocks
        self.pool.acquire_blocks(pinned)  # nothing below may evict what this lane will use
        restored = 0
        # all on the device (no host restore): the blocks wholly before the resume position are
        # shared as they are, in one call
        run = resume // bs if len(pinned) == used else 0
        if run:
            self.lanes.push_blocks(lane, pinned[:run])
            request.shared += run
        for j in range(run, used):
            below = (j + 1) * bs <= resume  # wholly before the resume position: read-only
            block = int(blocks[j])
            if block < 0:  # only on the host: restore into a fresh block
                entry = match.entry(j)
                block = self.take_block(core.LANE, lane)
                self._restores.append((block, entry.data, request.request_id))
                restored += 1
                if below:
                    self.share_restored(block, entry)
            elif not below:  # the prefill resumes inside it: this lane needs its own copy
                self.pool.release(block)
                if self.pool.refcount(block) == 0:
                    adopted = self.prefix.discard(block)
                    if adopted is not None and adopted.checkpoints and checkpoints is not None:
                        checkpoints.store.entry_gone(adopted)  # the lane rewrites the block
                    self.pool.adopt(block, lane)
                else:
                    copy = self.take_block(core.LANE, lane)
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
                    blocks=len(self.lanes.blocks(lane)))  # a count: the list cost a render

    def _looked_up(self, request: Request, queried: int, resume: int) -> None:
        """A prefix-cache lookup of `queried` tokens saved `resume` of them: vLLM's queries (and,
        in `prefix_hit_tokens`, its hits); the request's cached tokens from its first lookup."""
        self.counters.prefix_query_tokens += queried
        if request.cached_tokens < 0:
            request.cached_tokens = resume

    def attach_prefix_staged(self, request: Request, spare: int) -> None:
        """Staging from a cached prefix: share the device blocks wholly before the resume
        position, restore host copies into fresh STAGED blocks, and fill the spare (the block the
        prefill resumes in) from the cached block by a device copy or a host restore."""
        assert self.prefix is not None and self.checkpoints is None  # hybrid never stages
        tokens = request.prefill_tokens
        match = self.lookup(request, len(tokens))
        q, bs = self.artifact.prefill_chunk_size, self.artifact.block_size
        resume = (min(match.tokens, len(tokens) - 1) // q) * q
        request.blocks = []
        self.staged_spare = spare
        self._looked_up(request, len(tokens), resume)
        if resume == 0:
            self.counters.prefix_misses += 1
            request.blocks.append(spare)
            return
        below = resume // bs
        used = -(-resume // bs)
        blocks = match.blocks[:used]
        pinned = blocks[blocks >= 0] if match.has_host else blocks
        self.pool.acquire_blocks(pinned)  # pinned first: nothing below may evict them
        restored = 0
        run = below if len(pinned) == used else 0  # all on the device: shared as is
        if run:
            request.blocks.extend(pinned[:run].tolist())
            request.shared += run
        for j in range(run, below):
            block = int(blocks[j])
            if block < 0:  # a host copy: restored, cached and shared like a device entry
                entry = match.entry(j)
                block = self.take_block(core.STAGED, -2)
                self._restores.append((block, entry.data, request.request_id))
                self.share_restored(block, entry)
                restored += 1
            request.blocks.append(block)
            request.shared += 1
        if resume % bs:  # the prefill resumes inside a cached block: fill the spare from it
            source = int(blocks[below])
            if source >= 0:
                self._copies.append((source, spare, request.request_id))
                self._unpin.append(source)
            else:
                self._restores.append((spare, match.entry(below).data, request.request_id))
                restored += 1
        request.blocks.append(spare)
        request.prefill_pos = resume
        self.counters.prefix_hits += 1
        self.counters.prefix_hit_tokens += resume
        self.counters.host_restores += restored
        self._event("prefix.hit", request_id=request.request_id, lane=-1, tokens=resume,
                    shared=request.shared, restored=restored, blocks=len(request.blocks))

    def share_restored(self, block: int, entry: Entry) -> None:
        """A block restored from the host for positions before the resume point joins the device
        cache and is pinned by the request that restored it."""
        assert self.prefix is not None
        self.pool.cache(block)
        inserted = self.prefix.insert_digest(block, entry.digest, entry.parent, entry.tokens,
                                             entry.full)
        assert inserted is not None, "a host entry on the device was not replaced by lookup"
        if entry.checkpoints and self.checkpoints is not None:
            self.checkpoints.store.copy_to(entry, inserted)
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
        chain = self.chain(request, full_blocks * bs)  # the prompt's digests: nothing re-hashed
        published = 0
        for j in range(request.shared, full_blocks):
            block = row[j]
            if not self.prefix.insert_block(block, chain.digest(j), chain.parent(j),
                                            chain.tokens[j * bs:(j + 1) * bs]):
                break  # an identical block is cached already: stop here
            self.pool.cache(block)
            self.pool.acquire(block)
            request.shared += 1
            published += 1
        if published:
            self._event("prefix.published", request_id=request.request_id, blocks=published)
            if self.checkpoints is not None:
                self.checkpoints.publish(request.lane, chain, request.shared)
        return published

    def cache_blocks(self, request: Request, held: list[int], valid: int) -> None:
        """Keep a released lane's KV in the prefix cache (shared blocks are just unpinned).

        The digests are the request's own, computed as its tokens arrived: nothing is hashed
        here but the generated tokens the chain has not seen yet."""
        prefix = self.prefix
        assert prefix is not None
        bs = self.artifact.block_size
        chain = self.chain(request, valid)  # positions 0..valid-1 hold its first valid tokens
        pool = self.pool
        shared = min(request.shared, len(held))
        for block in held[:shared]:
            pool.release(block)
        full = min(valid // bs, len(held))
        # the full blocks in one loop; a block whose digest is cached already is freed
        duplicates = prefix.insert_full_blocks(held, chain, shared, full) if full > shared else []
        if duplicates:
            dropped = set(duplicates)
            for block in held[shared:full]:
                if block in dropped:
                    pool.free(block)
                else:
                    pool.cache(block)
        else:
            for block in held[shared:full]:
                pool.cache(block)
        for j in range(max(full, shared), len(held)):
            block, start = held[j], j * bs
            if start >= valid:
                pool.free(block)
                continue
            end = min(start + bs, valid)  # the partial last block
            digest = chain.partial_digest(end)
            if not prefix.insert_block(block, digest, chain.parent(j), chain.tokens[start:end]):
                pool.free(block)  # an identical block is cached already
            else:
                pool.cache(block)

    # -- invariants -------------------------------------------------------------------------------
    def check(self, by_lane: list[Request | None], staging: Request | None,
              live: bool) -> None:
        """The block-side invariants of docs/rules.md; raises `StateError` if one is broken."""
        pool, lanes = self.pool, self.lanes
        pool.check()
        owned: dict[int, str] = {}
        for lane in range(lanes.batch_size):
            request = by_lane[lane]
            state = lanes.state(lane)
            if (request is None) != (state == core.LANE_IDLE):
                raise StateError(f"lane={lane} state {state} disagrees with its request")
            if request is not None and (state == core.LANE_DECODING) != \
                    (request.state is S.DECODING):
                raise StateError(f"lane={lane} state {state} disagrees with request "
                                 f"{request.request_id} ({request.state.value})")
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
        if staging is not None:
            shared = staging.shared
            for block in staging.blocks[:shared]:
                if pool.state(block) != core.CACHED or pool.refcount(block) < 1:
                    raise StateError(f"staging shares block={block} but it is not pinned CACHED")
            for block in staging.blocks[shared:]:
                if pool.state(block) != core.STAGED or block in owned:
                    raise StateError(f"staged block={block} is not exclusively STAGED")
                owned[block] = "staging"
        if len(owned) != pool.num_lane + pool.num_staged:
            raise StateError(f"{len(owned)} owned blocks, pool counts "
                             f"{pool.num_lane + pool.num_staged} LANE+STAGED")
        if not self.single_block and pool.num_spare + (staging is not None) != 1:
            raise StateError(f"{pool.num_spare} spare blocks with staging={staging is not None}")
        if self.prefix is not None and len(self.prefix) != pool.num_cached:
            raise StateError(f"prefix index holds {len(self.prefix)} blocks, pool "
                             f"{pool.num_cached} CACHED")
        if self.checkpoints is not None:
            self.checkpoints.check(by_lane)
        if not live and (lanes.num_busy or pool.num_lane or pool.num_staged or
                         pool.num_evictable != pool.num_cached):
            raise StateError("no request is live but lanes or blocks are still owned")

"""Sliding-slot checkpoints: prefix and host caching for hybrid (sliding-window + global) models.

Theory of operation
-------------------
A Gemma3 lane keeps its sliding layers' K/V in a lane slot: a shift buffer holding the newest
`window` tokens, oldest first. The global layers' blocks can be shared and restored as for any
model, but a hit must also give the new lane the window every sliding layer held after the hit's
last token, and those K/V exist nowhere but in the slot of the lane that computed them. So at
chosen **boundaries** the slot is copied to host memory (a **checkpoint**, one array
`[num_sliding, 2, kv_heads, window, head_dim]`, `Runtime.read_slot`) under the chain digest of the
prefix that ends there, and a hit writes it into the new lane's slot (`Runtime.write_slot`).

- Boundaries are prefill chunk boundaries (multiples of `prefill_chunk_size`), because a prefill
  resumes only there (docs/scheduling.md). A lane checkpoints at the boundaries where a later
  request will resume: the last ones of its prompt (`floor((L - 1) / q) * q`, where an identical
  prompt resumes, and `floor(L / q) * q`, where a longer one does), the junction where its own
  lookup's global-layer match ended (a shared system prompt), and while decoding every boundary
  it crosses, keeping only the newest (where the next turn of a conversation resumes: turn 2 is
  turn 1's prompt and output plus new text).
- A checkpoint belongs to the cached block that holds its boundary's last token
  (`Entry.checkpoints`), registered when that block is cached (lane release, or publication of a
  prompt's blocks). It leaves with the block: an evicted block takes its checkpoints to the host
  cache, a block dropped from both caches lets them go, and a checkpoint no block and no lane
  holds is freed. Its bytes count in the host cache's budget (`host_cache_bytes`), shared with
  host copies of blocks; under pressure host blocks go first, then the least recently used
  checkpoints no lane holds (the blocks stay; hits are trimmed to the checkpoints left).
- A hit is the longest global-layer match (device, then host) trimmed back to the largest
  checkpointed boundary inside it, found by the digests of the request's chunk boundaries from
  the last one down (the only hashing a hybrid lookup does: at most the tokens up to the match,
  once). The trimmed position is exact, never a re-prefill of the last `window` tokens (a
  sliding layer there would attend to K/V the new slot does not have).
- Save and restore are runtime ops on the step plan (`StepPlan.slot_saves`,
  `StepPlan.slot_restores`), run before its device call: saves first, then restores, so a lane
  released and given to a new request in one step is read before it is written.

Ownership (docs/rules.md): a checkpoint is PENDING (its save op is planned; a restore planned in
the same step reads it after the save), HELD (host data; held by lanes and cached blocks) or
DROPPED. A restored slot is written only by its own lane: slots belong to lanes, a hybrid lane
whose slot holds anything is prefilled to the end before the next decode step (a decode step's
padding rows write idle and unstarted lanes' slots), and a restore still pending when its request
leaves (preemption, abort) is dropped with it, so it never lands in a later tenant's slot.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from atombatch.kernel.prefix import PARTIAL, ROOT_INPUT, Entry, HostCache, PrefixIndex, TokenChain

if TYPE_CHECKING:
    from atombatch.engine.request import Counters, Request

PENDING = "pending"     # the save op is planned, the data is not on the host yet
HELD = "held"           # host data present
DROPPED = "dropped"     # let go (no holder left, memory pressure, or a failed save)


@dataclass(eq=False, slots=True)
class Checkpoint:
    """A lane's sliding slot (every sliding layer) as it was after `position` tokens."""

    digest: bytes                       # chain digest of the prefix of `position` tokens
    position: int                       # tokens before the boundary (a chunk multiple)
    nbytes: int                         # host bytes it takes (counted in the host budget)
    data: Any = None                    # `Runtime.read_slot`'s array once saved
    state: str = PENDING
    lanes: int = 0                      # lanes holding it (a lane's planned or restored slot)
    entries: int = 0                    # cached blocks (device or host) holding it


@dataclass(slots=True)
class LaneCheckpoints:
    """What one lane's request holds and plans."""

    request_id: str
    held: list[Checkpoint] = field(default_factory=list)
    planned: tuple[int, ...] = ()       # prefill boundaries to save at
    decode: Checkpoint | None = None    # the newest boundary crossed while decoding
    due: int = -1                       # the decode step at which its next boundary is reached


class CheckpointStore:
    """Checkpoints by boundary digest in host memory, inside the host cache's byte budget."""

    def __init__(self, host: HostCache, nbytes: int) -> None:
        self.host = host
        self.nbytes = nbytes
        self._by_digest: dict[bytes, Checkpoint] = {}
        self._idle: OrderedDict[int, Checkpoint] = OrderedDict()  # no lane holds them: LRU
        self.saved = 0          # checkpoints whose save op was planned
        self.reused = 0         # boundaries a lane found checkpointed already (no device read)
        self.restored = 0       # restores planned
        self.dropped = 0        # let go under memory pressure or after a failed save
        self.skipped = 0        # boundaries not checkpointed: the budget was held by lanes
        host.on_drop = self.entry_gone
        host.reclaim = self._reclaim

    def __len__(self) -> int:
        return len(self._by_digest)

    @property
    def used_bytes(self) -> int:
        return len(self._by_digest) * self.nbytes

    def find(self, digest: bytes) -> Checkpoint | None:
        return self._by_digest.get(digest)

    def create(self, digest: bytes, position: int) -> Checkpoint | None:
        """A new PENDING checkpoint, making room in the budget; None if the budget is held by
        lanes' checkpoints."""
        host = self.host
        while host.used_bytes + self.nbytes > host.capacity_bytes:
            if not host.drop_lru() and not self._drop_idle():
                self.skipped += 1
                return None
        checkpoint = Checkpoint(digest, position, self.nbytes)
        self._by_digest[digest] = checkpoint
        host.used_bytes += self.nbytes
        self.saved += 1
        return checkpoint

    # -- holders ----------------------------------------------------------------------------------
    def hold_lane(self, checkpoint: Checkpoint) -> None:
        checkpoint.lanes += 1
        self._idle.pop(id(checkpoint), None)

    def release_lane(self, checkpoint: Checkpoint) -> None:
        checkpoint.lanes -= 1
        self._settle(checkpoint)

    def attach(self, checkpoint: Checkpoint, entry: Entry) -> None:
        """`entry` (a cached block) holds `checkpoint` from now on."""
        if checkpoint.state == DROPPED:
            return
        held = entry.checkpoints
        if held is None:
            entry.checkpoints = [checkpoint]
        elif any(c is checkpoint for c in held):
            return
        else:
            held.append(checkpoint)
        checkpoint.entries += 1
        self._settle(checkpoint)

    def entry_gone(self, entry: Entry) -> None:
        """A block left both caches (or its host copy was not kept): its checkpoints go with it."""
        held, entry.checkpoints = entry.checkpoints, None
        for checkpoint in held or ():
            if checkpoint.state != DROPPED:
                checkpoint.entries -= 1
                self._settle(checkpoint)

    def copy_to(self, source: Entry, entry: Entry) -> None:
        """A host copy was restored to the device as `entry`: it holds the same checkpoints."""
        for checkpoint in source.checkpoints or ():
            self.attach(checkpoint, entry)

    def touch(self, checkpoint: Checkpoint) -> None:
        key = id(checkpoint)
        if key in self._idle:
            self._idle.move_to_end(key)

    def _settle(self, checkpoint: Checkpoint) -> None:
        if checkpoint.state == DROPPED:
            return
        if checkpoint.lanes == 0 and checkpoint.entries == 0:
            self.drop(checkpoint)
        elif checkpoint.lanes == 0:
            self._idle[id(checkpoint)] = checkpoint
            self._idle.move_to_end(id(checkpoint))

    def drop(self, checkpoint: Checkpoint) -> None:
        """Let a checkpoint go: its memory is free, entries that list it skip it."""
        if checkpoint.state == DROPPED:
            return
        checkpoint.state = DROPPED
        checkpoint.data = None
        self._idle.pop(id(checkpoint), None)
        if self._by_digest.get(checkpoint.digest) is checkpoint:
            del self._by_digest[checkpoint.digest]
        self.host.used_bytes -= checkpoint.nbytes

    def _drop_idle(self) -> bool:
        if not self._idle:
            return False
        _, checkpoint = self._idle.popitem(last=False)
        self.drop(checkpoint)
        self.dropped += 1
        return True

    def _reclaim(self, size: int) -> bool:
        """The host cache needs `size` bytes and has no block left to drop."""
        return self._drop_idle()


def block_boundaries(chain: TokenChain, block: int, limit: int, chunk: int
                     ) -> list[tuple[int, bytes]]:
    """(position, digest) of the chunk boundaries in (block start, min(block end, limit)], in
    order: one running hash over the block's tokens, a copy finished at each boundary."""
    hasher = chain._hasher
    block_size = hasher.block_size
    start = block * block_size
    stop = min(start + block_size, limit)
    first = (start // chunk + 1) * chunk
    if first > stop:
        return []
    state = xxhash.xxh3_128(chain.parent(block) or ROOT_INPUT, seed=hasher.seed)
    tokens = chain.tokens
    out = []
    fed = start
    for position in range(first, stop + 1, chunk):
        if position == start + block_size:
            out.append((position, chain.digest(block)))
            continue
        state.update(tokens[fed:position].data)
        hasher.tokens_hashed += position - fed
        fed = position
        done = state.copy()
        done.update(PARTIAL)
        hasher.digests_made += 1
        out.append((position, done.digest()))
    return out


def boundary_digest(chain: TokenChain, position: int) -> bytes:
    """The chain digest of the first `position` tokens of `chain`: a full block's stored digest
    at a block boundary, else the partial digest of the block the boundary falls in."""
    block_size = chain._hasher.block_size
    if position % block_size == 0:
        return chain.digest(position // block_size - 1)
    return chain.partial_digest(position)


class SlotCheckpoints:
    """The KV manager's side of checkpoints: hits, planned saves, registration, ops."""

    def __init__(self, chunk: int, block_size: int, store: CheckpointStore,
                 prefix: PrefixIndex, counters: Counters) -> None:
        self.chunk = chunk
        self.block_size = block_size
        self.store = store
        self.prefix = prefix
        self.counters = counters
        self.lanes: dict[int, LaneCheckpoints] = {}
        self.saves: list[tuple[int, Checkpoint]] = []           # (lane, checkpoint)
        self.restores: list[tuple[int, Checkpoint, str]] = []   # (lane, checkpoint, request id)
        self._due: dict[int, list[tuple[int, str]]] = {}        # decode step -> (lane, request)
        self.dropped_restores = 0   # restores dropped before they ran (their request left)

    # -- a hit ------------------------------------------------------------------------------------
    def trim(self, chain: TokenChain, resume: int) -> Checkpoint | None:
        """The checkpoint at the largest chunk boundary <= `resume` of the request's chain (whose
        first `resume` tokens the matched blocks hold); None: no checkpoint. Found by digest, so
        a checkpoint saved by any sequence with this prefix counts, whichever cached sibling the
        match took; boundaries are tried from the last, one block's tokens hashed at a time."""
        q, block_size, store = self.chunk, self.block_size, self.store
        for j in range((resume - 1) // block_size, -1, -1):
            for _, digest in reversed(block_boundaries(chain, j, resume, q)):
                checkpoint = store.find(digest)
                if checkpoint is not None:
                    return checkpoint
        return None

    def begin(self, request: Request, lane: int, resume: int, matched: int, length: int,
              hit: Checkpoint | None) -> None:
        """A lane starts prefilling `length` tokens at `resume` (from `hit`, or 0); `matched`
        tokens agree with cached blocks. Plans its restore and the boundaries it saves."""
        record = LaneCheckpoints(request.request_id)
        self.lanes[lane] = record
        if hit is not None:
            self.store.hold_lane(hit)
            self.store.touch(hit)
            record.held.append(hit)
            self.restores.append((lane, hit, request.request_id))
            self.store.restored += 1
            self.counters.slot_restores += 1
        q = self.chunk
        wanted = {(length - 1) // q * q, length // q * q, min(matched, length) // q * q}
        record.planned = tuple(sorted(p for p in wanted if p > resume))

    # -- saves ------------------------------------------------------------------------------------
    def _checkpoint(self, record: LaneCheckpoints, lane: int, chain: TokenChain,
                    position: int) -> Checkpoint | None:
        """The lane's slot now holds the window after `position` tokens: hold the checkpoint of
        that boundary, planning a save when nobody has it."""
        if any(c.position == position for c in record.held):
            return None
        store = self.store
        digest = boundary_digest(chain, position)
        checkpoint = store.find(digest)
        if checkpoint is not None:
            store.reused += 1
        else:
            checkpoint = store.create(digest, position)
            if checkpoint is None:
                return None
            self.saves.append((lane, checkpoint))
            self.counters.slot_saves += 1
        store.hold_lane(checkpoint)
        record.held.append(checkpoint)
        return checkpoint

    def after_chunk(self, request: Request, chain: TokenChain) -> None:
        """A prefill chunk ended at `request.prefill_pos`."""
        record = self.lanes.get(request.lane)
        if record is not None and request.prefill_pos in record.planned:
            self._checkpoint(record, request.lane, chain, request.prefill_pos)

    def start_decode(self, request: Request, seq_len: int) -> None:
        """The lane decodes from position `seq_len`: its next boundary is due in as many steps."""
        record = self.lanes.get(request.lane)
        if record is None:
            return
        q = self.chunk
        record.due = self.counters.decode_steps + (seq_len // q + 1) * q - seq_len
        self._due.setdefault(record.due, []).append((request.lane, request.request_id))

    def after_decode(self, by_lane: list[Request | None], seq_len: Any,
                     chain_of: Any) -> None:
        """A decode step ran: lanes at a boundary now checkpoint it (replacing their previous
        decode checkpoint) and are due again one chunk later. O(1) when no lane is due."""
        step = self.counters.decode_steps
        due = self._due.pop(step, None)
        if due is None:
            return
        q = self.chunk
        for lane, request_id in due:
            request = by_lane[lane]
            record = self.lanes.get(lane)
            if request is None or record is None or record.request_id != request_id or \
                    record.due != step or request.state.value != "decoding":
                continue  # released, or re-admitted since (its new entry is the one due)
            position = seq_len(lane)
            if position <= 0 or position % q:
                continue
            checkpoint = self._checkpoint(record, lane, chain_of(request, position), position)
            if checkpoint is not None:
                previous, record.decode = record.decode, checkpoint
                if previous is not None:
                    record.held.remove(previous)
                    self.store.release_lane(previous)
            if position + q <= request_limit(request):
                record.due = step + q
                self._due.setdefault(record.due, []).append((lane, request_id))

    # -- registration -----------------------------------------------------------------------------
    def publish(self, lane: int, chain: TokenChain, full_blocks: int) -> None:
        """The lane's first `full_blocks` blocks are in the prefix index: they hold the lane's
        checkpoints that fall in them."""
        record = self.lanes.get(lane)
        if record is None:
            return
        for checkpoint in record.held:
            j = (checkpoint.position - 1) // self.block_size
            if j < full_blocks:
                entry = self.prefix.find(chain.digest(j))
                if entry is not None:
                    self.store.attach(checkpoint, entry)

    def release(self, request: Request, lane: int, chain: TokenChain | None, valid: int) -> None:
        """The lane is released with its first `valid` positions cached (0: nothing kept).
        Checkpoints at boundaries <= valid join the blocks holding them; the boundary at `valid`
        itself is checkpointed when it is a chunk multiple. A restore still pending for it is
        dropped (its slot never held that window)."""
        record = self.lanes.pop(lane, None)
        if record is None:
            return
        rid = request.request_id
        if any(op[2] == rid for op in self.restores):
            self.restores = [op for op in self.restores if op[2] != rid]
            self.dropped_restores += 1
            valid = 0
        store = self.store
        if valid and chain is not None:
            if valid % self.chunk == 0:
                self._checkpoint(record, lane, chain, valid)
            block_size = self.block_size
            partial = valid % block_size
            last = chain.partial_digest(valid) if partial else b""
            for checkpoint in record.held:
                if checkpoint.position > valid:
                    continue
                j = (checkpoint.position - 1) // block_size
                digest = chain.digest(j) if (j + 1) * block_size <= valid else last
                entry = self.prefix.find(digest)
                if entry is not None:
                    store.attach(checkpoint, entry)
        for checkpoint in record.held:
            store.release_lane(checkpoint)
        record.held.clear()

    def check(self, by_lane: list[Request | None]) -> None:
        """Checkpoint invariants (docs/rules.md); raises `StateError`."""
        from atombatch.errors import StateError

        for lane, record in self.lanes.items():
            request = by_lane[lane]
            if request is None or request.request_id != record.request_id:
                raise StateError(f"lane={lane} holds checkpoints of {record.request_id}, "
                                 "which does not run there")
            for checkpoint in record.held:
                if checkpoint.lanes < 1:
                    raise StateError(f"lane={lane} holds a checkpoint at "
                                     f"{checkpoint.position} that counts no lane holder")
        for lane, _, request_id in self.restores:
            request = by_lane[lane]
            if request is None or request.request_id != request_id:
                raise StateError(f"a slot restore for {request_id} targets lane={lane}, "
                                 "which it does not hold")
        host = self.store.host
        if host.used_bytes > host.capacity_bytes:
            raise StateError(f"host cache holds {host.used_bytes} bytes, over its "
                             f"{host.capacity_bytes}")

    # -- ops ----------------------------------------------------------------------------------------
    @property
    def has_ops(self) -> bool:
        return bool(self.saves or self.restores)

    def take_ops(self) -> tuple[tuple[tuple[int, Checkpoint], ...],
                                tuple[tuple[int, Checkpoint, str], ...]]:
        saves, restores = tuple(self.saves), tuple(self.restores)
        self.saves.clear()
        self.restores.clear()
        return saves, restores

    def drop_restores(self, request_id: str) -> bool:
        """A preempted request's restore that has not run; returns whether there was one."""
        kept = [op for op in self.restores if op[2] != request_id]
        dropped = len(kept) != len(self.restores)
        self.restores = kept
        self.dropped_restores += dropped
        return dropped


def request_limit(request: Request) -> int:
    """The last position a request's KV can reach (prompt + output limit - 1)."""
    return len(request.prompt) + request.max_tokens - 1


# -- the engine's side ---------------------------------------------------------------------------
def slot_ops_supported(runtime: Any, caps: Any) -> None:
    """A hybrid prefix cache needs the runtime's `read_slot` / `write_slot` (and, on the device,
    the SDK's KV fetch and update), as `caps` (`runtime.base.Capabilities`) reports them.
    Raises `ConfigError` naming what is missing."""
    from atombatch.errors import ConfigError

    missing = [name for name in ("read_slot", "write_slot") if not getattr(caps, name)]
    missing += [name for name in ("_fetch_kv_cache", "_update_kv_cache")
                if not caps.has_kv(name)]
    if missing:
        raise ConfigError(f"{type(runtime).__name__} lacks {', '.join(missing)}: the prefix "
                          "cache of a hybrid model saves and restores sliding slots through "
                          "them (docs/prefix-cache.md)")


def run_slot_ops(runtime: Any, plan: Any, checkpoints: SlotCheckpoints | None,
                 failed: dict[str, str]) -> None:
    """Run a plan's slot saves, then its slot restores, before its device call. A failed save
    drops that checkpoint (a restore of it then fails its request); a failed restore fails the
    request it was for (`failed`: request id -> message)."""
    from atombatch.logs import log

    for lane, checkpoint in plan.slot_saves:
        if checkpoint.state != PENDING:
            continue  # let go before its save ran
        try:
            checkpoint.data = runtime.read_slot(lane)
            checkpoint.state = HELD
        except Exception as exc:
            log.warning("checkpoint.save_failed", lane=lane, position=checkpoint.position,
                        error=str(exc))
            if checkpoints is not None:
                checkpoints.store.drop(checkpoint)
                checkpoints.store.dropped += 1
    for lane, checkpoint, request_id in plan.slot_restores:
        try:
            if checkpoint.data is None:
                raise RuntimeError(f"the checkpoint at position {checkpoint.position} was not "
                                   "saved")
            runtime.write_slot(lane, checkpoint.data)
        except Exception as exc:
            failed.setdefault(request_id, f"restoring the sliding slot of lane {lane} from its "
                                          f"checkpoint failed: {exc}")

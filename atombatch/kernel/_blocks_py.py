"""Pure-Python twin of `kernel/_blocks.pyx`: the behavioural reference of the block/lane core.

Theory of operation
-------------------
The device holds `num_blocks` KV blocks for the life of the process. `BlockPool` tracks the state of
every block (docs/rules.md):

    FREE      nobody owns it; it sits in the free list
    SPARE     reserved padding target / staging area; owned by the pool
    STAGED(r) being filled by queued request r (prefill or PD import) before it has a lane
    LANE(l)   owned by lane l
    CACHED    prefix cache; refcount >= 0; only refcount-0 blocks sit in the LRU (evictable) list

Both the free list and the LRU list are intrusive doubly linked lists threaded through one pair of
int32 `prev`/`next` arrays with sentinel nodes (a block is in at most one list), so every transition
is O(1) whatever the pool size and allocates nothing. Every method checks its preconditions before
changing anything, so a failed call leaves the pool exactly as it was.

`LaneTable` holds the B stable lanes: state (IDLE / PREFILLING / DECODING), sequence length, the
token to feed next, and the block row. `SlidingSlots` counts each lane's sliding-window fill.
`DecodeInputs` and `PrefillInputs` own the device input arrays (allocated once) and rewrite them in
place each step, applying the padding rules of docs/rules.md.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from atombatch.errors import CapacityError, RequestError, StateError
from atombatch.kernel.codes import (  # noqa: F401  (re-exported: the twin has the compiled core's names)
    CACHED,
    FREE,
    LANE,
    LANE_DECODING,
    LANE_IDLE,
    LANE_OWN_OUTPUT,
    LANE_PREFILLING,
    LANE_SAMPLE,
    LANE_STATE_NAMES,
    LANE_STOPCHECK,
    MAX_STOP_IDS,
    MAX_TABLE_BLOCK,
    ROW_CHECK,
    ROW_LENGTH,
    ROW_NONFINITE,
    ROW_OK,
    ROW_SAMPLE,
    ROW_SKIPPED,
    ROW_STATUS_NAMES,
    ROW_STOP,
    SPARE,
    STAGED,
    STATE_NAMES,
    check_buckets,
)

IMPLEMENTATION = "py"


class BlockPool:
    """Owner of every KV block's state; O(1) transitions over intrusive lists."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise CapacityError(f"num_blocks={num_blocks} must be positive")
        n = num_blocks
        self._n = n
        self._free_head, self._free_tail = n, n + 1
        self._lru_head, self._lru_tail = n + 2, n + 3
        self._prev = np.full(n + 4, -1, dtype=np.int32)
        self._next = np.full(n + 4, -1, dtype=np.int32)
        self._state = np.zeros(n, dtype=np.int8)
        self._owner = np.full(n, -1, dtype=np.int32)
        self._refcnt = np.zeros(n, dtype=np.int32)
        self._counts = [0, 0, 0, 0, 0]
        self._num_evictable = 0
        for head, tail in ((self._free_head, self._free_tail), (self._lru_head, self._lru_tail)):
            self._next[head] = tail
            self._prev[tail] = head
        for block in range(n):
            self._push_back(self._free_tail, block)
        self._counts[FREE] = n

    # -- list primitives ------------------------------------------------------------------------
    def _push_back(self, tail: int, node: int) -> None:
        last = int(self._prev[tail])
        self._next[last] = node
        self._prev[node] = last
        self._next[node] = tail
        self._prev[tail] = node

    def _unlink(self, node: int) -> None:
        before, after = int(self._prev[node]), int(self._next[node])
        self._next[before] = after
        self._prev[after] = before
        self._prev[node] = -1
        self._next[node] = -1

    def _check_block(self, block: int) -> None:
        if not 0 <= block < self._n:
            raise StateError(f"block={block} is outside the pool 0..{self._n - 1}")

    def _expect(self, block: int, state: int, action: str) -> None:
        self._check_block(block)
        if self._state[block] != state:
            raise StateError(f"cannot {action} block={block}: it is "
                             f"{STATE_NAMES[self._state[block]]}, not {STATE_NAMES[state]}")

    @staticmethod
    def _check_owner(owner: int) -> None:
        # the compiled core stores owners as int32 and refuses others before any change
        if not -(2**31) <= owner < 2**31:
            raise OverflowError(f"owner={owner} does not fit an int32")

    def _move(self, block: int, state: int, owner: int) -> None:
        self._counts[self._state[block]] -= 1
        self._counts[state] += 1
        self._state[block] = state
        self._owner[block] = owner

    # -- queries --------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._n

    @property
    def num_free(self) -> int:
        return self._counts[FREE]

    @property
    def num_spare(self) -> int:
        return self._counts[SPARE]

    @property
    def num_staged(self) -> int:
        return self._counts[STAGED]

    @property
    def num_lane(self) -> int:
        return self._counts[LANE]

    @property
    def num_cached(self) -> int:
        return self._counts[CACHED]

    @property
    def num_evictable(self) -> int:
        """CACHED blocks with refcount 0 (the LRU list)."""
        return self._num_evictable

    def state(self, block: int) -> int:
        self._check_block(block)
        return int(self._state[block])

    def owner(self, block: int) -> int:
        """Lane of a LANE block, request key of a STAGED block, -1 otherwise."""
        self._check_block(block)
        return int(self._owner[block])

    def refcount(self, block: int) -> int:
        self._check_block(block)
        return int(self._refcnt[block])

    def first_free(self) -> int:
        """The block `allocate` would hand out next, or -1 when the free list is empty."""
        head = int(self._next[self._free_head])
        return -1 if head == self._free_tail else head

    def free_blocks(self) -> list[int]:
        return self._walk(self._free_head, self._free_tail)

    def lru_blocks(self) -> list[int]:
        """Evictable CACHED blocks, least recently used first."""
        return self._walk(self._lru_head, self._lru_tail)

    def _walk(self, head: int, tail: int) -> list[int]:
        out = []
        node = int(self._next[head])
        while node != tail:
            out.append(node)
            node = int(self._next[node])
        return out

    def counts(self) -> tuple[int, int, int, int, int]:
        """(free, spare, staged, lane, cached)."""
        c = self._counts
        return (c[FREE], c[SPARE], c[STAGED], c[LANE], c[CACHED])

    # -- transitions ----------------------------------------------------------------------------
    def allocate(self, state: int, owner: int = -1) -> int:
        """FREE -> `state` (SPARE, STAGED or LANE) for `owner`; the oldest free block first."""
        if state not in (SPARE, STAGED, LANE):
            raise StateError(f"cannot allocate into state={state}: only SPARE, STAGED or LANE")
        self._check_owner(owner)
        block = self.first_free()
        if block < 0:
            raise CapacityError(f"Cannot get 1 free block from the pool: all {self._n} blocks "
                                f"are in use (cached evictable: {self._num_evictable})")
        self._unlink(block)
        self._move(block, state, owner if state != SPARE else -1)
        return block

    def free(self, block: int) -> None:
        """SPARE, STAGED or LANE -> FREE (appended to the free list)."""
        self._check_block(block)
        state = self._state[block]
        if state not in (SPARE, STAGED, LANE):
            raise StateError(f"cannot free block={block}: it is {STATE_NAMES[state]}")
        self._move(block, FREE, -1)
        self._push_back(self._free_tail, block)

    def reserve_spare(self) -> int:
        """Take a FREE block as the spare (padding target and staging area)."""
        return self.allocate(SPARE, -1)

    def stage(self, block: int, owner: int) -> None:
        """SPARE -> STAGED(owner): a queued request starts filling the spare."""
        self._expect(block, SPARE, "stage")
        self._check_owner(owner)
        self._move(block, STAGED, owner)

    def unstage(self, block: int) -> None:
        """STAGED -> SPARE: the staging request went away; the block is a padding target again."""
        self._expect(block, STAGED, "unstage")
        self._move(block, SPARE, -1)

    def assign(self, block: int, lane: int) -> None:
        """STAGED(r) -> LANE(lane): a staged request takes its lane, keeping its filled block."""
        self._expect(block, STAGED, "assign")
        self._check_owner(lane)
        self._move(block, LANE, lane)

    def to_spare(self, block: int) -> None:
        """LANE -> SPARE: a finished lane's block becomes the new spare (no KV copy)."""
        self._expect(block, LANE, "make spare")
        self._move(block, SPARE, -1)

    def rotate(self, staged_block: int, lane_block: int, lane: int) -> None:
        """Block rotation: STAGED -> LANE(lane) and that lane's old block LANE -> SPARE, at once."""
        self._expect(staged_block, STAGED, "rotate in")
        self._expect(lane_block, LANE, "rotate out")
        if self._owner[lane_block] != lane:
            raise StateError(f"cannot rotate block={lane_block} out of lane={lane}: it belongs to "
                             f"lane={self._owner[lane_block]}")
        self._move(staged_block, LANE, lane)
        self._move(lane_block, SPARE, -1)

    def cache(self, block: int) -> None:
        """LANE or STAGED -> CACHED with refcount 0, most recently used."""
        self._check_block(block)
        if self._state[block] not in (LANE, STAGED):
            raise StateError(f"cannot cache block={block}: it is {STATE_NAMES[self._state[block]]}")
        self._move(block, CACHED, -1)
        self._refcnt[block] = 0
        self._push_back(self._lru_tail, block)
        self._num_evictable += 1

    def acquire(self, block: int) -> None:
        """Pin a CACHED block (refcount + 1); a pinned block is not evictable."""
        self._expect(block, CACHED, "acquire")
        if self._refcnt[block] == 0:
            self._unlink(block)
            self._num_evictable -= 1
        self._refcnt[block] += 1

    def acquire_blocks(self, blocks: Sequence[int] | npt.NDArray[np.int32]) -> None:
        """`acquire` each block in order (a prefix hit pins its shared chain); every block is
        checked before any is pinned."""
        for block in blocks:
            self._expect(block, CACHED, "acquire")
        for block in blocks:
            if self._refcnt[block] == 0:
                self._unlink(block)
                self._num_evictable -= 1
            self._refcnt[block] += 1

    def release(self, block: int) -> None:
        """Unpin a CACHED block; at refcount 0 it becomes the most recently used evictable block."""
        self._expect(block, CACHED, "release")
        if self._refcnt[block] == 0:
            raise StateError(f"cannot release block={block}: its refcount is already 0")
        self._refcnt[block] -= 1
        if self._refcnt[block] == 0:
            self._push_back(self._lru_tail, block)
            self._num_evictable += 1

    def touch(self, block: int) -> None:
        """Mark an unpinned CACHED block most recently used."""
        self._expect(block, CACHED, "touch")
        if self._refcnt[block] == 0:
            self._unlink(block)
            self._push_back(self._lru_tail, block)

    def evict(self) -> int:
        """The least recently used unpinned CACHED block -> FREE; returns it."""
        block = int(self._next[self._lru_head])
        if block == self._lru_tail:
            raise CapacityError(f"Cannot evict: none of the {self._counts[CACHED]} cached blocks "
                                "is unpinned")
        self._unlink(block)
        self._num_evictable -= 1
        self._move(block, FREE, -1)
        self._push_back(self._free_tail, block)
        return block

    def evict_many(self, count: int) -> list[int]:
        """`evict` `count` times (the LRU blocks, in order, to the free list's tail); refused,
        changing nothing, when fewer are unpinned."""
        if not 0 <= count <= self._num_evictable:
            raise CapacityError(f"Cannot evict {count} blocks: {self._num_evictable} of the "
                                f"{self._counts[CACHED]} cached blocks are unpinned")
        return [self.evict() for _ in range(count)]

    def drop(self, block: int) -> None:
        """Remove one specific unpinned CACHED block -> FREE (invalidation)."""
        self._expect(block, CACHED, "drop")
        if self._refcnt[block]:
            raise StateError(f"cannot drop block={block}: refcount {self._refcnt[block]}")
        self._unlink(block)
        self._num_evictable -= 1
        self._move(block, FREE, -1)
        self._push_back(self._free_tail, block)

    def adopt(self, block: int, lane: int) -> None:
        """An unpinned CACHED block -> LANE(lane): a prefix hit takes the cached KV in place."""
        self._expect(block, CACHED, "adopt")
        self._check_owner(lane)
        if self._refcnt[block]:
            raise StateError(f"cannot adopt block={block}: refcount {self._refcnt[block]} "
                             "(shared blocks are copied, not adopted)")
        self._unlink(block)
        self._num_evictable -= 1
        self._move(block, LANE, lane)

    # -- invariants -----------------------------------------------------------------------------
    def check(self) -> None:
        """Raise `StateError` if the lists and counters disagree with the per-block states."""
        free = self.free_blocks()
        lru = self.lru_blocks()
        states = [int(s) for s in self._state]
        want = [states.count(s) for s in range(5)]
        if want != self._counts:
            raise StateError(f"counters {self._counts} disagree with block states {want}")
        if sum(self._counts) != self._n:
            raise StateError(f"conservation: {self._counts} does not sum to {self._n}")
        if sorted(free) != [b for b in range(self._n) if states[b] == FREE]:
            raise StateError("the free list does not hold exactly the FREE blocks")
        if sorted(lru) != [b for b in range(self._n) if states[b] == CACHED and
                           self._refcnt[b] == 0]:
            raise StateError("the LRU list does not hold exactly the unpinned CACHED blocks")
        if len(lru) != self._num_evictable:
            raise StateError(f"num_evictable={self._num_evictable}, LRU list has {len(lru)}")


class LaneTable:
    """B stable lanes: state, sequence length, next token and block row per lane."""

    def __init__(self, batch_size: int, blocks_per_seq: int, block_size: int) -> None:
        if batch_size <= 0 or blocks_per_seq <= 0 or block_size <= 0:
            raise CapacityError(f"batch_size={batch_size}, blocks_per_seq={blocks_per_seq}, "
                                f"block_size={block_size} must all be positive")
        self._b = batch_size
        self._bps = blocks_per_seq
        self._block_size = block_size
        self._state = np.zeros(batch_size, dtype=np.int8)
        self._seq_len = np.zeros(batch_size, dtype=np.int32)
        self._next_token = np.zeros(batch_size, dtype=np.int64)
        self._num_held = np.zeros(batch_size, dtype=np.int32)
        self._rows = np.full((batch_size, blocks_per_seq), -1, dtype=np.int32)
        self._num_busy = 0
        self._num_decoding = 0

    def _check_lane(self, lane: int) -> None:
        if not 0 <= lane < self._b:
            raise StateError(f"lane={lane} is outside 0..{self._b - 1}")

    def _check_busy(self, lane: int) -> None:
        self._check_lane(lane)
        if self._state[lane] == LANE_IDLE:
            raise StateError(f"lane={lane} is idle")

    @staticmethod
    def _check_table_block(block: int) -> None:
        # A -1 or wrapped int16 entry makes the device read or write out of range (docs/scheduling.md).
        if not 0 <= block <= MAX_TABLE_BLOCK:
            raise StateError(f"block={block} is outside the int16 block-table range "
                             f"0..{MAX_TABLE_BLOCK}")

    @property
    def batch_size(self) -> int:
        return self._b

    @property
    def blocks_per_seq(self) -> int:
        return self._bps

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_busy(self) -> int:
        return self._num_busy

    @property
    def num_idle(self) -> int:
        return self._b - self._num_busy

    def num_decoding(self) -> int:
        return self._num_decoding

    def state(self, lane: int) -> int:
        self._check_lane(lane)
        return int(self._state[lane])

    def seq_len(self, lane: int) -> int:
        self._check_lane(lane)
        return int(self._seq_len[lane])

    def next_token(self, lane: int) -> int:
        self._check_lane(lane)
        return int(self._next_token[lane])

    def num_held(self, lane: int) -> int:
        self._check_lane(lane)
        return int(self._num_held[lane])

    def blocks(self, lane: int) -> list[int]:
        self._check_lane(lane)
        return [int(b) for b in self._rows[lane, : self._num_held[lane]]]

    def last_block(self, lane: int) -> int:
        self._check_busy(lane)
        n = self._num_held[lane]
        return int(self._rows[lane, n - 1]) if n else -1

    def blocks_for(self, num_positions: int) -> int:
        """Blocks needed to hold positions 0..num_positions-1."""
        return -(-num_positions // self._block_size)

    def assign(self) -> int:
        """Take the lowest idle lane (state PREFILLING, length 0, no blocks)."""
        for lane in range(self._b):
            if self._state[lane] == LANE_IDLE:
                self._state[lane] = LANE_PREFILLING
                self._seq_len[lane] = 0
                self._next_token[lane] = 0
                self._num_held[lane] = 0
                self._num_busy += 1
                return lane
        raise CapacityError(f"Cannot assign a lane: all {self._b} lanes are busy")

    def release(self, lane: int) -> list[int]:
        """Return the lane to the idle set at once; gives back the blocks it held, in order."""
        self._check_busy(lane)
        held = self.blocks(lane)
        if self._state[lane] == LANE_DECODING:
            self._num_decoding -= 1
        self._state[lane] = LANE_IDLE
        self._seq_len[lane] = 0
        self._next_token[lane] = 0
        self._num_held[lane] = 0
        self._rows[lane, :] = -1
        self._num_busy -= 1
        return held

    def push_block(self, lane: int, block: int) -> None:
        """Append a block to the lane's row (the next `block_size` positions)."""
        self._check_busy(lane)
        self._check_table_block(block)
        n = int(self._num_held[lane])
        if n >= self._bps:
            raise CapacityError(f"lane={lane} already holds {n} blocks, the row's "
                                f"{self._bps} entries")
        self._rows[lane, n] = block
        self._num_held[lane] = n + 1

    def push_blocks(self, lane: int, blocks: Sequence[int] | npt.NDArray[np.int32]) -> None:
        """`push_block` each block in order; all are checked before the row changes."""
        self._check_busy(lane)
        for block in blocks:
            self._check_table_block(block)
        n = int(self._num_held[lane])
        if n + len(blocks) > self._bps:
            raise CapacityError(f"lane={lane} holds {n} blocks: {len(blocks)} more exceed the "
                                f"row's {self._bps} entries")
        self._rows[lane, n:n + len(blocks)] = blocks
        self._num_held[lane] = n + len(blocks)

    def pop_block(self, lane: int) -> int:
        """Remove and return the lane's last block."""
        self._check_busy(lane)
        n = int(self._num_held[lane])
        if n == 0:
            raise StateError(f"lane={lane} holds no block")
        block = int(self._rows[lane, n - 1])
        self._rows[lane, n - 1] = -1
        self._num_held[lane] = n - 1
        return block

    def replace_block(self, lane: int, index: int, block: int) -> int:
        """Swap the block at row entry `index` (rotation, copy-on-write); returns the old block."""
        self._check_busy(lane)
        if not 0 <= index < self._num_held[lane]:
            raise StateError(f"lane={lane} has no block at entry {index}")
        self._check_table_block(block)
        old = int(self._rows[lane, index])
        self._rows[lane, index] = block
        return old

    def set_seq_len(self, lane: int, seq_len: int) -> None:
        self._check_busy(lane)
        if not 0 <= seq_len <= self._bps * self._block_size:
            raise RequestError(f"seq_len={seq_len} is outside 0..{self._bps * self._block_size}")
        self._seq_len[lane] = seq_len

    def start_decode(self, lane: int, seq_len: int, token: int) -> None:
        """PREFILLING -> DECODING with `seq_len` cached positions and `token` to feed next."""
        self._check_busy(lane)
        if not 0 <= seq_len < self._bps * self._block_size:
            last = self._bps * self._block_size - 1
            raise RequestError(f"seq_len={seq_len} is outside 0..{last}")
        if self.blocks_for(seq_len + 1) > self._num_held[lane]:
            raise StateError(f"lane={lane} holds {self._num_held[lane]} blocks, too few for "
                             f"position {seq_len}")
        if self._state[lane] != LANE_DECODING:
            self._num_decoding += 1
        self._state[lane] = LANE_DECODING
        self._seq_len[lane] = seq_len
        self._next_token[lane] = token

    def stop_decode(self, lane: int) -> None:
        """DECODING -> PREFILLING (preemption keeps the lane while it recomputes)."""
        self._check_busy(lane)
        if self._state[lane] == LANE_DECODING:
            self._num_decoding -= 1
        self._state[lane] = LANE_PREFILLING

    def advance(self, lane: int, token: int) -> None:
        """After a decode step: one more cached position, and the sampled token to feed next."""
        self._check_lane(lane)
        if self._state[lane] != LANE_DECODING:
            raise StateError(f"lane={lane} is not decoding")
        self._seq_len[lane] += 1
        self._next_token[lane] = token

    def rows(self) -> npt.NDArray[np.int32]:
        """A read-only view of the raw rows (-1 past each lane's held blocks)."""
        view = self._rows.view()
        view.flags.writeable = False
        return view


class SlidingSlots:
    """Per-lane fill of the Gemma3 sliding-window slot (`min(positions, window)`)."""

    def __init__(self, batch_size: int, window: int) -> None:
        if batch_size <= 0 or window <= 0:
            raise CapacityError(f"batch_size={batch_size} and window={window} must be positive")
        self._window = window
        self._fill = np.zeros(batch_size, dtype=np.int32)

    @property
    def window(self) -> int:
        return self._window

    def fill(self, lane: int) -> int:
        if not 0 <= lane < len(self._fill):
            raise StateError(f"lane={lane} is outside 0..{len(self._fill) - 1}")
        return int(self._fill[lane])

    def reset(self, lane: int) -> None:
        """A new tenant: it must never read the previous tenant's window."""
        self.fill(lane)
        self._fill[lane] = 0

    def advance(self, lane: int, num_tokens: int) -> int:
        """`num_tokens` more tokens entered the slot; returns the new fill."""
        fill = self.fill(lane)
        if num_tokens < 0:
            raise StateError(f"num_tokens={num_tokens} must be >= 0")
        self._fill[lane] = min(fill + num_tokens, self._window)
        return int(self._fill[lane])


class DecodeInputs:
    """The decode graph's inputs, allocated once and rewritten in place every step.

    With several compiled decode batch sizes ("buckets"), each step runs the smallest bucket that
    holds the decoding lanes. Rows are packed: rows `0..n-1` are the decoding lanes in lane order,
    the remaining rows of the bucket are padding. Lanes never move (their blocks and sliding slots
    stay theirs); only the row a lane occupies changes. The buffers are allocated once at full batch
    size; a bucket's arrays are views of their first `b` rows (C-contiguous), made once.
    """

    def __init__(self, batch_size: int, blocks_per_seq: int,
                 buckets: Sequence[int] | None = None) -> None:
        self._b = batch_size
        self._bps = blocks_per_seq
        self.buckets = check_buckets(batch_size, buckets)
        self._input_ids = np.zeros((batch_size, 1), dtype=np.int64)
        self._cache_position = np.zeros((batch_size, 1), dtype=np.int32)
        self._block_tables = np.zeros((batch_size, blocks_per_seq), dtype=np.int16)
        self._local_block_tables = np.arange(batch_size, dtype=np.int16).reshape(batch_size, 1)
        self._row_lanes = np.arange(batch_size, dtype=np.int32)
        self._views = [(self._input_ids[:b], self._cache_position[:b], self._block_tables[:b],
                        self._local_block_tables[:b], self._row_lanes[:b]) for b in self.buckets]
        self._select(len(self.buckets) - 1)

    def _select(self, index: int) -> None:
        (self.input_ids, self.cache_position, self.block_tables, self.local_block_tables,
         self.row_lanes) = self._views[index]
        self.num_rows = self.buckets[index]

    def bucket_for(self, num_decoding: int) -> int:
        """The smallest compiled decode batch that holds `num_decoding` lanes."""
        for b in self.buckets:
            if b >= num_decoding:
                return b
        raise StateError(f"{num_decoding} decoding lanes exceed batch_size={self._b}")

    def build(self, lanes: LaneTable, padding_block: int) -> int:
        """Fill the rows of the smallest bucket that holds every decoding lane; returns how many lanes
        decode.

        A DECODING lane feeds its next token at position `seq_len` through its own blocks, the tail
        entries repeating its last block, with its own sliding slot. Padding rows take token 0,
        position 0, a table row that points only at `padding_block`, and the sliding slot of a lane
        that does not decode (idle or prefilling: the scheduler runs no decode step while a hybrid
        lane's window is half built, and its first chunk writes the window from position 0; a
        step built ahead after a chunk is `StepKernel.build_ahead`'s). Every lane is validated
        before anything is written, so a failed build leaves the buffers as they were.
        """
        b, bps = lanes._b, lanes._bps
        if self._block_tables.shape != (b, bps):
            raise StateError(f"decode buffers are {self._block_tables.shape}, lanes are {(b, bps)}")
        decoding = 0
        for lane in range(b):
            if lanes._state[lane] == LANE_DECODING:
                # The device writes position seq_len into entry seq_len // block_size: that entry
                # must be the lane's own block, not a repeated tail entry (or -1 when none is held).
                held = int(lanes._num_held[lane])
                if lanes.blocks_for(int(lanes._seq_len[lane]) + 1) > held or held == 0:
                    raise StateError(f"lane={lane} holds {held} blocks, too few for position "
                                     f"{lanes._seq_len[lane]}")
                decoding += 1
        index = 0
        while self.buckets[index] < decoding:
            index += 1
        rows = self.buckets[index]
        if rows > decoding and not 0 <= padding_block <= MAX_TABLE_BLOCK:
            raise StateError(f"row={decoding} needs padding but padding_block={padding_block}")
        row = 0
        pad_row = decoding
        for lane in range(b):
            if lanes._state[lane] == LANE_DECODING:
                self._lane_row(row, lanes, lane, int(lanes._next_token[lane]),
                               int(lanes._seq_len[lane]))
                row += 1
            elif pad_row < rows:
                self._pad_row(pad_row, lane, padding_block)
                pad_row += 1
        self._select(index)
        return decoding

    def _lane_row(self, row: int, lanes: LaneTable, lane: int, token: int, position: int) -> None:
        """Row `row` feeds `token` at `position` through lane `lane`'s blocks (the tail entries
        repeating its last one) and its own sliding slot."""
        held = int(lanes._num_held[lane])
        self._input_ids[row, 0] = token
        self._cache_position[row, 0] = position
        self._block_tables[row, :held] = lanes._rows[lane, :held]
        self._block_tables[row, held:] = lanes._rows[lane, held - 1]
        self._local_block_tables[row, 0] = lane
        self._row_lanes[row] = lane

    def _pad_row(self, row: int, lane: int, pad: int) -> None:
        """A padding row: token 0 at position 0, every entry `pad`, lane `lane`'s sliding slot."""
        self._input_ids[row, 0] = 0
        self._cache_position[row, 0] = 0
        self._block_tables[row, :] = pad
        self._local_block_tables[row, 0] = lane
        self._row_lanes[row] = lane


class PrefillInputs:
    """The prefill graph's inputs (batch 1, `chunk_size` tokens), allocated once."""

    def __init__(self, chunk_size: int, blocks_per_seq: int) -> None:
        self.chunk_size = chunk_size
        self.input_ids = np.zeros((1, chunk_size), dtype=np.int64)
        self.cache_position = np.zeros((1, chunk_size), dtype=np.int32)
        self.block_tables = np.zeros(blocks_per_seq, dtype=np.int16)
        self.local_block_tables = np.zeros(1, dtype=np.int16)
        self.query_position = np.zeros((), dtype=np.int16)

    def build(self, tokens: npt.NDArray[np.int64] | Sequence[int], start: int,
              blocks: npt.NDArray[np.int32] | Sequence[int], num_blocks: int,
              sliding_slot: int = 0) -> int:
        """Fill the chunk that starts at position `start`; returns its number of real tokens.

        Real tokens are `tokens[start : start + chunk_size]`; the rest of the chunk is token 0 at
        the following positions (the device writes them; the scheduler holds blocks for the padded
        extent). The table row holds `blocks[:num_blocks]`, tail entries repeating the last block.
        Everything is validated before anything is written.
        """
        q = self.chunk_size
        total = len(tokens)
        if not 0 <= start < total:
            raise StateError(f"start={start} is outside the {total}-token prompt")
        if not 0 < num_blocks <= len(self.block_tables):
            raise StateError(f"num_blocks={num_blocks} is outside 1..{len(self.block_tables)}")
        if num_blocks > len(blocks):
            raise StateError(f"num_blocks={num_blocks} but only {len(blocks)} blocks were given")
        for j in range(num_blocks):
            if not 0 <= blocks[j] <= MAX_TABLE_BLOCK:
                raise StateError(f"blocks[{j}]={blocks[j]} is outside the int16 block-table range "
                                 f"0..{MAX_TABLE_BLOCK}")
        if not 0 <= sliding_slot <= MAX_TABLE_BLOCK:
            raise StateError(f"sliding_slot={sliding_slot} is outside 0..{MAX_TABLE_BLOCK}")
        real = min(q, total - start)
        self.input_ids[0, :real] = tokens[start : start + real]
        self.input_ids[0, real:] = 0
        self.cache_position[0, :] = np.arange(start, start + q, dtype=np.int32)
        self.block_tables[:num_blocks] = blocks[:num_blocks]
        self.block_tables[num_blocks:] = blocks[num_blocks - 1]
        self.local_block_tables[0] = sliding_slot
        self.query_position[()] = real - 1
        return real


class StepKernel:
    """The per-lane work of a decode step, for every lane in one call each.

    A steady decode step is `grow()` (a new block for each lane at a block boundary, taken from the
    free list), `build(padding_block)` (the decode inputs, in place), the device call,
    `pick(logits, greedy)` (the greedy tokens, numpy's argmax, and the finite check of every row)
    and `complete(now)` (append each row's token to its request's output array, advance the lane
    and its sliding slot, detect stop ids and the output limit). Each returns how many entries of
    `attention` the caller must look at: lanes that need a block the free list does not have
    (eviction or preemption is the caller's choice), rows the caller samples or fails, rows that
    finished or whose requests want their outputs built by the caller. Everything else stays in
    this class's arrays: nothing is allocated per lane, and no Python runs per lane (in the
    compiled core; this twin is the readable reference).

    The request data a lane needs (its output and token-time arrays, its id, its output limit, its
    stop ids and flags) is bound when the lane starts decoding (`bind`) and dropped when the lane is
    released (`unbind`). Rows are those of the last `build`: rows `0..num_rows-1` are the decoding
    lanes in lane order (`inputs.row_lanes`); `tokens` and `status` are indexed by row.
    """

    def __init__(self, pool: BlockPool, lanes: LaneTable, inputs: DecodeInputs,
                 slots: SlidingSlots | None = None, max_stop_ids: int = MAX_STOP_IDS) -> None:
        b = lanes._b
        if inputs._block_tables.shape != (b, lanes._bps):
            raise StateError(f"decode buffers are {inputs._block_tables.shape}, lanes are "
                             f"{(b, lanes._bps)}")
        if slots is not None and len(slots._fill) != b:
            raise StateError(f"sliding slots cover {len(slots._fill)} lanes, the table {b}")
        if max_stop_ids < 0:
            raise CapacityError(f"max_stop_ids={max_stop_ids} must be >= 0")
        self.pool = pool
        self.lanes = lanes
        self.inputs = inputs
        self.slots = slots
        self.max_stop_ids = max_stop_ids
        self.num_rows = 0
        self.completed = 0
        self.tokens = np.zeros(b, dtype=np.int64)
        self.status = np.zeros(b, dtype=np.int8)
        self.plain = np.zeros(b, dtype=np.bool_)
        self.attention = np.zeros(b, dtype=np.int32)
        self._num_out = np.zeros(b, dtype=np.int32)
        self._max_out = np.zeros(b, dtype=np.int32)
        self._flags = np.zeros(b, dtype=np.int8)
        self._stops: list[tuple[int, ...]] = [()] * b
        self._outputs: list[array[int] | None] = [None] * b
        self._times: list[array[float] | None] = [None] * b
        self.ids: list[str | None] = [None] * b

    # -- per-lane request data ------------------------------------------------------------------
    def bind(self, lane: int, request_id: str, output: array[int], times: array[float],
             max_output: int, stop_ids: Sequence[int], flags: int) -> None:
        """Lane `lane` decodes for `request_id`: its tokens go to `output` (and `now` to `times`),
        it finishes "length" once `output` holds `max_output` tokens and "stop" on a token of
        `stop_ids`. `flags`: LANE_SAMPLE (the caller samples its row) and LANE_OWN_OUTPUT (the
        caller builds its outputs); more stop ids than `max_stop_ids` add LANE_STOPCHECK.
        `output` is an `array("q")` and `times` an `array("d")`: appended to in place."""
        self.lanes._check_lane(lane)
        if not isinstance(output, array) or not isinstance(times, array):
            raise TypeError("output must be an array('q') and times an array('d')")
        if self.lanes._state[lane] != LANE_DECODING:
            raise StateError(f"lane={lane} is not decoding: bind it after `start_decode`")
        if output.typecode != "q" or times.typecode != "d":
            raise TypeError(f"output must be an array('q') and times an array('d'), not "
                            f"array({output.typecode!r}) and array({times.typecode!r})")
        if not 0 <= max_output <= 0x7FFFFFFF:
            raise RequestError(f"max_output={max_output} is outside 0..{0x7FFFFFFF}")
        if flags & ~(LANE_SAMPLE | LANE_OWN_OUTPUT):
            raise StateError(f"flags={flags} has bits other than LANE_SAMPLE | LANE_OWN_OUTPUT")
        stops = tuple(int(t) for t in stop_ids)
        for t in stops:  # the compiled kernel holds them as int64
            if not -0x8000000000000000 <= t <= 0x7FFFFFFFFFFFFFFF:
                raise RequestError(f"stop id {t} is outside the int64 range")
        if len(stops) > self.max_stop_ids:
            flags |= LANE_STOPCHECK
            stops = ()
        self._stops[lane] = stops
        self._num_out[lane] = len(output)
        self._max_out[lane] = max_output
        self._flags[lane] = flags
        self._outputs[lane] = output
        self._times[lane] = times
        self.ids[lane] = request_id

    def unbind(self, lane: int) -> None:
        """Drop the lane's request data (it finished, failed or was preempted)."""
        self.lanes._check_lane(lane)
        self._outputs[lane] = None
        self._times[lane] = None
        self.ids[lane] = None
        self._flags[lane] = 0
        self._stops[lane] = ()

    def flags(self, lane: int) -> int:
        self.lanes._check_lane(lane)
        return int(self._flags[lane])

    def num_output(self, lane: int) -> int:
        self.lanes._check_lane(lane)
        return int(self._num_out[lane])

    # -- the step -------------------------------------------------------------------------------
    def grow(self, ahead: int = 0) -> int:
        """Give every decoding lane the blocks its next position needs, from the free list, in lane
        order. Returns k: `attention[:k]` are the lanes (in lane order) still short of a block
        because the free list ran dry; the caller evicts or preempts for them, then grows again.
        `ahead=1`: the position after that, for the step after the one on the device now
        (`build_ahead`); a lane whose output limit that step reaches is left alone, and one
        whose row cannot hold that position is reported short (not an error)."""
        lanes = self.lanes
        if not 0 <= ahead <= 1:
            raise StateError(f"ahead={ahead} must be 0 or 1")
        k = 0
        for lane in range(lanes._b):
            if lanes._state[lane] != LANE_DECODING:
                continue
            if ahead and self._num_out[lane] + 1 >= self._max_out[lane]:
                continue
            need = lanes.blocks_for(int(lanes._seq_len[lane]) + 1 + ahead)
            if ahead and need > lanes._bps:  # past its row: the synchronous step decides
                self.attention[k] = lane
                k += 1
                continue
            while lanes._num_held[lane] < need:
                held = int(lanes._num_held[lane])
                if held >= lanes._bps:
                    raise CapacityError(f"lane={lane} already holds {held} blocks, the row's "
                                        f"{lanes._bps} entries")
                if not self._push_free_block(lane, held):
                    self.attention[k] = lane
                    k += 1
                    break
        return k

    def _push_free_block(self, lane: int, held: int) -> bool:
        """The oldest free block into `lane`'s row at entry `held`; False if none is free."""
        block = self.pool.first_free()
        if block < 0:
            return False
        if block > MAX_TABLE_BLOCK:
            raise StateError(f"block={block} is outside the int16 block-table range "
                             f"0..{MAX_TABLE_BLOCK}")
        self.pool.allocate(LANE, lane)
        self.lanes._rows[lane, held] = block
        self.lanes._num_held[lane] = held + 1
        return True

    def grow_lane(self, lane: int, num_positions: int) -> int:
        """Give one busy lane the blocks that positions 0..num_positions-1 need, from the free
        list, oldest free block first (what `allocate(LANE, lane)` + `push_block` do block by
        block). Returns how many blocks it still lacks because the free list ran dry (the caller
        evicts for them)."""
        lanes = self.lanes
        lanes._check_busy(lane)
        need = lanes.blocks_for(num_positions)
        if need > lanes._bps:
            raise CapacityError(f"lane={lane} cannot hold {need} blocks: the row has "
                                f"{lanes._bps} entries")
        held = int(lanes._num_held[lane])
        while held < need and self._push_free_block(lane, held):
            held += 1
        return max(need - held, 0)

    def build(self, padding_block: int) -> int:
        """The decode inputs for the decoding lanes (`DecodeInputs.build`); returns the rows that
        decode (rows of the bucket past them are padding)."""
        self.num_rows = self.inputs.build(self.lanes, padding_block)
        return self.num_rows

    def use(self, inputs: DecodeInputs, num_rows: int) -> None:
        """`pick`, `complete` and `emit` read the rows of `inputs` (its first `num_rows` decode)
        from now on: the step that ran from them, when steps are built ahead into other buffers
        (`build_ahead`)."""
        if inputs._b != self.lanes._b or inputs._bps != self.lanes._bps:
            raise StateError(f"decode buffers are {(inputs._b, inputs._bps)}, lanes are "
                             f"{(self.lanes._b, self.lanes._bps)}")
        if not 0 <= num_rows <= inputs.num_rows:
            raise StateError(f"num_rows={num_rows} is outside 0..{inputs.num_rows}")
        self.inputs = inputs
        self.num_rows = num_rows

    def build_ahead(self, out: DecodeInputs, previous: DecodeInputs, previous_rows: int,
                    gather: npt.NDArray[np.int32], padding_block: int,
                    joins: npt.NDArray[np.int32] | None = None) -> int:
        """The inputs of the decode step after the one on the device now (built from `previous`,
        whose rows `0..previous_rows-1` decode), into `out`, before that step's tokens are known.

        Every decoding lane with a row in `previous` that that step does not finish by its
        output limit gets a row at position `seq_len + 1` (its blocks must cover it:
        `grow(ahead=1)`), in lane order; its token is not known yet: `gather[row]` is the row of
        `previous` whose token it takes (the caller writes `input_ids` from that step's tokens),
        -1 for padding rows (token 0). A decoding lane without a row in `previous` (it started
        decoding while that step was on the device: a prefill ran after it) joins as `build`
        gives it a row: its own next token at `seq_len`, `gather[row]` -2 (the token stays).
        With `previous_rows` 0 this is `build` into `out`. A lane that stops on a stop id in the
        step on the device still has a row here (its output is already complete: the caller
        drops the row when it lands). Padding rows are those of `build`, with the sliding slots
        of lanes that do not decode or finish in the step on the device; with sliding slots
        (hybrid) never that of a lane that prefills (a chunk planned ahead may run just before
        this step): the first other such slot serves the padding rows left over. A lane's flags
        do not matter here: the caller samples the rows it must before it writes the tokens in.
        Returns the rows that decode; 0 when no lane goes on; -1 when the step cannot be built
        ahead (padding rows and no `padding_block`, or no slot they may write). `self.inputs`
        and `num_rows` stay those of the last step.

        `joins` (int32, one entry per lane, or None): `joins[lane]` >= 0 for a lane that
        prefills, whose last chunk runs before this step (a wave's chain: several of them),
        joins it too: a row at `joins[lane]` (its prompt's length) through its blocks and its
        own slot, token 0 and `gather[row]` -2 (the caller writes the chunk's first token in);
        -1 for every other lane."""
        lanes = self.lanes
        b, bps = lanes._b, lanes._bps
        if out._b != b or out._bps != bps or previous._b != b or previous._bps != bps:
            raise StateError(f"decode buffers are {(out._b, out._bps)} and "
                             f"{(previous._b, previous._bps)}, lanes are {(b, bps)}")
        if out is previous:
            raise StateError("build_ahead needs a buffer other than the one on the device")
        if not 0 <= previous_rows <= previous.num_rows:
            raise StateError(f"previous_rows={previous_rows} is outside 0..{previous.num_rows}")
        if gather.shape[0] < b:
            raise StateError(f"gather has {gather.shape[0]} entries, fewer than {b} lanes")
        join_at: dict[int, int] = {}
        if joins is not None:
            if joins.shape[0] < b:
                raise StateError(f"joins has {joins.shape[0]} entries, fewer than {b} lanes")
            for lane in range(b):
                at = int(joins[lane])
                if at < 0:
                    continue
                if lanes._state[lane] != LANE_PREFILLING:
                    raise StateError(f"joins[{lane}]={at}: lane {lane} does not prefill")
                held = int(lanes._num_held[lane])
                if lanes.blocks_for(at + 1) > held:
                    raise StateError(f"joins[{lane}]={at}: lane {lane} holds {held} blocks, too "
                                     f"few for that position")
                join_at[lane] = at
        source = np.full(b, -1, dtype=np.int32)
        for row in range(previous_rows):
            source[previous._row_lanes[row]] = row
        going = []
        for lane in range(b):
            if lane in join_at:
                going.append(lane)
                continue
            if lanes._state[lane] != LANE_DECODING:
                continue
            joins = source[lane] < 0
            if not joins and self._num_out[lane] + 1 >= self._max_out[lane]:
                continue  # finishes in the step on the device
            held = int(lanes._num_held[lane])
            position = int(lanes._seq_len[lane]) + (not joins)
            if lanes.blocks_for(position + 1) > held:
                raise StateError(f"lane={lane} holds {held} blocks, too few for position "
                                 f"{position}")
            going.append(lane)
        decoding = len(going)
        if decoding == 0:
            return 0
        index = 0
        while out.buckets[index] < decoding:
            index += 1
        rows = out.buckets[index]
        if rows > decoding and not 0 <= padding_block <= MAX_TABLE_BLOCK:
            return -1  # padding rows and no block to point them at (no eviction ahead)
        goes = set(going)
        # A hybrid lane that prefills may have a chunk on the device before this step (its
        # window is being built, or just was): a padding row writes its slot at position 0, so
        # padding takes only the slots of lanes that are idle or end in the step on the device,
        # the first of them again when they are fewer than the padding rows
        hybrid = self.slots is not None
        padding_slot = -1
        if rows > decoding and hybrid:
            for lane in range(b):
                if lane not in goes and lanes._state[lane] != LANE_PREFILLING:
                    padding_slot = lane
                    break
            if padding_slot < 0:
                return -1  # every lane without a row prefills: no slot padding may write
        row = 0
        pad_row = decoding
        for lane in range(b):
            if lane in join_at:  # its first token comes from its chunk
                out._lane_row(row, lanes, lane, 0, join_at[lane])
                gather[row] = -2
                row += 1
            elif lane in goes:
                if source[lane] < 0:  # joins: its own token, at its own length
                    out._lane_row(row, lanes, lane, int(lanes._next_token[lane]),
                                  int(lanes._seq_len[lane]))
                    gather[row] = -2
                else:
                    out._lane_row(row, lanes, lane, 0, int(lanes._seq_len[lane]) + 1)
                    gather[row] = source[lane]
                row += 1
            elif pad_row < rows and not (hybrid and lanes._state[lane] == LANE_PREFILLING):
                out._pad_row(pad_row, lane, padding_block)
                gather[pad_row] = -1
                pad_row += 1
        while pad_row < rows:  # hybrid: fewer free slots than padding rows
            out._pad_row(pad_row, padding_slot, padding_block)
            gather[pad_row] = -1
            pad_row += 1
        out._select(index)
        return decoding

    def pick(self, logits: npt.NDArray[np.float32], greedy: npt.NDArray[np.int64]) -> int:
        """The rows of the last build: `greedy[row]` (the row's argmax as numpy's
        `logits.argmax(axis=1)` gives it, int64) becomes `tokens[row]`, and the logit it picked
        in float32 `logits` [rows, vocab] (row-major) is checked finite. numpy's argmax lands on
        a NaN or a +inf wherever a row holds one, so that one value tells a broken row without
        a second pass over every logit (at B64 and a 152k vocabulary that pass cost ~2 ms of
        each step's critical path); an -inf elsewhere in a row is a token that cannot be drawn,
        and a row of only -inf picks one. Returns k: `attention[:k]` are the rows the caller
        handles, in row order: ROW_SAMPLE (its lane's request samples: the caller writes
        `tokens[row]`) and ROW_NONFINITE (the picked logit is NaN or infinite: the caller fails
        the request)."""
        if not isinstance(logits, np.ndarray) or logits.dtype != np.float32 or logits.ndim != 2 \
                or not logits.flags.c_contiguous:
            raise ValueError("logits must be a C-contiguous 2-D float32 array")
        if not isinstance(greedy, np.ndarray) or greedy.dtype != np.int64 or greedy.ndim != 1 \
                or not greedy.flags.c_contiguous:
            raise ValueError("greedy must be a C-contiguous 1-D int64 array")
        self._check_picks(greedy, logits.shape[0], logits.shape[1], "logits")
        n = self.num_rows
        return self._mark_rows(logits[np.arange(n), greedy[:n]], greedy)

    def pick_values(self, best: npt.NDArray[np.float32], greedy: npt.NDArray[np.int64],
                    vocab: int) -> int:
        """`pick` for a step whose logits are gone (the device runs the next step into them):
        `best[row]` is the float32 logit `greedy[row]` picked in row `row`."""
        self._check_picks(greedy, best.shape[0], vocab, "best")
        return self._mark_rows(best, greedy)

    def _check_picks(self, picks: npt.NDArray[np.int64], rows: int, vocab: int,
                     what: str) -> None:
        """The last build's rows each have a logit row (`rows` of them) and a pick in 0..vocab-1."""
        n = self.num_rows
        if rows < n or picks.shape[0] < n:
            raise StateError(f"{what}: {rows} rows, greedy: {picks.shape[0]}; the step ran "
                             f"{n} rows")
        if vocab < 1:
            raise StateError("logits have no vocabulary entries")
        for row in range(n):
            if not 0 <= picks[row] < vocab:
                raise StateError(f"greedy[{row}]={picks[row]} is outside the vocabulary "
                                 f"0..{vocab - 1}")

    def _mark_rows(self, best: npt.NDArray[np.float32], greedy: npt.NDArray[np.int64]) -> int:
        """Each row picked `greedy[row]`, whose logit was `best[row]`: its status, token and
        attention entry; returns the attention count."""
        k = 0
        for row in range(self.num_rows):
            if not np.isfinite(best[row]):
                self.status[row] = ROW_NONFINITE
                self.tokens[row] = 0
                self.attention[k] = row
                k += 1
                continue
            self.tokens[row] = int(greedy[row])
            if self._flags[self.inputs._row_lanes[row]] & LANE_SAMPLE:
                self.status[row] = ROW_SAMPLE
                self.attention[k] = row
                k += 1
            else:
                self.status[row] = ROW_OK
        return k

    def complete(self, now: float) -> int:
        """Each row's `tokens[row]` becomes its lane's next token: appended to the bound output
        array (and `now` to the token times), the lane one position longer, its sliding slot one
        fuller. A row whose lane no longer decodes (its request failed during the step) is
        ROW_SKIPPED; a ROW_NONFINITE row is left alone. Returns k: `attention[:k]` are the rows
        the caller handles, in row order: ROW_STOP (a stop id), ROW_LENGTH (the output limit),
        ROW_CHECK (the caller checks the stop condition) and ROW_OK rows of LANE_OWN_OUTPUT lanes.
        `completed` counts the tokens appended; `plain[row]` is True for the other rows that
        appended a token (the caller has nothing to do for them but report the token)."""
        lanes, row_lanes = self.lanes, self.inputs._row_lanes
        n = self.num_rows
        for row in range(n):  # validated first: a failed call changes nothing
            lane = int(row_lanes[row])
            if lanes._state[lane] == LANE_DECODING and self.status[row] != ROW_NONFINITE and \
                    self._outputs[lane] is None:
                raise StateError(f"lane={lane} decodes but no request is bound to it")
        k = done = 0
        for row in range(n):
            lane = int(row_lanes[row])
            self.plain[row] = False
            if self.status[row] == ROW_NONFINITE:
                continue
            if lanes._state[lane] != LANE_DECODING:
                self.status[row] = ROW_SKIPPED
                continue
            token = int(self.tokens[row])
            lanes._seq_len[lane] += 1
            lanes._next_token[lane] = token
            if self.slots is not None and self.slots._fill[lane] < self.slots._window:
                self.slots._fill[lane] += 1
            self._outputs[lane].append(token)  # type: ignore[union-attr]
            self._times[lane].append(now)  # type: ignore[union-attr]
            self._num_out[lane] += 1
            done += 1
            flags = int(self._flags[lane])
            if flags & LANE_STOPCHECK:
                status = ROW_CHECK
            elif token in self._stops[lane]:
                status = ROW_STOP
            elif self._num_out[lane] >= self._max_out[lane]:
                status = ROW_LENGTH
            else:
                status = ROW_OK
            self.status[row] = status
            if status != ROW_OK or flags & LANE_OWN_OUTPUT:
                self.attention[k] = row
                k += 1
            else:
                self.plain[row] = True
        self.completed = done
        return k

    def emit(self, out: list[Any], factory: Callable[..., Any]) -> int:
        """Append `factory(request_id, (token,), False)` for every `plain` row of the last
        `complete` (built only for callers that want one object per token); returns how many."""
        count = 0
        for row in range(self.num_rows):
            if self.plain[row]:
                lane = int(self.inputs._row_lanes[row])
                out.append(factory(self.ids[lane], (int(self.tokens[row]),), False))
                count += 1
        return count


# -- the decode pipeline's critical path (atombatch/engine/pipeline.py) ------------------------------------

def picked_logits(logits: npt.NDArray[np.float32], greedy: npt.NDArray[np.int64],
                  best: npt.NDArray[np.float32], keep: int) -> int:
    """`best[row] = logits[row, greedy[row]]` for rows `0..keep-1` (float32 `logits`)."""
    if not 0 <= keep <= logits.shape[0] or greedy.shape[0] < keep or best.shape[0] < keep:
        raise StateError(f"keep={keep} rows of {logits.shape[0]} (greedy {greedy.shape[0]}, "
                         f"best {best.shape[0]})")
    vocab = logits.shape[1]
    for row in range(keep):
        pick = int(greedy[row])
        if not 0 <= pick < vocab:
            raise StateError(f"greedy[{row}]={pick} is outside the vocabulary 0..{vocab - 1}")
        best[row] = logits[row, pick]
    return keep


def gather_tokens(tokens: npt.NDArray[np.int64], gather: npt.NDArray[np.int32],
                  input_ids: npt.NDArray[np.int64]) -> int:
    """`input_ids[row, 0] = tokens[gather[row]]` for every row (`gather[row] == -1`: 0; -2: the
    row keeps its token)."""
    rows = input_ids.shape[0]
    if gather.shape[0] < rows or input_ids.shape[1] != 1:
        raise StateError(f"gather has {gather.shape[0]} entries for input_ids of shape "
                         f"{(rows, input_ids.shape[1])}")
    n = tokens.shape[0]
    for row in range(rows):
        source = int(gather[row])
        if not -2 <= source < n:
            raise StateError(f"gather[{row}]={source} is outside -2..{n - 1}")
        if source != -2:
            input_ids[row, 0] = tokens[source] if source >= 0 else 0
    return int(rows)


def argmax_rows(logits: npt.NDArray[np.float32], greedy: npt.NDArray[np.int64],
                best: npt.NDArray[np.float32] | None = None) -> int:
    """`greedy[row] = numpy.argmax(logits[row])` for every row (the first NaN of a row that holds
    one, else the first index of its maximum) and, with `best`, `best[row]` the logit it picked;
    returns the rows."""
    rows, vocab = logits.shape
    if vocab < 1 or vocab >= 2 ** 31 or greedy.shape[0] < rows or \
            (best is not None and best.shape[0] < rows):
        raise StateError(f"logits of shape {(rows, vocab)} for greedy {greedy.shape[0]}"
                         + (f", best {best.shape[0]}" if best is not None else "")
                         + " (rows need an entry each, and 1 <= vocab < 2**31)")
    np.argmax(logits, axis=1, out=greedy[:rows])
    if best is not None:
        best[:rows] = logits[np.arange(rows), greedy[:rows]]
    return int(rows)


def argmax_call(raw: Any, rows: int, vocab: int, limit: int, greedy: npt.NDArray[np.int64],
                best: npt.NDArray[np.float32]) -> bool:
    """`argmax_rows(raw, greedy, best)` when `raw` (a decode call's result) is a plain
    C-contiguous float32 ndarray of shape `(rows, vocab)` with fewer than `limit` entries:
    returns True. Otherwise False, and nothing is written (the caller converts and checks it)."""
    if type(raw) is not np.ndarray or rows * vocab >= limit or not 1 <= vocab < 2 ** 31 or \
            greedy.shape[0] < rows or best.shape[0] < rows:
        return False
    if raw.dtype != np.dtype("=f4") or not raw.flags.c_contiguous or raw.shape != (rows, vocab):
        return False
    argmax_rows(raw, greedy, best)
    return True


# -- prefix digests and token comparison ----------------------------------------------------------

_ROOT_INPUT = bytes(16)


def block_digests(tokens: npt.NDArray[np.int64], start: int, stop: int, block_size: int,
                  parent: bytes, seed: int) -> list[bytes]:
    """The chained digests of the full blocks `tokens[start:stop]` (a whole number of blocks),
    the first chained to `parent` (16 zero bytes when empty): each is
    `xxh3_128(parent || int64 tokens || b"F", seed)` in canonical (big-endian) byte order."""
    if block_size <= 0 or start < 0 or stop > len(tokens) or stop < start or \
            (stop - start) % block_size:
        raise ValueError(f"tokens[{start}:{stop}] is not a whole number of {block_size}-token "
                         f"blocks of the {len(tokens)} tokens")
    if len(parent) not in (0, 16):
        raise ValueError(f"a parent digest has 16 bytes, not {len(parent)}")
    out: list[bytes] = []
    parent = parent or _ROOT_INPUT
    for position in range(start, stop, block_size):
        state = xxhash.xxh3_128(parent, seed=seed)
        state.update(tokens[position:position + block_size].data)
        state.update(b"F")
        parent = state.digest()
        out.append(parent)
    return out


def common_prefix(a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def match_digests(by_digest: dict[bytes, Any], digests: list[bytes], start: int, stop: int,
                  out: list[Any]) -> int:
    """Append `by_digest[digests[j]]` to `out` for j = start, start + 1, ... while j < stop and
    the digest is there; returns the first j that was not appended."""
    block, stop = start, min(stop, len(digests))
    while block < stop:
        entry = by_digest.get(digests[block])
        if entry is None:
            break
        out.append(entry)
        block += 1
    return block


def chain_digests(tokens: npt.NDArray[np.int64], start: int, stop: int, block_size: int,
                  parent: bytes, seed: int, out: npt.NDArray[np.uint8], row: int) -> None:
    """`block_digests` written into `out[row:row + (stop - start) // block_size]` (16 bytes a
    row) instead of returned as bytes: one compiled pass, no Python object per block."""
    digests = block_digests(tokens, start, stop, block_size, parent, seed)  # checks the range
    count = len(digests)
    if out.shape[1] != 16 or row < 0 or row + count > out.shape[0]:
        raise ValueError(f"rows {row}..{row + count - 1} do not fit a digest array of shape "
                         f"({out.shape[0]}, {out.shape[1]})")
    for j, digest in enumerate(digests):
        out[row + j] = np.frombuffer(digest, dtype=np.uint8)


def _key(digest: bytes, root_ok: bool) -> bytes:
    if len(digest) == 16:
        return digest
    if len(digest) == 0 and root_ok:
        return _ROOT_INPUT
    raise ValueError(f"a digest has 16 bytes, not {len(digest)}")


class PrefixTable:
    """The device prefix index's cached blocks, in arrays indexed by block.

    Per block: its digest, its parent's digest (16 zero bytes for the root), its tokens (one row
    of `block_size`, the first `num_tokens(block)` valid) and its place in its parent's list of
    children (most recently inserted first). The compiled core maps digests to blocks and
    parents to first children with open addressing over the 128-bit digests; this twin with
    dicts. A real digest of 16 zero bytes would read as the root: the odds are 2**-128 for a
    seeded hash, as for any collision.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise CapacityError(f"num_blocks={num_blocks} and block_size={block_size} must be "
                                "positive")
        self._n, self._block_size = num_blocks, block_size
        self._tokens = np.zeros((num_blocks, block_size), dtype=np.int64)
        self._ntok = [0] * num_blocks                  # 0: the block is not held
        self._digest: list[bytes] = [b""] * num_blocks
        self._parent: list[bytes] = [b""] * num_blocks  # 16 bytes; zeros for the root
        self._by_digest: dict[bytes, int] = {}
        self._children: dict[bytes, list[int]] = {}    # parent -> children, most recent first

    @property
    def block_size(self) -> int:
        return self._block_size

    def __len__(self) -> int:
        return len(self._by_digest)

    def _check_block(self, block: int) -> None:
        if not 0 <= block < self._n:
            raise StateError(f"block={block} is outside the table 0..{self._n - 1}")

    def _check_held(self, block: int) -> None:
        self._check_block(block)
        if self._ntok[block] == 0:
            raise StateError(f"block={block} is not in the prefix table")

    def holds(self, block: int) -> bool:
        self._check_block(block)
        return self._ntok[block] > 0

    def blocks(self) -> list[int]:
        """The blocks held, in ascending order."""
        return [block for block in range(self._n) if self._ntok[block] > 0]

    def find(self, digest: bytes) -> int:
        """The block cached under `digest`, or -1."""
        return self._by_digest.get(_key(digest, False), -1)

    def first_child(self, parent: bytes) -> int:
        """The most recently inserted child of `parent` (b"" is the root), or -1."""
        children = self._children.get(_key(parent, True))
        return children[0] if children else -1

    def siblings(self, parent: bytes) -> list[int]:
        """Every child of `parent`, most recently inserted first."""
        return list(self._children.get(_key(parent, True), ()))

    def digest(self, block: int) -> bytes:
        self._check_held(block)
        return self._digest[block]

    def parent(self, block: int) -> bytes:
        """The parent's digest (b"" for the root)."""
        self._check_held(block)
        parent = self._parent[block]
        return b"" if parent == _ROOT_INPUT else parent

    def num_tokens(self, block: int) -> int:
        self._check_held(block)
        return self._ntok[block]

    def tokens(self, block: int) -> npt.NDArray[np.int64]:
        """A copy of the block's tokens."""
        self._check_held(block)
        return self._tokens[block, :self._ntok[block]].copy()

    def common_prefix(self, block: int, tokens: npt.NDArray[np.int64]) -> int:
        """How many leading tokens the block and `tokens` share."""
        self._check_held(block)
        return common_prefix(self._tokens[block, :self._ntok[block]], tokens)

    def match(self, digests: npt.NDArray[np.uint8], start: int, stop: int,
              out: npt.NDArray[np.int32]) -> int:
        """Write the block of `digests[j]` to `out[j - start]` for j = start, start + 1, ... while
        j < stop and the digest is cached; returns the first j that was not written."""
        if digests.shape[1] != 16:
            raise ValueError(f"digest rows have 16 bytes, not {digests.shape[1]}")
        start, stop = max(start, 0), min(stop, digests.shape[0])
        if stop - start > len(out):
            raise ValueError(f"{stop - start} blocks do not fit an output of {len(out)}")
        j = start
        while j < stop:
            block = self._by_digest.get(digests[j].tobytes())
            if block is None:
                break
            out[j - start] = block
            j += 1
        return j

    def check(self) -> None:
        """Raise `StateError` if the digest and parent tables disagree with the blocks held."""
        held = [b for b in range(self._n) if self._ntok[b]]
        for block in held:
            if self._by_digest.get(self._digest[block]) != block:
                raise StateError(f"block={block} is not found under its digest")
        children = 0
        for parent, kids in self._children.items():
            for child in kids:
                if self._ntok[child] == 0 or self._parent[child] != parent:
                    raise StateError(f"block={child} is listed under a parent it does not have")
            children += len(kids)
        if len(held) != len(self._by_digest) or children != len(self._by_digest):
            raise StateError(f"{len(self._by_digest)} blocks counted, {len(held)} held, "
                             f"{children} listed under parents")

    def _link(self, block: int, digest: bytes, parent: bytes) -> None:
        self._by_digest[digest] = block
        self._digest[block] = digest
        self._parent[block] = parent
        self._children.setdefault(parent, []).insert(0, block)

    def insert(self, block: int, digest: bytes, parent: bytes,
               tokens: npt.NDArray[np.int64]) -> int:
        """Cache `block` as holding `tokens` (1..block_size of them) after `parent` under
        `digest`. Returns -1, changing nothing, if that digest is cached already; else how many
        other children its parent has."""
        self._check_block(block)
        if self._ntok[block]:
            raise StateError(f"block={block} is already in the prefix table")
        n = len(tokens)
        if not 0 < n <= self._block_size:
            raise ValueError(f"a block holds 1..{self._block_size} tokens, not {n}")
        digest, parent = _key(digest, False), _key(parent, True)
        if digest in self._by_digest:
            return -1
        self._tokens[block, :n] = tokens
        self._ntok[block] = n
        self._link(block, digest, parent)
        return min(len(self._children[parent]) - 1, 2)

    def insert_run(self, blocks: Sequence[int], digests: npt.NDArray[np.uint8], first: int,
                   stop: int, parent: bytes,
                   tokens: npt.NDArray[np.int64]) -> tuple[list[int], list[int]]:
        """Cache `blocks[j]` as full block j of a chain, for j = first..stop-1: its digest
        `digests[j]`, its tokens `tokens[j * block_size:(j + 1) * block_size]`, block `first`
        chained to `parent` and each next one to the previous digest (what `insert` does block
        by block). Every block is checked before any is cached. Returns (the blocks not cached
        because their digest is cached already, the cached blocks whose parent has other
        children)."""
        bs = self._block_size
        if digests.shape[1] != 16:
            raise ValueError(f"digest rows have 16 bytes, not {digests.shape[1]}")
        if first < 0 or stop > digests.shape[0] or stop * bs > len(tokens) or stop > len(blocks):
            raise ValueError(f"blocks {first}..{stop - 1} are not all in the chain")
        seen: set[int] = set()  # a block twice in the run
        for j in range(first, stop):
            self._check_block(blocks[j])
            if self._ntok[blocks[j]] or blocks[j] in seen:
                raise StateError(f"block={blocks[j]} is already in the prefix table")
            seen.add(blocks[j])
        parent = _key(parent, True)
        duplicates: list[int] = []
        branched: list[int] = []
        for j in range(first, stop):
            block, digest = blocks[j], digests[j].tobytes()
            if digest in self._by_digest:
                duplicates.append(block)
            else:
                self._tokens[block] = tokens[j * bs:(j + 1) * bs]
                self._ntok[block] = bs
                self._link(block, digest, parent)
                if len(self._children[parent]) > 1:
                    branched.append(block)
            parent = digest
        return duplicates, branched

    def remove(self, block: int) -> int:
        """The block leaves the table; returns how many children its parent still has (0, 1, or
        2 for two or more)."""
        self._check_held(block)
        del self._by_digest[self._digest[block]]
        parent = self._parent[block]
        children = self._children[parent]
        children.remove(block)
        if not children:
            del self._children[parent]
        self._ntok[block] = 0
        return min(len(children), 2)

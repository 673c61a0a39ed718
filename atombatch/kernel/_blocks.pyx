# cython: language_level=3, embedsignature=True
"""Compiled block/lane core: the hot path of atombatch (see `kernel/_blocks_py.py` for the reference).

Theory of operation
-------------------
Identical to the pure-Python twin `kernel/_blocks_py.py`, which is the behavioural reference: every class,
method, property, return value, exception type and message here matches it (the tests drive both
with the same operation sequences and compare every array).

`BlockPool` threads its free list and its LRU list of unpinned CACHED blocks through one pair of int32
`prev`/`next` arrays with four sentinel nodes (free head/tail = n, n+1; LRU head/tail = n+2, n+3), so
every transition is a few array writes: O(1) whatever the pool size, and no allocation. Each public
method validates its block/lane indices and the state it expects and raises a typed error before it
changes anything; only then do the `noexcept` list primitives run, with bounds checks off (they are
back on, and `check()` runs after every transition, in a build made with `ATOMBATCH_DEBUG=1`).

The numpy arrays are allocated once in the constructors; the compiled code reads and writes them
through typed memoryviews. `DecodeInputs.build` reads the `LaneTable`'s arrays directly and rewrites
the decode buffers in place: no Python object is created per lane.
"""

cimport cython
from cpython cimport array as carray
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint64_t

from array import array

import numpy as np

from atombatch.kernel.codes import (  # one definition of the states and step codes for both cores
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
from atombatch.errors import CapacityError, RequestError, StateError

IMPLEMENTATION = "c"

DEBUG = bool(ATOMBATCH_DEBUG)

cdef enum:
    C_FREE = 0
    C_SPARE = 1
    C_STAGED = 2
    C_LANE = 3
    C_CACHED = 4
    C_LANE_IDLE = 0
    C_LANE_PREFILLING = 1
    C_LANE_DECODING = 2
    C_MAX_TABLE_BLOCK = 32767
    C_ROW_OK = 0
    C_ROW_SAMPLE = 1
    C_ROW_NONFINITE = 2
    C_ROW_STOP = 3
    C_ROW_LENGTH = 4
    C_ROW_CHECK = 5
    C_ROW_SKIPPED = 6
    C_LANE_SAMPLE = 1
    C_LANE_OWN_OUTPUT = 2
    C_LANE_STOPCHECK = 4


# The compiled code branches on the C enum above (a compile-time mirror); Python callers compare
# with atombatch.kernel.codes, so the two must agree: checked once, at import.
if (C_FREE, C_SPARE, C_STAGED, C_LANE, C_CACHED, C_LANE_IDLE, C_LANE_PREFILLING,
        C_LANE_DECODING, C_MAX_TABLE_BLOCK, C_ROW_OK, C_ROW_SAMPLE, C_ROW_NONFINITE, C_ROW_STOP,
        C_ROW_LENGTH, C_ROW_CHECK, C_ROW_SKIPPED, C_LANE_SAMPLE, C_LANE_OWN_OUTPUT,
        C_LANE_STOPCHECK) != (
        FREE, SPARE, STAGED, LANE, CACHED, LANE_IDLE, LANE_PREFILLING, LANE_DECODING,
        MAX_TABLE_BLOCK, ROW_OK, ROW_SAMPLE, ROW_NONFINITE, ROW_STOP, ROW_LENGTH, ROW_CHECK,
        ROW_SKIPPED, LANE_SAMPLE, LANE_OWN_OUTPUT, LANE_STOPCHECK):  # pragma: no cover
    raise ImportError("atombatch.kernel._blocks: its C enum disagrees with atombatch.kernel.codes (a build "
                      "from mismatched sources)")

cdef extern from *:
    """
    #if defined(_MSC_VER)
    #include <intrin.h>
    static inline int atombatch_ctz64(unsigned long long x) {
        unsigned long i; _BitScanForward64(&i, x); return (int)i;
    }
    #else
    static inline int atombatch_ctz64(unsigned long long x) { return __builtin_ctzll(x); }
    #endif
    """
    int _ctz64 "atombatch_ctz64"(uint64_t x) noexcept nogil  # x != 0


cdef extern from *:
    """
    #include <string.h>
    /* 1 when every entry of a float32 row is finite (no NaN, no infinity): one pass over the
       exponent bits, an integer loop the compiler vectorizes. */
    static inline int atombatch_all_finite_f32(const float *x, long long n) {
        uint32_t bad = 0;
        long long i;
        for (i = 0; i < n; i++) {
            uint32_t b; memcpy(&b, x + i, 4);
            bad |= (uint32_t)((b & 0x7f800000u) == 0x7f800000u);
        }
        return bad == 0;
    }
    """
    int _all_finite_f32 "atombatch_all_finite_f32"(const float *x, long long n) noexcept nogil


cdef inline bint _int32_vector(object blocks):
    """A C-contiguous 1-D int32 numpy array (read through a typed memoryview)."""
    return isinstance(blocks, np.ndarray) and blocks.dtype == np.int32 and blocks.ndim == 1 \
        and blocks.flags.c_contiguous


cdef inline Py_ssize_t _ceil_div(Py_ssize_t a, Py_ssize_t b) noexcept:
    # Python's -(-a // b): without the cdivision directive `//` floors like Python does.
    return -((-a) // b)


@cython.final
cdef class BlockPool:
    """Owner of every KV block's state; O(1) transitions over intrusive lists."""

    def __cinit__(self, Py_ssize_t num_blocks):
        if num_blocks <= 0:
            raise CapacityError(f"num_blocks={num_blocks} must be positive")
        if num_blocks > 0x7FFFFFFF - 4:
            raise CapacityError(f"num_blocks={num_blocks} does not fit the int32 block index")
        cdef Py_ssize_t n = num_blocks, block
        self._n = n
        self._free_head = <int32_t>n
        self._free_tail = <int32_t>(n + 1)
        self._lru_head = <int32_t>(n + 2)
        self._lru_tail = <int32_t>(n + 3)
        self._prev = np.full(n + 4, -1, dtype=np.int32)
        self._next = np.full(n + 4, -1, dtype=np.int32)
        self._state = np.zeros(n, dtype=np.int8)
        self._owner = np.full(n, -1, dtype=np.int32)
        self._refcnt = np.zeros(n, dtype=np.int32)
        self._prev_v = self._prev
        self._next_v = self._next
        self._state_v = self._state
        self._owner_v = self._owner
        self._refcnt_v = self._refcnt
        for block in range(5):
            self._count[block] = 0
        self._num_evictable = 0
        self._next_v[self._free_head] = self._free_tail
        self._prev_v[self._free_tail] = self._free_head
        self._next_v[self._lru_head] = self._lru_tail
        self._prev_v[self._lru_tail] = self._lru_head
        for block in range(n):
            self._push_back(self._free_tail, <int32_t>block)
        self._count[C_FREE] = n

    # -- list primitives (callers have validated every index) ----------------------------------
    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    @cython.initializedcheck(ATOMBATCH_DEBUG)
    cdef inline void _push_back(self, int32_t tail, int32_t node) noexcept:
        cdef int32_t last = self._prev_v[tail]
        self._next_v[last] = node
        self._prev_v[node] = last
        self._next_v[node] = tail
        self._prev_v[tail] = node

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    @cython.initializedcheck(ATOMBATCH_DEBUG)
    cdef inline void _unlink(self, int32_t node) noexcept:
        cdef int32_t before = self._prev_v[node]
        cdef int32_t after = self._next_v[node]
        self._next_v[before] = after
        self._prev_v[after] = before
        self._prev_v[node] = -1
        self._next_v[node] = -1

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    @cython.initializedcheck(ATOMBATCH_DEBUG)
    cdef inline void _move(self, int32_t block, int8_t state, int32_t owner) noexcept:
        self._count[self._state_v[block]] -= 1
        self._count[state] += 1
        self._state_v[block] = state
        self._owner_v[block] = owner

    cdef int _check_block(self, Py_ssize_t block) except -1:
        if not 0 <= block < self._n:
            raise StateError(f"block={block} is outside the pool 0..{self._n - 1}")
        return 0

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    cdef int _expect(self, Py_ssize_t block, int8_t state, str action) except -1:
        self._check_block(block)
        if self._state_v[block] != state:
            raise StateError(f"cannot {action} block={block}: it is "
                             f"{STATE_NAMES[self._state_v[block]]}, not {STATE_NAMES[state]}")
        return 0

    cdef int _debug_check(self) except -1:
        if ATOMBATCH_DEBUG:
            self.check()
        return 0

    # -- queries --------------------------------------------------------------------------------
    @property
    def num_blocks(self):
        return self._n

    @property
    def num_free(self):
        return self._count[C_FREE]

    @property
    def num_spare(self):
        return self._count[C_SPARE]

    @property
    def num_staged(self):
        return self._count[C_STAGED]

    @property
    def num_lane(self):
        return self._count[C_LANE]

    @property
    def num_cached(self):
        return self._count[C_CACHED]

    @property
    def num_evictable(self):
        """CACHED blocks with refcount 0 (the LRU list)."""
        return self._num_evictable

    @property
    def _counts(self):
        return [self._count[0], self._count[1], self._count[2], self._count[3], self._count[4]]

    def state(self, Py_ssize_t block):
        self._check_block(block)
        return self._state_v[block]

    def owner(self, Py_ssize_t block):
        """Lane of a LANE block, request key of a STAGED block, -1 otherwise."""
        self._check_block(block)
        return self._owner_v[block]

    def refcount(self, Py_ssize_t block):
        self._check_block(block)
        return self._refcnt_v[block]

    def first_free(self):
        """The block `allocate` would hand out next, or -1 when the free list is empty."""
        cdef int32_t head = self._next_v[self._free_head]
        return -1 if head == self._free_tail else head

    def free_blocks(self):
        return self._walk(self._free_head, self._free_tail)

    def lru_blocks(self):
        """Evictable CACHED blocks, least recently used first."""
        return self._walk(self._lru_head, self._lru_tail)

    cdef list _walk(self, int32_t head, int32_t tail):
        cdef list out = []
        cdef int32_t node = self._next_v[head]
        cdef Py_ssize_t steps = 0
        while node != tail:
            if node < 0 or node >= self._n or steps > self._n:
                raise StateError(f"list from sentinel {head} is corrupt at node {node}")
            out.append(node)
            node = self._next_v[node]
            steps += 1
        return out

    def counts(self):
        """(free, spare, staged, lane, cached)."""
        return (self._count[C_FREE], self._count[C_SPARE], self._count[C_STAGED],
                self._count[C_LANE], self._count[C_CACHED])

    # -- transitions ----------------------------------------------------------------------------
    def allocate(self, int state, owner=-1):
        """FREE -> `state` (SPARE, STAGED or LANE) for `owner`; the oldest free block first."""
        if state != C_SPARE and state != C_STAGED and state != C_LANE:
            raise StateError(f"cannot allocate into state={state}: only SPARE, STAGED or LANE")
        cdef int32_t owner_id = owner
        cdef int32_t block = self._next_v[self._free_head]
        if block == self._free_tail:
            raise CapacityError(f"Cannot get 1 free block from the pool: all {self._n} blocks "
                                f"are in use (cached evictable: {self._num_evictable})")
        self._unlink(block)
        self._move(block, <int8_t>state, owner_id if state != C_SPARE else -1)
        self._debug_check()
        return block

    def free(self, Py_ssize_t block):
        """SPARE, STAGED or LANE -> FREE (appended to the free list)."""
        self._check_block(block)
        cdef int8_t state = self._state_v[block]
        if state != C_SPARE and state != C_STAGED and state != C_LANE:
            raise StateError(f"cannot free block={block}: it is {STATE_NAMES[state]}")
        self._move(<int32_t>block, C_FREE, -1)
        self._push_back(self._free_tail, <int32_t>block)
        self._debug_check()

    def reserve_spare(self):
        """Take a FREE block as the spare (padding target and staging area)."""
        return self.allocate(C_SPARE, -1)

    def stage(self, Py_ssize_t block, owner):
        """SPARE -> STAGED(owner): a queued request starts filling the spare."""
        cdef int32_t owner_id = owner
        self._expect(block, C_SPARE, "stage")
        self._move(<int32_t>block, C_STAGED, owner_id)
        self._debug_check()

    def unstage(self, Py_ssize_t block):
        """STAGED -> SPARE: the staging request went away; the block is a padding target again."""
        self._expect(block, C_STAGED, "unstage")
        self._move(<int32_t>block, C_SPARE, -1)
        self._debug_check()

    def assign(self, Py_ssize_t block, lane):
        """STAGED(r) -> LANE(lane): a staged request takes its lane, keeping its filled block."""
        cdef int32_t lane_id = lane
        self._expect(block, C_STAGED, "assign")
        self._move(<int32_t>block, C_LANE, lane_id)
        self._debug_check()

    def to_spare(self, Py_ssize_t block):
        """LANE -> SPARE: a finished lane's block becomes the new spare (no KV copy)."""
        self._expect(block, C_LANE, "make spare")
        self._move(<int32_t>block, C_SPARE, -1)
        self._debug_check()

    def rotate(self, Py_ssize_t staged_block, Py_ssize_t lane_block, lane):
        """Block rotation: STAGED -> LANE(lane) and that lane's old block LANE -> SPARE, at once."""
        cdef int32_t lane_id = lane
        self._expect(staged_block, C_STAGED, "rotate in")
        self._expect(lane_block, C_LANE, "rotate out")
        if self._owner_v[lane_block] != lane_id:
            raise StateError(f"cannot rotate block={lane_block} out of lane={lane}: it belongs to "
                             f"lane={self._owner_v[lane_block]}")
        self._move(<int32_t>staged_block, C_LANE, lane_id)
        self._move(<int32_t>lane_block, C_SPARE, -1)
        self._debug_check()

    def cache(self, Py_ssize_t block):
        """LANE or STAGED -> CACHED with refcount 0, most recently used."""
        self._check_block(block)
        cdef int8_t state = self._state_v[block]
        if state != C_LANE and state != C_STAGED:
            raise StateError(f"cannot cache block={block}: it is {STATE_NAMES[state]}")
        self._move(<int32_t>block, C_CACHED, -1)
        self._refcnt_v[block] = 0
        self._push_back(self._lru_tail, <int32_t>block)
        self._num_evictable += 1
        self._debug_check()

    def acquire(self, Py_ssize_t block):
        """Pin a CACHED block (refcount + 1); a pinned block is not evictable."""
        self._expect(block, C_CACHED, "acquire")
        if self._refcnt_v[block] == 0:
            self._unlink(<int32_t>block)
            self._num_evictable -= 1
        self._refcnt_v[block] += 1
        self._debug_check()

    def acquire_blocks(self, blocks):
        """`acquire` each block in order (a prefix hit pins its shared chain); every block is
        checked before any is pinned."""
        cdef Py_ssize_t block, j
        cdef const int32_t[::1] view
        if _int32_vector(blocks):  # an int32 array (a prefix match): no Python int per block
            view = blocks
            for j in range(view.shape[0]):
                self._expect(view[j], C_CACHED, "acquire")
            for j in range(view.shape[0]):
                block = view[j]
                if self._refcnt_v[block] == 0:
                    self._unlink(<int32_t>block)
                    self._num_evictable -= 1
                self._refcnt_v[block] += 1
            self._debug_check()
            return
        for block in blocks:
            self._expect(block, C_CACHED, "acquire")
        for block in blocks:
            if self._refcnt_v[block] == 0:
                self._unlink(<int32_t>block)
                self._num_evictable -= 1
            self._refcnt_v[block] += 1
        self._debug_check()

    def release(self, Py_ssize_t block):
        """Unpin a CACHED block; at refcount 0 it becomes the most recently used evictable block."""
        self._expect(block, C_CACHED, "release")
        if self._refcnt_v[block] == 0:
            raise StateError(f"cannot release block={block}: its refcount is already 0")
        self._refcnt_v[block] -= 1
        if self._refcnt_v[block] == 0:
            self._push_back(self._lru_tail, <int32_t>block)
            self._num_evictable += 1
        self._debug_check()

    def touch(self, Py_ssize_t block):
        """Mark an unpinned CACHED block most recently used."""
        self._expect(block, C_CACHED, "touch")
        if self._refcnt_v[block] == 0:
            self._unlink(<int32_t>block)
            self._push_back(self._lru_tail, <int32_t>block)
        self._debug_check()

    def evict(self):
        """The least recently used unpinned CACHED block -> FREE; returns it."""
        cdef int32_t block = self._next_v[self._lru_head]
        if block == self._lru_tail:
            raise CapacityError(f"Cannot evict: none of the {self._count[C_CACHED]} cached blocks "
                                "is unpinned")
        self._unlink(block)
        self._num_evictable -= 1
        self._move(block, C_FREE, -1)
        self._push_back(self._free_tail, block)
        self._debug_check()
        return block

    def evict_many(self, Py_ssize_t count):
        """`evict` `count` times (the LRU blocks, in order, to the free list's tail); refused,
        changing nothing, when fewer are unpinned."""
        if not 0 <= count <= self._num_evictable:
            raise CapacityError(f"Cannot evict {count} blocks: {self._num_evictable} of the "
                                f"{self._count[C_CACHED]} cached blocks are unpinned")
        cdef list out = []
        cdef int32_t block
        cdef Py_ssize_t j
        for j in range(count):
            block = self._next_v[self._lru_head]
            self._unlink(block)
            self._num_evictable -= 1
            self._move(block, C_FREE, -1)
            self._push_back(self._free_tail, block)
            out.append(block)
        self._debug_check()
        return out

    def drop(self, Py_ssize_t block):
        """Remove one specific unpinned CACHED block -> FREE (invalidation)."""
        self._expect(block, C_CACHED, "drop")
        if self._refcnt_v[block]:
            raise StateError(f"cannot drop block={block}: refcount {self._refcnt_v[block]}")
        self._unlink(<int32_t>block)
        self._num_evictable -= 1
        self._move(<int32_t>block, C_FREE, -1)
        self._push_back(self._free_tail, <int32_t>block)
        self._debug_check()

    def adopt(self, Py_ssize_t block, lane):
        """An unpinned CACHED block -> LANE(lane): a prefix hit takes the cached KV in place."""
        cdef int32_t lane_id = lane
        self._expect(block, C_CACHED, "adopt")
        if self._refcnt_v[block]:
            raise StateError(f"cannot adopt block={block}: refcount {self._refcnt_v[block]} "
                             "(shared blocks are copied, not adopted)")
        self._unlink(<int32_t>block)
        self._num_evictable -= 1
        self._move(<int32_t>block, C_LANE, lane_id)
        self._debug_check()

    # -- invariants -----------------------------------------------------------------------------
    def check(self):
        """Raise `StateError` if the lists and counters disagree with the per-block states."""
        free = self.free_blocks()
        lru = self.lru_blocks()
        cdef list counts = self._counts
        cdef list want = [0, 0, 0, 0, 0]
        cdef Py_ssize_t block
        for block in range(self._n):
            if not 0 <= self._state_v[block] <= C_CACHED:
                raise StateError(f"block={block} has an unknown state {self._state_v[block]}")
            want[self._state_v[block]] += 1
        if want != counts:
            raise StateError(f"counters {counts} disagree with block states {want}")
        if sum(counts) != self._n:
            raise StateError(f"conservation: {counts} does not sum to {self._n}")
        if sorted(free) != [b for b in range(self._n) if self._state_v[b] == C_FREE]:
            raise StateError("the free list does not hold exactly the FREE blocks")
        if sorted(lru) != [b for b in range(self._n) if self._state_v[b] == C_CACHED and
                           self._refcnt_v[b] == 0]:
            raise StateError("the LRU list does not hold exactly the unpinned CACHED blocks")
        if len(lru) != self._num_evictable:
            raise StateError(f"num_evictable={self._num_evictable}, LRU list has {len(lru)}")


@cython.final
cdef class LaneTable:
    """B stable lanes: state, sequence length, next token and block row per lane."""

    def __cinit__(self, Py_ssize_t batch_size, Py_ssize_t blocks_per_seq, Py_ssize_t block_size):
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
        self._state_v = self._state
        self._seq_len_v = self._seq_len
        self._next_token_v = self._next_token
        self._num_held_v = self._num_held
        self._rows_v = self._rows
        self._num_busy = 0
        self._num_decoding = 0
        # Idle lanes as a bitmap, so `assign` finds the lowest one in B / 64 word reads.
        cdef Py_ssize_t lane
        self._idle_bits = np.zeros((batch_size + 63) // 64, dtype=np.uint64)
        self._idle_v = self._idle_bits
        for lane in range(batch_size):
            self._idle_v[lane >> 6] |= (<uint64_t>1) << (lane & 63)

    cdef int _check_lane(self, Py_ssize_t lane) except -1:
        if not 0 <= lane < self._b:
            raise StateError(f"lane={lane} is outside 0..{self._b - 1}")
        return 0

    cdef int _check_busy(self, Py_ssize_t lane) except -1:
        self._check_lane(lane)
        if self._state_v[lane] == C_LANE_IDLE:
            raise StateError(f"lane={lane} is idle")
        return 0

    cdef inline Py_ssize_t _blocks_for(self, Py_ssize_t num_positions) noexcept:
        return _ceil_div(num_positions, self._block_size)

    @property
    def batch_size(self):
        return self._b

    @property
    def blocks_per_seq(self):
        return self._bps

    @property
    def block_size(self):
        return self._block_size

    @property
    def num_busy(self):
        return self._num_busy

    @property
    def num_idle(self):
        return self._b - self._num_busy

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    def num_decoding(self):
        return self._num_decoding

    def state(self, Py_ssize_t lane):
        self._check_lane(lane)
        return self._state_v[lane]

    def seq_len(self, Py_ssize_t lane):
        self._check_lane(lane)
        return self._seq_len_v[lane]

    def next_token(self, Py_ssize_t lane):
        self._check_lane(lane)
        return self._next_token_v[lane]

    def num_held(self, Py_ssize_t lane):
        self._check_lane(lane)
        return self._num_held_v[lane]

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    def blocks(self, Py_ssize_t lane):
        self._check_lane(lane)
        cdef Py_ssize_t j
        return [self._rows_v[lane, j] for j in range(self._num_held_v[lane])]

    def last_block(self, Py_ssize_t lane):
        self._check_busy(lane)
        cdef int32_t n = self._num_held_v[lane]
        return self._rows_v[lane, n - 1] if n else -1

    def blocks_for(self, Py_ssize_t num_positions):
        """Blocks needed to hold positions 0..num_positions-1."""
        return self._blocks_for(num_positions)

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    def assign(self):
        """Take the lowest idle lane (state PREFILLING, length 0, no blocks)."""
        cdef Py_ssize_t lane, word
        cdef uint64_t bits
        for word in range(self._idle_v.shape[0]):
            bits = self._idle_v[word]
            if bits:
                lane = (word << 6) + _ctz64(bits)
                self._idle_v[word] = bits & (bits - 1)
                self._state_v[lane] = C_LANE_PREFILLING
                self._seq_len_v[lane] = 0
                self._next_token_v[lane] = 0
                self._num_held_v[lane] = 0
                self._num_busy += 1
                return lane
        raise CapacityError(f"Cannot assign a lane: all {self._b} lanes are busy")

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    def release(self, Py_ssize_t lane):
        """Return the lane to the idle set at once; gives back the blocks it held, in order."""
        self._check_busy(lane)
        cdef Py_ssize_t j
        cdef list held = [self._rows_v[lane, j] for j in range(self._num_held_v[lane])]
        if self._state_v[lane] == C_LANE_DECODING:
            self._num_decoding -= 1
        self._state_v[lane] = C_LANE_IDLE
        self._idle_v[lane >> 6] |= (<uint64_t>1) << (lane & 63)
        self._seq_len_v[lane] = 0
        self._next_token_v[lane] = 0
        self._num_held_v[lane] = 0
        for j in range(self._bps):
            self._rows_v[lane, j] = -1
        self._num_busy -= 1
        return held

    def push_block(self, Py_ssize_t lane, Py_ssize_t block):
        """Append a block to the lane's row (the next `block_size` positions)."""
        self._check_busy(lane)
        if not 0 <= block <= C_MAX_TABLE_BLOCK:
            raise StateError(f"block={block} is outside the int16 block-table range "
                             f"0..{MAX_TABLE_BLOCK}")
        cdef int32_t n = self._num_held_v[lane]
        if n >= self._bps:
            raise CapacityError(f"lane={lane} already holds {n} blocks, the row's "
                                f"{self._bps} entries")
        self._rows_v[lane, n] = <int32_t>block
        self._num_held_v[lane] = n + 1

    def push_blocks(self, Py_ssize_t lane, blocks):
        """`push_block` each block in order; all are checked before the row changes."""
        self._check_busy(lane)
        cdef Py_ssize_t block, j
        cdef const int32_t[::1] view
        cdef bint vector = _int32_vector(blocks)  # an int32 array: no Python int per block
        if vector:
            view = blocks
            for j in range(view.shape[0]):
                if not 0 <= view[j] <= C_MAX_TABLE_BLOCK:
                    raise StateError(f"block={view[j]} is outside the int16 block-table range "
                                     f"0..{MAX_TABLE_BLOCK}")
        else:
            for block in blocks:
                if not 0 <= block <= C_MAX_TABLE_BLOCK:
                    raise StateError(f"block={block} is outside the int16 block-table range "
                                     f"0..{MAX_TABLE_BLOCK}")
        cdef int32_t n = self._num_held_v[lane]
        cdef Py_ssize_t count = len(blocks)
        if n + count > self._bps:
            raise CapacityError(f"lane={lane} holds {n} blocks: {count} more exceed the "
                                f"row's {self._bps} entries")
        if vector:
            for j in range(count):
                self._rows_v[lane, n] = view[j]
                n += 1
        else:
            for block in blocks:
                self._rows_v[lane, n] = <int32_t>block
                n += 1
        self._num_held_v[lane] = n

    def pop_block(self, Py_ssize_t lane):
        """Remove and return the lane's last block."""
        self._check_busy(lane)
        cdef int32_t n = self._num_held_v[lane]
        if n == 0:
            raise StateError(f"lane={lane} holds no block")
        cdef int32_t block = self._rows_v[lane, n - 1]
        self._rows_v[lane, n - 1] = -1
        self._num_held_v[lane] = n - 1
        return block

    def replace_block(self, Py_ssize_t lane, Py_ssize_t index, Py_ssize_t block):
        """Swap the block at row entry `index` (rotation, copy-on-write); returns the old block."""
        self._check_busy(lane)
        if not 0 <= index < self._num_held_v[lane]:
            raise StateError(f"lane={lane} has no block at entry {index}")
        if not 0 <= block <= C_MAX_TABLE_BLOCK:
            raise StateError(f"block={block} is outside the int16 block-table range "
                             f"0..{MAX_TABLE_BLOCK}")
        cdef int32_t old = self._rows_v[lane, index]
        self._rows_v[lane, index] = <int32_t>block
        return old

    def set_seq_len(self, Py_ssize_t lane, Py_ssize_t seq_len):
        self._check_busy(lane)
        if not 0 <= seq_len <= self._bps * self._block_size:
            raise RequestError(f"seq_len={seq_len} is outside 0..{self._bps * self._block_size}")
        self._seq_len_v[lane] = <int32_t>seq_len

    def start_decode(self, Py_ssize_t lane, Py_ssize_t seq_len, int64_t token):
        """PREFILLING -> DECODING with `seq_len` cached positions and `token` to feed next."""
        self._check_busy(lane)
        if not 0 <= seq_len < self._bps * self._block_size:
            raise RequestError(f"seq_len={seq_len} is outside 0..{self._bps * self._block_size - 1}")
        if self._blocks_for(seq_len + 1) > self._num_held_v[lane]:
            raise StateError(f"lane={lane} holds {self._num_held_v[lane]} blocks, too few for "
                             f"position {seq_len}")
        if self._state_v[lane] != C_LANE_DECODING:
            self._num_decoding += 1
        self._state_v[lane] = C_LANE_DECODING
        self._seq_len_v[lane] = <int32_t>seq_len
        self._next_token_v[lane] = token

    def stop_decode(self, Py_ssize_t lane):
        """DECODING -> PREFILLING (preemption keeps the lane while it recomputes)."""
        self._check_busy(lane)
        if self._state_v[lane] == C_LANE_DECODING:
            self._num_decoding -= 1
        self._state_v[lane] = C_LANE_PREFILLING

    def advance(self, Py_ssize_t lane, int64_t token):
        """After a decode step: one more cached position, and the sampled token to feed next."""
        self._check_lane(lane)
        if self._state_v[lane] != C_LANE_DECODING:
            raise StateError(f"lane={lane} is not decoding")
        self._seq_len_v[lane] += 1
        self._next_token_v[lane] = token

    def rows(self):
        """A read-only view of the raw rows (-1 past each lane's held blocks)."""
        view = self._rows.view()
        view.flags.writeable = False
        return view


@cython.final
cdef class SlidingSlots:
    """Per-lane fill of the Gemma3 sliding-window slot (`min(positions, window)`)."""

    def __cinit__(self, Py_ssize_t batch_size, Py_ssize_t window):
        if batch_size <= 0 or window <= 0:
            raise CapacityError(f"batch_size={batch_size} and window={window} must be positive")
        self._window = window
        self._fill = np.zeros(batch_size, dtype=np.int32)
        self._fill_v = self._fill

    cdef int _check_lane(self, Py_ssize_t lane) except -1:
        if not 0 <= lane < self._fill_v.shape[0]:
            raise StateError(f"lane={lane} is outside 0..{self._fill_v.shape[0] - 1}")
        return 0

    @property
    def window(self):
        return self._window

    def fill(self, Py_ssize_t lane):
        self._check_lane(lane)
        return self._fill_v[lane]

    def reset(self, Py_ssize_t lane):
        """A new tenant: it must never read the previous tenant's window."""
        self._check_lane(lane)
        self._fill_v[lane] = 0

    def advance(self, Py_ssize_t lane, Py_ssize_t num_tokens):
        """`num_tokens` more tokens entered the slot; returns the new fill."""
        self._check_lane(lane)
        if num_tokens < 0:
            raise StateError(f"num_tokens={num_tokens} must be >= 0")
        cdef Py_ssize_t fill = self._fill_v[lane] + num_tokens
        if fill > self._window:
            fill = self._window
        self._fill_v[lane] = <int32_t>fill
        return self._fill_v[lane]


@cython.final
cdef class DecodeInputs:
    """The decode graph's inputs, allocated once and rewritten in place every step.

    With several compiled decode batch sizes ("buckets"), each step runs the smallest bucket that
    holds the decoding lanes. Rows are packed: rows `0..n-1` are the decoding lanes in lane order,
    the remaining rows of the bucket are padding. Lanes never move (their blocks and sliding slots
    stay theirs); only the row a lane occupies changes. The buffers are allocated once at full batch
    size; a bucket's arrays are views of their first `b` rows (C-contiguous), made once.
    """

    def __cinit__(self, Py_ssize_t batch_size, Py_ssize_t blocks_per_seq, buckets=None):
        self._b = batch_size
        self._bps = blocks_per_seq
        self.buckets = check_buckets(batch_size, buckets)
        self._buckets_v = np.asarray(self.buckets, dtype=np.int32)
        input_ids = np.zeros((batch_size, 1), dtype=np.int64)
        cache_position = np.zeros((batch_size, 1), dtype=np.int32)
        block_tables = np.zeros((batch_size, blocks_per_seq), dtype=np.int16)
        local_block_tables = np.arange(batch_size, dtype=np.int16).reshape(batch_size, 1)
        row_lanes = np.arange(batch_size, dtype=np.int32)
        self._buffers = (input_ids, cache_position, block_tables, local_block_tables, row_lanes)
        self._input_ids_v = input_ids
        self._cache_position_v = cache_position
        self._block_tables_v = block_tables
        self._local_block_tables_v = local_block_tables
        self._row_lanes_v = row_lanes
        self._views = [(input_ids[:b], cache_position[:b], block_tables[:b],
                        local_block_tables[:b], row_lanes[:b]) for b in self.buckets]
        self._select(len(self.buckets) - 1)

    cdef int _select(self, Py_ssize_t index) except -1:
        (self.input_ids, self.cache_position, self.block_tables, self.local_block_tables,
         self.row_lanes) = self._views[index]
        self.num_rows = self._buckets_v[index]
        return 0

    def bucket_for(self, Py_ssize_t num_decoding):
        """The smallest compiled decode batch that holds `num_decoding` lanes."""
        cdef Py_ssize_t i
        for i in range(self._buckets_v.shape[0]):
            if self._buckets_v[i] >= num_decoding:
                return self._buckets_v[i]
        raise StateError(f"{num_decoding} decoding lanes exceed batch_size={self._b}")

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    @cython.initializedcheck(ATOMBATCH_DEBUG)
    def build(self, LaneTable lanes not None, Py_ssize_t padding_block):
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
        cdef Py_ssize_t b = lanes._b, bps = lanes._bps
        cdef Py_ssize_t lane, held, decoding = 0, index = 0, rows, row = 0, pad_row
        cdef int16_t pad
        cdef int8_t[::1] state = lanes._state_v
        cdef int32_t[::1] num_held = lanes._num_held_v
        cdef int32_t[::1] seq_len = lanes._seq_len_v
        cdef int64_t[::1] next_token = lanes._next_token_v
        if self._b != b or self._bps != bps:
            raise StateError(f"decode buffers are {(self._b, self._bps)}, lanes are {(b, bps)}")
        for lane in range(b):
            if state[lane] == C_LANE_DECODING:
                # The device writes position seq_len into entry seq_len // block_size: that entry
                # must be the lane's own block, not a repeated tail entry (or -1 when none is held).
                held = num_held[lane]
                if lanes._blocks_for(seq_len[lane] + 1) > held or held == 0:
                    raise StateError(f"lane={lane} holds {held} blocks, too few for position "
                                     f"{seq_len[lane]}")
                decoding += 1
        while self._buckets_v[index] < decoding:
            index += 1
        rows = self._buckets_v[index]
        if rows > decoding and not 0 <= padding_block <= C_MAX_TABLE_BLOCK:
            raise StateError(f"row={decoding} needs padding but padding_block={padding_block}")
        pad = <int16_t>padding_block
        pad_row = decoding
        for lane in range(b):
            if state[lane] == C_LANE_DECODING:
                self._lane_row(row, lanes, lane, next_token[lane], seq_len[lane])
                row += 1
            elif pad_row < rows:
                self._pad_row(pad_row, lane, pad)
                pad_row += 1
        self._select(index)
        return decoding

    cdef void _lane_row(self, Py_ssize_t row, LaneTable lanes, Py_ssize_t lane, int64_t token,
                        int32_t position) noexcept:
        """Row `row` feeds `token` at `position` through lane `lane`'s blocks (the tail entries
        repeating its last one) and its own sliding slot."""
        cdef Py_ssize_t j, held = lanes._num_held_v[lane]
        cdef int16_t last = <int16_t>lanes._rows_v[lane, held - 1]
        self._input_ids_v[row, 0] = token
        self._cache_position_v[row, 0] = position
        for j in range(held):
            self._block_tables_v[row, j] = <int16_t>lanes._rows_v[lane, j]
        for j in range(held, self._bps):
            self._block_tables_v[row, j] = last
        self._local_block_tables_v[row, 0] = <int16_t>lane
        self._row_lanes_v[row] = <int32_t>lane

    cdef void _pad_row(self, Py_ssize_t row, Py_ssize_t lane, int16_t pad) noexcept:
        """A padding row: token 0 at position 0, every entry `pad`, lane `lane`'s sliding slot."""
        cdef Py_ssize_t j
        self._input_ids_v[row, 0] = 0
        self._cache_position_v[row, 0] = 0
        for j in range(self._bps):
            self._block_tables_v[row, j] = pad
        self._local_block_tables_v[row, 0] = <int16_t>lane
        self._row_lanes_v[row] = <int32_t>lane


@cython.final
cdef class PrefillInputs:
    """The prefill graph's inputs (batch 1, `chunk_size` tokens), allocated once."""

    def __cinit__(self, Py_ssize_t chunk_size, Py_ssize_t blocks_per_seq):
        self.chunk_size = chunk_size
        self._bps = blocks_per_seq
        self.input_ids = np.zeros((1, chunk_size), dtype=np.int64)
        self.cache_position = np.zeros((1, chunk_size), dtype=np.int32)
        self.block_tables = np.zeros(blocks_per_seq, dtype=np.int16)
        self.local_block_tables = np.zeros(1, dtype=np.int16)
        self.query_position = np.zeros((), dtype=np.int16)
        self._input_ids_v = self.input_ids
        self._cache_position_v = self.cache_position
        self._block_tables_v = self.block_tables
        self._local_block_tables_v = self.local_block_tables
        self._query_position_v = self.query_position.reshape(1)  # a view of the 0-d array

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    @cython.initializedcheck(ATOMBATCH_DEBUG)
    def build(self, tokens, Py_ssize_t start, blocks, Py_ssize_t num_blocks,
              Py_ssize_t sliding_slot=0):
        """Fill the chunk that starts at position `start`; returns its number of real tokens.

        Real tokens are `tokens[start : start + chunk_size]`; the rest of the chunk is token 0 at the
        following positions (the device writes them; the scheduler holds blocks for the padded
        extent). The table row holds `blocks[:num_blocks]`, tail entries repeating the last block.
        Everything is validated before anything is written.
        """
        cdef Py_ssize_t q = self.chunk_size, total = len(tokens), j, real
        cdef Py_ssize_t nb = self._bps
        cdef const int64_t[:] token_v
        cdef const int32_t[:] block_v
        cdef int16_t[::1] tables = self._block_tables_v
        cdef int64_t[:, ::1] input_ids = self._input_ids_v
        cdef int32_t[:, ::1] cache_position = self._cache_position_v
        cdef int16_t last
        if not 0 <= start < total:
            raise StateError(f"start={start} is outside the {total}-token prompt")
        if not 0 < num_blocks <= nb:
            raise StateError(f"num_blocks={num_blocks} is outside 1..{nb}")
        if num_blocks > len(blocks):
            raise StateError(f"num_blocks={num_blocks} but only {len(blocks)} blocks were given")
        fast_blocks = isinstance(blocks, np.ndarray) and blocks.dtype == np.int32 and blocks.ndim == 1
        if fast_blocks:
            block_v = blocks
            for j in range(num_blocks):
                if not 0 <= block_v[j] <= C_MAX_TABLE_BLOCK:
                    raise StateError(f"blocks[{j}]={block_v[j]} is outside the int16 block-table "
                                     f"range 0..{MAX_TABLE_BLOCK}")
        else:
            for j in range(num_blocks):
                if not 0 <= blocks[j] <= MAX_TABLE_BLOCK:
                    raise StateError(f"blocks[{j}]={blocks[j]} is outside the int16 block-table "
                                     f"range 0..{MAX_TABLE_BLOCK}")
        if not 0 <= sliding_slot <= C_MAX_TABLE_BLOCK:
            raise StateError(f"sliding_slot={sliding_slot} is outside 0..{MAX_TABLE_BLOCK}")
        real = min(q, total - start)
        if isinstance(tokens, np.ndarray) and tokens.dtype == np.int64 and tokens.ndim == 1:
            token_v = tokens
            for j in range(real):
                input_ids[0, j] = token_v[start + j]
        else:
            self.input_ids[0, :real] = tokens[start : start + real]
        for j in range(real, q):
            input_ids[0, j] = 0
        for j in range(q):
            cache_position[0, j] = <int32_t>(start + j)
        if fast_blocks:
            for j in range(num_blocks):
                tables[j] = <int16_t>block_v[j]
            last = <int16_t>block_v[num_blocks - 1]
        else:
            for j in range(num_blocks):
                tables[j] = <int16_t>blocks[j]
            last = <int16_t>blocks[num_blocks - 1]
        for j in range(num_blocks, nb):
            tables[j] = last
        self._local_block_tables_v[0] = <int16_t>sliding_slot
        self._query_position_v[0] = <int16_t>(real - 1)
        return real


@cython.final
cdef class StepKernel:
    """The per-lane work of a decode step, for every lane in one call each.

    A steady decode step is `grow()` (a new block for each lane at a block boundary, taken from the
    free list), `build(padding_block)` (the decode inputs, in place), the device call,
    `pick(logits, greedy)` (the greedy tokens, numpy's argmax, and the finite check of every row)
    and `complete(now)` (append each row's token to its request's output array, advance the lane
    and its sliding slot, detect stop ids and the output limit). Each returns how many entries of
    `attention` the caller must look at: lanes that need a block the free list does not have
    (eviction or preemption is the caller's choice), rows the caller samples or fails, rows that
    finished or whose requests want their outputs built by the caller. Everything else stays in
    this class's arrays: nothing is allocated per lane, and no Python runs per lane.

    The request data a lane needs (its output and token-time arrays, its id, its output limit, its
    stop ids and flags) is bound when the lane starts decoding (`bind`) and dropped when the lane is
    released (`unbind`). Rows are those of the last `build`: rows `0..num_rows-1` are the decoding
    lanes in lane order (`inputs.row_lanes`); `tokens` and `status` are indexed by row.
    """

    cdef readonly BlockPool pool
    cdef readonly LaneTable lanes
    cdef readonly DecodeInputs inputs
    cdef readonly object slots
    cdef readonly Py_ssize_t num_rows, completed, max_stop_ids
    cdef readonly object tokens, status, plain, attention, ids
    cdef readonly object _num_out, _max_out, _flags
    cdef object _num_stops, _stops, _outputs, _times
    cdef int64_t[::1] _tokens_v
    cdef int8_t[::1] _status_v, _plain_v
    cdef int32_t[::1] _attention_v
    cdef int32_t[::1] _num_out_v, _max_out_v, _num_stops_v
    cdef int8_t[::1] _flags_v
    cdef int64_t[:, ::1] _stops_v
    cdef int32_t[::1] _fill_v
    cdef int32_t[::1] _source_v
    cdef object _source
    cdef Py_ssize_t _window

    def __cinit__(self, BlockPool pool not None, LaneTable lanes not None,
                  DecodeInputs inputs not None, SlidingSlots slots=None,
                  Py_ssize_t max_stop_ids=MAX_STOP_IDS):
        cdef Py_ssize_t b = lanes._b
        if inputs._b != b or inputs._bps != lanes._bps:
            raise StateError(f"decode buffers are {(inputs._b, inputs._bps)}, lanes are "
                             f"{(b, lanes._bps)}")
        if slots is not None and slots._fill_v.shape[0] != b:
            raise StateError(f"sliding slots cover {slots._fill_v.shape[0]} lanes, the table {b}")
        if max_stop_ids < 0:
            raise CapacityError(f"max_stop_ids={max_stop_ids} must be >= 0")
        self.pool = pool
        self.lanes = lanes
        self.inputs = inputs
        self.slots = slots
        if slots is not None:
            self._fill_v = slots._fill_v
            self._window = slots._window
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
        self._num_stops = np.zeros(b, dtype=np.int32)
        self._stops = np.zeros((b, max(max_stop_ids, 1)), dtype=np.int64)
        self._tokens_v = self.tokens
        self._status_v = self.status
        self._plain_v = self.plain.view(np.int8)
        self._attention_v = self.attention
        self._num_out_v = self._num_out
        self._max_out_v = self._max_out
        self._flags_v = self._flags
        self._num_stops_v = self._num_stops
        self._stops_v = self._stops
        self._outputs = [None] * b
        self._times = [None] * b
        self.ids = [None] * b
        self._source = np.full(b, -1, dtype=np.int32)
        self._source_v = self._source

    # -- per-lane request data ------------------------------------------------------------------
    def bind(self, Py_ssize_t lane, request_id, carray.array output not None,
             carray.array times not None, max_output, stop_ids, flags):
        """Lane `lane` decodes for `request_id`: its tokens go to `output` (and `now` to `times`),
        it finishes "length" once `output` holds `max_output` tokens and "stop" on a token of
        `stop_ids`. `flags`: LANE_SAMPLE (the caller samples its row) and LANE_OWN_OUTPUT (the
        caller builds its outputs); more stop ids than `max_stop_ids` add LANE_STOPCHECK.
        `output` is an `array("q")` and `times` an `array("d")`: appended to in place.
        Everything is checked (as Python ints) before anything is written: a refused bind leaves
        the lane's binding as it was."""
        self.lanes._check_lane(lane)
        if self.lanes._state_v[lane] != C_LANE_DECODING:
            raise StateError(f"lane={lane} is not decoding: bind it after `start_decode`")
        if output.typecode != "q" or times.typecode != "d":
            raise TypeError(f"output must be an array('q') and times an array('d'), not "
                            f"array({output.typecode!r}) and array({times.typecode!r})")
        if not 0 <= max_output <= 0x7FFFFFFF:
            raise RequestError(f"max_output={max_output} is outside 0..{0x7FFFFFFF}")
        if flags & ~(C_LANE_SAMPLE | C_LANE_OWN_OUTPUT):
            raise StateError(f"flags={flags} has bits other than LANE_SAMPLE | LANE_OWN_OUTPUT")
        stops = [int(t) for t in stop_ids]
        for t in stops:
            if not -0x8000000000000000 <= t <= 0x7FFFFFFFFFFFFFFF:
                raise RequestError(f"stop id {t} is outside the int64 range")
        cdef Py_ssize_t j, n = len(stops)
        cdef int lane_flags = flags
        if n > self.max_stop_ids:
            lane_flags |= C_LANE_STOPCHECK
            n = 0
        for j in range(n):
            self._stops_v[lane, j] = stops[j]
        self._num_stops_v[lane] = <int32_t>n
        self._num_out_v[lane] = <int32_t>len(output)
        self._max_out_v[lane] = <int32_t>max_output
        self._flags_v[lane] = <int8_t>lane_flags
        self._outputs[lane] = output
        self._times[lane] = times
        self.ids[lane] = request_id

    def unbind(self, Py_ssize_t lane):
        """Drop the lane's request data (it finished, failed or was preempted)."""
        self.lanes._check_lane(lane)
        self._outputs[lane] = None
        self._times[lane] = None
        self.ids[lane] = None
        self._flags_v[lane] = 0
        self._num_stops_v[lane] = 0

    def flags(self, Py_ssize_t lane):
        self.lanes._check_lane(lane)
        return self._flags_v[lane]

    def num_output(self, Py_ssize_t lane):
        self.lanes._check_lane(lane)
        return self._num_out_v[lane]

    # -- the step -------------------------------------------------------------------------------
    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    @cython.initializedcheck(ATOMBATCH_DEBUG)
    def grow(self, Py_ssize_t ahead=0):
        """Give every decoding lane the blocks its next position needs, from the free list, in lane
        order. Returns k: `attention[:k]` are the lanes (in lane order) still short of a block
        because the free list ran dry; the caller evicts or preempts for them, then grows again.
        `ahead=1`: the position after that, for the step after the one on the device now
        (`build_ahead`); a lane whose output limit that step reaches is left alone, and one
        whose row cannot hold that position is reported short (not an error)."""
        cdef LaneTable lanes = self.lanes
        cdef BlockPool pool = self.pool
        cdef Py_ssize_t b = lanes._b, bps = lanes._bps, lane, need, k = 0
        cdef int32_t held, block
        cdef int8_t[::1] state = lanes._state_v
        cdef int32_t[::1] num_held = lanes._num_held_v
        cdef int32_t[::1] seq_len = lanes._seq_len_v
        cdef int32_t[:, ::1] rows = lanes._rows_v
        if not 0 <= ahead <= 1:
            raise StateError(f"ahead={ahead} must be 0 or 1")
        for lane in range(b):
            if state[lane] != C_LANE_DECODING:
                continue
            if ahead and self._num_out_v[lane] + 1 >= self._max_out_v[lane]:
                continue
            need = lanes._blocks_for(seq_len[lane] + 1 + ahead)
            if ahead and need > bps:  # past its row: the synchronous step decides what ends
                self._attention_v[k] = <int32_t>lane
                k += 1
                continue
            while num_held[lane] < need:
                held = num_held[lane]
                if held >= bps:
                    raise CapacityError(f"lane={lane} already holds {held} blocks, the row's "
                                        f"{bps} entries")
                if not self._push_free_block(rows, num_held, lane, held):
                    self._attention_v[k] = <int32_t>lane
                    k += 1
                    break
        pool._debug_check()
        return k

    cdef inline int _push_free_block(self, int32_t[:, ::1] rows, int32_t[::1] num_held,
                                     Py_ssize_t lane, int32_t held) except -1:
        """The oldest free block into `lane`'s row at entry `held`; 0 if none is free."""
        cdef BlockPool pool = self.pool
        cdef int32_t block = pool._next_v[pool._free_head]
        if block == pool._free_tail:
            return 0
        if block > C_MAX_TABLE_BLOCK:
            raise StateError(f"block={block} is outside the int16 block-table range "
                             f"0..{MAX_TABLE_BLOCK}")
        pool._unlink(block)
        pool._move(block, C_LANE, <int32_t>lane)
        rows[lane, held] = block
        num_held[lane] = held + 1
        return 1

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    @cython.initializedcheck(ATOMBATCH_DEBUG)
    def grow_lane(self, Py_ssize_t lane, Py_ssize_t num_positions):
        """Give one busy lane the blocks that positions 0..num_positions-1 need, from the free
        list, oldest free block first (what `allocate(LANE, lane)` + `push_block` do block by
        block). Returns how many blocks it still lacks because the free list ran dry (the caller
        evicts for them)."""
        cdef LaneTable lanes = self.lanes
        cdef BlockPool pool = self.pool
        lanes._check_busy(lane)
        cdef Py_ssize_t need = lanes._blocks_for(num_positions)
        if need > lanes._bps:
            raise CapacityError(f"lane={lane} cannot hold {need} blocks: the row has "
                                f"{lanes._bps} entries")
        cdef int32_t[::1] num_held = lanes._num_held_v
        cdef int32_t[:, ::1] rows = lanes._rows_v
        cdef int32_t held = num_held[lane]
        while held < need and self._push_free_block(rows, num_held, lane, held):
            held += 1
        pool._debug_check()
        return need - held if need > held else 0

    def build(self, Py_ssize_t padding_block):
        """The decode inputs for the decoding lanes (`DecodeInputs.build`); returns the rows that
        decode (rows of the bucket past them are padding)."""
        self.num_rows = self.inputs.build(self.lanes, padding_block)
        return self.num_rows

    def use(self, DecodeInputs inputs not None, Py_ssize_t num_rows):
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

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    @cython.initializedcheck(ATOMBATCH_DEBUG)
    def build_ahead(self, DecodeInputs out not None, DecodeInputs previous not None,
                    Py_ssize_t previous_rows, gather, Py_ssize_t padding_block, joins=None):
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
        cdef LaneTable lanes = self.lanes
        cdef Py_ssize_t b = lanes._b, bps = lanes._bps
        cdef Py_ssize_t lane, held, decoding = 0, index = 0, rows, row = 0, pad_row, position
        cdef Py_ssize_t padding_slot = -1
        cdef bint hybrid
        cdef int16_t pad
        cdef int8_t[::1] state = lanes._state_v
        cdef int32_t[::1] num_held = lanes._num_held_v
        cdef int32_t[::1] seq_len = lanes._seq_len_v
        cdef int32_t[::1] source = self._source_v
        cdef int32_t[::1] previous_lanes = previous._row_lanes_v
        cdef int32_t[::1] gather_v = gather
        cdef int32_t[::1] join_at
        cdef bint joining = joins is not None
        if out._b != b or out._bps != bps or previous._b != b or previous._bps != bps:
            raise StateError(f"decode buffers are {(out._b, out._bps)} and "
                             f"{(previous._b, previous._bps)}, lanes are {(b, bps)}")
        if out is previous:
            raise StateError("build_ahead needs a buffer other than the one on the device")
        if not 0 <= previous_rows <= previous.num_rows:
            raise StateError(f"previous_rows={previous_rows} is outside 0..{previous.num_rows}")
        if gather_v.shape[0] < b:
            raise StateError(f"gather has {gather_v.shape[0]} entries, fewer than {b} lanes")
        if joining:
            join_at = joins
            if join_at.shape[0] < b:
                raise StateError(f"joins has {join_at.shape[0]} entries, fewer than {b} lanes")
            for lane in range(b):
                if join_at[lane] < 0:
                    continue
                if state[lane] != C_LANE_PREFILLING:
                    raise StateError(f"joins[{lane}]={join_at[lane]}: lane {lane} does not "
                                     f"prefill")
                if lanes._blocks_for(join_at[lane] + 1) > num_held[lane]:
                    raise StateError(f"joins[{lane}]={join_at[lane]}: lane {lane} holds "
                                     f"{num_held[lane]} blocks, too few for that position")
        for lane in range(b):
            source[lane] = -1
        for row in range(previous_rows):
            source[previous_lanes[row]] = <int32_t>row
        for lane in range(b):
            if joining and join_at[lane] >= 0:
                decoding += 1
                continue
            if state[lane] != C_LANE_DECODING:
                continue
            if source[lane] >= 0 and self._num_out_v[lane] + 1 >= self._max_out_v[lane]:
                continue  # finishes in the step on the device
            held = num_held[lane]
            position = seq_len[lane] + (source[lane] >= 0)
            if lanes._blocks_for(position + 1) > held:
                raise StateError(f"lane={lane} holds {held} blocks, too few for position "
                                 f"{position}")
            decoding += 1
        if decoding == 0:
            return 0
        while out._buckets_v[index] < decoding:
            index += 1
        rows = out._buckets_v[index]
        if rows > decoding and not 0 <= padding_block <= C_MAX_TABLE_BLOCK:
            return -1  # padding rows and no block to point them at (no eviction ahead)
        # A hybrid lane that prefills may have a chunk on the device before this step (its
        # window is being built, or just was): a padding row writes its slot at position 0, so
        # padding takes only the slots of lanes that are idle or end in the step on the device,
        # the first of them again when they are fewer than the padding rows
        hybrid = self.slots is not None
        if rows > decoding and hybrid:
            for lane in range(b):
                if state[lane] == C_LANE_PREFILLING:
                    continue
                if state[lane] == C_LANE_DECODING and (
                        source[lane] < 0 or self._num_out_v[lane] + 1 < self._max_out_v[lane]):
                    continue  # it goes on
                padding_slot = lane
                break
            if padding_slot < 0:
                return -1  # every lane without a row prefills: no slot padding may write
        pad = <int16_t>padding_block
        pad_row = decoding
        row = 0
        for lane in range(b):
            if joining and join_at[lane] >= 0:  # its first token comes from its chunk
                out._lane_row(row, lanes, lane, 0, join_at[lane])
                gather_v[row] = -2
                row += 1
            elif state[lane] == C_LANE_DECODING and source[lane] < 0:
                # joins: its own token, at its own length
                out._lane_row(row, lanes, lane, lanes._next_token_v[lane], seq_len[lane])
                gather_v[row] = -2
                row += 1
            elif state[lane] == C_LANE_DECODING and \
                    self._num_out_v[lane] + 1 < self._max_out_v[lane]:
                out._lane_row(row, lanes, lane, 0, seq_len[lane] + 1)
                gather_v[row] = source[lane]
                row += 1
            elif pad_row < rows and not (hybrid and state[lane] == C_LANE_PREFILLING):
                out._pad_row(pad_row, lane, pad)
                gather_v[pad_row] = -1
                pad_row += 1
        while pad_row < rows:  # hybrid: fewer free slots than padding rows
            out._pad_row(pad_row, padding_slot, pad)
            gather_v[pad_row] = -1
            pad_row += 1
        out._select(index)
        return decoding

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    @cython.initializedcheck(ATOMBATCH_DEBUG)
    def pick(self, logits, greedy):
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
        cdef const float[:, ::1] values = logits
        cdef const int64_t[::1] picks = greedy
        cdef Py_ssize_t n = self.num_rows, row, k = 0
        self._check_picks(picks, values.shape[0], values.shape[1], "logits")
        for row in range(n):
            k = self._mark(row, _all_finite_f32(&values[row, picks[row]], 1), picks[row], k)
        return k

    cdef int _check_picks(self, const int64_t[::1] picks, Py_ssize_t rows, Py_ssize_t vocab,
                          str what) except -1:
        """The last build's rows each have a logit row (`rows` of them) and a pick in 0..vocab-1."""
        cdef Py_ssize_t n = self.num_rows, row
        if rows < n or picks.shape[0] < n:
            raise StateError(f"{what}: {rows} rows, greedy: {picks.shape[0]}; the step ran "
                             f"{n} rows")
        if vocab < 1:
            raise StateError("logits have no vocabulary entries")
        for row in range(n):
            if not 0 <= picks[row] < vocab:
                raise StateError(f"greedy[{row}]={picks[row]} is outside the vocabulary "
                                 f"0..{vocab - 1}")
        return 0

    cdef inline Py_ssize_t _mark(self, Py_ssize_t row, bint finite, int64_t best,
                                 Py_ssize_t k) noexcept:
        """Row `row` picked `best` (its logit finite or not); returns the attention count."""
        if not finite:
            self._status_v[row] = C_ROW_NONFINITE
            self._tokens_v[row] = 0
            self._attention_v[k] = <int32_t>row
            return k + 1
        self._tokens_v[row] = best
        if self._flags_v[self.inputs._row_lanes_v[row]] & C_LANE_SAMPLE:
            self._status_v[row] = C_ROW_SAMPLE
            self._attention_v[k] = <int32_t>row
            return k + 1
        self._status_v[row] = C_ROW_OK
        return k

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    @cython.initializedcheck(ATOMBATCH_DEBUG)
    def pick_values(self, best, greedy, Py_ssize_t vocab):
        """`pick` for a step whose logits are gone (the device runs the next step into them):
        `best[row]` is the float32 logit `greedy[row]` picked in row `row`."""
        cdef const float[::1] values = best
        cdef const int64_t[::1] picks = greedy
        cdef Py_ssize_t n = self.num_rows, row, k = 0
        self._check_picks(picks, values.shape[0], vocab, "best")
        for row in range(n):
            k = self._mark(row, _all_finite_f32(&values[row], 1), picks[row], k)
        return k

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    @cython.initializedcheck(ATOMBATCH_DEBUG)
    def complete(self, now):
        """Each row's `tokens[row]` becomes its lane's next token: appended to the bound output
        array (and `now` to the token times), the lane one position longer, its sliding slot one
        fuller. A row whose lane no longer decodes (its request failed during the step) is
        ROW_SKIPPED; a ROW_NONFINITE row is left alone. Returns k: `attention[:k]` are the rows
        the caller handles, in row order: ROW_STOP (a stop id), ROW_LENGTH (the output limit),
        ROW_CHECK (the caller checks the stop condition) and ROW_OK rows of LANE_OWN_OUTPUT lanes.
        `completed` counts the tokens appended; `plain[row]` is True for the other rows that
        appended a token (the caller has nothing to do for them but report the token)."""
        cdef LaneTable lanes = self.lanes
        cdef Py_ssize_t n = self.num_rows, row, lane, k = 0, j, done = 0
        cdef int8_t[::1] state = lanes._state_v
        cdef int32_t[::1] seq_len = lanes._seq_len_v
        cdef int64_t[::1] next_token = lanes._next_token_v
        cdef int32_t[::1] row_lanes = self.inputs._row_lanes_v
        cdef int64_t token
        cdef int8_t status, flags
        cdef bint hybrid = self.slots is not None
        cdef list outputs = self._outputs, times = self._times
        cdef carray.array out, at
        cdef Py_ssize_t size
        cdef double when = now
        for row in range(n):  # validated first: a failed call changes nothing
            lane = row_lanes[row]
            if state[lane] == C_LANE_DECODING and self._status_v[row] != C_ROW_NONFINITE and \
                    outputs[lane] is None:
                raise StateError(f"lane={lane} decodes but no request is bound to it")
        for row in range(n):
            lane = row_lanes[row]
            self._plain_v[row] = 0
            if self._status_v[row] == C_ROW_NONFINITE:
                continue
            if state[lane] != C_LANE_DECODING:
                self._status_v[row] = C_ROW_SKIPPED
                continue
            token = self._tokens_v[row]
            seq_len[lane] += 1
            next_token[lane] = token
            if hybrid and self._fill_v[lane] < self._window:
                self._fill_v[lane] += 1
            out = <carray.array>outputs[lane]
            size = len(out)
            carray.resize_smart(out, size + 1)
            out.data.as_longlongs[size] = token
            at = <carray.array>times[lane]
            size = len(at)
            carray.resize_smart(at, size + 1)
            at.data.as_doubles[size] = when
            self._num_out_v[lane] += 1
            done += 1
            flags = self._flags_v[lane]
            status = C_ROW_OK
            if flags & C_LANE_STOPCHECK:
                status = C_ROW_CHECK
            else:
                for j in range(self._num_stops_v[lane]):
                    if self._stops_v[lane, j] == token:
                        status = C_ROW_STOP
                        break
                if status == C_ROW_OK and self._num_out_v[lane] >= self._max_out_v[lane]:
                    status = C_ROW_LENGTH
            self._status_v[row] = status
            if status != C_ROW_OK or flags & C_LANE_OWN_OUTPUT:
                self._attention_v[k] = <int32_t>row
                k += 1
            else:
                self._plain_v[row] = 1
        self.completed = done
        return k

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    @cython.initializedcheck(ATOMBATCH_DEBUG)
    def emit(self, list out not None, factory):
        """Append `factory(request_id, (token,), False)` for every `plain` row of the last
        `complete` (built only for callers that want one object per token); returns how many."""
        cdef Py_ssize_t n = self.num_rows, row, count = 0
        cdef int32_t[::1] row_lanes = self.inputs._row_lanes_v
        cdef list ids = self.ids
        for row in range(n):
            if self._plain_v[row]:
                out.append(factory(ids[row_lanes[row]], (self._tokens_v[row],), False))
                count += 1
        return count


# -- prefix digests and token comparison -----------------------------------------------------------
# The prefix cache's block digests (`atombatch.kernel.prefix`): xxh3-128 from the vendored single-header
# xxHash 0.8.4 (`_vendor/xxhash`, BSD-2-Clause; the version the `xxhash` wheel wraps), inlined so
# that a prompt's full blocks are hashed in one call with no Python object per block but the
# digests themselves. xxh3's one-shot and streaming forms give the same value, so these equal the
# twin's per-block `xxhash.xxh3_128` states byte for byte.

cdef extern from *:
    """
    #define XXH_INLINE_ALL
    #include "xxhash.h"
    """
    ctypedef struct XXH128_hash_t:
        uint64_t low64
        uint64_t high64
    ctypedef struct XXH128_canonical_t:
        unsigned char digest[16]
    XXH128_hash_t XXH3_128bits_withSeed(const void* data, size_t length, uint64_t seed) nogil
    void XXH128_canonicalFromHash(XXH128_canonical_t* dst, XXH128_hash_t hash) nogil

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdlib cimport free as c_free
from libc.stdlib cimport calloc, malloc
from libc.string cimport memcpy


def block_digests(const int64_t[::1] tokens, Py_ssize_t start, Py_ssize_t stop,
                  Py_ssize_t block_size, bytes parent, uint64_t seed):
    """The chained digests of the full blocks `tokens[start:stop]` (a whole number of blocks),
    the first chained to `parent` (16 zero bytes when empty): each is
    `xxh3_128(parent || int64 tokens || b"F", seed)` in canonical (big-endian) byte order.
    `chain_digests` computes them; this returns each as bytes."""
    if block_size <= 0 or start < 0 or stop > tokens.shape[0] or stop < start or \
            (stop - start) % block_size:
        raise ValueError(f"tokens[{start}:{stop}] is not a whole number of {block_size}-token "
                         f"blocks of the {tokens.shape[0]} tokens")
    rows = np.empty(((stop - start) // block_size, 16), dtype=np.uint8)
    chain_digests(tokens, start, stop, block_size, parent, seed, rows, 0)
    return [row.tobytes() for row in rows]


# -- the decode pipeline's critical path (atombatch/engine/pipeline.py) ------------------------------------
# Between two device calls of the pipeline the host only picks each row's token (numpy's argmax)
# and writes it into the next call's inputs. Measured here, the first numpy call after a device
# wait costs 20-50 us more than the same call back to back (its dispatch code is cold), so the
# rest is plain loops, one call each.

@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def picked_logits(const float[:, ::1] logits, const int64_t[::1] greedy, float[::1] best,
                  Py_ssize_t keep):
    """`best[row] = logits[row, greedy[row]]` for rows `0..keep-1` (float32 `logits`)."""
    cdef Py_ssize_t row, vocab = logits.shape[1], pick
    if not 0 <= keep <= logits.shape[0] or greedy.shape[0] < keep or best.shape[0] < keep:
        raise StateError(f"keep={keep} rows of {logits.shape[0]} (greedy {greedy.shape[0]}, "
                         f"best {best.shape[0]})")
    for row in range(keep):
        pick = greedy[row]
        if not 0 <= pick < vocab:
            raise StateError(f"greedy[{row}]={pick} is outside the vocabulary 0..{vocab - 1}")
        best[row] = logits[row, pick]
    return keep


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def gather_tokens(const int64_t[::1] tokens, const int32_t[::1] gather, int64_t[:, ::1] input_ids):
    """`input_ids[row, 0] = tokens[gather[row]]` for every row (`gather[row] == -1`: 0; -2: the
    row keeps its token)."""
    cdef Py_ssize_t rows = input_ids.shape[0], row, source, n = tokens.shape[0]
    if gather.shape[0] < rows or input_ids.shape[1] != 1:
        raise StateError(f"gather has {gather.shape[0]} entries for input_ids of shape "
                         f"{(rows, input_ids.shape[1])}")
    for row in range(rows):
        source = gather[row]
        if not -2 <= source < n:
            raise StateError(f"gather[{row}]={source} is outside -2..{n - 1}")
        if source != -2:
            input_ids[row, 0] = tokens[source] if source >= 0 else 0
    return rows


cdef extern from *:
    """
    #include <stddef.h>
    #include <stdint.h>
    #include <string.h>
    /* Vectors of eight floats (GCC/clang vector extensions: SIMD where the target has it,
       scalar code where not); on x86-64 Linux an AVX2 clone is picked at load time. */
    typedef float atombatch_vf __attribute__((vector_size(32)));
    typedef int32_t atombatch_vi __attribute__((vector_size(32)));
    #define ATOMBATCH_L 8
    #if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) || __GNUC__ >= 6)
    #define ATOMBATCH_CLONES __attribute__((target_clones("avx2", "default")))
    #else
    #define ATOMBATCH_CLONES
    #endif
    /* one accumulator: its lanes keep the largest value seen and the first index it was at */
    #define ATOMBATCH_ACC(a, idx, off) do { \
            atombatch_vf v_; atombatch_vi gt_; \
            memcpy(&v_, x + i + (off), sizeof v_); \
            gt_ = v_ > a; \
            a = (atombatch_vf)(((atombatch_vi)v_ & gt_) | ((atombatch_vi)a & ~gt_)); \
            idx = ((lane + (int32_t)(i + (off))) & gt_) | (idx & ~gt_); \
            nan |= v_ != v_; } while (0)

    /* numpy's argmax of one float32 row of n >= 1 entries (n < 2^31): the first NaN if it
       holds one, else the first index of its maximum. One pass over the row, four vectors of
       eight per iteration, each lane keeping its own maximum and where it was. */
    ATOMBATCH_CLONES
    static Py_ssize_t atombatch_row_argmax(const float *x, Py_ssize_t n) {
        float m;
        Py_ssize_t i = 0, j, k, at = 0;
        int any = 0;
        if (n >= 4 * ATOMBATCH_L) {
            atombatch_vf a0, a1, a2, a3;
            atombatch_vi i0, i1, i2, i3, nan, lane;
            for (k = 0; k < ATOMBATCH_L; k++) lane[k] = (int32_t)k;
            memcpy(&a0, x, sizeof a0);
            memcpy(&a1, x + ATOMBATCH_L, sizeof a1);
            memcpy(&a2, x + 2 * ATOMBATCH_L, sizeof a2);
            memcpy(&a3, x + 3 * ATOMBATCH_L, sizeof a3);
            nan = (a0 != a0) | (a1 != a1) | (a2 != a2) | (a3 != a3);
            i0 = lane;
            i1 = lane + ATOMBATCH_L;
            i2 = lane + 2 * ATOMBATCH_L;
            i3 = lane + 3 * ATOMBATCH_L;
            for (i = 4 * ATOMBATCH_L; i + 4 * ATOMBATCH_L <= n; i += 4 * ATOMBATCH_L) {
                ATOMBATCH_ACC(a0, i0, 0);
                ATOMBATCH_ACC(a1, i1, ATOMBATCH_L);
                ATOMBATCH_ACC(a2, i2, 2 * ATOMBATCH_L);
                ATOMBATCH_ACC(a3, i3, 3 * ATOMBATCH_L);
            }
            for (k = 0; k < ATOMBATCH_L; k++) any |= nan[k];
            {
                atombatch_vf values[4] = {a0, a1, a2, a3};
                atombatch_vi where[4] = {i0, i1, i2, i3};
                m = a0[0];
                at = i0[0];
                for (j = 0; j < 4; j++) {
                    for (k = 0; k < ATOMBATCH_L; k++) {
                        float e = values[j][k];
                        if (e > m || (e == m && where[j][k] < at)) { m = e; at = where[j][k]; }
                    }
                }
            }
        } else {
            m = x[0];
            any = m != m;
            i = 1;
        }
        for (; i < n; i++) {  /* the tail: indices above every vector's */
            float v = x[i];
            if (v > m) { m = v; at = i; }
            any |= v != v;
        }
        if (any) {
            for (i = 0; x[i] == x[i]; i++) {}
            return i;
        }
        return at;
    }
    """
    Py_ssize_t atombatch_row_argmax(const float *x, Py_ssize_t n) nogil


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def argmax_rows(const float[:, ::1] logits, int64_t[::1] greedy, float[::1] best=None):
    """`greedy[row] = numpy.argmax(logits[row])` for every row (the first NaN of a row that holds
    one, else the first index of its maximum) and, with `best`, `best[row]` the logit it picked;
    returns the rows. One compiled pass per row, without the interpreter lock."""
    cdef Py_ssize_t rows = logits.shape[0], vocab = logits.shape[1], row, pick
    cdef bint keep = best is not None
    if vocab < 1 or vocab >= 2 ** 31 or greedy.shape[0] < rows or \
            (keep and best.shape[0] < rows):
        raise StateError(f"logits of shape {(rows, vocab)} for greedy {greedy.shape[0]}"
                         + (f", best {best.shape[0]}" if keep else "")
                         + " (rows need an entry each, and 1 <= vocab < 2**31)")
    with nogil:
        for row in range(rows):
            pick = atombatch_row_argmax(&logits[row, 0], vocab)
            greedy[row] = pick
            if keep:
                best[row] = logits[row, pick]
    return rows


from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBuffer_Release, PyObject_GetBuffer


@cython.boundscheck(False)
@cython.wraparound(False)
def argmax_call(object raw, Py_ssize_t rows, Py_ssize_t vocab, Py_ssize_t limit,
                int64_t[::1] greedy, float[::1] best):
    """`argmax_rows(raw, greedy, best)` when `raw` (a decode call's result) is a plain
    C-contiguous float32 ndarray of shape `(rows, vocab)` with fewer than `limit` entries:
    returns True. Otherwise False, and nothing is written (the caller converts and checks it).
    What a device thread runs right after a decode call, in one call."""
    cdef Py_buffer view
    cdef const float* x
    cdef Py_ssize_t row, pick
    if type(raw) is not np.ndarray or rows * vocab >= limit or not 1 <= vocab < 2 ** 31 or \
            greedy.shape[0] < rows or best.shape[0] < rows:
        return False
    try:
        PyObject_GetBuffer(raw, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
    except (BufferError, ValueError):  # a strided array
        return False
    try:
        if view.ndim != 2 or view.shape[0] != rows or view.shape[1] != vocab or \
                view.itemsize != 4 or view.format == NULL or view.format[0] != b"f" or \
                view.format[1] != 0:
            return False
        x = <const float*>view.buf
        with nogil:
            for row in range(rows):
                pick = atombatch_row_argmax(x + row * vocab, vocab)
                greedy[row] = pick
                best[row] = x[row * vocab + pick]
        return True
    finally:
        PyBuffer_Release(&view)


@cython.boundscheck(False)
@cython.wraparound(False)
def common_prefix(const int64_t[::1] a, const int64_t[::1] b):
    """How many leading tokens `a` and `b` share."""
    cdef Py_ssize_t n = min(a.shape[0], b.shape[0])
    cdef Py_ssize_t i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


from cpython.dict cimport PyDict_GetItem
from cpython.ref cimport PyObject
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE


def match_digests(dict by_digest, list digests, Py_ssize_t start, Py_ssize_t stop, list out):
    """Append `by_digest[digests[j]]` to `out` for j = start, start + 1, ... while j < stop and
    the digest is there; returns the first j that was not appended."""
    cdef Py_ssize_t block = start
    cdef PyObject* entry
    if stop > PyList_GET_SIZE(digests):
        stop = PyList_GET_SIZE(digests)
    while block < stop:
        entry = PyDict_GetItem(by_digest, <object>PyList_GET_ITEM(digests, block))
        if entry == NULL:
            break
        out.append(<object>entry)
        block += 1
    return block


# -- the device prefix index's table ------------------------------------------------------------
# A chain's digests live in a uint8 [n, 16] array (`TokenChain`), written here in one pass, and the
# device prefix index keeps its blocks in arrays indexed by block: no Python object per block.

cdef extern from *:
    """
    static inline uint64_t atombatch_load64(const unsigned char *p) {
        uint64_t v; memcpy(&v, p, 8); return v;
    }
    """
    uint64_t _load64 "atombatch_load64"(const unsigned char *p) noexcept nogil

from libc.stdint cimport uint8_t


@cython.boundscheck(False)
@cython.wraparound(False)
def chain_digests(const int64_t[::1] tokens, Py_ssize_t start, Py_ssize_t stop,
                  Py_ssize_t block_size, bytes parent, uint64_t seed,
                  uint8_t[:, ::1] out not None, Py_ssize_t row):
    """`block_digests` written into `out[row:row + (stop - start) // block_size]` (16 bytes a
    row) instead of returned as bytes: one compiled pass, no Python object per block."""
    if block_size <= 0 or start < 0 or stop > tokens.shape[0] or stop < start or \
            (stop - start) % block_size:
        raise ValueError(f"tokens[{start}:{stop}] is not a whole number of {block_size}-token "
                         f"blocks of the {tokens.shape[0]} tokens")
    if len(parent) not in (0, 16):
        raise ValueError(f"a parent digest has 16 bytes, not {len(parent)}")
    cdef Py_ssize_t count = (stop - start) // block_size
    if out.shape[1] != 16 or row < 0 or row + count > out.shape[0]:
        raise ValueError(f"rows {row}..{row + count - 1} do not fit a digest array of shape "
                         f"({out.shape[0]}, {out.shape[1]})")
    if count == 0:
        return
    cdef Py_ssize_t width = 8 * block_size
    cdef size_t length = 16 + width + 1
    cdef unsigned char* buffer = <unsigned char*>malloc(length)
    if buffer == NULL:
        raise MemoryError()
    cdef XXH128_canonical_t canonical
    cdef Py_ssize_t position = start
    cdef int i
    try:
        if len(parent):
            memcpy(buffer, PyBytes_AS_STRING(parent), 16)
        else:
            for i in range(16):
                buffer[i] = 0
        buffer[16 + width] = 70  # b"F"
        while position < stop:
            memcpy(buffer + 16, &tokens[position], width)
            XXH128_canonicalFromHash(&canonical, XXH3_128bits_withSeed(buffer, length, seed))
            memcpy(buffer, canonical.digest, 16)  # the next block's parent
            memcpy(&out[row, 0], canonical.digest, 16)
            row += 1
            position += block_size
    finally:
        c_free(buffer)


cdef inline int _key_of(object digest, uint64_t *k0, uint64_t *k1, bint root_ok) except -1:
    cdef Py_ssize_t n = len(<bytes>digest)
    cdef const unsigned char *p
    if n == 16:
        p = <const unsigned char*>PyBytes_AS_STRING(digest)
        k0[0] = _load64(p)
        k1[0] = _load64(p + 8)
        return 0
    if n == 0 and root_ok:
        k0[0] = 0
        k1[0] = 0
        return 0
    raise ValueError(f"a digest has 16 bytes, not {n}")


@cython.final
cdef class PrefixTable:
    """The device prefix index's cached blocks, in arrays indexed by block.

    Per block: its digest, its parent's digest (16 zero bytes for the root), its tokens (one row
    of `block_size`, the first `num_tokens(block)` valid) and its place in its parent's list of
    children (an intrusive doubly linked list, most recently inserted first). Two open-addressing
    tables with linear probing over the 128-bit digests (deletion by backward shift, so no
    tombstones) map a digest to its block and a parent digest to its first child; both have
    at least twice as many slots as the pool has blocks. Every operation is O(1) but `siblings`
    (O(children)); nothing allocates a Python object per block. A real digest of 16 zero bytes
    would read as the root: the odds are 2**-128 for a seeded hash, as for any collision.
    """

    cdef readonly Py_ssize_t _n, _block_size, _count, _mask
    cdef object _digest, _parent, _tokens, _ntok, _next, _prev, _dkeys, _dval, _pkeys, _pval
    cdef uint64_t[:, ::1] _digest_v, _parent_v, _dkeys_v, _pkeys_v
    cdef int64_t[:, ::1] _tokens_v
    cdef int32_t[::1] _ntok_v, _next_v, _prev_v, _dval_v, _pval_v

    def __cinit__(self, Py_ssize_t num_blocks, Py_ssize_t block_size):
        if num_blocks <= 0 or block_size <= 0:
            raise CapacityError(f"num_blocks={num_blocks} and block_size={block_size} must be "
                                "positive")
        cdef Py_ssize_t slots = 8
        while slots < 2 * num_blocks:
            slots *= 2
        self._n, self._block_size, self._count, self._mask = num_blocks, block_size, 0, slots - 1
        self._digest = np.zeros((num_blocks, 2), dtype=np.uint64)
        self._parent = np.zeros((num_blocks, 2), dtype=np.uint64)
        self._tokens = np.zeros((num_blocks, block_size), dtype=np.int64)
        self._ntok = np.zeros(num_blocks, dtype=np.int32)      # 0: the block is not held
        self._next = np.full(num_blocks, -1, dtype=np.int32)   # next sibling
        self._prev = np.full(num_blocks, -1, dtype=np.int32)   # previous sibling
        self._dkeys = np.zeros((slots, 2), dtype=np.uint64)
        self._dval = np.full(slots, -1, dtype=np.int32)        # digest -> block, -1 empty
        self._pkeys = np.zeros((slots, 2), dtype=np.uint64)
        self._pval = np.full(slots, -1, dtype=np.int32)        # parent -> first child
        self._digest_v, self._parent_v = self._digest, self._parent
        self._tokens_v, self._ntok_v = self._tokens, self._ntok
        self._next_v, self._prev_v = self._next, self._prev
        self._dkeys_v, self._dval_v = self._dkeys, self._dval
        self._pkeys_v, self._pval_v = self._pkeys, self._pval

    # -- open addressing ---------------------------------------------------------------------------
    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    cdef inline Py_ssize_t _slot(self, uint64_t[:, ::1] keys, int32_t[::1] vals, uint64_t k0,
                                 uint64_t k1) noexcept:
        """The slot holding (k0, k1), or the empty slot where it would go."""
        cdef Py_ssize_t i = <Py_ssize_t>((k0 ^ (k1 >> 7)) & <uint64_t>self._mask)
        while vals[i] >= 0 and (keys[i, 0] != k0 or keys[i, 1] != k1):
            i = (i + 1) & self._mask
        return i

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    cdef inline void _erase(self, uint64_t[:, ::1] keys, int32_t[::1] vals, Py_ssize_t i) noexcept:
        """Empty slot i, shifting back the entries after it that probed past it."""
        cdef Py_ssize_t j = i, home
        cdef Py_ssize_t mask = self._mask
        while True:
            j = (j + 1) & mask
            if vals[j] < 0:
                break
            home = <Py_ssize_t>((keys[j, 0] ^ (keys[j, 1] >> 7)) & <uint64_t>mask)
            if (i <= j and i < home <= j) or (i > j and (home > i or home <= j)):
                continue  # j is still reachable from its home without crossing i
            keys[i, 0] = keys[j, 0]
            keys[i, 1] = keys[j, 1]
            vals[i] = vals[j]
            i = j
        vals[i] = -1

    cdef int _check_block(self, Py_ssize_t block) except -1:
        if not 0 <= block < self._n:
            raise StateError(f"block={block} is outside the table 0..{self._n - 1}")
        return 0

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    cdef void _link(self, Py_ssize_t block, uint64_t d0, uint64_t d1, uint64_t p0,
                    uint64_t p1) noexcept:
        """Index a validated, new block under its digest and its parent."""
        cdef Py_ssize_t i = self._slot(self._dkeys_v, self._dval_v, d0, d1)
        self._dkeys_v[i, 0] = d0
        self._dkeys_v[i, 1] = d1
        self._dval_v[i] = <int32_t>block
        self._digest_v[block, 0] = d0
        self._digest_v[block, 1] = d1
        self._parent_v[block, 0] = p0
        self._parent_v[block, 1] = p1
        i = self._slot(self._pkeys_v, self._pval_v, p0, p1)
        cdef int32_t first = self._pval_v[i]
        self._prev_v[block] = -1
        self._next_v[block] = first
        if first >= 0:
            self._prev_v[first] = <int32_t>block
        else:
            self._pkeys_v[i, 0] = p0
            self._pkeys_v[i, 1] = p1
        self._pval_v[i] = <int32_t>block
        self._count += 1

    # -- queries ---------------------------------------------------------------------------------
    @property
    def block_size(self):
        return self._block_size

    def __len__(self):
        return self._count

    def holds(self, Py_ssize_t block):
        self._check_block(block)
        return self._ntok_v[block] > 0

    def blocks(self):
        """The blocks held, in ascending order."""
        cdef Py_ssize_t block
        return [block for block in range(self._n) if self._ntok_v[block] > 0]

    def find(self, bytes digest not None):
        """The block cached under `digest`, or -1."""
        cdef uint64_t k0, k1
        _key_of(digest, &k0, &k1, False)
        return self._dval_v[self._slot(self._dkeys_v, self._dval_v, k0, k1)]

    def first_child(self, bytes parent not None):
        """The most recently inserted child of `parent` (b"" is the root), or -1."""
        cdef uint64_t k0, k1
        _key_of(parent, &k0, &k1, True)
        return self._pval_v[self._slot(self._pkeys_v, self._pval_v, k0, k1)]

    def siblings(self, bytes parent not None):
        """Every child of `parent`, most recently inserted first."""
        cdef int32_t block = self.first_child(parent)
        cdef list out = []
        while block >= 0:
            out.append(block)
            block = self._next_v[block]
        return out

    cdef int _check_held(self, Py_ssize_t block) except -1:
        self._check_block(block)
        if self._ntok_v[block] == 0:
            raise StateError(f"block={block} is not in the prefix table")
        return 0

    def digest(self, Py_ssize_t block):
        self._check_held(block)
        return PyBytes_FromStringAndSize(<char*>&self._digest_v[block, 0], 16)

    def parent(self, Py_ssize_t block):
        """The parent's digest (b"" for the root)."""
        self._check_held(block)
        if self._parent_v[block, 0] == 0 and self._parent_v[block, 1] == 0:
            return b""
        return PyBytes_FromStringAndSize(<char*>&self._parent_v[block, 0], 16)

    def num_tokens(self, Py_ssize_t block):
        self._check_held(block)
        return self._ntok_v[block]

    def tokens(self, Py_ssize_t block):
        """A copy of the block's tokens."""
        self._check_held(block)
        return self._tokens[block, :self._ntok_v[block]].copy()

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    def common_prefix(self, Py_ssize_t block, const int64_t[::1] tokens):
        """How many leading tokens the block and `tokens` share."""
        self._check_held(block)
        cdef Py_ssize_t n = min(<Py_ssize_t>self._ntok_v[block], tokens.shape[0]), i = 0
        while i < n and self._tokens_v[block, i] == tokens[i]:
            i += 1
        return i

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    def match(self, const uint8_t[:, ::1] digests, Py_ssize_t start, Py_ssize_t stop,
              int32_t[::1] out not None):
        """Write the block of `digests[j]` to `out[j - start]` for j = start, start + 1, ... while
        j < stop and the digest is cached; returns the first j that was not written."""
        if digests.shape[1] != 16:
            raise ValueError(f"digest rows have 16 bytes, not {digests.shape[1]}")
        if start < 0:
            start = 0
        if stop > digests.shape[0]:
            stop = digests.shape[0]
        if stop - start > out.shape[0]:
            raise ValueError(f"{stop - start} blocks do not fit an output of {out.shape[0]}")
        cdef Py_ssize_t j = start
        cdef int32_t block
        while j < stop:
            block = self._dval_v[self._slot(self._dkeys_v, self._dval_v, _load64(&digests[j, 0]),
                                            _load64(&digests[j, 8]))]
            if block < 0:
                break
            out[j - start] = block
            j += 1
        return j

    def check(self):
        """Raise `StateError` if the digest and parent tables disagree with the blocks held."""
        cdef Py_ssize_t block, i, held = 0, children = 0
        cdef int32_t child, steps
        for block in range(self._n):
            if self._ntok_v[block] == 0:
                continue
            held += 1
            i = self._slot(self._dkeys_v, self._dval_v, self._digest_v[block, 0],
                           self._digest_v[block, 1])
            if self._dval_v[i] != block:
                raise StateError(f"block={block} is not found under its digest")
        for i in range(self._mask + 1):
            if self._pval_v[i] < 0:
                continue
            child, steps = self._pval_v[i], 0
            if self._prev_v[child] != -1:
                raise StateError(f"the first child block={child} has a previous sibling")
            while child >= 0:
                if self._ntok_v[child] == 0 or self._parent_v[child, 0] != self._pkeys_v[i, 0] \
                        or self._parent_v[child, 1] != self._pkeys_v[i, 1]:
                    raise StateError(f"block={child} is listed under a parent it does not have")
                if self._next_v[child] >= 0 and self._prev_v[self._next_v[child]] != child:
                    raise StateError(f"the sibling list breaks after block={child}")
                children += 1
                steps += 1
                if steps > self._n:
                    raise StateError("a sibling list loops")
                child = self._next_v[child]
        if held != self._count or children != self._count or \
                int((self._dval >= 0).sum()) != self._count:
            raise StateError(f"{self._count} blocks counted, {held} held, {children} listed "
                             "under parents")

    # -- changes -----------------------------------------------------------------------------------
    def insert(self, Py_ssize_t block, bytes digest not None, bytes parent not None,
               const int64_t[::1] tokens):
        """Cache `block` as holding `tokens` (1..block_size of them) after `parent` under
        `digest`. Returns -1, changing nothing, if that digest is cached already; else how many
        other children its parent has."""
        self._check_block(block)
        if self._ntok_v[block]:
            raise StateError(f"block={block} is already in the prefix table")
        cdef Py_ssize_t n = tokens.shape[0]
        if not 0 < n <= self._block_size:
            raise ValueError(f"a block holds 1..{self._block_size} tokens, not {n}")
        cdef uint64_t d0, d1, p0, p1
        _key_of(digest, &d0, &d1, False)
        _key_of(parent, &p0, &p1, True)
        if self._dval_v[self._slot(self._dkeys_v, self._dval_v, d0, d1)] >= 0:
            return -1
        memcpy(&self._tokens_v[block, 0], &tokens[0], n * 8)
        self._ntok_v[block] = <int32_t>n
        self._link(block, d0, d1, p0, p1)
        cdef Py_ssize_t others = 0
        cdef int32_t sibling = self._next_v[block]
        while sibling >= 0 and others < 2:
            others += 1
            sibling = self._next_v[sibling]
        return others

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    def insert_run(self, blocks, const uint8_t[:, ::1] digests, Py_ssize_t first,
                   Py_ssize_t stop, bytes parent not None, const int64_t[::1] tokens):
        """Cache `blocks[j]` as full block j of a chain, for j = first..stop-1: its digest
        `digests[j]`, its tokens `tokens[j * block_size:(j + 1) * block_size]`, block `first`
        chained to `parent` and each next one to the previous digest (what `insert` does block
        by block). Every block is checked before any is cached. Returns (the blocks not cached
        because their digest is cached already, the cached blocks whose parent has other
        children)."""
        cdef Py_ssize_t bs = self._block_size, j, block, i
        if digests.shape[1] != 16:
            raise ValueError(f"digest rows have 16 bytes, not {digests.shape[1]}")
        if first < 0 or stop > digests.shape[0] or stop * bs > tokens.shape[0] or \
                stop > len(blocks):
            raise ValueError(f"blocks {first}..{stop - 1} are not all in the chain")
        cdef uint8_t* seen = <uint8_t*>calloc(self._n, 1)  # a block twice in the run
        if seen == NULL:
            raise MemoryError()
        try:
            for j in range(first, stop):
                block = blocks[j]
                self._check_block(block)
                if self._ntok_v[block] or seen[block]:
                    raise StateError(f"block={block} is already in the prefix table")
                seen[block] = 1
        finally:
            c_free(seen)
        cdef uint64_t p0, p1, d0, d1
        _key_of(parent, &p0, &p1, True)
        cdef list duplicates = [], branched = []
        for j in range(first, stop):
            block = blocks[j]
            d0 = _load64(&digests[j, 0])
            d1 = _load64(&digests[j, 8])
            if self._dval_v[self._slot(self._dkeys_v, self._dval_v, d0, d1)] >= 0:
                duplicates.append(block)
            else:
                memcpy(&self._tokens_v[block, 0], &tokens[j * bs], bs * 8)
                self._ntok_v[block] = <int32_t>bs
                self._link(block, d0, d1, p0, p1)
                if self._next_v[block] >= 0:
                    branched.append(block)
            p0, p1 = d0, d1
        return duplicates, branched

    @cython.boundscheck(ATOMBATCH_DEBUG)
    @cython.wraparound(ATOMBATCH_DEBUG)
    def remove(self, Py_ssize_t block):
        """The block leaves the table; returns how many children its parent still has (0, 1, or
        2 for two or more)."""
        self._check_held(block)
        cdef uint64_t p0 = self._parent_v[block, 0], p1 = self._parent_v[block, 1]
        cdef Py_ssize_t i = self._slot(self._dkeys_v, self._dval_v, self._digest_v[block, 0],
                                       self._digest_v[block, 1])
        self._erase(self._dkeys_v, self._dval_v, i)
        cdef int32_t before = self._prev_v[block], after = self._next_v[block], first
        if after >= 0:
            self._prev_v[after] = before
        if before >= 0:
            self._next_v[before] = after
        i = self._slot(self._pkeys_v, self._pval_v, p0, p1)
        if before < 0:  # it was the first child
            if after >= 0:
                self._pval_v[i] = after
            else:
                self._erase(self._pkeys_v, self._pval_v, i)
        self._next_v[block] = -1
        self._prev_v[block] = -1
        self._ntok_v[block] = 0
        self._count -= 1
        first = self._pval_v[i] if after >= 0 or before >= 0 else -1
        if first < 0:
            return 0
        return 1 if self._next_v[first] < 0 else 2

# cython: language_level=3
"""C-level interface of the block/lane core (for `cimport atombatch.kernel._blocks`).

The numpy arrays (`_prev`, `_rows`, ...) own the memory and are what Python sees; the typed
memoryviews (`*_v`) over them are what the compiled code reads and writes.
"""

cimport cython
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint64_t


@cython.final
cdef class BlockPool:
    cdef readonly Py_ssize_t _n
    cdef readonly int32_t _free_head, _free_tail, _lru_head, _lru_tail
    cdef readonly object _prev, _next, _state, _owner, _refcnt
    cdef int32_t[::1] _prev_v, _next_v, _owner_v, _refcnt_v
    cdef int8_t[::1] _state_v
    cdef Py_ssize_t _count[5]
    cdef readonly Py_ssize_t _num_evictable

    cdef void _push_back(self, int32_t tail, int32_t node) noexcept
    cdef void _unlink(self, int32_t node) noexcept
    cdef void _move(self, int32_t block, int8_t state, int32_t owner) noexcept
    cdef int _check_block(self, Py_ssize_t block) except -1
    cdef int _expect(self, Py_ssize_t block, int8_t state, str action) except -1
    cdef list _walk(self, int32_t head, int32_t tail)
    cdef int _debug_check(self) except -1


@cython.final
cdef class LaneTable:
    cdef readonly Py_ssize_t _b, _bps, _block_size, _num_busy, _num_decoding
    cdef readonly object _state, _seq_len, _next_token, _num_held, _rows
    cdef int8_t[::1] _state_v
    cdef int32_t[::1] _seq_len_v, _num_held_v
    cdef int64_t[::1] _next_token_v
    cdef int32_t[:, ::1] _rows_v
    cdef object _idle_bits                  # uint64 words, bit set = lane idle
    cdef uint64_t[::1] _idle_v

    cdef int _check_lane(self, Py_ssize_t lane) except -1
    cdef int _check_busy(self, Py_ssize_t lane) except -1
    cdef Py_ssize_t _blocks_for(self, Py_ssize_t num_positions) noexcept


@cython.final
cdef class SlidingSlots:
    cdef readonly Py_ssize_t _window
    cdef readonly object _fill
    cdef int32_t[::1] _fill_v

    cdef int _check_lane(self, Py_ssize_t lane) except -1


@cython.final
cdef class DecodeInputs:
    cdef readonly object input_ids, cache_position, block_tables, local_block_tables, row_lanes
    cdef readonly object buckets
    cdef readonly Py_ssize_t _b, _bps, num_rows
    cdef object _views
    cdef object _buffers
    cdef int32_t[::1] _buckets_v
    cdef int32_t[::1] _row_lanes_v

    cdef int _select(self, Py_ssize_t index) except -1
    cdef void _lane_row(self, Py_ssize_t row, LaneTable lanes, Py_ssize_t lane, int64_t token,
                        int32_t position) noexcept
    cdef void _pad_row(self, Py_ssize_t row, Py_ssize_t lane, int16_t pad) noexcept
    cdef int64_t[:, ::1] _input_ids_v
    cdef int32_t[:, ::1] _cache_position_v
    cdef int16_t[:, ::1] _block_tables_v
    cdef int16_t[:, ::1] _local_block_tables_v


@cython.final
cdef class PrefillInputs:
    cdef readonly Py_ssize_t chunk_size, _bps
    cdef readonly object input_ids, cache_position, block_tables, local_block_tables
    cdef readonly object query_position
    cdef int64_t[:, ::1] _input_ids_v
    cdef int32_t[:, ::1] _cache_position_v
    cdef int16_t[::1] _block_tables_v
    cdef int16_t[::1] _local_block_tables_v
    cdef int16_t[::1] _query_position_v

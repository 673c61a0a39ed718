"""The compiled core and its twin on the input builders' slow paths: `PrefillInputs` with
strided or non-int64 tokens, int64 or list block rows and a padded last chunk, their error paths
(which leave the buffers untouched), `DecodeInputs`' padding and tail rows, a pool that refuses an
out-of-range owner without changing state, and sliding slots that saturate at the window."""

from __future__ import annotations

import numpy as np
import pytest

from atombatch.errors import StateError
from atombatch.kernel import _blocks as C
from atombatch.kernel import _blocks_py as P

IMPLS = (C, P)


# -- compiled core vs twin -------------------------------------------------------------------------
def _prefill_state(inputs):
    return (inputs.input_ids.tolist(), inputs.cache_position.tolist(),
            inputs.block_tables.tolist(), inputs.local_block_tables.tolist(),
            int(inputs.query_position))


PREFILL_CASES = [
    # tokens, start, blocks, num_blocks, slot
    (np.arange(50, dtype=np.int64), 48, np.array([3, 4, 5], np.int32), 2, 1),     # fast paths
    (np.arange(100, dtype=np.int64)[::2], 8, np.array([9, 1, 5, 7], np.int32)[::2], 2, 0),  # strided
    (np.arange(20, dtype=np.int32), 16, np.array([1, 2, 3], np.int64), 3, 0),     # slow paths
    (list(range(5)), 0, [7], 1, 2),                                               # lists, 1 block
    ((1, 2, 3, 4, 5, 6, 7, 8, 9), 8, (32767, 0), 2, 32767),                       # int16 edges
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"start{c[1]}")
def test_prefill_inputs_twin_parity_on_slow_and_padded_paths(case):
    tokens, start, blocks, num_blocks, slot = case
    results = []
    for impl in IMPLS:
        inputs = impl.PrefillInputs(8, 3)
        # pre-fill with garbage: build must overwrite every entry (padding included)
        inputs.input_ids[...] = 99
        inputs.block_tables[...] = 99
        real = inputs.build(tokens, start, blocks, num_blocks, slot)
        results.append((real, _prefill_state(inputs)))
    assert results[0] == results[1]
    real, (ids, positions, table, _, query) = results[0]
    assert real == min(8, len(tokens) - start) and query == real - 1
    assert ids[0][real:] == [0] * (8 - real)                  # padded tokens are 0
    assert positions[0] == list(range(start, start + 8))      # padded positions continue
    assert table[num_blocks:] == [table[num_blocks - 1]] * (3 - num_blocks)


PREFILL_ERRORS = [
    (list(range(4)), 4, [1], 1, 0),            # start past the prompt
    (list(range(4)), 0, [1], 0, 0),            # no block
    (list(range(4)), 0, [1], 4, 0),            # more blocks than the row
    (list(range(4)), 0, [1], 2, 0),            # more blocks than given
    (list(range(4)), 0, [1, -1], 2, 0),        # negative block
    (list(range(4)), 0, np.array([1, 32768], np.int32), 2, 0),  # int16 overflow (fast path)
    (list(range(4)), 0, [1, 32768], 2, 0),     # int16 overflow (slow path)
    (list(range(4)), 0, [1], 1, 32768),        # sliding slot overflow
]


@pytest.mark.parametrize("case", PREFILL_ERRORS)
def test_prefill_inputs_errors_match_and_leave_buffers_untouched(case):
    messages = []
    for impl in IMPLS:
        inputs = impl.PrefillInputs(4, 3)
        inputs.build(list(range(10, 14)), 0, [2, 2, 2], 3, 0)
        before = _prefill_state(inputs)
        with pytest.raises(StateError) as info:
            inputs.build(*case)
        assert _prefill_state(inputs) == before
        messages.append(str(info.value))
    assert messages[0] == messages[1]


def test_decode_inputs_padding_and_tail_rows_match_twin():
    tables = []
    for impl in IMPLS:
        lanes = impl.LaneTable(4, 3, 4)
        a, b, c = lanes.assign(), lanes.assign(), lanes.assign()
        lanes.push_block(a, 5)
        lanes.start_decode(a, 3, 11)          # last position of its only block
        lanes.push_block(b, 6)
        lanes.push_block(b, 7)
        lanes.start_decode(b, 4, 12)          # first position of its second block
        lanes.push_block(c, 8)                # still prefilling: padded like an idle lane
        inputs = impl.DecodeInputs(4, 3)
        assert inputs.build(lanes, 9) == 2
        tables.append((inputs.input_ids.tolist(), inputs.cache_position.tolist(),
                       inputs.block_tables.tolist(), inputs.local_block_tables.tolist()))
        # one position too far for the blocks held: refused, buffers unchanged
        lanes.advance(a, 13)
        snapshot = inputs.block_tables.copy()
        with pytest.raises(StateError, match="too few for position 4"):
            inputs.build(lanes, 9)
        assert (inputs.block_tables == snapshot).all()
    assert tables[0] == tables[1]
    ids, positions, rows, local = tables[0]
    assert ids == [[11], [12], [0], [0]] and positions == [[3], [4], [0], [0]]
    assert rows == [[5, 5, 5], [6, 7, 7], [9, 9, 9], [9, 9, 9]]
    assert local == [[0], [1], [2], [3]]


def test_compiled_pool_refuses_an_owner_outside_int32_without_changing_state():
    pool = C.BlockPool(3)
    with pytest.raises(OverflowError):
        pool.allocate(C.STAGED, 2**31)
    spare = pool.reserve_spare()
    with pytest.raises(OverflowError):
        pool.stage(spare, 2**40)
    pool.check()
    assert pool.counts() == (2, 1, 0, 0, 0) and pool.state(spare) == C.SPARE


@pytest.mark.parametrize("impl", IMPLS, ids=lambda m: m.IMPLEMENTATION)
def test_sliding_slots_saturate_at_the_window(impl):
    slots = impl.SlidingSlots(2, 4)
    assert [slots.advance(0, n) for n in (3, 0, 1, 1, 2**40)] == [3, 3, 4, 4, 4]
    slots.reset(0)
    assert slots.fill(0) == 0 and slots.fill(1) == 0

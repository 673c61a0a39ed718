"""Behaviour of the block/lane core, run against the compiled module and its twin (`impl`)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import ModuleType

import numpy as np
import pytest

from atombatch.errors import AtomBatchError, CapacityError, ConfigError, RequestError, StateError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FREE, SPARE, STAGED, LANE, CACHED = range(5)
IDLE, PREFILLING, DECODING = range(3)


def snapshot(pool) -> tuple:
    """Everything observable about a pool, to prove a failed call changed nothing."""
    n = pool.num_blocks
    return (pool.counts(), pool.num_evictable, pool.free_blocks(), pool.lru_blocks(),
            [(pool.state(b), pool.owner(b), pool.refcount(b)) for b in range(n)])


def lane_snapshot(lanes) -> tuple:
    return (lanes.num_busy, [(lanes.state(ln), lanes.seq_len(ln), lanes.next_token(ln),
                              lanes.blocks(ln)) for ln in range(lanes.batch_size)],
            lanes.rows().tolist())


def raises_unchanged(pool, exc: type[Exception], match: str, fn, *args) -> None:
    before = snapshot(pool)
    with pytest.raises(exc, match=match):
        fn(*args)
    assert snapshot(pool) == before


# -- module surface --------------------------------------------------------------------------------


def test_constants_and_implementation(impl: ModuleType) -> None:
    assert (impl.FREE, impl.SPARE, impl.STAGED, impl.LANE, impl.CACHED) == (0, 1, 2, 3, 4)
    assert impl.STATE_NAMES == ("FREE", "SPARE", "STAGED", "LANE", "CACHED")
    assert (impl.LANE_IDLE, impl.LANE_PREFILLING, impl.LANE_DECODING) == (0, 1, 2)
    assert impl.LANE_STATE_NAMES == ("IDLE", "PREFILLING", "DECODING")
    assert impl.MAX_TABLE_BLOCK == 32767
    expected = "c" if impl.__name__ == "atombatch.kernel._blocks" else "py"
    assert expected == impl.IMPLEMENTATION


def test_errors_inherit_builtins() -> None:
    assert issubclass(StateError, AtomBatchError) and issubclass(StateError, RuntimeError)
    assert issubclass(CapacityError, RuntimeError) and issubclass(RequestError, ValueError)


# -- BlockPool -------------------------------------------------------------------------------------


def test_new_pool_is_all_free_in_order(impl: ModuleType) -> None:
    pool = impl.BlockPool(6)
    assert pool.num_blocks == 6
    assert pool.counts() == (6, 0, 0, 0, 0)
    assert pool.free_blocks() == [0, 1, 2, 3, 4, 5]
    assert pool.lru_blocks() == []
    assert pool.first_free() == 0
    assert all(pool.state(b) == FREE and pool.owner(b) == -1 and pool.refcount(b) == 0
               for b in range(6))
    pool.check()


@pytest.mark.parametrize("n", [0, -3])
def test_pool_size_must_be_positive(impl: ModuleType, n: int) -> None:
    with pytest.raises(CapacityError, match=f"num_blocks={n} must be positive"):
        impl.BlockPool(n)


def test_allocate_oldest_free_first_and_free_appends(impl: ModuleType) -> None:
    pool = impl.BlockPool(4)
    assert pool.reserve_spare() == 0
    assert pool.allocate(LANE, 2) == 1
    assert pool.allocate(STAGED, 9) == 2
    assert (pool.state(0), pool.owner(0)) == (SPARE, -1)
    assert (pool.state(1), pool.owner(1)) == (LANE, 2)
    assert (pool.state(2), pool.owner(2)) == (STAGED, 9)
    assert pool.counts() == (1, 1, 1, 1, 0)
    pool.free(1)
    assert pool.free_blocks() == [3, 1]
    assert pool.first_free() == 3
    assert pool.allocate(LANE, 0) == 3
    assert pool.allocate(LANE, 0) == 1
    assert pool.first_free() == -1
    pool.check()


def test_allocate_spare_ignores_owner(impl: ModuleType) -> None:
    pool = impl.BlockPool(2)
    block = pool.allocate(SPARE, 7)
    assert pool.owner(block) == -1


@pytest.mark.parametrize("state", [FREE, CACHED, 5, -1])
def test_allocate_rejects_other_states(impl: ModuleType, state: int) -> None:
    pool = impl.BlockPool(3)
    raises_unchanged(pool, StateError, f"cannot allocate into state={state}: only SPARE",
                     pool.allocate, state, 0)


def test_allocate_when_empty_is_capacity_error_and_changes_nothing(impl: ModuleType) -> None:
    pool = impl.BlockPool(3)
    pool.allocate(LANE, 0)
    pool.cache(pool.allocate(LANE, 0))
    pool.reserve_spare()
    raises_unchanged(pool, CapacityError,
                     r"Cannot get 1 free block from the pool: all 3 blocks are in use "
                     r"\(cached evictable: 1\)", pool.allocate, LANE, 1)
    raises_unchanged(pool, CapacityError, "Cannot get 1 free block", pool.reserve_spare)


@pytest.mark.parametrize("block", [-1, 3, 100])
def test_every_block_argument_is_range_checked(impl: ModuleType, block: int) -> None:
    pool = impl.BlockPool(3)
    msg = f"block={block} is outside the pool 0..2"
    for fn, args in [(pool.state, ()), (pool.owner, ()), (pool.refcount, ()), (pool.free, ()),
                     (pool.stage, (1,)), (pool.unstage, ()), (pool.assign, (0,)),
                     (pool.to_spare, ()), (pool.cache, ()), (pool.acquire, ()),
                     (pool.release, ()), (pool.touch, ()), (pool.drop, ()), (pool.adopt, (0,))]:
        raises_unchanged(pool, StateError, msg, fn, block, *args)
    raises_unchanged(pool, StateError, msg, pool.rotate, block, 0, 0)


def test_free_only_from_spare_staged_lane(impl: ModuleType) -> None:
    pool = impl.BlockPool(3)
    raises_unchanged(pool, StateError, "cannot free block=0: it is FREE", pool.free, 0)
    block = pool.allocate(LANE, 0)
    pool.cache(block)
    raises_unchanged(pool, StateError, f"cannot free block={block}: it is CACHED", pool.free, block)
    for state in (SPARE, STAGED, LANE):
        b = pool.allocate(state, 1)
        pool.free(b)
        assert pool.state(b) == FREE and pool.owner(b) == -1
    pool.check()


def test_stage_unstage_assign_to_spare(impl: ModuleType) -> None:
    pool = impl.BlockPool(3)
    spare = pool.reserve_spare()
    pool.stage(spare, 42)
    assert (pool.state(spare), pool.owner(spare)) == (STAGED, 42)
    assert pool.counts() == (2, 0, 1, 0, 0)
    pool.unstage(spare)
    assert (pool.state(spare), pool.owner(spare)) == (SPARE, -1)
    pool.stage(spare, 43)
    pool.assign(spare, 1)
    assert (pool.state(spare), pool.owner(spare)) == (LANE, 1)
    pool.to_spare(spare)
    assert (pool.state(spare), pool.owner(spare)) == (SPARE, -1)
    assert pool.counts() == (2, 1, 0, 0, 0)
    pool.check()


def test_illegal_transitions_name_the_states(impl: ModuleType) -> None:
    pool = impl.BlockPool(4)
    spare = pool.reserve_spare()
    lane_block = pool.allocate(LANE, 0)
    cases = [
        (pool.stage, (lane_block, 1), f"cannot stage block={lane_block}: it is LANE, not SPARE"),
        (pool.stage, (3, 1), "cannot stage block=3: it is FREE, not SPARE"),
        (pool.unstage, (spare,), f"cannot unstage block={spare}: it is SPARE, not STAGED"),
        (pool.assign, (spare, 0), f"cannot assign block={spare}: it is SPARE, not STAGED"),
        (pool.to_spare, (spare,), f"cannot make spare block={spare}: it is SPARE, not LANE"),
        (pool.rotate, (spare, lane_block, 0), f"cannot rotate in block={spare}: it is SPARE"),
        (pool.cache, (spare,), f"cannot cache block={spare}: it is SPARE"),
        (pool.cache, (3,), "cannot cache block=3: it is FREE"),
        (pool.acquire, (lane_block,), f"cannot acquire block={lane_block}: it is LANE, not CACHED"),
        (pool.release, (3,), "cannot release block=3: it is FREE, not CACHED"),
        (pool.touch, (spare,), f"cannot touch block={spare}: it is SPARE, not CACHED"),
        (pool.drop, (lane_block,), f"cannot drop block={lane_block}: it is LANE, not CACHED"),
        (pool.adopt, (3, 0), "cannot adopt block=3: it is FREE, not CACHED"),
    ]
    for fn, args, msg in cases:
        raises_unchanged(pool, StateError, msg, fn, *args)


def test_rotate_swaps_staged_in_and_lane_block_out(impl: ModuleType) -> None:
    pool = impl.BlockPool(4)
    spare = pool.reserve_spare()
    lane0 = pool.allocate(LANE, 0)
    lane1 = pool.allocate(LANE, 1)
    pool.stage(spare, 7)
    raises_unchanged(pool, StateError,
                     f"cannot rotate block={lane1} out of lane=0: it belongs to lane=1",
                     pool.rotate, spare, lane1, 0)
    raises_unchanged(pool, StateError, f"cannot rotate out block={spare}: it is STAGED, not LANE",
                     pool.rotate, spare, spare, 0)
    pool.rotate(spare, lane0, 0)
    assert (pool.state(spare), pool.owner(spare)) == (LANE, 0)
    assert (pool.state(lane0), pool.owner(lane0)) == (SPARE, -1)
    assert pool.counts() == (1, 1, 0, 2, 0)
    pool.check()


def test_cache_lru_order_touch_and_evict(impl: ModuleType) -> None:
    pool = impl.BlockPool(5)
    blocks = [pool.allocate(LANE, 0) for _ in range(3)]
    staged = pool.allocate(STAGED, 5)
    for b in [*blocks, staged]:
        pool.cache(b)
        assert (pool.state(b), pool.owner(b), pool.refcount(b)) == (CACHED, -1, 0)
    assert pool.lru_blocks() == [0, 1, 2, 3]
    assert pool.num_cached == pool.num_evictable == 4
    pool.touch(0)
    assert pool.lru_blocks() == [1, 2, 3, 0]
    assert pool.evict() == 1
    assert pool.state(1) == FREE
    assert pool.free_blocks() == [4, 1]
    assert pool.lru_blocks() == [2, 3, 0]
    assert pool.counts() == (2, 0, 0, 0, 3)
    pool.check()


def test_refcounts_pin_and_unpin(impl: ModuleType) -> None:
    pool = impl.BlockPool(3)
    a, b = pool.allocate(LANE, 0), pool.allocate(LANE, 0)
    pool.cache(a)
    pool.cache(b)
    pool.acquire(a)
    pool.acquire(a)
    assert pool.refcount(a) == 2
    assert pool.lru_blocks() == [b]
    assert pool.num_evictable == 1
    pool.touch(a)  # pinned: not in the LRU list, touching changes nothing
    assert pool.lru_blocks() == [b]
    raises_unchanged(pool, StateError, f"cannot drop block={a}: refcount 2", pool.drop, a)
    raises_unchanged(pool, StateError, f"cannot adopt block={a}: refcount 2", pool.adopt, a, 0)
    pool.release(a)
    assert pool.refcount(a) == 1 and pool.lru_blocks() == [b]
    pool.release(a)
    assert pool.refcount(a) == 0
    assert pool.lru_blocks() == [b, a]  # unpinned: most recently used
    raises_unchanged(pool, StateError, f"cannot release block={a}: its refcount is already 0",
                     pool.release, a)
    pool.check()


def test_evict_with_nothing_unpinned(impl: ModuleType) -> None:
    pool = impl.BlockPool(2)
    raises_unchanged(pool, CapacityError, "Cannot evict: none of the 0 cached blocks is unpinned",
                     pool.evict)
    block = pool.allocate(LANE, 0)
    pool.cache(block)
    pool.acquire(block)
    raises_unchanged(pool, CapacityError, "Cannot evict: none of the 1 cached blocks is unpinned",
                     pool.evict)


def test_drop_and_adopt(impl: ModuleType) -> None:
    pool = impl.BlockPool(4)
    blocks = [pool.allocate(LANE, 0) for _ in range(3)]
    for b in blocks:
        pool.cache(b)
    pool.drop(1)
    assert pool.state(1) == FREE and pool.lru_blocks() == [0, 2]
    pool.adopt(2, 3)
    assert (pool.state(2), pool.owner(2), pool.refcount(2)) == (LANE, 3, 0)
    assert pool.lru_blocks() == [0]
    assert pool.counts() == (2, 0, 0, 1, 1)
    assert pool.num_evictable == 1
    pool.check()


def test_recache_resets_refcount_and_goes_last(impl: ModuleType) -> None:
    pool = impl.BlockPool(3)
    a, b = pool.allocate(LANE, 0), pool.allocate(LANE, 1)
    pool.cache(a)
    pool.cache(b)
    pool.adopt(a, 2)
    pool.cache(a)
    assert pool.lru_blocks() == [b, a]
    assert pool.refcount(a) == 0


def test_conservation_across_a_mixed_sequence(impl: ModuleType) -> None:
    pool = impl.BlockPool(8)
    pool.reserve_spare()
    for lane in range(4):
        pool.allocate(LANE, lane)
    pool.stage(0, 11)
    pool.cache(1)
    pool.acquire(1)
    pool.cache(2)
    pool.evict()
    assert sum(pool.counts()) == 8
    assert pool.counts() == (4, 0, 1, 2, 1)
    pool.check()


def test_check_detects_a_corrupted_pool(impl: ModuleType) -> None:
    pool = impl.BlockPool(3)
    pool.allocate(LANE, 0)
    pool._state[2] = LANE  # forged behind the pool's back
    with pytest.raises(StateError, match="disagree with block states"):
        pool.check()


# -- LaneTable -------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [(0, 1, 1), (1, 0, 1), (1, 1, 0), (-1, 2, 2)])
def test_lane_table_shape_must_be_positive(impl: ModuleType, args: tuple[int, int, int]) -> None:
    with pytest.raises(CapacityError, match="must all be positive"):
        impl.LaneTable(*args)


def test_lane_table_initial_state(impl: ModuleType) -> None:
    lanes = impl.LaneTable(3, 4, 16)
    assert (lanes.batch_size, lanes.blocks_per_seq, lanes.block_size) == (3, 4, 16)
    assert (lanes.num_busy, lanes.num_idle, lanes.num_decoding()) == (0, 3, 0)
    assert all(lanes.state(ln) == IDLE and lanes.blocks(ln) == [] for ln in range(3))
    assert lanes.rows().tolist() == [[-1] * 4] * 3
    assert lanes.rows().dtype == np.int32


def test_assign_lowest_first_and_reuse_after_release(impl: ModuleType) -> None:
    lanes = impl.LaneTable(3, 2, 8)
    assert [lanes.assign() for _ in range(3)] == [0, 1, 2]
    before = lane_snapshot(lanes)
    with pytest.raises(CapacityError, match="Cannot assign a lane: all 3 lanes are busy"):
        lanes.assign()
    assert lane_snapshot(lanes) == before
    lanes.release(1)
    assert (lanes.num_busy, lanes.num_idle) == (2, 1)
    assert lanes.assign() == 1
    lanes.release(2)
    lanes.release(0)
    assert lanes.assign() == 0
    assert lanes.assign() == 2


def test_assign_resets_the_lane(impl: ModuleType) -> None:
    lanes = impl.LaneTable(1, 2, 4)
    lane = lanes.assign()
    lanes.push_block(lane, 5)
    lanes.start_decode(lane, 3, 99)
    lanes.advance(lane, 100)
    assert lanes.release(lane) == [5]
    lane = lanes.assign()
    assert (lanes.state(lane), lanes.seq_len(lane), lanes.next_token(lane),
            lanes.num_held(lane), lanes.blocks(lane)) == (PREFILLING, 0, 0, 0, [])
    assert lanes.rows().tolist() == [[-1, -1]]


def test_push_pop_replace_and_rows(impl: ModuleType) -> None:
    lanes = impl.LaneTable(2, 3, 4)
    lane = lanes.assign()
    lanes.push_block(lane, 7)
    lanes.push_block(lane, 2)
    assert lanes.blocks(lane) == [7, 2] and lanes.num_held(lane) == 2
    assert lanes.last_block(lane) == 2
    assert lanes.rows().tolist() == [[7, 2, -1], [-1, -1, -1]]
    assert lanes.replace_block(lane, 0, 9) == 7
    assert lanes.pop_block(lane) == 2
    assert lanes.blocks(lane) == [9]
    assert lanes.pop_block(lane) == 9
    assert lanes.last_block(lane) == -1
    with pytest.raises(StateError, match=f"lane={lane} holds no block"):
        lanes.pop_block(lane)
    rows = lanes.rows()
    with pytest.raises(ValueError, match="read-only"):
        rows[0, 0] = 1


def test_push_block_past_the_row_is_capacity_error(impl: ModuleType) -> None:
    lanes = impl.LaneTable(1, 2, 4)
    lane = lanes.assign()
    lanes.push_block(lane, 0)
    lanes.push_block(lane, 1)
    before = lane_snapshot(lanes)
    with pytest.raises(CapacityError, match="lane=0 already holds 2 blocks, the row's 2 entries"):
        lanes.push_block(lane, 2)
    assert lane_snapshot(lanes) == before


@pytest.mark.parametrize("block", [-1, 32768, 70000])
def test_table_entries_must_fit_int16(impl: ModuleType, block: int) -> None:
    lanes = impl.LaneTable(1, 2, 4)
    lane = lanes.assign()
    lanes.push_block(lane, 32767)
    before = lane_snapshot(lanes)
    with pytest.raises(StateError, match=f"block={block} is outside the int16 block-table range"):
        lanes.push_block(lane, block)
    with pytest.raises(StateError, match=f"block={block} is outside the int16 block-table range"):
        lanes.replace_block(lane, 0, block)
    assert lane_snapshot(lanes) == before


def test_lane_arguments_are_checked(impl: ModuleType) -> None:
    lanes = impl.LaneTable(2, 2, 4)
    for lane in (-1, 2):
        for fn, args in [(lanes.state, ()), (lanes.seq_len, ()), (lanes.next_token, ()),
                         (lanes.num_held, ()), (lanes.blocks, ()), (lanes.release, ()),
                         (lanes.push_block, (0,)), (lanes.pop_block, ()), (lanes.last_block, ()),
                         (lanes.replace_block, (0, 0)), (lanes.set_seq_len, (0,)),
                         (lanes.start_decode, (0, 1)), (lanes.stop_decode, ()),
                         (lanes.advance, (1,))]:
            with pytest.raises(StateError, match=rf"lane={lane} is outside 0\.\.1"):
                fn(lane, *args)


def test_idle_lane_transitions_are_illegal(impl: ModuleType) -> None:
    lanes = impl.LaneTable(2, 2, 4)
    for fn, args in [(lanes.release, ()), (lanes.push_block, (0,)), (lanes.pop_block, ()),
                     (lanes.last_block, ()), (lanes.replace_block, (0, 0)),
                     (lanes.set_seq_len, (0,)), (lanes.start_decode, (0, 1)),
                     (lanes.stop_decode, ())]:
        with pytest.raises(StateError, match="lane=1 is idle"):
            fn(1, *args)
    with pytest.raises(StateError, match="lane=1 is not decoding"):
        lanes.advance(1, 5)
    assert lanes.num_busy == 0


def test_decode_lifecycle(impl: ModuleType) -> None:
    lanes = impl.LaneTable(2, 3, 4)
    lane = lanes.assign()
    with pytest.raises(StateError, match="lane=0 is not decoding"):
        lanes.advance(lane, 1)
    lanes.push_block(lane, 4)
    with pytest.raises(StateError, match="lane=0 holds 1 blocks, too few for position 4"):
        lanes.start_decode(lane, 4, 11)
    lanes.start_decode(lane, 3, 11)
    assert (lanes.state(lane), lanes.seq_len(lane), lanes.next_token(lane)) == (DECODING, 3, 11)
    assert lanes.num_decoding() == 1
    lanes.advance(lane, 12)
    assert (lanes.seq_len(lane), lanes.next_token(lane)) == (4, 12)
    lanes.stop_decode(lane)
    assert lanes.state(lane) == PREFILLING and lanes.num_decoding() == 0
    lanes.set_seq_len(lane, 2)
    assert lanes.seq_len(lane) == 2


@pytest.mark.parametrize("seq_len", [-1, 13])
def test_set_seq_len_range(impl: ModuleType, seq_len: int) -> None:
    lanes = impl.LaneTable(1, 3, 4)
    lane = lanes.assign()
    lanes.set_seq_len(lane, 12)
    with pytest.raises(RequestError, match=f"seq_len={seq_len} is outside 0..12"):
        lanes.set_seq_len(lane, seq_len)
    assert lanes.seq_len(lane) == 12


@pytest.mark.parametrize("seq_len", [-1, 12])
def test_start_decode_range(impl: ModuleType, seq_len: int) -> None:
    lanes = impl.LaneTable(1, 3, 4)
    lane = lanes.assign()
    for block in range(3):
        lanes.push_block(lane, block)
    with pytest.raises(RequestError, match=f"seq_len={seq_len} is outside 0..11"):
        lanes.start_decode(lane, seq_len, 1)
    assert lanes.state(lane) == PREFILLING


@pytest.mark.parametrize(("positions", "blocks"), [(0, 0), (1, 1), (4, 1), (5, 2), (12, 3)])
def test_blocks_for(impl: ModuleType, positions: int, blocks: int) -> None:
    assert impl.LaneTable(1, 3, 4).blocks_for(positions) == blocks


# -- SlidingSlots ----------------------------------------------------------------------------------


def test_sliding_fill_is_min_of_positions_and_window(impl: ModuleType) -> None:
    slots = impl.SlidingSlots(2, 5)
    assert slots.window == 5
    assert slots.advance(0, 3) == 3
    assert slots.advance(0, 1) == 4
    assert slots.advance(0, 0) == 4
    assert slots.advance(0, 7) == 5
    assert slots.fill(0) == 5 and slots.fill(1) == 0
    slots.reset(0)
    assert slots.fill(0) == 0
    assert slots.advance(1, 100) == 5


def test_sliding_errors(impl: ModuleType) -> None:
    with pytest.raises(CapacityError, match="batch_size=0 and window=4 must be positive"):
        impl.SlidingSlots(0, 4)
    with pytest.raises(CapacityError, match="must be positive"):
        impl.SlidingSlots(2, 0)
    slots = impl.SlidingSlots(2, 4)
    for fn, args in [(slots.fill, ()), (slots.reset, ()), (slots.advance, (1,))]:
        with pytest.raises(StateError, match=r"lane=2 is outside 0\.\.1"):
            fn(2, *args)
    with pytest.raises(StateError, match="num_tokens=-1 must be >= 0"):
        slots.advance(0, -1)
    assert slots.fill(0) == 0


# -- DecodeInputs ----------------------------------------------------------------------------------


def test_decode_buffers_shapes_and_dtypes(impl: ModuleType) -> None:
    inputs = impl.DecodeInputs(4, 3)
    expected = {"input_ids": ((4, 1), np.int64), "cache_position": ((4, 1), np.int32),
                "block_tables": ((4, 3), np.int16), "local_block_tables": ((4, 1), np.int16)}
    for name, (shape, dtype) in expected.items():
        array = getattr(inputs, name)
        assert isinstance(array, np.ndarray)
        assert array.shape == shape and array.dtype == dtype and array.flags.c_contiguous, name
    assert inputs.local_block_tables.ravel().tolist() == [0, 1, 2, 3]


def decode_fixture(impl: ModuleType):
    """4 lanes x 3 blocks of 4: lane0 decoding at 5 with 2 blocks, lane1 prefilling, lane2 idle,
    lane3 decoding at 11 with all 3 blocks."""
    lanes = impl.LaneTable(4, 3, 4)
    for _ in range(4):
        lanes.assign()
    lanes.push_block(0, 6)
    lanes.push_block(0, 2)
    lanes.start_decode(0, 5, 101)
    lanes.push_block(1, 8)
    lanes.release(2)
    for block in (3, 4, 5):
        lanes.push_block(3, block)
    lanes.start_decode(3, 10, 303)
    lanes.advance(3, 304)
    return lanes


def test_decode_build_padding_rules(impl: ModuleType) -> None:
    lanes = decode_fixture(impl)
    inputs = impl.DecodeInputs(4, 3)
    ids, pos, tables, local = (inputs.input_ids, inputs.cache_position, inputs.block_tables,
                               inputs.local_block_tables)
    inputs.input_ids[:] = 77
    inputs.cache_position[:] = 77
    inputs.block_tables[:] = 77
    assert inputs.build(lanes, 9) == 2
    # decoding lanes 0 and 3 packed into rows 0-1; rows 2-3 pad with the slots of lanes 1 and 2
    assert inputs.num_rows == 4
    assert inputs.input_ids.ravel().tolist() == [101, 304, 0, 0]
    assert inputs.cache_position.ravel().tolist() == [5, 11, 0, 0]
    assert inputs.block_tables.tolist() == [[6, 2, 2], [3, 4, 5], [9, 9, 9], [9, 9, 9]]
    assert inputs.local_block_tables.ravel().tolist() == [0, 3, 1, 2]
    assert inputs.row_lanes.tolist() == [0, 3, 1, 2]
    assert (inputs.block_tables >= 0).all()
    # the very same arrays are refilled in place
    assert inputs.input_ids is ids and inputs.cache_position is pos
    assert inputs.block_tables is tables and inputs.local_block_tables is local


def test_decode_build_follows_the_lanes(impl: ModuleType) -> None:
    lanes = decode_fixture(impl)
    inputs = impl.DecodeInputs(4, 3)
    inputs.build(lanes, 9)
    lanes.release(0)
    lanes.push_block(1, 1)
    lanes.start_decode(1, 7, 55)
    assert inputs.build(lanes, 6) == 2
    assert inputs.input_ids.ravel().tolist() == [55, 304, 0, 0]
    assert inputs.cache_position.ravel().tolist() == [7, 11, 0, 0]
    assert inputs.block_tables.tolist() == [[8, 1, 1], [3, 4, 5], [6, 6, 6], [6, 6, 6]]
    assert inputs.row_lanes.tolist() == [1, 3, 0, 2]


def test_decode_build_all_decoding_needs_no_padding(impl: ModuleType) -> None:
    lanes = impl.LaneTable(2, 2, 8)
    for block in (0, 1):
        lanes.push_block(lanes.assign(), block)
        lanes.start_decode(block, 0, 5)
    inputs = impl.DecodeInputs(2, 2)
    assert inputs.build(lanes, -1) == 2
    assert inputs.block_tables.tolist() == [[0, 0], [1, 1]]


@pytest.mark.parametrize("padding", [-1, 32768])
def test_decode_build_rejects_a_bad_padding_block(impl: ModuleType, padding: int) -> None:
    lanes = decode_fixture(impl)
    inputs = impl.DecodeInputs(4, 3)
    inputs.block_tables[:] = 77
    with pytest.raises(StateError, match=f"row=2 needs padding but padding_block={padding}"):
        inputs.build(lanes, padding)
    assert (inputs.block_tables == 77).all()  # nothing was written


def test_decode_build_rejects_a_lane_without_its_position_block(impl: ModuleType) -> None:
    lanes = impl.LaneTable(2, 3, 4)
    lane = lanes.assign()
    lanes.push_block(lane, 1)
    lanes.start_decode(lane, 3, 5)
    lanes.advance(lane, 6)  # position 4 needs a second block the scheduler did not push
    inputs = impl.DecodeInputs(2, 3)
    with pytest.raises(StateError, match="lane=0 holds 1 blocks, too few for position 4"):
        inputs.build(lanes, 0)
    lanes.push_block(lane, 2)
    lanes.pop_block(lane)
    lanes.pop_block(lane)
    with pytest.raises(StateError, match="lane=0 holds 0 blocks, too few for position 4"):
        inputs.build(lanes, 0)
    lanes.push_block(lane, 1)
    lanes.push_block(lane, 2)
    assert inputs.build(lanes, 0) == 1
    assert inputs.block_tables.tolist() == [[1, 2, 2], [0, 0, 0]]


def test_decode_build_shape_mismatch(impl: ModuleType) -> None:
    lanes = impl.LaneTable(2, 3, 4)
    with pytest.raises(StateError, match=r"decode buffers are \(2, 2\), lanes are \(2, 3\)"):
        impl.DecodeInputs(2, 2).build(lanes, 0)
    with pytest.raises(StateError, match=r"decode buffers are \(3, 3\), lanes are \(2, 3\)"):
        impl.DecodeInputs(3, 3).build(lanes, 0)


def test_decode_buckets_run_the_smallest_batch_that_holds_the_lanes(impl: ModuleType) -> None:
    lanes = decode_fixture(impl)  # lanes 0 and 3 decode, 1 prefills, 2 is idle
    inputs = impl.DecodeInputs(4, 3, (1, 2, 4))
    assert inputs.buckets == (1, 2, 4) and inputs.num_rows == 4
    assert [inputs.bucket_for(n) for n in range(5)] == [1, 1, 2, 4, 4]
    with pytest.raises(StateError, match="5 decoding lanes exceed batch_size=4"):
        inputs.bucket_for(5)
    assert inputs.build(lanes, -1) == 2  # bucket 2 is full: no padding row, none needed
    assert inputs.num_rows == 2 and inputs.row_lanes.tolist() == [0, 3]
    assert inputs.input_ids.ravel().tolist() == [101, 304]
    assert inputs.block_tables.tolist() == [[6, 2, 2], [3, 4, 5]]
    assert inputs.local_block_tables.ravel().tolist() == [0, 3]
    two = inputs.input_ids
    lanes.push_block(1, 7)
    lanes.start_decode(1, 4, 202)  # three lanes decode: bucket 4, one padding row (lane 2)
    with pytest.raises(StateError, match="row=3 needs padding but padding_block=-1"):
        inputs.build(lanes, -1)
    assert inputs.num_rows == 2 and inputs.input_ids.ravel().tolist() == [101, 304]
    assert inputs.build(lanes, 9) == 3
    assert inputs.num_rows == 4 and inputs.row_lanes.tolist() == [0, 1, 3, 2]
    assert inputs.cache_position.ravel().tolist() == [5, 4, 11, 0]
    assert inputs.block_tables.tolist()[3] == [9, 9, 9]
    lanes.release(0)
    lanes.release(1)  # one lane decodes: bucket 1, the arrays are the same views as before
    assert inputs.build(lanes, 9) == 1 and inputs.num_rows == 1
    assert inputs.input_ids.ravel().tolist() == [304] and inputs.row_lanes.tolist() == [3]
    lane = lanes.assign()
    lanes.push_block(lane, 6)
    lanes.start_decode(lane, 1, 101)
    assert inputs.build(lanes, 9) == 2 and inputs.input_ids is two
    for name in ("input_ids", "cache_position", "block_tables", "local_block_tables", "row_lanes"):
        assert getattr(inputs, name).flags.c_contiguous, name


@pytest.mark.parametrize("buckets, rule", [
    ((), "non-empty"), ((1, 1, 4), "strictly ascending"), ((2, 1, 4), "strictly ascending"),
    ((1, 2), "include batch_size"), ((0, 4), "lie in 1..batch_size=4"), ((1.0, 4), "ints"),
    ((2, 8), "include batch_size")])
def test_decode_buckets_are_validated(impl: ModuleType, buckets, rule) -> None:
    with pytest.raises(ConfigError, match=rf"decoder_batch_sizes=.* must .*{rule}"):
        impl.DecodeInputs(4, 3, buckets)


def test_eager_single_block_decode(impl: ModuleType) -> None:
    """block_size == max_seq_len: one entry per row; B lanes + 1 spare."""
    pool = impl.BlockPool(3)
    lanes = impl.LaneTable(2, 1, 64)
    spare = pool.reserve_spare()
    lane = lanes.assign()
    lanes.push_block(lane, pool.allocate(LANE, lane))
    lanes.start_decode(lane, 63, 9)
    inputs = impl.DecodeInputs(2, 1)
    assert inputs.build(lanes, spare) == 1
    assert inputs.block_tables.tolist() == [[1], [spare]]
    assert inputs.cache_position.ravel().tolist() == [63, 0]
    lanes.advance(lane, 10)  # position 64 is past the context: the lane must finish first
    with pytest.raises(StateError, match="too few for position 64"):
        inputs.build(lanes, spare)


# -- PrefillInputs ---------------------------------------------------------------------------------


def test_prefill_buffers_shapes_and_dtypes(impl: ModuleType) -> None:
    inputs = impl.PrefillInputs(8, 3)
    assert inputs.chunk_size == 8
    expected = {"input_ids": ((1, 8), np.int64), "cache_position": ((1, 8), np.int32),
                "block_tables": ((3,), np.int16), "local_block_tables": ((1,), np.int16),
                "query_position": ((), np.int16)}
    for name, (shape, dtype) in expected.items():
        array = getattr(inputs, name)
        assert isinstance(array, np.ndarray)
        assert array.shape == shape and array.dtype == dtype, name


@pytest.mark.parametrize("as_array", [False, True])
def test_prefill_build_full_and_last_chunk(impl: ModuleType, as_array: bool) -> None:
    prompt = list(range(100, 111))  # 11 tokens, chunks of 4
    blocks = [5, 3, 8]
    tokens = np.array(prompt, dtype=np.int64) if as_array else prompt
    row = np.array(blocks, dtype=np.int32) if as_array else blocks
    inputs = impl.PrefillInputs(4, 3)
    query = inputs.query_position
    assert inputs.build(tokens, 0, row, 1) == 4
    assert inputs.input_ids.tolist() == [[100, 101, 102, 103]]
    assert inputs.cache_position.tolist() == [[0, 1, 2, 3]]
    assert inputs.block_tables.tolist() == [5, 5, 5]
    assert int(inputs.query_position) == 3
    assert inputs.build(tokens, 8, row, 2, sliding_slot=3) == 3
    assert inputs.input_ids.tolist() == [[108, 109, 110, 0]]
    assert inputs.cache_position.tolist() == [[8, 9, 10, 11]]  # padding continues the positions
    assert inputs.block_tables.tolist() == [5, 3, 3]
    assert inputs.local_block_tables.tolist() == [3]
    assert int(inputs.query_position) == 2
    assert inputs.query_position is query and query.shape == ()


def test_prefill_build_single_token(impl: ModuleType) -> None:
    inputs = impl.PrefillInputs(4, 2)
    assert inputs.build([42], 0, [1, 0], 2) == 1
    assert inputs.input_ids.tolist() == [[42, 0, 0, 0]]
    assert int(inputs.query_position) == 0
    assert inputs.block_tables.tolist() == [1, 0]


def test_prefill_build_errors_write_nothing(impl: ModuleType) -> None:
    inputs = impl.PrefillInputs(4, 3)
    inputs.build([1, 2, 3], 0, [2], 1)
    before = [a.copy() for a in (inputs.input_ids, inputs.cache_position, inputs.block_tables,
                                 inputs.local_block_tables, inputs.query_position)]
    cases = [
        (([1, 2, 3], 3, [1], 1), {}, "start=3 is outside the 3-token prompt"),
        (([1, 2, 3], -1, [1], 1), {}, "start=-1 is outside the 3-token prompt"),
        (([], 0, [1], 1), {}, "start=0 is outside the 0-token prompt"),
        (([1, 2, 3], 0, [1], 0), {}, r"num_blocks=0 is outside 1\.\.3"),
        (([1, 2, 3], 0, [1, 2, 3, 4], 4), {}, r"num_blocks=4 is outside 1\.\.3"),
        (([1, 2, 3], 0, [1], 2), {}, "num_blocks=2 but only 1 blocks were given"),
        (([1, 2, 3], 0, [1, -1], 2), {}, r"blocks\[1\]=-1 is outside the int16 block-table range"),
        (([1, 2, 3], 0, np.array([40000], dtype=np.int32), 1), {},
         r"blocks\[0\]=40000 is outside the int16"),
        (([1, 2, 3], 0, [1], 1), {"sliding_slot": -2}, r"sliding_slot=-2 is outside 0\.\.32767"),
    ]
    for args, kwargs, msg in cases:
        with pytest.raises(StateError, match=msg):
            inputs.build(*args, **kwargs)
    after = [inputs.input_ids, inputs.cache_position, inputs.block_tables,
             inputs.local_block_tables, inputs.query_position]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_prefill_accepts_other_integer_sequences(impl: ModuleType) -> None:
    inputs = impl.PrefillInputs(3, 2)
    assert inputs.build(np.array([7, 8, 9, 10], dtype=np.int32), 1,
                        np.array([4, 1], dtype=np.int64), 2) == 3
    assert inputs.input_ids.tolist() == [[8, 9, 10]]
    assert inputs.block_tables.tolist() == [4, 1]
    assert inputs.build(tuple(range(5)), 3, (6,), 1) == 2
    assert inputs.input_ids.tolist() == [[3, 4, 0]]
    assert inputs.block_tables.tolist() == [6, 6]


# -- the switch ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("no_extensions", "expected"), [("1", "py"), (None, "c")])
def test_environment_switch_picks_the_implementation(no_extensions: str | None,
                                                     expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ATOMBATCH_NO_EXTENSIONS"}
    if no_extensions is not None:
        env["ATOMBATCH_NO_EXTENSIONS"] = no_extensions
    code = ("import atombatch.kernel.blocks as b; "
            "print(b.IMPLEMENTATION, b.BlockPool.__module__, b.NO_EXTENSIONS)")
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                         text=True, cwd=REPO_ROOT).stdout.split()
    module = "atombatch.kernel._blocks_py" if expected == "py" else "atombatch.kernel._blocks"
    assert out == [expected, module, str(no_extensions is not None)]


def test_micro_bench_quick_writes_records(tmp_path) -> None:
    import msgspec

    from atombatch.bench import micro

    path = tmp_path / "micro.json"
    records = micro.run(lanes=(2,), json_path=str(path), quick=True)
    block_records = [r for r in records if r.op not in micro.case_defs.PREFIX_OPS]
    assert {(r.impl, r.num_blocks) for r in block_records} == {("c", 3), ("py", 3), ("c", 145),
                                                               ("py", 145)}
    vllm_only = set() if os.environ.get("ATOMBATCH_VLLM_SRC") else \
        set(micro.case_defs.VLLM_SOURCE_OPS)  # vLLM's own code, when its source is given
    if not os.environ.get("ATOMBATCH_VLLM_PYTHON"):  # vLLM's scheduler, when its venv is given
        vllm_only |= set(micro.case_defs.VLLM_SCHEDULER_OPS)
    assert {r.op for r in records} == set(micro.OPS) - vllm_only
    assert {(r.op, r.shape) for r in records if r.op == "engine_step"} == {
        ("engine_step", "eager"), ("engine_step", "partitioned")}
    assert all(r.ns_per_op > 0 for r in records)
    assert all(r.lanes == 2 for r in block_records)
    run = msgspec.json.decode(path.read_bytes(), type=micro.MicroRun)
    assert run.records == records and len(run.load_before) == 3
    table = micro.format_table(records)
    assert "decode_build" in table and "prefix_lookup" in table and "load average" in table


def test_an_owner_outside_int32_is_refused_before_any_change(impl):
    pool = impl.BlockPool(3)
    spare = pool.reserve_spare()
    before = (pool.counts(), pool.free_blocks())
    with pytest.raises(OverflowError):
        pool.allocate(impl.STAGED, 2**31)
    with pytest.raises(OverflowError):
        pool.stage(spare, 2**40)
    assert (pool.counts(), pool.free_blocks()) == before
    assert pool.state(spare) == impl.SPARE
    pool.check()


def test_micro_bench_in_several_processes_keeps_the_median_and_the_range(tmp_path) -> None:
    import msgspec

    from atombatch.bench import micro

    path = tmp_path / "micro.json"
    records = micro.run_processes(3, (2,), str(path), True, ("decode_build", "engine_step"), 1)
    run = msgspec.json.decode(path.read_bytes(), type=micro.MicroRun)
    assert run.processes == 3 and run.records == records
    assert {(r.op, r.impl, r.shape) for r in records} == {
        (op, impl, shape) for op in ("decode_build", "engine_step") for impl in ("c", "py")
        for shape in ("eager", "partitioned")}
    for r in records:
        low, high = r.cpu_ns_range
        assert r.processes == 3 and 0 < low <= r.cpu_ns_per_op <= high
    text = micro._provenance(run, "x.json")
    assert "in each of 3 fresh processes" in text

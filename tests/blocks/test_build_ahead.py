"""The kernel's half of the decode pipeline (atombatch/engine/pipeline.py): `grow(ahead=1)` and
`build_ahead` build the step after the one on the device before its tokens exist; the device
thread then writes those tokens in with `gather_tokens` and keeps each row's picked logit with
`picked_logits` (the landing's `pick_values` checks it).

Random lane states, driven through the compiled core and its twin side by side: every array
must agree, and match what `build` gives once the step on the device has completed (the rows of
the lanes that go on, one position further, each fed the token its row produced; lanes that
started decoding while that step was on the device, after a prefill, join with their own token).
"""

from __future__ import annotations

from array import array
from typing import Any

import atombatch.kernel._blocks as c_impl
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.twins import LANE_ARRAYS, Twin, admit_lane, assert_same_arrays, twin

import atombatch.kernel._blocks_py as py_impl
from atombatch.errors import StateError

LANE, DECODING = py_impl.LANE, py_impl.LANE_DECODING
INPUTS = ("input_ids", "cache_position", "block_tables", "local_block_tables", "row_lanes")


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_step_built_ahead_is_the_step_built_after_the_one_on_the_device(
        data: st.DataObject) -> None:
    b = data.draw(st.integers(1, 6), label="B")
    bps = data.draw(st.integers(1, 4), label="bps")
    block_size = data.draw(st.integers(1, 3), label="block_size")
    num_blocks = data.draw(st.integers(bps + 1, b * bps + 3), label="num_blocks")
    smaller = data.draw(st.sets(st.integers(1, b - 1)) if b > 1 else st.just(set()))
    buckets = (*sorted(smaller), b)
    vocab = 9
    pool = twin("BlockPool", num_blocks)
    lanes = twin("LaneTable", b, bps, block_size)
    first = twin("DecodeInputs", b, bps, buckets)
    ahead = twin("DecodeInputs", b, bps, buckets)
    kernel = Twin(c_impl.StepKernel(pool.c, lanes.c, first.c, None),
                  py_impl.StepKernel(pool.py, lanes.py, first.py, None))
    spare = pool.reserve_spare()
    outputs: dict[int, tuple[array[int], array[int]]] = {}
    plain = data.draw(st.booleans(), label="every lane plain")

    def admit(label: str) -> None:
        for _ in range(b):
            if not data.draw(st.booleans(), label=label) or pool.first_free() < 0 or \
                    not lanes.num_idle:
                continue
            seq_len = data.draw(st.integers(0, bps * block_size - 2), label="seq_len") \
                if bps * block_size >= 2 else 0
            lane = admit_lane(pool, lanes, block_size, seq_len,
                              data.draw(st.integers(0, vocab - 1), label="token"))
            if lane is None:
                continue
            limit = data.draw(st.integers(1, 4), label="limit")
            flag = 0 if plain else data.draw(st.sampled_from(
                [0, py_impl.LANE_SAMPLE, py_impl.LANE_OWN_OUTPUT]), label="flag")
            outputs[lane] = (array("q"), array("q"))
            kernel.c.bind(lane, f"r{lane}", outputs[lane][0], array("d"), limit, (), flag)
            kernel.py.bind(lane, f"r{lane}", outputs[lane][1], array("d"), limit, (), flag)

    admit("admit")
    decoding = [lane for lane in range(b) if lanes.state(lane) == DECODING]
    if not decoding:
        return
    rows = kernel.build(spare)  # the step "on the device"
    assert rows == len(decoding)
    admit("join")  # lanes that start decoding while it runs (a prefill after it)
    joined = [lane for lane in range(b) if lanes.state(lane) == DECODING and
              lane not in decoding]
    # lanes whose last chunk runs between the two steps (a wave's chain: several) join at
    # their prompt's length, their first token written in from their chunk's logits (`joins`)
    join_at: dict[int, int] = {}
    while lanes.num_idle and data.draw(st.booleans(), label="a chunk's lane joins"):
        join = lanes.assign()
        position = data.draw(st.integers(0, bps * block_size - 1), label="prompt length")
        while lanes.num_held(join) * block_size <= position and pool.first_free() >= 0:
            lanes.push_block(join, pool.allocate(LANE, join))
        if lanes.num_held(join) * block_size <= position:
            for block in lanes.release(join):
                pool.free(block)
            break
        join_at[join] = position
    joins = np.full(b, -1, dtype=np.int32)
    for join, position in join_at.items():
        joins[join] = position
    short = kernel.grow(1)
    assert_same_arrays(lanes, LANE_ARRAYS)
    limits = {lane: int(kernel.c._max_out[lane]) for lane in decoding + joined}
    # limit 1: finishes on the device; a lane that joins decodes its own token in the step
    going = sorted([lane for lane in decoding if limits[lane] > 1] + joined + list(join_at))
    if short:  # a lane the free list could not serve: the caller does not build ahead
        for lane in kernel.c.attention[:short].tolist():
            assert lane in going and limits[lane] > 1
            assert lanes.blocks_for(lanes.seq_len(lane) + 2) > lanes.num_held(lane)
        return
    gathers = (np.full(b, 7, dtype=np.int32), np.full(b, 7, dtype=np.int32))
    padding = data.draw(st.sampled_from([spare, -1]), label="padding block")
    built = [impl.build_ahead(out, prev, rows, gather, padding,
                              joins if join_at or data.draw(st.booleans(), label="array") else
                              None)
             for impl, out, prev, gather in
             ((kernel.c, ahead.c, first.c, gathers[0]), (kernel.py, ahead.py, first.py,
                                                        gathers[1]))]
    assert built[0] == built[1]
    assert_same_arrays(ahead, ("num_rows",))
    if not going:  # (a lane's flags do not matter: the caller samples before writing tokens)
        assert built[0] == 0
        return
    if padding < 0 and first.c.bucket_for(len(going)) > len(going):
        assert built[0] == -1
        return
    assert built[0] == len(going)
    n = ahead.c.num_rows
    for name in INPUTS:
        assert np.array_equal(getattr(ahead.c, name), getattr(ahead.py, name)), name
    assert np.array_equal(gathers[0][:n], gathers[1][:n])
    assert [gathers[0][row] == -2 for row in range(len(going))] == \
        [lane in joined or lane in join_at for lane in going]
    # the step on the device completes: each row's token is 10 + its row
    tokens = np.arange(10, 10 + first.c.num_rows, dtype=np.int64)
    fed = [ahead.c.input_ids.copy(), ahead.py.input_ids.copy()]  # the thread writes in place
    assert c_impl.gather_tokens(tokens, gathers[0], fed[0]) == \
        py_impl.gather_tokens(tokens, gathers[1], fed[1]) == n
    assert np.array_equal(fed[0], fed[1])
    for join, position in join_at.items():  # the chunks land: each lane decodes its first
        first_token = data.draw(st.integers(0, vocab - 1), label="first token")  # token
        for ids in fed:  # (the thread wrote it in)
            ids[going.index(join), 0] = first_token
        lanes.start_decode(join, position, first_token)
        outputs[join] = (array("q"), array("q"))
        kernel.c.bind(join, f"r{join}", outputs[join][0], array("d"), 4, (), 0)
        kernel.py.bind(join, f"r{join}", outputs[join][1], array("d"), 4, (), 0)
    for impl in (kernel.c, kernel.py):
        impl.tokens[:rows] = tokens[:rows]
        impl.status[:rows] = py_impl.ROW_OK
        impl.complete(0.0)
    for lane in decoding:
        if lane not in going:
            for block in lanes.release(lane):
                pool.free(block)
            kernel.unbind(lane)
    after = twin("DecodeInputs", b, bps, buckets)
    kernel.use(after, 0)
    assert kernel.build(spare) == len(going) and after.c.num_rows == n
    assert np.array_equal(after.c.cache_position, ahead.c.cache_position)
    assert np.array_equal(after.c.row_lanes, ahead.c.row_lanes)
    real = slice(0, len(going))
    assert np.array_equal(after.c.block_tables[real], ahead.c.block_tables[real])
    assert np.array_equal(after.c.input_ids[real], fed[0][real])  # the tokens gathered in
    assert (fed[0][len(going):] == 0).all()
    pool.check()


@pytest.mark.parametrize("impl", [c_impl, py_impl], ids=["c", "py"])
def test_picked_logits_and_gather_tokens_check_their_indices(impl: Any) -> None:
    logits = np.array([[0.0, 2.0, np.nan], [1.0, -np.inf, 3.0]], dtype=np.float32)
    best = np.zeros(2, dtype=np.float32)
    assert impl.picked_logits(logits, np.array([1, 1], dtype=np.int64), best, 2) == 2
    assert best.tolist() == [2.0, -np.inf]
    with pytest.raises(StateError, match=r"greedy\[0\]=3 is outside the vocabulary 0..2"):
        impl.picked_logits(logits, np.array([3, 0], dtype=np.int64), best, 1)
    with pytest.raises(StateError, match="keep=3 rows of 2"):
        impl.picked_logits(logits, np.zeros(3, dtype=np.int64), np.zeros(3, np.float32), 3)
    ids = np.zeros((2, 1), dtype=np.int64)
    with pytest.raises(StateError, match=r"gather\[1\]=2 is outside -2..1"):
        impl.gather_tokens(np.array([5, 6], dtype=np.int64), np.array([0, 2], dtype=np.int32),
                           ids)
    with pytest.raises(StateError, match=r"gather\[0\]=-3 is outside -2..1"):
        impl.gather_tokens(np.array([5, 6], dtype=np.int64), np.array([-3, 0], dtype=np.int32),
                           ids)
    ids[:, 0] = (8, 9)  # -2: the row keeps its token (a lane that joins); -1: padding
    assert impl.gather_tokens(np.array([5, 6], dtype=np.int64),
                              np.array([-2, -1], dtype=np.int32), ids) == 2
    assert ids[:, 0].tolist() == [8, 0]


@pytest.mark.parametrize("impl", [c_impl, py_impl], ids=["c", "py"])
def test_build_ahead_refuses_its_own_buffer_and_a_short_lane(impl: Any) -> None:
    pool, lanes = impl.BlockPool(6), impl.LaneTable(2, 2, 2)
    inputs, other = impl.DecodeInputs(2, 2), impl.DecodeInputs(2, 2)
    kernel = impl.StepKernel(pool, lanes, inputs, None)
    lane = lanes.assign()
    lanes.push_block(lane, pool.allocate(LANE, lane))
    lanes.start_decode(lane, 1, 3)   # position 1 in block 0; position 2 needs a second block
    kernel.bind(lane, "r", array("q"), array("d"), 5, (), 0)
    rows = kernel.build(pool.first_free())
    gather = np.zeros(2, dtype=np.int32)
    with pytest.raises(StateError, match="a buffer other than the one on the device"):
        kernel.build_ahead(inputs, inputs, rows, gather, pool.first_free())
    with pytest.raises(StateError, match="lane=0 holds 1 blocks, too few for position 2"):
        kernel.build_ahead(other, inputs, rows, gather, pool.first_free())
    assert kernel.grow(1) == 0
    assert kernel.build_ahead(other, inputs, rows, gather, pool.first_free()) == 1
    assert other.cache_position[0, 0] == 2 and gather[0] == 0


@pytest.mark.parametrize("impl", [c_impl, py_impl], ids=["c", "py"])
def test_build_ahead_refuses_a_join_lane_that_does_not_prefill_or_lacks_its_block(
        impl: Any) -> None:
    pool, lanes = impl.BlockPool(8), impl.LaneTable(4, 2, 2)
    inputs, other = impl.DecodeInputs(4, 2), impl.DecodeInputs(4, 2)
    kernel = impl.StepKernel(pool, lanes, inputs, None)
    lane = lanes.assign()
    lanes.push_block(lane, pool.allocate(LANE, lane))
    lanes.start_decode(lane, 0, 3)
    kernel.bind(lane, "r", array("q"), array("d"), 5, (), 0)
    rows = kernel.build(pool.first_free())
    gather = np.zeros(4, dtype=np.int32)

    def joins(**at: int) -> np.ndarray:
        out = np.full(4, -1, dtype=np.int32)
        for name, position in at.items():
            out[int(name[1:])] = position
        return out

    with pytest.raises(StateError, match="joins has 3 entries, fewer than 4 lanes"):
        kernel.build_ahead(other, inputs, rows, gather, pool.first_free(),
                           np.full(3, -1, dtype=np.int32))
    with pytest.raises(StateError, match=r"joins\[0\]=1: lane 0 does not prefill"):
        kernel.build_ahead(other, inputs, rows, gather, pool.first_free(), joins(l0=1))
    with pytest.raises(StateError, match=r"joins\[1\]=1: lane 1 does not prefill"):
        kernel.build_ahead(other, inputs, rows, gather, pool.first_free(), joins(l1=1))  # idle
    chunk = lanes.assign()
    lanes.push_block(chunk, pool.allocate(LANE, chunk))  # positions 0..1: its prompt is 2 long
    with pytest.raises(StateError, match=rf"joins\[{chunk}\]=2: lane {chunk} holds 1 blocks, "
                                         "too few for that position"):
        kernel.build_ahead(other, inputs, rows, gather, pool.first_free(), joins(**{
            f"l{chunk}": 2}))
    second = lanes.assign()  # a wave's chain: two chunks' lanes join the same step
    lanes.push_block(second, pool.allocate(LANE, second))
    assert kernel.build_ahead(other, inputs, rows, gather, pool.first_free(),
                              joins(**{f"l{chunk}": 1, f"l{second}": 0})) == 3
    assert other.row_lanes[:3].tolist() == [lane, chunk, second]
    assert other.cache_position[:3, 0].tolist() == [1, 1, 0]
    assert gather[:3].tolist() == [0, -2, -2]

"""The decode-step kernel (`StepKernel`): compiled and twin driven by the same random steps, and both
checked against an independent per-lane reference (the finite check and the stop rules written out).

Every cycle binds requests to lanes with random stop ids, output limits and flags, grows the lanes
from a pool that may run dry (the short lanes are then served or stopped by the test, as the
scheduler would), builds a bucketed decode batch, picks tokens from random logits (ties, signed
zeros, NaN and infinities included), samples the flagged rows and completes the step. After every
call both implementations must agree array for array, and the outputs must be what a plain Python
loop over the lanes computes.
"""

from __future__ import annotations

from array import array
from typing import Any

import atombatch.kernel._blocks as c_impl
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.twins import LANE_ARRAYS, Twin, assert_same_arrays, twin

import atombatch.kernel._blocks_py as py_impl
from atombatch.errors import StateError

LANE, DECODING = py_impl.LANE, py_impl.LANE_DECODING
KERNEL_ARRAYS = ("tokens", "status", "plain", "attention", "_num_out", "_max_out", "_flags")


def kernel_twin(pool: Twin, lanes: Twin, inputs: Twin, slots: Twin | None,
                max_stop_ids: int) -> Twin:
    return Twin(c_impl.StepKernel(pool.c, lanes.c, inputs.c, slots.c if slots else None,
                                  max_stop_ids),
                py_impl.StepKernel(pool.py, lanes.py, inputs.py, slots.py if slots else None,
                                   max_stop_ids))


def as_tuple(*args: Any) -> tuple[Any, ...]:
    return args


logit_values = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, 2.5, 3e38, -3e38, np.nan, np.inf,
                                -np.inf, 1e-45])


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_kernel_twin_and_reference_agree_over_random_steps(data: st.DataObject) -> None:
    b = data.draw(st.integers(1, 6), label="B")
    bps = data.draw(st.integers(1, 4), label="bps")
    block_size = data.draw(st.integers(1, 3), label="block_size")
    num_blocks = data.draw(st.integers(bps + 1, b * bps + 2), label="num_blocks")
    vocab = data.draw(st.integers(1, 7), label="vocab")
    smaller = data.draw(st.sets(st.integers(1, b - 1)) if b > 1 else st.just(set()))
    buckets = (*sorted(smaller), b)
    hybrid = data.draw(st.booleans(), label="hybrid")
    window = data.draw(st.integers(1, 5), label="window")
    max_stop_ids = data.draw(st.integers(0, 3), label="max_stop_ids")
    pool = twin("BlockPool", num_blocks)
    lanes = twin("LaneTable", b, bps, block_size)
    inputs = twin("DecodeInputs", b, bps, buckets)
    slots = twin("SlidingSlots", b, window) if hybrid else None
    kernel = kernel_twin(pool, lanes, inputs, slots, max_stop_ids)
    spare = pool.reserve_spare()
    # per lane, what the reference expects (outputs are separate lists per implementation)
    outputs: dict[int, tuple[array[int], array[int]]] = {}
    times: dict[int, tuple[array[float], array[float]]] = {}
    stops: dict[int, tuple[int, ...]] = {}
    limits: dict[int, int] = {}
    flags: dict[int, int] = {}

    def bind(lane: int) -> None:
        stop_ids = tuple(data.draw(st.lists(st.integers(0, vocab), max_size=4), label="stops"))
        limit = data.draw(st.integers(0, 6), label="limit")
        flag = data.draw(st.sampled_from([0, py_impl.LANE_SAMPLE, py_impl.LANE_OWN_OUTPUT,
                                          py_impl.LANE_SAMPLE | py_impl.LANE_OWN_OUTPUT]))
        prior = data.draw(st.lists(st.integers(0, vocab), max_size=3), label="prior")
        outputs[lane] = (array("q", prior), array("q", prior))
        times[lane] = (array("d"), array("d"))
        stops[lane], limits[lane] = stop_ids, limit
        flags[lane] = flag | (py_impl.LANE_STOPCHECK if len(stop_ids) > max_stop_ids else 0)
        for side, impl in (("c", kernel.c), ("py", kernel.py)):
            index = 0 if side == "c" else 1
            impl.bind(lane, f"r{lane}", outputs[lane][index], times[lane][index], limit,
                      stop_ids, flag)
        assert kernel.flags(lane) == flags[lane]

    def release(lane: int) -> None:
        for block in lanes.release(lane):
            pool.free(block)
        kernel.unbind(lane)
        outputs.pop(lane, None)

    for step in range(data.draw(st.integers(1, 6), label="steps")):
        # new tenants for idle lanes, each starting to decode at a random length
        while lanes.num_idle and data.draw(st.booleans(), label="admit"):
            if pool.first_free() < 0:
                break
            lane = lanes.assign()
            seq_len = data.draw(st.integers(0, bps * block_size - 1), label="seq_len")
            for _ in range(-(-(seq_len + 1) // block_size)):
                if pool.first_free() < 0:
                    break
                lanes.push_block(lane, pool.allocate(LANE, lane))
            if lanes.num_held(lane) * block_size <= seq_len:
                release(lane)
                continue
            lanes.start_decode(lane, seq_len, data.draw(st.integers(0, vocab), label="token"))
            if slots is not None:
                slots.reset(lane)
                slots.advance(lane, seq_len)
            bind(lane)
        # growth: lanes short of a block are served by the test (eviction stands in) or dropped
        while True:
            short = kernel.grow()
            assert_same_arrays(lanes, LANE_ARRAYS)
            assert_same_arrays(kernel, ("attention",))
            if not short:
                break
            for lane in kernel.c.attention[:short].tolist():
                assert lanes.state(lane) == DECODING
                assert lanes.blocks_for(lanes.seq_len(lane) + 1) > lanes.num_held(lane)
                release(lane)  # preempted: its blocks go back, so the next lanes can grow
        for lane in range(b):
            if lanes.state(lane) == DECODING:
                assert lanes.blocks_for(lanes.seq_len(lane) + 1) <= lanes.num_held(lane)
        decoding = [ln for ln in range(b) if lanes.state(ln) == DECODING]
        if not decoding:
            continue
        rows = kernel.build(spare)
        assert rows == len(decoding)
        assert inputs.row_lanes[:rows].tolist() == decoding
        values = np.array(data.draw(st.lists(st.lists(logit_values, min_size=vocab,
                                                      max_size=vocab),
                                             min_size=inputs.num_rows,
                                             max_size=inputs.num_rows), label="logits"),
                          dtype=np.float32).reshape(inputs.num_rows, vocab)
        # any valid ids (the engine passes numpy's argmax): the kernel must copy them, not pick
        greedy = np.array(data.draw(st.lists(st.integers(0, vocab - 1), min_size=inputs.num_rows,
                                             max_size=inputs.num_rows), label="greedy"),
                          dtype=np.int64)
        attention = kernel.pick(values, greedy)
        assert_same_arrays(kernel, KERNEL_ARRAYS)
        want_attention = []
        for row, lane in enumerate(decoding):
            best = int(greedy[row]) if np.isfinite(values[row, greedy[row]]) else -1
            if best < 0:
                assert kernel.c.status[row] == py_impl.ROW_NONFINITE
                want_attention.append(row)
            else:
                assert kernel.c.tokens[row] == best
                sampled = bool(flags[lane] & py_impl.LANE_SAMPLE)
                assert kernel.c.status[row] == (py_impl.ROW_SAMPLE if sampled else py_impl.ROW_OK)
                if sampled:
                    want_attention.append(row)
        assert kernel.c.attention[:attention].tolist() == want_attention
        # the caller: fails non-finite rows (their lanes stop), samples the flagged ones
        failed = set()
        for row in want_attention:
            lane = decoding[row]
            if kernel.c.status[row] == py_impl.ROW_NONFINITE:
                failed.add(lane)
            else:
                token = data.draw(st.integers(0, vocab), label="sampled")
                kernel.c.tokens[row] = kernel.py.tokens[row] = token
        lost = data.draw(st.sets(st.sampled_from(decoding)), label="failed during the step")
        before = {lane: (lanes.seq_len(lane), list(outputs[lane][0])) for lane in decoding}
        tokens = kernel.c.tokens[:rows].tolist()
        status_before = kernel.c.status[:rows].tolist()
        for lane in failed | lost:
            release(lane)
        attention = kernel.complete(float(step))
        assert_same_arrays(kernel, KERNEL_ARRAYS)
        assert_same_arrays(lanes, LANE_ARRAYS)
        if slots is not None:
            assert_same_arrays(slots, ("_fill",))
        want_attention = []
        completed = 0
        for row, lane in enumerate(decoding):
            status = kernel.c.status[row]
            if status_before[row] == py_impl.ROW_NONFINITE:
                assert status == py_impl.ROW_NONFINITE
                continue
            if lane in failed | lost:
                assert status == py_impl.ROW_SKIPPED
                continue
            completed += 1
            token = tokens[row]
            seq_len, out = before[lane]
            assert lanes.seq_len(lane) == seq_len + 1 and lanes.next_token(lane) == token
            assert list(outputs[lane][0]) == list(outputs[lane][1]) == [*out, token]
            assert times[lane][0][-1] == times[lane][1][-1] == float(step)
            if slots is not None:
                assert slots.fill(lane) == min(seq_len + 1, window)
            if flags[lane] & py_impl.LANE_STOPCHECK:
                want = py_impl.ROW_CHECK
            elif token in stops[lane]:
                want = py_impl.ROW_STOP
            elif len(outputs[lane][0]) >= limits[lane]:
                want = py_impl.ROW_LENGTH
            else:
                want = py_impl.ROW_OK
            assert status == want, (row, lane, status, want)
            if want != py_impl.ROW_OK or flags[lane] & py_impl.LANE_OWN_OUTPUT:
                want_attention.append(row)
            else:
                assert kernel.c.plain[row]
        assert kernel.c.plain[:rows].sum() == completed - sum(
            1 for row in want_attention if kernel.c.status[row] != py_impl.ROW_SKIPPED)
        assert kernel.c.attention[:attention].tolist() == want_attention
        assert kernel.completed == completed
        emitted: tuple[list[Any], list[Any]] = ([], [])
        assert kernel.c.emit(emitted[0], as_tuple) == kernel.py.emit(emitted[1], as_tuple)
        assert emitted[0] == emitted[1] == [
            (f"r{lane}", (tokens[row],), False) for row, lane in enumerate(decoding)
            if kernel.c.status[row] == py_impl.ROW_OK and
            not flags[lane] & py_impl.LANE_OWN_OUTPUT]
        # finished lanes leave, as the scheduler releases them
        for row in want_attention:
            if kernel.c.status[row] in (py_impl.ROW_STOP, py_impl.ROW_LENGTH):
                release(decoding[row])
        for lane in list(outputs):
            if lanes.state(lane) == DECODING and \
                    lanes.seq_len(lane) + 1 >= bps * block_size:
                release(lane)  # its context is full
    pool.check()


@pytest.mark.parametrize("impl", [c_impl, py_impl], ids=["c", "py"])
def test_kernel_refuses_misuse_without_changing_anything(impl: Any) -> None:
    pool, lanes = impl.BlockPool(6), impl.LaneTable(2, 2, 4)
    inputs = impl.DecodeInputs(2, 2, (1, 2))
    kernel = impl.StepKernel(pool, lanes, inputs)
    with pytest.raises(StateError, match="decode buffers"):
        impl.StepKernel(pool, impl.LaneTable(3, 2, 4), inputs)
    lane = lanes.assign()
    lanes.push_block(lane, pool.allocate(LANE, lane))
    lanes.start_decode(lane, 1, 5)
    kernel.build(pool.reserve_spare())
    with pytest.raises(StateError, match="no request is bound"):
        kernel.complete(0.0)
    assert lanes.seq_len(lane) == 1
    with pytest.raises(StateError, match="flags"):
        kernel.bind(lane, "r", array("q"), array("d"), 4, (), 64)
    with pytest.raises(TypeError, match="array"):
        kernel.bind(lane, "r", array("i"), array("d"), 4, (), 0)
    with pytest.raises(TypeError):
        kernel.bind(lane, "r", [], array("d"), 4, (), 0)
    with pytest.raises(StateError, match="rows"):
        kernel.pick(np.zeros((0, 3), dtype=np.float32), np.zeros(1, dtype=np.int64))
    with pytest.raises(ValueError):
        kernel.pick(np.zeros((1, 3), dtype=np.float64), np.zeros(1, dtype=np.int64))
    with pytest.raises(StateError, match="outside the vocabulary"):
        kernel.pick(np.zeros((1, 3), dtype=np.float32), np.array([3], dtype=np.int64))
    output = array("q", [9])
    kernel.bind(lane, "r", output, array("d"), 3, (7,), 0)
    assert kernel.num_output(lane) == 1
    logits = np.array([[0.0, 1.0, 0.5]], dtype=np.float32)
    assert kernel.pick(logits, logits.argmax(axis=1)) == 0
    assert kernel.complete(2.0) == 0 and list(output) == [9, 1] and kernel.completed == 1
    assert lanes.seq_len(lane) == 2 and lanes.next_token(lane) == 1


@pytest.mark.parametrize("impl", [c_impl, py_impl], ids=["c", "py"])
def test_grow_takes_free_blocks_in_lane_order_and_reports_the_rest(impl: Any) -> None:
    """Three lanes cross a block boundary in the same step and the pool has one FREE block: the
    lowest lane takes it, the two others are handed back in lane order, with nothing changed."""
    pool, lanes = impl.BlockPool(4), impl.LaneTable(3, 2, 2)
    kernel = impl.StepKernel(pool, lanes, impl.DecodeInputs(3, 2))
    for lane in range(3):
        assert lanes.assign() == lane
        lanes.push_block(lane, pool.allocate(LANE, lane))
        lanes.start_decode(lane, 1, 1)
        lanes.advance(lane, 1)  # position 2 is in the second block
    free = pool.first_free()
    assert kernel.grow() == 2
    assert kernel.attention[:2].tolist() == [1, 2]
    assert lanes.blocks(0)[-1] == free and lanes.num_held(1) == lanes.num_held(2) == 1
    assert pool.owner(free) == 0 and pool.state(free) == LANE
    pool.check()

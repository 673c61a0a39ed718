"""The decode pipeline's kernel calls that tests/blocks/test_build_ahead.py leaves out, on the
compiled core and its twin side by side: `pick_values` (the landing's pick from the values the
device thread kept) against `pick` on the same logits, `grow(ahead=1)` for lanes at the end of
their row, and `use`'s checks."""

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

LANE = py_impl.LANE
KERNEL_ARRAYS = ("tokens", "status", "attention")


def kernel_with_lanes(data: st.DataObject, b: int, bps: int, block_size: int,
                      num_blocks: int) -> tuple[Twin, Twin, Twin, Twin]:
    pool = twin("BlockPool", num_blocks)
    lanes = twin("LaneTable", b, bps, block_size)
    inputs = twin("DecodeInputs", b, bps)
    kernel = Twin(c_impl.StepKernel(pool.c, lanes.c, inputs.c, None),
                  py_impl.StepKernel(pool.py, lanes.py, inputs.py, None))
    for _ in range(b):
        if not data.draw(st.booleans(), label="admit") or pool.first_free() < 0:
            continue
        seq_len = data.draw(st.integers(0, bps * block_size - 1), label="seq_len")
        lane = admit_lane(pool, lanes, block_size, seq_len, 1)
        if lane is None:
            continue
        limit = data.draw(st.integers(1, 2 * bps * block_size), label="limit")
        flag = data.draw(st.sampled_from([0, 0, py_impl.LANE_SAMPLE]), label="flag")
        kernel.c.bind(lane, f"r{lane}", array("q"), array("d"), limit, (), flag)
        kernel.py.bind(lane, f"r{lane}", array("q"), array("d"), limit, (), flag)
    return pool, lanes, inputs, kernel


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_grow_ahead_at_the_end_of_a_row(data: st.DataObject) -> None:
    """Lanes up to the last position of their row: the two cores take the same blocks and report
    the same lanes short; a lane reported short is one whose next-but-one position the free list
    or its row cannot hold."""
    b = data.draw(st.integers(1, 5), label="B")
    bps = data.draw(st.integers(1, 3), label="bps")
    block_size = data.draw(st.integers(1, 3), label="block_size")
    pool, lanes, _, kernel = kernel_with_lanes(
        data, b, bps, block_size, data.draw(st.integers(1, b * bps + 2), label="num_blocks"))
    short = kernel.grow(1)
    assert_same_arrays(lanes, LANE_ARRAYS)
    assert np.array_equal(kernel.c.attention[:short], kernel.py.attention[:short])
    reported = set(kernel.c.attention[:short].tolist())
    for lane in range(b):
        if lanes.state(lane) != py_impl.LANE_DECODING:
            continue
        need = lanes.blocks_for(lanes.seq_len(lane) + 2)
        finishing = kernel.num_output(lane) + 1 >= int(kernel.c._max_out[lane])
        if finishing:
            assert lane not in reported
        elif lane not in reported:
            assert lanes.num_held(lane) >= need
        else:
            assert need > bps or pool.first_free() < 0
    pool.check()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_pick_values_is_pick_on_the_same_logits(data: st.DataObject) -> None:
    """`pick_values` from the argmax and the picked logit (what the device thread keeps) gives
    the tokens, statuses and attention rows `pick` gives from the logits themselves."""
    b = data.draw(st.integers(1, 5), label="B")
    _, lanes, _, kernel = kernel_with_lanes(data, b, 2, 2, 2 * b + 1)
    if not lanes.num_decoding():
        return
    rows = kernel.build(0)
    vocab = data.draw(st.integers(1, 6), label="vocab")
    n = kernel.c.inputs.num_rows
    special = st.sampled_from([np.nan, np.inf, -np.inf, 0.5, -2.0, 3.0])
    logits = np.array([[data.draw(special) for _ in range(vocab)] for _ in range(n)],
                      dtype=np.float32)
    greedy = np.argmax(logits, axis=1).astype(np.int64)
    best = np.zeros(n, dtype=np.float32)
    c_impl.picked_logits(logits, greedy, best, rows)
    want = kernel.c.pick(logits, greedy)
    picked = {name: np.array(getattr(kernel.c, name)[:rows]) for name in KERNEL_ARRAYS}
    assert kernel.py.pick(logits, greedy) == want
    assert kernel.pick_values(best, greedy, vocab) == want
    for name in KERNEL_ARRAYS:
        got = getattr(kernel.c, name)[:rows]
        if name == "attention":
            got, expected = got[:want], picked[name][:want]
        else:
            expected = picked[name]
        assert np.array_equal(got, expected), name
    assert_same_arrays(kernel, ("tokens", "status"))


@pytest.mark.parametrize("impl", [c_impl, py_impl], ids=["c", "py"])
def test_use_and_pick_values_check_their_arguments(impl: Any) -> None:
    pool, lanes = impl.BlockPool(4), impl.LaneTable(2, 2, 2)
    inputs = impl.DecodeInputs(2, 2)
    kernel = impl.StepKernel(pool, lanes, inputs, None)
    with pytest.raises(StateError, match=r"decode buffers are \(3, 2\), lanes are \(2, 2\)"):
        kernel.use(impl.DecodeInputs(3, 2), 0)
    with pytest.raises(StateError, match=r"num_rows=3 is outside 0..2"):
        kernel.use(impl.DecodeInputs(2, 2), 3)
    lane = lanes.assign()
    lanes.push_block(lane, pool.allocate(LANE, lane))
    lanes.start_decode(lane, 0, 3)
    kernel.bind(lane, "r", array("q"), array("d"), 5, (), 0)
    assert kernel.build(pool.first_free()) == 1
    kernel.use(inputs, 1)
    with pytest.raises(StateError, match=r"greedy\[0\]=4 is outside the vocabulary 0..3"):
        kernel.pick_values(np.zeros(2, np.float32), np.array([4, 0], np.int64), 4)
    with pytest.raises(StateError, match="logits have no vocabulary entries"):
        kernel.pick_values(np.zeros(2, np.float32), np.zeros(2, np.int64), 0)
    with pytest.raises(StateError, match="best: 0 rows, greedy: 2; the step ran 1 rows"):
        kernel.pick_values(np.zeros(0, np.float32), np.zeros(2, np.int64), 4)

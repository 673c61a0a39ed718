"""`StepKernel.build_ahead` with sliding slots (a hybrid model, atombatch/engine/pipeline.py): the decode
step built after a prefill chunk planned ahead runs right after that chunk, so none of its padding
rows may name the sliding slot of a lane that prefills (a padding row writes its slot at
position 0, into the window the chunk just built). Random lane states through the compiled core
and its twin side by side: every array agrees, padding rows name only the slots of lanes without
a row that do not prefill (one of them again when they are fewer than the padding rows), and the
step is not built (-1) when every lane without a row prefills.
"""

from __future__ import annotations

from array import array

import atombatch.kernel._blocks as c_impl
import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.twins import Twin, admit_lane, twin

import atombatch.kernel._blocks_py as py_impl

PREFILLING = py_impl.LANE_PREFILLING
INPUTS = ("input_ids", "cache_position", "block_tables", "local_block_tables", "row_lanes")


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_padding_rows_built_ahead_never_name_a_prefilling_lanes_slot(
        data: st.DataObject) -> None:
    b = data.draw(st.integers(1, 6), label="B")
    bps, block_size = 2, 4
    smaller = data.draw(st.sets(st.integers(1, b - 1)) if b > 1 else st.just(set()))
    buckets = (*sorted(smaller), b)
    pool = twin("BlockPool", b * bps + 2)
    lanes = twin("LaneTable", b, bps, block_size)
    slots = (c_impl.SlidingSlots(b, 4), py_impl.SlidingSlots(b, 4))
    first = twin("DecodeInputs", b, bps, buckets)
    ahead = twin("DecodeInputs", b, bps, buckets)
    kernel = Twin(c_impl.StepKernel(pool.c, lanes.c, first.c, slots[0]),
                  py_impl.StepKernel(pool.py, lanes.py, first.py, slots[1]))
    spare = pool.reserve_spare()
    outputs = []
    for _ in range(b):
        kind = data.draw(st.sampled_from(["idle", "prefilling", "decoding"]), label="lane")
        if kind == "prefilling":
            lanes.assign()  # admitted: its chunk is on the device before the step built
        elif kind == "decoding":
            lane = admit_lane(pool, lanes, block_size, data.draw(st.integers(0, 6)), 3)
            assert lane is not None
            limit = data.draw(st.integers(1, 4), label="limit")
            outputs.append((array("q"), array("q")))
            kernel.c.bind(lane, f"r{lane}", outputs[-1][0], array("d"), limit, (), 0)
            kernel.py.bind(lane, f"r{lane}", outputs[-1][1], array("d"), limit, (), 0)
        else:
            break  # the rest stay idle
    decoding = [lane for lane in range(b) if lanes.state(lane) == py_impl.LANE_DECODING]
    prefilling = {lane for lane in range(b) if lanes.state(lane) == PREFILLING}
    # the step on the device: none (the decode after a chunk: every decode before it landed)
    # or the decoding lanes' step, whose lanes at their limit end in it
    on_device = data.draw(st.booleans(), label="a decode on the device") and bool(decoding)
    rows = kernel.build(spare) if on_device else 0
    if on_device and kernel.grow(1):
        return  # a lane the free list could not serve: the caller does not build ahead
    going = [lane for lane in decoding
             if not on_device or int(kernel.c._max_out[lane]) > 1]
    gathers = (np.full(b, 7, dtype=np.int32), np.full(b, 7, dtype=np.int32))
    built = [impl.build_ahead(out, prev, rows, gather, spare) for impl, out, prev, gather in
             ((kernel.c, ahead.c, first.c, gathers[0]),
              (kernel.py, ahead.py, first.py, gathers[1]))]
    assert built[0] == built[1]
    if not going:
        assert built[0] == 0
        return
    bucket = first.c.bucket_for(len(going))
    free_slots = [lane for lane in range(b) if lane not in going and lane not in prefilling]
    if bucket > len(going) and not free_slots:
        assert built[0] == -1  # every lane without a row prefills: back to the host
        event("no slot for padding")
        return
    assert built[0] == len(going) and ahead.c.num_rows == bucket
    for name in INPUTS:
        assert np.array_equal(getattr(ahead.c, name), getattr(ahead.py, name)), name
    assert np.array_equal(gathers[0][:bucket], gathers[1][:bucket])
    assert ahead.c.row_lanes[:len(going)].tolist() == going
    padding = ahead.c.local_block_tables[len(going):bucket, 0].tolist()
    assert padding == ahead.c.row_lanes[len(going):bucket].tolist()
    # free slots in lane order, then the first of them again
    want = (free_slots + free_slots[:1] * bucket)[:bucket - len(going)]
    assert padding == want
    event("a slot padded twice" if len(set(padding)) < len(padding) else
          "padding beside a prefilling lane" if prefilling and padding else "other")
    assert not set(padding) & (prefilling | set(going))
    assert (ahead.c.cache_position[len(going):bucket] == 0).all()
    assert (gathers[0][len(going):bucket] == -1).all()


def test_without_sliding_slots_padding_still_takes_a_prefilling_lanes_slot() -> None:
    """A model without sliding layers keeps the layout it had: the slot a padding row names is
    never read, so the prefilling lane's entry serves as any other."""
    for impl in (c_impl, py_impl):
        pool = impl.BlockPool(6)
        lanes = impl.LaneTable(3, 2, 4)
        inputs, ahead = impl.DecodeInputs(3, 2, (3,)), impl.DecodeInputs(3, 2, (3,))
        kernel = impl.StepKernel(pool, lanes, inputs, None)
        spare = pool.reserve_spare()
        lane = lanes.assign()
        lanes.push_block(lane, pool.allocate(py_impl.LANE, lane))
        lanes.start_decode(lane, 1, 5)
        kernel.bind(lane, "r", array("q"), array("d"), 4, (), 0)
        assert lanes.assign() == 1  # prefilling
        gather = np.zeros(3, dtype=np.int32)
        assert kernel.build_ahead(ahead, inputs, 0, gather, spare) == 1
        assert ahead.local_block_tables[:, 0].tolist() == [0, 1, 2]

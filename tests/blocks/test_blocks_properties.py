"""Stateful property tests: the compiled core and its twin, driven by the same random operations.

`CoreMachine` plays a small scheduler over random shapes (admit, grow, start/advance/stop decoding,
finish or abort with or without the prefix cache, stage into the spare, rotate, pin/unpin/touch/
evict/drop/adopt cached blocks, build decode and prefill inputs) on both implementations at once.
After every step the two are compared array for array and DESIGN §3's invariants are checked:
conservation, exclusivity, padding safety at every decode build and no leak at teardown. Alongside,
"chaos" rules fire arbitrary (mostly illegal) calls at a second pool/lane table pair and require the
same result or the same exception type and message from both, with nothing changed by a failure.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support.twins import (  # noqa: F401
    LANE_ARRAYS,
    Raised,
    Twin,
    assert_same_arrays,
    same,
    twin,
)

from atombatch.errors import AtomBatchError

FREE, SPARE, STAGED, LANE, CACHED = range(5)
IDLE, PREFILLING, DECODING = range(3)

POOL_ARRAYS = ("_prev", "_next", "_state", "_owner", "_refcnt")
TABLE_ARRAYS = ("input_ids", "cache_position", "block_tables", "local_block_tables")
DECODE_ARRAYS = (*TABLE_ARRAYS, "row_lanes")
PREFILL_ARRAYS = (*TABLE_ARRAYS, "query_position")


def pool_state(pool: Twin) -> tuple:
    assert_same_arrays(pool, POOL_ARRAYS)
    return (pool.counts(), pool.num_evictable, pool.free_blocks(), pool.lru_blocks(),
            pool.c._prev.tolist(), pool.c._next.tolist(), pool.c._state.tolist(),
            pool.c._owner.tolist(), pool.c._refcnt.tolist())


def lane_state(lanes: Twin) -> tuple:
    assert_same_arrays(lanes, LANE_ARRAYS)
    return (lanes.num_busy, lanes.num_idle, lanes.num_decoding(), lanes.rows().tolist(),
            lanes.c._state.tolist(), lanes.c._seq_len.tolist(), lanes.c._next_token.tolist(),
            lanes.c._num_held.tolist())


class CoreMachine(RuleBasedStateMachine):
    # -- set-up ------------------------------------------------------------------------------------
    @initialize(batch_size=st.integers(1, 5), blocks_per_seq=st.integers(1, 4),
                block_size=st.integers(1, 4), extra=st.integers(0, 12),
                chaos_blocks=st.integers(1, 6), window=st.integers(1, 6), data=st.data())
    def setup(self, batch_size: int, blocks_per_seq: int, block_size: int, extra: int,
              chaos_blocks: int, window: int, data: st.DataObject) -> None:
        b, bps = batch_size, blocks_per_seq
        # From the oversubscribed minimum bps + 1 up to more than the general rule B * bps + 1.
        num_blocks = min(bps + 1 + extra, b * bps + 2)
        self.b, self.bps, self.block_size, self.num_blocks = b, bps, block_size, num_blocks
        self.pool = twin("BlockPool", num_blocks)
        self.lanes = twin("LaneTable", b, bps, block_size)
        self.slots = twin("SlidingSlots", b, window)
        smaller = data.draw(st.sets(st.integers(1, b - 1)) if b > 1 else st.just(set()),
                            label="buckets")
        self.buckets = (*sorted(smaller), b)
        self.decode = twin("DecodeInputs", b, bps, self.buckets)
        self.prefill = twin("PrefillInputs", data.draw(st.integers(1, 5), label="chunk"), bps)
        self.spare: int | None = self.pool.reserve_spare()
        self.staged: int | None = None
        self.next_request = 100
        # chaos pair: anything goes, only agreement and atomic failure are checked
        self.raw_pool = twin("BlockPool", chaos_blocks)
        self.raw_lanes = twin("LaneTable", data.draw(st.integers(1, 3), label="raw_b"),
                              data.draw(st.integers(1, 3), label="raw_bps"),
                              data.draw(st.integers(1, 3), label="raw_bs"))
        self.raw_slots = twin("SlidingSlots", self.raw_lanes.batch_size, window)
        raw_b = self.raw_lanes.batch_size
        self.raw_decode = twin("DecodeInputs", raw_b, self.raw_lanes.blocks_per_seq,
                               tuple(sorted({1, raw_b})))

    # -- helpers -----------------------------------------------------------------------------------
    def lanes_in(self, *states: int) -> list[int]:
        return [lane for lane in range(self.b) if self.lanes.state(lane) in states]

    def blocks_in(self, state: int, pinned: bool | None = None) -> list[int]:
        out = [blk for blk in range(self.num_blocks) if self.pool.state(blk) == state]
        if pinned is not None:
            out = [blk for blk in out if (self.pool.refcount(blk) > 0) == pinned]
        return out

    def take_block(self, owner: int) -> int | None:
        """A LANE block for `owner`, evicting the LRU cached block when the free list is empty."""
        if self.pool.first_free() < 0:
            if not self.pool.num_evictable:
                return None
            self.pool.evict()
        return self.pool.allocate(LANE, owner)

    def give_back(self, blocks: list[int], cache: bool) -> None:
        for blk in blocks:
            if cache:
                self.pool.cache(blk)
            else:
                self.pool.free(blk)

    # -- lanes -------------------------------------------------------------------------------------
    @precondition(lambda self: self.lanes.num_idle > 0)
    @rule(data=st.data(), prefix_hit=st.booleans())
    def admit(self, data: st.DataObject, prefix_hit: bool) -> None:
        idle = self.lanes_in(IDLE)
        lane = self.lanes.assign()
        assert lane == idle[0]  # lowest idle lane first
        assert (self.lanes.state(lane), self.lanes.seq_len(lane), self.lanes.blocks(lane)) == (
            PREFILLING, 0, [])
        unpinned = self.blocks_in(CACHED, pinned=False)
        if prefix_hit and unpinned:
            block: int | None = data.draw(st.sampled_from(unpinned), label="adopt")
            self.pool.adopt(block, lane)
        else:
            block = self.take_block(lane)
        if block is None:
            assert self.lanes.release(lane) == []
            return
        self.lanes.push_block(lane, block)
        self.slots.reset(lane)

    @rule(data=st.data(), adopt=st.booleans())
    def grow(self, data: st.DataObject, adopt: bool) -> None:
        lanes = [ln for ln in self.lanes_in(PREFILLING, DECODING)
                 if self.lanes.num_held(ln) < self.bps]
        if not lanes:
            return
        lane = data.draw(st.sampled_from(lanes), label="lane")
        unpinned = self.blocks_in(CACHED, pinned=False)
        if adopt and unpinned:
            block: int | None = data.draw(st.sampled_from(unpinned), label="adopt")
            self.pool.adopt(block, lane)
        else:
            block = self.take_block(lane)
        if block is not None:
            self.lanes.push_block(lane, block)

    @rule(data=st.data())
    def start_decode(self, data: st.DataObject) -> None:
        lanes = [ln for ln in self.lanes_in(PREFILLING) if self.lanes.num_held(ln)]
        if not lanes:
            return
        lane = data.draw(st.sampled_from(lanes), label="lane")
        capacity = self.lanes.num_held(lane) * self.block_size
        seq_len = data.draw(st.integers(0, capacity - 1), label="seq_len")
        self.lanes.start_decode(lane, seq_len, data.draw(st.integers(0, 2**40), label="token"))
        self.slots.reset(lane)  # the prefill (re)computed the window from scratch
        self.slots.advance(lane, seq_len)
        assert self.slots.fill(lane) == min(seq_len, self.slots.window)

    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        limit = self.bps * self.block_size
        lanes = [ln for ln in self.lanes_in(DECODING) if self.lanes.seq_len(ln) + 1 < limit]
        if not lanes:
            return
        lane = data.draw(st.sampled_from(lanes), label="lane")
        seq_len = self.lanes.seq_len(lane)
        self.lanes.advance(lane, data.draw(st.integers(0, 2**31), label="token"))
        assert self.lanes.seq_len(lane) == seq_len + 1
        self.slots.advance(lane, 1)
        if self.lanes.blocks_for(seq_len + 2) > self.lanes.num_held(lane):
            block = self.take_block(lane)
            if block is None:  # pool dry: preempt, as the engine does
                self.lanes.stop_decode(lane)
            else:
                self.lanes.push_block(lane, block)

    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        lanes = self.lanes_in(DECODING)
        if not lanes:
            return
        lane = data.draw(st.sampled_from(lanes), label="lane")
        self.lanes.stop_decode(lane)
        for _ in range(data.draw(st.integers(0, self.lanes.num_held(lane)), label="pop")):
            self.pool.free(self.lanes.pop_block(lane))
        self.lanes.set_seq_len(lane, 0)
        self.slots.reset(lane)  # it recomputes its window from scratch

    @rule(data=st.data(), cache=st.booleans())
    def finish_or_abort(self, data: st.DataObject, cache: bool) -> None:
        lanes = self.lanes_in(PREFILLING, DECODING)
        if not lanes:
            return
        lane = data.draw(st.sampled_from(lanes), label="lane")
        expected = self.lanes.blocks(lane)
        held = self.lanes.release(lane)
        assert held == expected
        assert self.lanes.state(lane) == IDLE and self.lanes.blocks(lane) == []
        self.give_back(held, cache)

    # -- spare, staging, rotation ------------------------------------------------------------------
    @precondition(lambda self: self.spare is not None)
    @rule()
    def stage(self) -> None:
        if self.lanes.num_idle:  # with an idle lane the request simply takes the lane
            return
        self.pool.stage(self.spare, self.next_request)
        assert self.pool.owner(self.spare) == self.next_request
        self.staged, self.spare = self.spare, None
        self.next_request += 1

    @precondition(lambda self: self.staged is not None)
    @rule()
    def unstage(self) -> None:
        self.pool.unstage(self.staged)
        self.spare, self.staged = self.staged, None

    @precondition(lambda self: self.staged is not None and self.lanes.num_idle > 0)
    @rule()
    def staged_takes_idle_lane(self) -> None:
        """A lane finished mid-staging: the staged request takes it, keeping its filled block."""
        lane = self.lanes.assign()
        self.pool.assign(self.staged, lane)
        self.lanes.push_block(lane, self.staged)
        self.slots.reset(lane)
        self.staged = None

    @precondition(lambda self: self.spare is None and self.staged is None)
    @rule()
    def reserve_spare(self) -> None:
        if self.pool.first_free() < 0 and self.pool.num_evictable:
            self.pool.evict()
        if self.pool.first_free() >= 0:
            first = self.pool.first_free()
            self.spare = self.pool.reserve_spare()
            assert self.spare == first

    @precondition(lambda self: self.lanes.num_idle > 0)
    @rule(data=st.data())
    def admit_all(self, data: st.DataObject) -> None:
        while self.lanes.num_idle and (self.pool.first_free() >= 0 or self.pool.num_evictable):
            self.admit(data, prefix_hit=False)

    @rule(data=st.data())
    def copy_on_write(self, data: st.DataObject) -> None:
        lanes = [ln for ln in self.lanes_in(PREFILLING, DECODING) if self.lanes.num_held(ln)]
        if not lanes or self.pool.first_free() < 0:
            return
        lane = data.draw(st.sampled_from(lanes), label="lane")
        index = data.draw(st.integers(0, self.lanes.num_held(lane) - 1), label="index")
        held = self.lanes.blocks(lane)
        new = self.pool.allocate(LANE, lane)
        assert self.lanes.replace_block(lane, index, new) == held[index]
        self.pool.free(held[index])
        assert self.lanes.last_block(lane) == self.lanes.blocks(lane)[-1]

    @precondition(lambda self: self.staged is not None and self.lanes.num_idle == 0)
    @rule(data=st.data(), cache=st.booleans(), in_one_call=st.booleans())
    def rotate(self, data: st.DataObject, cache: bool, in_one_call: bool) -> None:
        lanes = [ln for ln in self.lanes_in(PREFILLING, DECODING) if self.lanes.num_held(ln)]
        if not lanes:
            return
        lane = data.draw(st.sampled_from(lanes), label="lane")
        held = self.lanes.blocks(lane)
        out = data.draw(st.sampled_from(held), label="out")
        if in_one_call:
            self.pool.rotate(self.staged, out, lane)
        else:
            self.pool.to_spare(out)
            self.pool.assign(self.staged, lane)
        assert self.lanes.release(lane) == held
        assert self.lanes.assign() == lane  # the only idle lane: lanes are stable
        self.lanes.push_block(lane, self.staged)
        self.slots.reset(lane)
        self.give_back([blk for blk in held if blk != out], cache)
        self.spare, self.staged = out, None

    # -- prefix cache ------------------------------------------------------------------------------
    @rule(data=st.data())
    def acquire(self, data: st.DataObject) -> None:
        cached = self.blocks_in(CACHED)
        if cached:
            block = data.draw(st.sampled_from(cached), label="block")
            count = self.pool.refcount(block)
            self.pool.acquire(block)
            assert self.pool.refcount(block) == count + 1
            assert block not in self.pool.lru_blocks()

    @rule(data=st.data())
    def release_pin(self, data: st.DataObject) -> None:
        pinned = self.blocks_in(CACHED, pinned=True)
        if pinned:
            block = data.draw(st.sampled_from(pinned), label="block")
            self.pool.release(block)
            if self.pool.refcount(block) == 0:
                assert self.pool.lru_blocks()[-1] == block

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        cached = self.blocks_in(CACHED)
        if cached:
            block = data.draw(st.sampled_from(cached), label="block")
            lru = self.pool.lru_blocks()
            self.pool.touch(block)
            if block in lru:
                assert self.pool.lru_blocks() == [b for b in lru if b != block] + [block]
            else:
                assert self.pool.lru_blocks() == lru

    @rule()
    def evict(self) -> None:
        lru = self.pool.lru_blocks()
        if lru:
            assert self.pool.evict() == lru[0]
            assert self.pool.free_blocks()[-1] == lru[0]

    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        unpinned = self.blocks_in(CACHED, pinned=False)
        if unpinned:
            self.pool.drop(data.draw(st.sampled_from(unpinned), label="block"))

    # -- device inputs -----------------------------------------------------------------------------
    @rule()
    def decode_build(self) -> None:
        padding = self.spare if self.spare is not None else self.pool.first_free()
        if padding < 0 and self.pool.num_evictable:
            padding = self.pool.evict()  # CACHED blocks go before the last padding target
        decoding = self.lanes.num_decoding()
        rows = min(bucket for bucket in self.buckets if bucket >= decoding)
        assert self.decode.bucket_for(decoding) == rows
        if padding < 0 and rows > decoding:
            return
        assert self.decode.build(self.lanes, padding) == decoding
        assert self.decode.c.num_rows == self.decode.py.num_rows == rows
        assert_same_arrays(self.decode, DECODE_ARRAYS)
        ids, pos, tables, local, row_lanes = (getattr(self.decode.c, n) for n in DECODE_ARRAYS)
        assert ids.shape == (rows, 1) and tables.shape == (rows, self.bps)
        assert all(getattr(self.decode.c, n).flags.c_contiguous for n in DECODE_ARRAYS)
        # decoding lanes packed first in lane order; every row a distinct lane, its own slot
        assert row_lanes[:decoding].tolist() == self.lanes_in(DECODING)
        assert len(set(row_lanes.tolist())) == rows
        assert local.ravel().tolist() == row_lanes.tolist()
        for row, lane in enumerate(row_lanes.tolist()):
            table = tables[row].tolist()
            assert min(table) >= 0
            if row < decoding:
                blocks, seq_len = self.lanes.blocks(lane), self.lanes.seq_len(lane)
                assert table == blocks + [blocks[-1]] * (self.bps - len(blocks))
                assert table[seq_len // self.block_size] in blocks  # it writes its own block
                assert (ids[row, 0], pos[row, 0]) == (self.lanes.next_token(lane), seq_len)
                assert all(self.pool.state(blk) == LANE and self.pool.owner(blk) == lane
                           for blk in table)
            else:  # padding: a lane that does not decode, only a FREE or SPARE block, token 0 at 0
                assert self.lanes.state(lane) != DECODING
                assert table == [padding] * self.bps
                assert self.pool.state(padding) in (FREE, SPARE)
                assert (ids[row, 0], pos[row, 0]) == (0, 0)

    @rule(data=st.data())
    def prefill_build(self, data: st.DataObject) -> None:
        tokens = data.draw(st.lists(st.integers(0, 2**31), min_size=0, max_size=12), label="tokens")
        if data.draw(st.booleans(), label="as_array"):
            tokens = np.array(tokens, dtype=np.int64)
        start = data.draw(st.integers(-1, 12), label="start")
        blocks = data.draw(st.lists(st.integers(-1, 40), min_size=0, max_size=self.bps + 1),
                           label="blocks")
        if data.draw(st.booleans(), label="blocks_as_array"):
            blocks = np.array(blocks, dtype=np.int32)
        num_blocks = data.draw(st.integers(0, self.bps + 1), label="num_blocks")
        slot = data.draw(st.integers(-1, 3), label="slot")
        before = [getattr(self.prefill.c, n).copy() for n in PREFILL_ARRAYS]
        try:
            real = self.prefill.build(tokens, start, blocks, num_blocks, slot)
        except AtomBatchError:
            after = [getattr(self.prefill.c, n) for n in PREFILL_ARRAYS]
            assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))
        else:
            q = self.prefill.chunk_size
            assert real == min(q, len(tokens) - start)
            assert self.prefill.c.cache_position.ravel().tolist() == list(range(start, start + q))
            assert int(self.prefill.c.query_position) == real - 1
            row = self.prefill.c.block_tables.tolist()
            assert row == list(blocks[:num_blocks]) + [blocks[num_blocks - 1]] * (
                self.bps - num_blocks)
        assert_same_arrays(self.prefill, PREFILL_ARRAYS)

    @rule(data=st.data())
    def chaos_sliding(self, data: st.DataObject) -> None:
        slots = self.raw_slots
        lane = data.draw(st.integers(-1, slots.c._fill.shape[0]), label="lane")
        try:
            if data.draw(st.booleans(), label="reset"):
                slots.reset(lane)
                assert slots.fill(lane) == 0
            else:
                fill = slots.fill(lane)
                num = data.draw(st.integers(-1, 8), label="num")
                assert slots.advance(lane, num) == min(fill + num, slots.window)
        except AtomBatchError:
            pass
        assert_same_arrays(slots, ("_fill",))

    # -- chaos: arbitrary calls must agree, and a failed call must change nothing ------------------
    @rule(method=st.sampled_from(["allocate", "free", "reserve_spare", "stage", "unstage",
                                  "assign", "to_spare", "rotate", "cache", "acquire", "release",
                                  "touch", "evict", "drop", "adopt", "state", "owner",
                                  "refcount", "first_free"]),
          args=st.lists(st.integers(-1, 7), min_size=3, max_size=3))
    def chaos_pool(self, method: str, args: list[int]) -> None:
        arity = {"allocate": 2, "reserve_spare": 0, "stage": 2, "assign": 2, "rotate": 3,
                 "evict": 0, "adopt": 2, "first_free": 0}.get(method, 1)
        before = pool_state(self.raw_pool)
        try:
            getattr(self.raw_pool, method)(*args[:arity])
        except AtomBatchError:
            assert pool_state(self.raw_pool) == before
        self.raw_pool.check()

    @rule(method=st.sampled_from(["assign", "release", "push_block", "pop_block", "replace_block",
                                  "set_seq_len", "start_decode", "stop_decode", "advance",
                                  "last_block", "blocks", "num_held", "seq_len", "next_token",
                                  "blocks_for", "build"]),
          args=st.lists(st.integers(-1, 10), min_size=3, max_size=3))
    def chaos_lanes(self, method: str, args: list[int]) -> None:
        arity = {"assign": 0, "push_block": 2, "replace_block": 3, "set_seq_len": 2,
                 "start_decode": 3, "advance": 2}.get(method, 1)
        before = lane_state(self.raw_lanes)
        try:
            if method == "build":
                self.raw_decode.build(self.raw_lanes, args[0])
            else:
                getattr(self.raw_lanes, method)(*args[:arity])
        except AtomBatchError:
            assert lane_state(self.raw_lanes) == before
        assert_same_arrays(self.raw_decode, DECODE_ARRAYS)

    # -- invariants after every step ---------------------------------------------------------------
    @invariant()
    def implementations_agree(self) -> None:
        pool_state(self.pool)
        lane_state(self.lanes)
        pool_state(self.raw_pool)
        lane_state(self.raw_lanes)
        assert_same_arrays(self.decode, DECODE_ARRAYS)

    @invariant()
    def ownership(self) -> None:
        self.pool.check()  # both: lists and counters match the states
        counts = self.pool.counts()
        assert sum(counts) == self.num_blocks  # conservation
        owner_of: dict[int, int] = {}
        for lane in range(self.b):
            blocks = self.lanes.blocks(lane)
            row = self.lanes.rows()[lane].tolist()
            assert row == blocks + [-1] * (self.bps - len(blocks))
            if self.lanes.state(lane) == IDLE:
                assert blocks == []
            for blk in blocks:  # exclusivity: a block is in at most one lane's row, as LANE(lane)
                assert blk not in owner_of, (blk, lane, owner_of)
                owner_of[blk] = lane
                assert (self.pool.state(blk), self.pool.owner(blk)) == (LANE, lane)
            if self.lanes.state(lane) == DECODING:
                assert self.lanes.blocks_for(self.lanes.seq_len(lane) + 1) <= len(blocks)
        assert len(owner_of) == counts[LANE]
        assert counts[SPARE] == (self.spare is not None)
        assert counts[STAGED] == (self.staged is not None)
        if self.spare is not None:
            assert self.pool.state(self.spare) == SPARE
        if self.staged is not None:
            assert self.pool.state(self.staged) == STAGED

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for lane in self.lanes_in(PREFILLING, DECODING):
            self.pool_give_back_all(lane)
        if self.staged is not None:
            self.pool.unstage(self.staged)
            self.spare, self.staged = self.staged, None
        if self.spare is not None:
            self.pool.free(self.spare)
        counts = self.pool.counts()
        assert counts[SPARE] == counts[STAGED] == counts[LANE] == 0  # no leak
        assert counts[FREE] + counts[CACHED] == self.num_blocks
        assert self.lanes.num_busy == 0
        self.pool.check()
        pool_state(self.pool)
        lane_state(self.lanes)

    def pool_give_back_all(self, lane: int) -> None:
        self.give_back(self.lanes.release(lane), cache=lane % 2 == 0)


CoreMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCore = CoreMachine.TestCase

"""Leak tests: many allocate/free, assign/release and build cycles leave memory flat.

A million cycles for the compiled core (100k for the pure-Python twin). Python-heap growth is
measured with tracemalloc, whole-process growth with the resident set size (`/proc/self/statm`),
which also sees C-level allocations that tracemalloc cannot.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tracemalloc
from collections.abc import Callable
from types import ModuleType

import pytest

from atombatch.errors import CapacityError, StateError

pytestmark = pytest.mark.slow

LANE = 3
TRACED_BOUND = 64 * 1024  # bytes of Python heap a cycle loop may keep (caches, interned ints)
RSS_BOUND = 4 * 1024 * 1024  # bytes of resident memory


def cycles(impl: ModuleType) -> int:
    return 1_000_000 if impl.IMPLEMENTATION == "c" else 100_000


def rss_bytes() -> int:
    if not sys.platform.startswith("linux"):
        return 0
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def growth(loop: Callable[[int], None], n: int) -> tuple[int, int]:
    """(traced Python-heap growth, RSS growth) of `loop(n)` after a warm-up `loop(n // 10)`."""
    loop(max(n // 10, 1))
    gc.collect()
    rss_before = rss_bytes()
    loop(n)
    gc.collect()
    rss_growth = rss_bytes() - rss_before
    traced_n = max(n // 10, 1)  # tracemalloc slows every allocation; a tenth is plenty to see slope
    tracemalloc.start()
    try:
        loop(traced_n)
        gc.collect()
        before, _ = tracemalloc.get_traced_memory()
        loop(traced_n)
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return after - before, rss_growth


def assert_flat(loop: Callable[[int], None], n: int) -> None:
    traced, rss = growth(loop, n)
    assert traced < TRACED_BOUND, f"Python heap grew by {traced} bytes"
    assert rss < RSS_BOUND, f"resident memory grew by {rss} bytes"


def test_allocate_free_cycles(impl: ModuleType) -> None:
    pool = impl.BlockPool(64)
    pool.reserve_spare()

    def loop(n: int) -> None:
        allocate, free = pool.allocate, pool.free
        for i in range(n):
            free(allocate(LANE, i & 7))

    assert_flat(loop, cycles(impl))
    pool.check()
    assert pool.counts() == (63, 1, 0, 0, 0)


def test_cache_pin_evict_adopt_cycles(impl: ModuleType) -> None:
    pool = impl.BlockPool(8)

    def loop(n: int) -> None:
        for i in range(n // 4):
            block = pool.allocate(LANE, 0)
            pool.cache(block)
            pool.acquire(block)
            pool.release(block)
            pool.touch(block)
            if i & 1:
                pool.evict()
            else:
                pool.adopt(block, 1)
                pool.free(block)

    assert_flat(loop, cycles(impl))
    pool.check()
    assert pool.num_lane == 0


def test_assign_release_cycles(impl: ModuleType) -> None:
    lanes = impl.LaneTable(4, 4, 16)
    lanes.assign()

    def loop(n: int) -> None:
        assign, release, push = lanes.assign, lanes.release, lanes.push_block
        for i in range(n):
            lane = assign()
            push(lane, i & 1023)
            release(lane)

    assert_flat(loop, cycles(impl))
    assert lanes.num_busy == 1


def test_decode_build_cycles(impl: ModuleType) -> None:
    lanes = impl.LaneTable(8, 4, 16)
    for lane in range(6):
        lanes.assign()
        lanes.push_block(lane, lane)
        lanes.start_decode(lane, 3, 7)
    inputs = impl.DecodeInputs(8, 4)

    def loop(n: int) -> None:
        build = inputs.build
        for _ in range(n):
            build(lanes, 20)

    assert_flat(loop, cycles(impl) // 10)


def test_error_paths_do_not_leak(impl: ModuleType) -> None:
    pool = impl.BlockPool(2)
    pool.allocate(LANE, 0)
    pool.allocate(LANE, 0)
    lanes = impl.LaneTable(1, 1, 4)

    def loop(n: int) -> None:
        for _ in range(n):
            with contextlib.suppress(CapacityError):
                pool.allocate(LANE, 1)
            with contextlib.suppress(StateError):
                lanes.release(0)

    assert_flat(loop, cycles(impl) // 10)

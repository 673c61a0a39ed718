"""Micro-benchmark of the block/lane hot path: the compiled `_blocks` beside its pure-Python twin.

`python -m atombatch.bench micro [--lanes 1,4,16,64,256] [--quick] [--json PATH]`

For every batch size B it measures, on both implementations in the same run, the cost of one
operation (a short compound: a transition and the one that undoes it, so the state stays the same
whatever the number of iterations) and of one full decode-step build, for two artifact shapes:

- eager: `block_size == max_seq_len` (one block per sequence), `num_blocks = B + 1`;
- partitioned: `max_seq_len = 9216`, `block_size = 128` (72 blocks per sequence),
  `num_blocks = B * 72 + 1` (18 433 blocks at B = 256).

Comparing the two shapes at the same B shows that per-operation cost does not grow with the pool.
Each figure is the median of several repeats of a timed loop (timeit-style: the iteration count is
calibrated so a repeat lasts about `target_ms`), in nanoseconds per loop iteration, Python loop
overhead included for both implementations.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import cycle, islice
from types import ModuleType
from typing import Any

import msgspec
import numpy as np

from atombatch import _blocks_py

try:
    from atombatch import _blocks as _blocks_c  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - a build without the extension: measure the twin alone
    _blocks_c = None

LANE = _blocks_py.LANE
PARTITIONED_MAX_SEQ_LEN = 9216
PARTITIONED_BLOCK_SIZE = 128
EAGER_MAX_SEQ_LEN = 4096
PREFILL_CHUNK = 128

Loop = Callable[[int], None]


class MicroRecord(msgspec.Struct, frozen=True):
    """One measurement: `ns_per_op` nanoseconds per `op` on `impl` ("c" or "py")."""

    op: str          # operation measured (see OPS)
    impl: str        # "c" (compiled `_blocks`) or "py" (`_blocks_py`)
    lanes: int       # batch size B
    num_blocks: int  # blocks in the pool (B + 1 eager, B * 72 + 1 partitioned)
    ns_per_op: float  # median over repeats, nanoseconds per operation


OPS = (
    "allocate+free",          # FREE -> LANE -> FREE on a pool whose lanes hold their blocks
    "assign+release",         # the lowest idle lane taken and given back (B - 1 lanes busy)
    "stage+rotate",           # the spare staged, then rotated into lane 0 (old block -> spare)
    "touch",                  # an unpinned CACHED block made most recently used
    "evict+allocate+cache",   # LRU block evicted, re-allocated and cached again
    "adopt+cache",            # a cached block adopted by a lane (prefix hit) and cached again
    "acquire+release",        # pin and unpin a cached block
    "decode_build",           # one full decode step's input arrays, every lane decoding
    "prefill_build",          # one prefill chunk's input arrays (128 tokens)
    "engine_step",            # a whole Batcher decode step on a null device (eager shape only):
                              #   schedule + build + greedy sampling + outputs, every lane decoding
)

ENGINE_VOCAB = 256
ENGINE_MAX_SEQ_LEN = 65536  # long enough that no lane finishes while a measurement runs


# -- workloads -----------------------------------------------------------------------------------


def _filled_pool(impl: ModuleType, num_blocks: int, lanes: int, held: int) -> Any:
    """A pool whose `lanes` lanes hold `held` blocks each (allocated in lane order)."""
    pool = impl.BlockPool(num_blocks)
    for lane in range(lanes):
        for _ in range(held):
            pool.allocate(LANE, lane)
    return pool


def _cached_pool(impl: ModuleType, num_blocks: int) -> tuple[Any, list[int]]:
    """A pool whose every block is CACHED and unpinned; the blocks in a scattered order."""
    pool = impl.BlockPool(num_blocks)
    blocks = [pool.allocate(LANE, 0) for _ in range(num_blocks)]
    for block in blocks:
        pool.cache(block)
    order = [int(b) for b in np.random.default_rng(0).permutation(num_blocks)]
    return pool, order


def _workloads(impl: ModuleType, lanes: int, blocks_per_seq: int, block_size: int,
               num_blocks: int) -> dict[str, Loop]:
    """One loop per op, each leaving its objects in an equivalent state after every iteration."""
    b, bps = lanes, blocks_per_seq
    loops: dict[str, Loop] = {}

    # Lanes hold all but one block each (eager: their one block), leaving free blocks to cycle.
    lane_held = max(bps - 1, 1)
    pool = _filled_pool(impl, num_blocks, b, lane_held)

    def allocate_free(n: int, allocate=pool.allocate, free=pool.free) -> None:
        for _ in range(n):
            free(allocate(LANE, 0))

    loops["allocate+free"] = allocate_free

    table = impl.LaneTable(b, bps, block_size)
    for _ in range(b - 1):
        table.assign()

    def assign_release(n: int, assign=table.assign, release=table.release) -> None:
        for _ in range(n):
            release(assign())

    loops["assign+release"] = assign_release

    pool_r = _filled_pool(impl, num_blocks, b, lane_held)
    spare = pool_r.reserve_spare()
    pool_r.stage(spare, 1)
    lane0_block = 0  # allocated first, to lane 0

    def stage_rotate(n: int, rotate=pool_r.rotate, stage=pool_r.stage) -> None:
        staged, out = spare, lane0_block
        for _ in range(n):
            rotate(staged, out, 0)
            stage(out, 1)
            staged, out = out, staged
        if n % 2:  # put the two blocks back where they started
            rotate(staged, out, 0)
            stage(out, 1)

    loops["stage+rotate"] = stage_rotate

    cached, order = _cached_pool(impl, num_blocks)

    def touch(n: int, touch=cached.touch) -> None:
        for block in islice(cycle(order), n):
            touch(block)

    def evict_cache(n: int, evict=cached.evict, allocate=cached.allocate,
                    cache=cached.cache) -> None:
        for _ in range(n):
            evict()
            cache(allocate(LANE, 0))

    def adopt_cache(n: int, adopt=cached.adopt, cache=cached.cache) -> None:
        for block in islice(cycle(order), n):
            adopt(block, 0)
            cache(block)

    def acquire_release(n: int, acquire=cached.acquire, release=cached.release) -> None:
        for block in islice(cycle(order), n):
            acquire(block)
            release(block)

    loops["touch"] = touch
    loops["evict+allocate+cache"] = evict_cache
    loops["adopt+cache"] = adopt_cache
    loops["acquire+release"] = acquire_release

    # A full decode step: every lane decoding at the end of a full row (worst case for the copy).
    decoding = impl.LaneTable(b, bps, block_size)
    for lane in range(b):
        decoding.assign()
        for j in range(bps):
            decoding.push_block(lane, lane * bps + j)
        decoding.start_decode(lane, bps * block_size - 1, 1000 + lane)
    inputs = impl.DecodeInputs(b, bps)
    padding = num_blocks - 1

    def decode_build(n: int, build=inputs.build) -> None:
        for _ in range(n):
            build(decoding, padding)

    loops["decode_build"] = decode_build

    prefill = impl.PrefillInputs(PREFILL_CHUNK, bps)
    tokens = np.arange(4 * PREFILL_CHUNK, dtype=np.int64)
    row = np.arange(bps, dtype=np.int32)
    num_row = min(bps, max(1, (2 * PREFILL_CHUNK) // block_size + 1))

    def prefill_build(n: int, build=prefill.build) -> None:
        for _ in range(n):
            build(tokens, PREFILL_CHUNK, row, num_row)

    loops["prefill_build"] = prefill_build
    if blocks_per_seq == 1:
        loops["engine_step"] = _engine_step_loop(impl, b)
    return loops


class _NullDevice:
    """A device that returns the same logits instantly: what is left is the host's work."""

    def __init__(self, artifact: Any) -> None:
        self.artifact = artifact
        self._decode = np.zeros((artifact.batch_size, ENGINE_VOCAB), dtype=np.float32)
        self._decode[:, 7] = 1.0
        self._prefill = self._decode[0]

    def prefill(self, inputs: Any) -> np.ndarray:
        return self._prefill

    def decode(self, inputs: Any) -> np.ndarray:
        return self._decode


def _engine_step_loop(impl: ModuleType, lanes: int) -> Loop:
    """A Batcher on `impl`'s core with every lane decoding; each iteration is one `step()`."""
    from atombatch import scheduler as scheduler_module
    from atombatch.config import ArtifactConfig, ModelSpec
    from atombatch.engine import Batcher
    from atombatch.structs import SamplingParams

    spec = ModelSpec(name="null", family="llama", vocab_size=ENGINE_VOCAB, hidden_size=8,
                     intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8)
    art = ArtifactConfig(model=spec, batch_size=lanes, max_seq_len=ENGINE_MAX_SEQ_LEN,
                         block_size=ENGINE_MAX_SEQ_LEN, num_blocks=lanes + 1,
                         prefill_chunk_size=128)
    core = scheduler_module.core
    names = ("BlockPool", "LaneTable", "SlidingSlots", "DecodeInputs", "PrefillInputs")
    saved = {name: getattr(core, name) for name in names}
    try:  # the scheduler binds its core objects at construction
        for name in names:
            setattr(core, name, getattr(impl, name))
        batcher = Batcher(_NullDevice(art))  # type: ignore[arg-type]
    finally:
        for name, value in saved.items():
            setattr(core, name, value)
    params = SamplingParams(temperature=0.0, max_tokens=ENGINE_MAX_SEQ_LEN - 8, ignore_eos=True)
    for _ in range(lanes):
        batcher.submit([1, 2, 3], params)
    while batcher.scheduler.lanes.num_decoding() < lanes:
        batcher.step()

    def engine_step(n: int, step: Callable[[], Any] = batcher.step) -> None:
        for _ in range(n):
            step()

    return engine_step


# -- timing ----------------------------------------------------------------------------------------


def _time_ns(loop: Loop, n: int) -> int:
    start = time.perf_counter_ns()
    loop(n)
    return time.perf_counter_ns() - start


def measure(loop: Loop, target_ms: float, repeats: int) -> float:
    """Median nanoseconds per iteration of `loop`, timeit-style."""
    target = target_ms * 1e6
    n = 1
    elapsed = _time_ns(loop, n)
    while elapsed < target / 10 and n < 10**8:
        n *= 10
        elapsed = _time_ns(loop, n)
    n = max(1, int(n * target / max(elapsed, 1)))
    return statistics.median(_time_ns(loop, n) / n for _ in range(repeats))


def shapes(batch_size: int) -> list[tuple[str, int, int, int]]:
    """(config, blocks_per_seq, block_size, num_blocks) of the eager and partitioned artifacts."""
    bps = PARTITIONED_MAX_SEQ_LEN // PARTITIONED_BLOCK_SIZE
    return [("eager", 1, EAGER_MAX_SEQ_LEN, batch_size + 1),
            ("partitioned", bps, PARTITIONED_BLOCK_SIZE, batch_size * bps + 1)]


def implementations() -> list[ModuleType]:
    return [m for m in (_blocks_c, _blocks_py) if m is not None]


def run(lanes: Iterable[int] = (1, 4, 16, 64, 256), json_path: str | None = None,
        quick: bool = False) -> list[MicroRecord]:
    """Measure every op on both implementations; optionally write the records as JSON.

    Args:
        lanes: the batch sizes B to measure.
        json_path: where to write the list of `MicroRecord`s (msgspec JSON), or None.
        quick: short repeats (about a millisecond, 3 repeats) for a run of a few seconds.

    Returns:
        One `MicroRecord` per (op, implementation, B, shape).
    """
    target_ms, repeats = (1.0, 3) if quick else (20.0, 5)
    records: list[MicroRecord] = []
    for b in lanes:
        for _config, bps, block_size, num_blocks in shapes(b):
            for impl in implementations():
                loops = _workloads(impl, b, bps, block_size, num_blocks)
                for op in OPS:
                    if op not in loops:
                        continue
                    ns = measure(loops[op], target_ms, repeats)
                    records.append(MicroRecord(op=op, impl=impl.IMPLEMENTATION, lanes=b,
                                               num_blocks=num_blocks, ns_per_op=round(ns, 1)))
    if json_path is not None:
        with open(json_path, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(records), indent=2))
    return records


def format_table(records: Sequence[MicroRecord]) -> str:
    """One line per (shape, B, op): compiled and twin ns/op side by side, and their ratio."""
    by_key: dict[tuple[str, int, int], dict[str, float]] = {}
    for r in records:
        config = "eager" if r.num_blocks == r.lanes + 1 else "partitioned"
        by_key.setdefault((config, r.lanes, r.num_blocks), {})[f"{r.op}/{r.impl}"] = r.ns_per_op
    lines = [f"{'shape':<12}{'B':>4}{'blocks':>7}  {'op':<22}{'c ns':>10}{'py ns':>12}{'py/c':>8}"]
    for (config, b, num_blocks), values in by_key.items():
        for op in OPS:
            c, py = values.get(f"{op}/c"), values.get(f"{op}/py")
            if c is None and py is None:
                continue
            ratio = f"{py / c:7.1f}x" if c and py else "       -"
            c_text = f"{c:10.0f}" if c is not None else f"{'-':>10}"
            py_text = f"{py:12.0f}" if py is not None else f"{'-':>12}"
            lines.append(f"{config:<12}{b:>4}{num_blocks:>7}  {op:<22}{c_text}{py_text}{ratio}")
    return "\n".join(lines + ["", *LEGEND])


# What each column and operation of `format_table` means (printed under the table).
LEGEND = (
    "columns: shape = eager (one block per sequence, blocks = B + 1) or partitioned (72 blocks "
    "of 128 tokens per sequence, blocks = B x 72 + 1);",
    "  B = decode lanes; blocks = KV blocks in the pool; op = the operation timed (below);",
    "  c ns = median nanoseconds per operation (Python call included) on the compiled _blocks; "
    "py ns = the same on its pure-Python twin; py/c = how many times faster the compiled one is.",
    "ops: allocate+free = a free block taken by a lane and freed; assign+release = the lowest idle "
    "lane taken and given back;",
    "  stage+rotate = the spare staged for a queued request, then rotated into a finished lane;",
    "  touch = a cached block made most recently used; evict+allocate+cache = the LRU cached "
    "block evicted, reused and cached again;",
    "  adopt+cache = a cached block adopted on a prefix hit and cached again; acquire+release = "
    "a cached block pinned and unpinned;",
    "  decode_build / prefill_build = one decode step's / one 128-token prefill chunk's input "
    "arrays; engine_step = a whole Batcher step on a null device.",
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m atombatch.bench micro",
        description="ns per block/lane operation and per decode-step build, compiled vs twin.")
    parser.add_argument("--lanes", default="1,4,16,64,256",
                        help="comma-separated batch sizes B (default: 1,4,16,64,256)")
    parser.add_argument("--quick", action="store_true", help="short repeats (a few seconds)")
    parser.add_argument("--json", metavar="PATH", help="write the records as msgspec JSON")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        lanes = [int(x) for x in args.lanes.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--lanes must be comma-separated integers, got {args.lanes!r}")
    if not lanes or min(lanes) <= 0:
        parser.error(f"--lanes must be positive integers, got {args.lanes!r}")
    if _blocks_c is None:
        print("note: the compiled extension is not built; measuring the twin only", file=sys.stderr)
    records = run(lanes=lanes, json_path=args.json, quick=args.quick)
    print(format_table(records))
    if args.json:
        print(f"\nwrote {len(records)} records to {args.json}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

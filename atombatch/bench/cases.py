"""The micro-benchmark cases, defined once: `bench micro` and the pyperf suite in `bench/` both
time exactly these.

A case is a name plus a `make()` that builds its objects and returns a *time function*:
`time_func(loops) -> seconds` runs the operation `loops` times and returns the time those runs
took, excluding any untimed reset it needs between runs (pyperf's `bench_time_func` protocol).
Building is lazy, so a pyperf worker builds only the case it measures.

Shapes (see `micro` for what they show):
- eager: `block_size == max_seq_len` (one block per sequence), `num_blocks = B + 1`;
- partitioned: `max_seq_len = 9216`, `block_size = 128` (72 blocks per sequence),
  `num_blocks = B * 72 + 1` (18 433 blocks at B = 256).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import cycle, islice
from types import ModuleType
from typing import Any

import numpy as np

from atombatch.bench import vllm_scheduler
from atombatch.kernel import _blocks_py

try:
    from atombatch.kernel import _blocks as _blocks_c  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - a build without the extension: measure the twin alone
    _blocks_c = None

LANE = _blocks_py.LANE
PARTITIONED_MAX_SEQ_LEN = 9216
PARTITIONED_BLOCK_SIZE = 128
EAGER_MAX_SEQ_LEN = 4096
PREFILL_CHUNK = 128
ENGINE_VOCAB = 256
ENGINE_EAGER_MAX_SEQ_LEN = 65536   # long: lanes are renewed (untimed) long before they finish
PREFIX_TOKENS = 8192               # the prompt of the prefix-cache cases
PREFIX_MAX_SEQ_LEN = 9216
PREFIX_CHUNK = 1024                # large prefill chunks: a cheap untimed reset

Loop = Callable[[int], None]
TimeFunc = Callable[[int], float]

BLOCK_OPS = (
    "allocate+free",          # FREE -> LANE -> FREE on a pool whose lanes hold their blocks
    "assign+release",         # the lowest idle lane taken and given back (B - 1 lanes busy)
    "stage+rotate",           # the spare staged, then rotated into lane 0 (old block -> spare)
    "touch",                  # an unpinned CACHED block made most recently used
    "evict+allocate+cache",   # LRU block evicted, re-allocated and cached again
    "adopt+cache",            # a cached block adopted by a lane (prefix hit) and cached again
    "acquire+release",        # pin and unpin a cached block
    "decode_build",           # one full decode step's input arrays, every lane decoding
    "prefill_build",          # one prefill chunk's input arrays (128 tokens)
)
ENGINE_OPS = (
    "engine_step",            # a whole Batcher decode step on a null device: schedule + build +
                              #   greedy sampling + outputs, every lane decoding
    "engine_step_arrays",     # the same step through Batcher.step_arrays(): tokens as arrays,
                              #   no RequestOutput per token
    "scheduler_step",         # the scheduler alone: schedule() + complete_decode() (growth,
                              #   table build, token append and stop checks), no device call,
                              #   no sampling, no outputs
)
PREFIX_8K_OPS = (
    "prefix_hash",            # hashing an 8 192-token prompt once (xxh3-128 block chain, and
                              #   the partial last block's digest)
    "prefix_hash_blake2b",    # baseline: the same digests with keyed blake2b-128
    "prefix_lookup",          # the longest cached prefix of that prompt, every block cached
    "prefix_insert",          # caching the finished 8 192-token request (Batcher.abort)
)
PREFIX_SCALE_OPS = (
    "prefix_miss",            # a lookup that misses at block 0 with 1k/10k/30k 16-token blocks
                              #   cached in 8-block chains (one root sibling per chain: what a
                              #   scan of siblings pays most for)
    "prefix_hash_lookup",     # hashing an 8 192-token prompt in 16-token blocks + its lookup,
                              #   every block cached (a fresh request's whole prefix-cache cost)
    "prefix_hash_lookup_vllm",  # baseline: vLLM v1's own block hasher (sha256 of the pickled
                              #   (parent, token tuple, None) per block, as BlockHash) and
                              #   BlockPool.get_cached_block per block, loaded from
                              #   $ATOMBATCH_VLLM_SRC (bench/vllm_baseline.py), else the recipe
    "prefix_insert_32k",      # caching a finished 32 768-token request (Batcher.abort)
    "prefix_admit_hit",       # the step that admits an 8 192-token request whose prompt is cached
                              #   in 16-token blocks (shares 448 blocks, prefills its last chunk)
    "prefix_admit_hit_schedule",  # that step's Scheduler.schedule() alone: lookup, pinning and
                              #   sharing the hit, growth, the chunk's prefill inputs
    "prefix_admit_hit_vllm",  # baseline (with $ATOMBATCH_VLLM_SRC): the block-pool work of vLLM
                              #   v1 admitting the same cached prompt, on its own BlockPool
                              #   (find_longest_cache_hit's probes, touch, get_new_blocks,
                              #   cache_full_blocks); hashes precomputed, as vLLM's are
    "prefix_admit",           # the step that admits a 128-token request at a full cache of
                              #   1k/10k/30k blocks (its lookup misses; its blocks are evicted)
    "prefix_admit_nocache",   # the same admitting step with the prefix cache off
    "prefix_steady",          # a steady decode step of the same Batcher (every lane decoding)
)
# vLLM's own Scheduler (a subprocess in its own venv, $ATOMBATCH_VLLM_PYTHON; bench/vllm_scheduler.py)
VLLM_SCHEDULER_OPS = vllm_scheduler.OPS
PREFIX_OPS = PREFIX_8K_OPS + PREFIX_SCALE_OPS + VLLM_SCHEDULER_OPS
VLLM_SOURCE_OPS = ("prefix_admit_hit_vllm",)  # measured only with $ATOMBATCH_VLLM_SRC
OPS = BLOCK_OPS + ENGINE_OPS + PREFIX_OPS


@dataclass(frozen=True)
class Case:
    """One measurement: an operation on one implementation, batch size and shape."""

    op: str                   # one of OPS
    impl: str                 # "c" (compiled `_blocks`), "py" (`_blocks_py`)
    shape: str                # "eager" | "partitioned"
    lanes: int                # batch size B
    num_blocks: int           # blocks in the pool
    make: Callable[[], TimeFunc]

    @property
    def name(self) -> str:
        """The pyperf benchmark name, e.g. `engine_step/partitioned/B16/c`."""
        return f"{self.op}/{self.shape}/B{self.lanes}/{self.impl}"


def implementations() -> list[ModuleType]:
    return [m for m in (_blocks_c, _blocks_py) if m is not None]


def shapes(batch_size: int) -> list[tuple[str, int, int, int]]:
    """(shape, blocks_per_seq, block_size, num_blocks) of the eager and partitioned artifacts."""
    bps = PARTITIONED_MAX_SEQ_LEN // PARTITIONED_BLOCK_SIZE
    return [("eager", 1, EAGER_MAX_SEQ_LEN, batch_size + 1),
            ("partitioned", bps, PARTITIONED_BLOCK_SIZE, batch_size * bps + 1)]


CPU_SECONDS = [0.0]
"""Process CPU time spent in timed regions, accumulated by every time function (wall time is what
they return). On a shared machine a timed region is descheduled part of the time; its CPU time
is close to what it would take on an idle one. `micro` reports both."""


def start_clocks() -> tuple[float, float]:
    cpu = time.process_time()
    return time.perf_counter(), cpu


def stop_clocks(started: tuple[float, float]) -> float:
    """Wall seconds since `started`; the CPU seconds go to CPU_SECONDS."""
    wall = time.perf_counter()
    CPU_SECONDS[0] += time.process_time() - started[1]
    return wall - started[0]


def timed(loop: Loop) -> TimeFunc:
    """A loop whose every iteration is the operation: time the whole loop."""
    def time_func(loops: int) -> float:
        started = start_clocks()
        loop(loops)
        return stop_clocks(started)
    return time_func


def cases(lanes: Iterable[int] = (1, 4, 16, 64, 256), ops: Iterable[str] = OPS,
          impls: Iterable[str] | None = None) -> list[Case]:
    """Every case, in a stable order (pyperf workers find theirs by position)."""
    wanted, by_name = set(ops), {m.IMPLEMENTATION: m for m in implementations()}
    impl_names = [n for n in by_name if impls is None or n in set(impls)]
    out: list[Case] = []
    for b in lanes:
        for shape, bps, block_size, num_blocks in shapes(b):
            for name in impl_names:
                impl = by_name[name]
                for op in BLOCK_OPS:
                    if op in wanted:
                        out.append(Case(op, name, shape, b, num_blocks, _block_case(
                            impl, op, b, bps, block_size, num_blocks)))
                for op in ENGINE_OPS:
                    if op in wanted:
                        engine_blocks = b + 1 if shape == "eager" else num_blocks
                        out.append(Case(op, name, shape, b, engine_blocks,
                                        _engine_case(impl, b, shape, op)))
    default = implementations()[0]
    if impls is not None and default.IMPLEMENTATION not in set(impls):
        return out
    for shape, num_blocks in (("eager", 2), ("partitioned", PREFIX_MAX_SEQ_LEN // 128 + 1)):
        for op in PREFIX_8K_OPS:
            if op in wanted:
                out.append(Case(op, default.IMPLEMENTATION, shape, 1, num_blocks,
                                _prefix_case(default, op, shape)))
    for op, shape, b, num_blocks in prefix_scale_shapes():
        if op in wanted:
            out.append(Case(op, default.IMPLEMENTATION, shape, b, num_blocks,
                            _prefix_scale_case(default, op, shape, b, num_blocks)))
    return out


# -- block/lane operations -------------------------------------------------------------------


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


def _block_case(impl: ModuleType, op: str, lanes: int, bps: int, block_size: int,
                num_blocks: int) -> Callable[[], TimeFunc]:
    return lambda: timed(block_loops(impl, lanes, bps, block_size, num_blocks, op))


def block_loops(impl: ModuleType, lanes: int, blocks_per_seq: int, block_size: int,
                num_blocks: int, op: str) -> Loop:
    """The loop of one block/lane op, leaving its objects in an equivalent state after every
    iteration (a transition and the one that undoes it)."""
    b, bps = lanes, blocks_per_seq
    # Lanes hold all but one block each (eager: their one block), leaving free blocks to cycle.
    lane_held = max(bps - 1, 1)

    if op == "allocate+free":
        pool = _filled_pool(impl, num_blocks, b, lane_held)

        def allocate_free(n: int, allocate=pool.allocate, free=pool.free) -> None:
            for _ in range(n):
                free(allocate(LANE, 0))
        return allocate_free

    if op == "assign+release":
        table = impl.LaneTable(b, bps, block_size)
        for _ in range(b - 1):
            table.assign()

        def assign_release(n: int, assign=table.assign, release=table.release) -> None:
            for _ in range(n):
                release(assign())
        return assign_release

    if op == "stage+rotate":
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
        return stage_rotate

    if op in ("touch", "evict+allocate+cache", "adopt+cache", "acquire+release"):
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

        loops: dict[str, Loop] = {"touch": touch, "evict+allocate+cache": evict_cache,
                                  "adopt+cache": adopt_cache, "acquire+release": acquire_release}
        return loops[op]

    if op == "decode_build":
        # A full decode step: every lane decoding at the end of a full row (worst case for the
        # copy).
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
        return decode_build

    if op == "prefill_build":
        prefill = impl.PrefillInputs(PREFILL_CHUNK, bps)
        tokens = np.arange(4 * PREFILL_CHUNK, dtype=np.int64)
        row = np.arange(bps, dtype=np.int32)
        num_row = min(bps, max(1, (2 * PREFILL_CHUNK) // block_size + 1))

        def prefill_build(n: int, build=prefill.build) -> None:
            for _ in range(n):
                build(tokens, PREFILL_CHUNK, row, num_row)
        return prefill_build

    raise ValueError(f"op={op!r} is not a block/lane op ({', '.join(BLOCK_OPS)})")


# -- the whole engine step -------------------------------------------------------------------


class NullDevice:
    """A device that returns the same logits instantly: what is left is the host's work."""

    def __init__(self, artifact: Any) -> None:
        self.artifact = artifact
        self._decode = np.zeros((artifact.batch_size, ENGINE_VOCAB), dtype=np.float32)
        self._decode[:, 7] = 1.0
        self._prefill = self._decode[0]

    def prefill(self, inputs: Any) -> np.ndarray:
        return self._prefill

    def decode(self, inputs: Any) -> np.ndarray:
        return self._decode[:len(inputs.input_ids)]  # one row per decode-graph row


def _null_spec() -> Any:
    from atombatch.artifact.config import ModelSpec

    return ModelSpec(name="null", family="llama", vocab_size=ENGINE_VOCAB, hidden_size=8,
                     intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8)


def batcher_on(impl: ModuleType, artifact: Any, **options: Any) -> Any:
    """A Batcher on a null device whose scheduler uses `impl`'s block core."""
    from atombatch.engine import scheduler as scheduler_module
    from atombatch.engine.batcher import Batcher

    core = scheduler_module.core
    names = [n for n in ("BlockPool", "LaneTable", "SlidingSlots", "DecodeInputs",
                         "PrefillInputs", "StepKernel") if hasattr(impl, n)]
    saved = {name: getattr(core, name) for name in names}
    try:  # the scheduler binds its core objects at construction
        for name in names:
            setattr(core, name, getattr(impl, name))
        return Batcher(NullDevice(artifact), **options)  # type: ignore[arg-type]
    finally:
        for name, value in saved.items():
            setattr(core, name, value)


def _engine_case(impl: ModuleType, lanes: int, shape: str,
                 op: str = "engine_step") -> Callable[[], TimeFunc]:
    return lambda: engine_step_time_func(impl, lanes, shape, op)


def engine_step_time_func(impl: ModuleType, lanes: int, shape: str,
                          op: str = "engine_step") -> TimeFunc:
    """A Batcher with every lane decoding; each timed iteration is one `step()` (engine_step),
    one `step_arrays()` (engine_step_arrays) or the scheduler's share of a step alone
    (scheduler_step: `schedule` + `complete_decode`, the tokens of the previous step reused).

    Prompt lengths are staggered over a block so that block growth (partitioned) is spread over
    steps as in a real workload. Before any lane could finish, the lanes are renewed (aborted and
    resubmitted, untimed), so every timed step decodes all B lanes."""
    from atombatch.api.structs import SamplingParams
    from atombatch.artifact.config import ArtifactConfig

    if shape == "eager":
        max_seq_len, block_size, num_blocks = (ENGINE_EAGER_MAX_SEQ_LEN,
                                               ENGINE_EAGER_MAX_SEQ_LEN, lanes + 1)
    else:
        max_seq_len, block_size = PARTITIONED_MAX_SEQ_LEN, PARTITIONED_BLOCK_SIZE
        num_blocks = lanes * (max_seq_len // block_size) + 1
    art = ArtifactConfig(model=_null_spec(), batch_size=lanes, max_seq_len=max_seq_len,
                         block_size=block_size, num_blocks=num_blocks, prefill_chunk_size=128)
    batcher = batcher_on(impl, art)
    longest_prompt = 128
    max_tokens = max_seq_len - longest_prompt - 8
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids: list[str] = []
    left = [0]  # timed steps before a lane could finish

    def renew() -> None:
        for request_id in ids:
            batcher.abort(request_id)
        batcher.step()  # drains the aborts' final outputs
        ids[:] = [batcher.submit([1 + (lane + j) % 200 for j in
                                        range(1 + (lane * longest_prompt) // lanes)], params)
                        for lane in range(lanes)]
        while batcher.scheduler.lanes.num_decoding() < lanes:
            batcher.step()
        left[0] = max_tokens - 2

    scheduler, clock = batcher.scheduler, batcher.clock

    def scheduler_step() -> None:
        scheduler.complete_decode(scheduler.schedule(clock()), clock())

    step_of = {"engine_step": batcher.step, "engine_step_arrays": batcher.step_arrays,
               "scheduler_step": scheduler_step}

    def time_func(loops: int, step: Callable[[], Any] = step_of[op]) -> float:
        elapsed = 0.0
        while loops:
            if left[0] <= 0:
                renew()
            run = min(loops, left[0])
            started = start_clocks()
            for _ in range(run):
                step()
            elapsed += stop_clocks(started)
            loops -= run
            left[0] -= run
        return elapsed

    return time_func


# -- the prefix cache ------------------------------------------------------------------------


def blake2b_chain(tokens: np.ndarray, block_size: int, key: bytes) -> list[bytes]:
    """The baseline: keyed blake2b-128 over the same input as `TokenChain` (every full block's
    digest, then the partial last block's)."""
    data = np.ascontiguousarray(tokens, dtype=np.int64).data.cast("B")
    parent, out, width = b"", [], 8 * block_size
    for start in range(0, len(data), width):
        block = data[start:start + width]
        state = hashlib.blake2b(parent, digest_size=16, key=key)
        state.update(block)
        state.update(b"F" if len(block) == width else b"P")
        parent = state.digest()
        out.append(parent)
    return out


def _prefix_case(impl: ModuleType, op: str, shape: str) -> Callable[[], TimeFunc]:
    return lambda: prefix_time_func(impl, op, shape)


def prefix_time_func(impl: ModuleType, op: str, shape: str) -> TimeFunc:
    """The prefix cache of a B=1 Batcher around one 8 192-token prompt (block_size 128, or one
    9 216-token block when eager)."""
    from atombatch.api.structs import SamplingParams
    from atombatch.artifact.config import ArtifactConfig

    block_size = PREFIX_MAX_SEQ_LEN if shape == "eager" else 128
    art = ArtifactConfig(model=_null_spec(), batch_size=1, max_seq_len=PREFIX_MAX_SEQ_LEN,
                         block_size=block_size, num_blocks=PREFIX_MAX_SEQ_LEN // block_size + 1,
                         prefill_chunk_size=PREFIX_CHUNK)
    batcher = batcher_on(impl, art, prefix_cache=True)
    scheduler = batcher.scheduler
    prefix = scheduler.prefix
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, ENGINE_VOCAB, size=PREFIX_TOKENS).astype(np.int64)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    serial = [0]

    def decoding_request(tokens: np.ndarray) -> str:
        """Submit, and step until its prefill is done (untimed)."""
        request_id = batcher.submit(tokens.tolist(), params)
        while scheduler.lanes.num_decoding() < 1:
            batcher.step()
        return str(request_id)

    if op == "prefix_hash":
        partial = PREFIX_TOKENS % block_size != 0

        def hash_prompt(n: int, chain=prefix.chain) -> None:
            for _ in range(n):
                hashed = chain(prompt)
                if partial:
                    hashed.partial_digest(PREFIX_TOKENS)
        return timed(hash_prompt)

    if op == "prefix_hash_blake2b":
        key = os.urandom(16)

        def hash_blake2b(n: int) -> None:
            for _ in range(n):
                blake2b_chain(prompt, block_size=block_size, key=key)
        return timed(hash_blake2b)

    if op == "prefix_lookup":
        batcher.abort(decoding_request(prompt))   # its 8 192 positions are cached
        batcher.step()
        chain = prefix.chain(prompt)
        probe = prefix.match(chain, PREFIX_TOKENS)
        if probe.tokens != PREFIX_TOKENS:
            raise RuntimeError(f"the prefix case expected a full hit, got {probe.tokens} tokens")

        def lookup(n: int, match=prefix.match) -> None:
            for _ in range(n):
                match(chain, PREFIX_TOKENS)
        return timed(lookup)

    if op == "prefix_insert":
        def insert(loops: int) -> float:
            elapsed = 0.0
            for _ in range(loops):
                serial[0] += 1
                tokens = prompt.copy()
                tokens[0] = 1 + serial[0] % (ENGINE_VOCAB - 1)   # a new prefix: no hit
                tokens[1] = 1 + serial[0] // (ENGINE_VOCAB - 1) % (ENGINE_VOCAB - 1)
                request_id = decoding_request(tokens)
                started = start_clocks()
                batcher.abort(request_id)     # releases the lane and caches its 8 192 positions
                elapsed += stop_clocks(started)
                batcher.step()                # drains the final output (untimed)
            return elapsed
        return insert

    raise ValueError(f"op={op!r} is not a prefix op ({', '.join(PREFIX_8K_OPS)})")


# -- the prefix index at scale ---------------------------------------------------------------

SCALE_BLOCK_SIZE = 16              # vLLM's default block size: the most blocks per prompt
SCALE_CACHED_BLOCKS = (1_000, 10_000, 30_000)
SCALE_CHAIN_BLOCKS = 8             # cached chains of 128-token prompts: one root sibling each
INSERT_TOKENS = 32_768             # the finished request of `prefix_insert_32k`
ADMIT_LANES = (4, 16)
ADMIT_MAX_SEQ_LEN = 2048
ADMIT_CACHED = 30_000              # the cache the nocache case's pool is sized for
ADMIT_NUM_BLOCKS = 30_720          # a full cache of 16-token blocks
ADMIT_PROMPT = 128                 # the admitted request's prompt (a miss)


def prefix_scale_shapes() -> list[tuple[str, str, int, int]]:
    """(op, shape, lanes, num_blocks) of every scale case."""
    out = [("prefix_miss", f"cached{n // 1000}k", 1, n) for n in SCALE_CACHED_BLOCKS]
    out += [("prefix_hash_lookup", "bs16", 1, PREFIX_TOKENS // SCALE_BLOCK_SIZE)]
    out += [("prefix_hash_lookup_vllm", shape, 1, PREFIX_TOKENS // SCALE_BLOCK_SIZE)
            for shape in dict.fromkeys((vllm_shape(), "bs16-recipe"))]
    out += [("prefix_insert_32k", shape, 1, INSERT_TOKENS // bs + 64 + 1)
            for shape, bs in (("bs16", 16), ("bs128", 128))]
    out += [("prefix_insert_32k", "eager", 1, 2)]
    out += [(op, "bs16", 1, PREFIX_MAX_SEQ_LEN // SCALE_BLOCK_SIZE + 1)
            for op in ("prefix_admit_hit", "prefix_admit_hit_schedule")]
    if vllm_shape() == "bs16-vllm":
        out += [("prefix_admit_hit_vllm", "bs16-vllm", 1, PREFIX_TOKENS // SCALE_BLOCK_SIZE + 1)]
    for b in ADMIT_LANES:
        for cached in SCALE_CACHED_BLOCKS:
            out += [(op, f"cached{cached // 1000}k", b, admit_num_blocks(b, cached))
                    for op in ("prefix_admit", "prefix_steady")]
        out += [("prefix_admit_nocache", "nocache", b, admit_num_blocks(b, ADMIT_CACHED))]
    extra = vllm_scheduler.EXTRA_CACHED  # beside vLLM's scheduler at larger B, when it runs
    for b in vllm_scheduler.extra_lanes():
        if admit_num_blocks(b, extra) <= np.iinfo(np.int16).max:  # what block tables can hold
            out += [(op, f"cached{extra // 1000}k", b, admit_num_blocks(b, extra))
                    for op in ("prefix_admit", "prefix_steady")]
    return out


def admit_num_blocks(lanes: int, cached: int) -> int:
    """The pool of the admission cases: `cached` blocks in the prefix cache, plus room for every
    lane's longest sequence and some."""
    return cached + lanes * (ADMIT_MAX_SEQ_LEN // SCALE_BLOCK_SIZE) + 200


def _prefix_scale_case(impl: ModuleType, op: str, shape: str, lanes: int,
                       num_blocks: int) -> Callable[[], TimeFunc]:
    if op == "prefix_miss":
        return lambda: prefix_miss_time_func(num_blocks)
    if op in ("prefix_hash_lookup", "prefix_hash_lookup_vllm"):
        return lambda: prefix_hash_lookup_time_func(op, recipe_only=shape == "bs16-recipe")
    if op == "prefix_insert_32k":
        return lambda: prefix_insert_32k_time_func(impl, shape)
    if op in ("prefix_admit_hit", "prefix_admit_hit_schedule"):
        return lambda: prefix_admit_hit_time_func(impl, op == "prefix_admit_hit_schedule")
    if op == "prefix_admit_hit_vllm":
        return prefix_admit_hit_vllm_time_func
    return lambda: prefix_admit_time_func(impl, op, lanes, num_blocks)


def cached_index(num_blocks: int, chain_blocks: int = SCALE_CHAIN_BLOCKS,
                 block_size: int = SCALE_BLOCK_SIZE, seed: int = 0) -> Any:
    """A `PrefixIndex` holding `num_blocks` full blocks in chains of `chain_blocks` random
    tokens (distinct first blocks)."""
    from atombatch.kernel.prefix import PrefixIndex

    index = PrefixIndex(block_size, seed=1, num_blocks=num_blocks)
    rng = np.random.default_rng(seed)
    block = 0
    while block < num_blocks:
        chain = index.chain(rng.integers(1, 32_000, size=chain_blocks * block_size))
        for j in range(min(chain_blocks, num_blocks - block)):
            index.insert_digest(block, chain.digests[j], chain.parent(j),
                                chain.tokens[j * block_size:(j + 1) * block_size], True)
            block += 1
    return index


def prefix_miss_time_func(num_blocks: int) -> TimeFunc:
    """`PrefixIndex.match` of an 8 192-token prompt (hashed once, untimed) that shares no block
    with the `num_blocks` cached ones."""
    index = cached_index(num_blocks)
    chain = index.chain(np.random.default_rng(99).integers(1, 32_000, size=PREFIX_TOKENS))
    if index.match(chain, PREFIX_TOKENS).tokens > SCALE_BLOCK_SIZE:
        raise RuntimeError("the miss case expected a miss")

    def miss(n: int, match=index.match) -> None:
        for _ in range(n):
            match(chain, PREFIX_TOKENS)
    return timed(miss)


def vllm_block_hashes(tokens: list[int], block_size: int, none_hash: bytes) -> list[bytes]:
    """vLLM v1's block hashes re-implemented (`atombatch.bench.vllm_baseline.recipe_hashes`)."""
    from atombatch.bench.vllm_baseline import recipe_hashes

    return recipe_hashes(tokens, block_size, none_hash)


def vllm_shape() -> str:
    """The baseline's shape name: vLLM's own code when `ATOMBATCH_VLLM_SRC` is set (see
    `atombatch.bench.vllm_baseline`), else the re-implemented recipe."""
    from atombatch.bench.vllm_baseline import ENV

    return "bs16-vllm" if os.environ.get(ENV) else "bs16-recipe"


def prefix_hash_lookup_time_func(op: str, recipe_only: bool = False) -> TimeFunc:
    """A fresh 8 192-token prompt's whole prefix-cache cost in 16-token blocks: its digests, then
    its longest cached prefix, every block cached. The baseline does the same the vLLM v1 way:
    its block hashes, then one dict probe per block until the first miss."""
    prompt = np.random.default_rng(0).integers(1, 32_000, size=PREFIX_TOKENS)
    if op == "prefix_hash_lookup":
        from atombatch.kernel.prefix import PrefixIndex

        index = PrefixIndex(SCALE_BLOCK_SIZE, seed=1,
                            num_blocks=PREFIX_TOKENS // SCALE_BLOCK_SIZE)
        cached = index.chain(prompt)
        for j in range(PREFIX_TOKENS // SCALE_BLOCK_SIZE):
            index.insert_digest(j, cached.digests[j], cached.parent(j),
                                cached.tokens[j * SCALE_BLOCK_SIZE:(j + 1) * SCALE_BLOCK_SIZE],
                                True)

        def hash_lookup(n: int, chain=index.chain, match=index.match) -> None:
            for _ in range(n):
                match(chain(prompt), PREFIX_TOKENS)
        return timed(hash_lookup)

    from atombatch.bench.vllm_baseline import load, recipe

    tokens = prompt.tolist()  # vLLM keeps a request's token ids as a list
    baseline = recipe(SCALE_BLOCK_SIZE) if recipe_only else load(SCALE_BLOCK_SIZE)
    cached = baseline.cache(tokens)
    if baseline.lookup(baseline.hash_request(tokens), cached) != PREFIX_TOKENS // SCALE_BLOCK_SIZE:
        raise RuntimeError("the vLLM baseline expected a full hit")

    def hash_lookup_vllm(n: int, hash_request=baseline.hash_request,
                         lookup=baseline.lookup) -> None:
        for _ in range(n):
            lookup(hash_request(tokens), cached)
    return timed(hash_lookup_vllm)


def prefix_insert_32k_time_func(impl: ModuleType, shape: str) -> TimeFunc:
    """`Batcher.abort` of a decoding request with a 32 768-token prompt: its lane released and
    its blocks cached (16- or 128-token blocks, or one eager block); a new prefix every time."""
    from atombatch.api.structs import SamplingParams
    from atombatch.artifact.config import ArtifactConfig

    max_seq_len = INSERT_TOKENS + 1024
    block_size = {"bs16": 16, "bs128": 128, "eager": max_seq_len}[shape]
    art = ArtifactConfig(model=_null_spec(), batch_size=1, max_seq_len=max_seq_len,
                         block_size=block_size, num_blocks=max_seq_len // block_size + 1,
                         prefill_chunk_size=PREFIX_CHUNK)
    batcher = batcher_on(impl, art, prefix_cache=True)
    scheduler = batcher.scheduler
    prompt = np.random.default_rng(0).integers(1, ENGINE_VOCAB, size=INSERT_TOKENS)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    serial = [0]

    def insert(loops: int) -> float:
        elapsed = 0.0
        for _ in range(loops):
            serial[0] += 1
            tokens = prompt.copy()
            tokens[0] = 1 + serial[0] % (ENGINE_VOCAB - 1)   # a new prefix: no hit
            tokens[1] = 1 + serial[0] // (ENGINE_VOCAB - 1) % (ENGINE_VOCAB - 1)
            request_id = batcher.submit(tokens.tolist(), params)
            while scheduler.lanes.num_decoding() < 1:
                batcher.step()
            started = start_clocks()
            batcher.abort(request_id)     # releases the lane and caches its 32 768 positions
            elapsed += stop_clocks(started)
            batcher.step()                # drains the final output (untimed)
        return elapsed
    return insert


def prefix_admit_hit_time_func(impl: ModuleType, schedule_only: bool = False) -> TimeFunc:
    """A B=1 Batcher (16-token blocks, chunks of 1 024) whose cache holds an 8 192-token prompt;
    each timed iteration is the step that admits that prompt again (lookup, 448 shared blocks
    pinned, the blocks of its last chunk taken, that chunk prefilled), or with `schedule_only`
    that step's `Scheduler.schedule()` alone (the rest of the step is the device call, sampling
    and outputs). Submitting (hashing) and finishing are untimed."""
    from atombatch.api.structs import SamplingParams
    from atombatch.artifact.config import ArtifactConfig

    art = ArtifactConfig(model=_null_spec(), batch_size=1, max_seq_len=PREFIX_MAX_SEQ_LEN,
                         block_size=SCALE_BLOCK_SIZE,
                         num_blocks=PREFIX_MAX_SEQ_LEN // SCALE_BLOCK_SIZE + 1,
                         prefill_chunk_size=PREFIX_CHUNK)
    batcher = batcher_on(impl, art, prefix_cache=True)
    scheduler = batcher.scheduler
    prompt = np.random.default_rng(0).integers(1, ENGINE_VOCAB, size=PREFIX_TOKENS).tolist()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def finish(request_id: Any) -> None:
        while scheduler.lanes.num_decoding() < 1:
            batcher.step()
        batcher.abort(request_id)
        batcher.step()

    finish(batcher.submit(prompt, params))
    schedule, in_schedule = scheduler.schedule, [0.0]

    def timed_schedule(*args: Any, **kwargs: Any) -> Any:
        started = start_clocks()
        plan = schedule(*args, **kwargs)
        in_schedule[0] += stop_clocks(started)
        return plan

    def admit(loops: int) -> float:
        elapsed, hits = 0.0, batcher.stats().prefix_hits
        for _ in range(loops):
            request_id = batcher.submit(prompt, params)
            if schedule_only:
                in_schedule[0] = 0.0
                scheduler.schedule = timed_schedule   # the admitting step's schedule() only
                batcher.step()
                del scheduler.schedule
                elapsed += in_schedule[0]
            else:
                started = start_clocks()
                batcher.step()
                elapsed += stop_clocks(started)
            finish(request_id)
        if batcher.stats().prefix_hits != hits + loops:
            raise RuntimeError("the admit-hit case expected every admission to hit")
        return elapsed
    return admit


def prefix_admit_hit_vllm_time_func() -> TimeFunc:
    """vLLM's block-pool work admitting the cached 8 192-token prompt (`prefix_admit_hit_vllm`),
    from `atombatch.bench.vllm_baseline`; needs `$ATOMBATCH_VLLM_SRC`."""
    from atombatch.bench.vllm_baseline import admit_time_func

    prompt = np.random.default_rng(0).integers(1, ENGINE_VOCAB, size=PREFIX_TOKENS).tolist()
    return admit_time_func(prompt, SCALE_BLOCK_SIZE, start_clocks, stop_clocks)


def full_cache_batcher(impl: ModuleType, lanes: int, prefix_cache: bool = True,
                       num_blocks: int = ADMIT_NUM_BLOCKS) -> Any:
    """A Batcher on a null device (16-token blocks, 2 048-token context) whose prefix cache
    holds every block but the spare and a few partial ones, from finished 2 000-token requests
    (filled until it evicts): the free list is dry, so nearly every block a request takes
    (admitted or growing) evicts the LRU cached one. (Leaving
    the lanes' room free, as this did before, made the first few hundred admissions evict
    nothing, and `prefix_admit` at B16 none in a quick run.)"""
    from atombatch.api.structs import SamplingParams
    from atombatch.artifact.config import ArtifactConfig

    art = ArtifactConfig(model=_null_spec(), batch_size=lanes, max_seq_len=ADMIT_MAX_SEQ_LEN,
                         block_size=SCALE_BLOCK_SIZE, num_blocks=num_blocks,
                         prefill_chunk_size=512)
    batcher = batcher_on(impl, art, prefix_cache=prefix_cache)
    if not prefix_cache:
        return batcher
    scheduler, rng = batcher.scheduler, np.random.default_rng(0)
    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    while scheduler.counters.evictions == 0:  # then the free list holds the partial blocks
        for _ in range(lanes):
            batcher.submit(rng.integers(1, ENGINE_VOCAB, size=2000).tolist(), once)
        while scheduler.has_work():
            batcher.step()
    return batcher


def prefix_admit_time_func(impl: ModuleType, op: str, lanes: int,
                           num_blocks: int = ADMIT_NUM_BLOCKS) -> TimeFunc:
    """Every lane decoding at a full cache. `prefix_admit`: one lane's request is aborted, a new
    128-token request is submitted (its prompt hashed; untimed), and the step that admits it is
    timed (lookup, eviction of the blocks it takes, its prefill chunk, the other lanes' decode);
    `prefix_admit_nocache` is that step without a prefix cache; `prefix_steady` a decode step."""
    from atombatch.api.structs import SamplingParams

    batcher = full_cache_batcher(impl, lanes, prefix_cache=op != "prefix_admit_nocache",
                                 num_blocks=num_blocks)
    scheduler, rng = batcher.scheduler, np.random.default_rng(1)
    max_tokens = ADMIT_MAX_SEQ_LEN - ADMIT_PROMPT - 8
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids: list[Any] = []
    left = [0]  # decode steps before the oldest lane could finish

    def fresh() -> Any:
        return batcher.submit(rng.integers(1, ENGINE_VOCAB, size=ADMIT_PROMPT).tolist(), params)

    def settle() -> None:
        while scheduler.lanes.num_decoding() < lanes:
            batcher.step()

    def renew() -> None:
        for request_id in ids:
            batcher.abort(request_id)
        batcher.step()
        ids[:] = [fresh() for _ in range(lanes)]
        settle()
        left[0] = max_tokens - 4

    renew()

    if op == "prefix_steady":
        def steady(loops: int) -> float:
            elapsed = 0.0
            while loops:
                if left[0] <= 0:
                    renew()
                run = min(loops, left[0])
                started = start_clocks()
                for _ in range(run):
                    batcher.step()
                elapsed += stop_clocks(started)
                loops -= run
                left[0] -= run
            return elapsed
        return steady

    def admit(loops: int) -> float:
        elapsed = 0.0
        for _ in range(loops):
            if left[0] <= 8:
                renew()
            batcher.abort(ids[0])
            batcher.step()                # drains the abort (untimed)
            ids[:] = [*ids[1:], fresh()]  # hashed at submit (untimed: prefix_hash times it)
            started = start_clocks()
            batcher.step()                # admits it: lookup, eviction, its prefill chunk
            elapsed += stop_clocks(started)
            settle()
            left[0] -= 8                  # steps the other lanes decoded meanwhile (a bound)
        return elapsed
    return admit

"""Reports: what the engine, a PD producer pool and a prefix-cache summarizer tell their readers.

Plain structs (msgspec) that the front/core wire (atombatch/core/messages.py), the metrics and the
router read: a leaf of the import graph, so the wire never imports the engine or the cluster code
that fills them. Their old homes re-export them (`atombatch.engine.batcher.EngineStats`,
`atombatch.pd.pool.ProducerState`, `atombatch.cluster.summary.CacheSummary`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.errors import ConfigError

__all__ = ["BITS_PER_DIGEST", "DEFAULT_HASHES", "DEFAULT_SUMMARY_BITS", "MAX_SUMMARY_BITS",
           "SCALAR_COUNTERS", "CacheSummary", "EngineCounters", "EngineStats", "ProducerState",
           "check_summary_size"]


class EngineCounters(msgspec.Struct, kw_only=True):
    """The engine's monotonic counters, each named once: the scheduler counts into `Counters`
    (this struct, mutable), `Batcher.stats()` copies every one into `EngineStats` (which extends
    it) under its name, the wire carries them there, and `/metrics` exports each scalar one as
    `atombatch_engine_<name>_total` (`SCALAR_COUNTERS`)."""

    steps: int = 0                      # device calls so far
    imports: int = 0                    # KV import steps (PD)
    prefill_chunks: int = 0
    staged_chunks: int = 0              # prefill chunks or KV imports run into the spare
    decode_steps: int = 0
    generated_tokens: int = 0
    rotations: int = 0                  # staged requests that took over a finished lane's slot
    preemptions: int = 0
    prefix_hits: int = 0                # lanes started from a cached prefix
    prefix_misses: int = 0
    prefix_hit_tokens: int = 0          # prompt tokens whose prefill the cache saved
    # vLLM's prefix-cache queries: tokens of every lookup (the hits are `prefix_hit_tokens`)
    prefix_query_tokens: int = 0
    host_restores: int = 0              # blocks written back from the host cache
    evictions: int = 0                  # CACHED blocks evicted from the device
    prompt_forks: int = 0               # n > 1 choices started from a device copy of choice 0's
                                        #   prompt KV (prefix cache off)
    fork_saved_tokens: int = 0          # prompt tokens those choices did not prefill
    slot_saves: int = 0                 # sliding-slot checkpoints read to the host (hybrid)
    slot_restores: int = 0              # sliding-slot checkpoints written into a lane (hybrid)
    # device calls by the tokens they computed (a prefill chunk's tokens, a decode step's rows):
    # their sum (`vllm:iteration_tokens_total`); the histogram is `iteration_tokens`
    iteration_tokens_sum: int = 0
    # speculative decoding (vLLM's vllm:spec_decode_* counters): verify calls with a draft,
    # draft tokens, accepted draft tokens, and accepted drafts by position (index 0: the first)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # requests by finish reason; decode steps by number of decoding lanes (index = lanes); decode
    # steps by the compiled decode batch size that ran; device calls over
    # `request.ITERATION_TOKEN_BUCKETS` (the last count: above every bound). Lists and dicts
    # here, frozen to tuples in `EngineStats`.
    finished: dict[str, int] = msgspec.field(default_factory=dict)
    lane_histogram: Sequence[int] = ()
    bucket_steps: dict[int, int] = msgspec.field(default_factory=dict)
    iteration_tokens: Sequence[int] = ()
    spec_decode_num_accepted_tokens_per_pos: Sequence[int] = ()


#: The scalar counters, in order: what `/metrics` exports as `atombatch_engine_<name>_total`.
SCALAR_COUNTERS: tuple[str, ...] = tuple(
    name for name, kind in zip(EngineCounters.__struct_fields__,
                               msgspec.structs.fields(EngineCounters), strict=True)
    if kind.type is int)


# msgspec lets a frozen struct extend a mutable one (the scheduler's `Counters` is the mutable
# sibling); mypy's dataclass rule does not know that.
class EngineStats(EngineCounters, frozen=True, kw_only=True):  # type: ignore[misc]
    """A snapshot a server can export: every counter of `EngineCounters` and these gauges."""

    lane_histogram: tuple[int, ...] = ()   # the counters' lists, frozen
    iteration_tokens: tuple[int, ...] = ()
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    occupied_lanes: int = 0             # lanes holding a request now
    decoding_lanes: int = 0             # of those, decoding
    queue_length: int = 0               # requests without a lane (waiting + staging/staged, and
                                        #   n > 1 choices waiting for choice 0's prefill)
    free_blocks: int = 0
    spare_blocks: int = 0
    staged_blocks: int = 0
    lane_blocks: int = 0
    cached_blocks: int = 0
    checkpoint_bytes: int = 0           # host bytes the sliding-slot checkpoints hold now (hybrid)
    # Where the device's time went: wall seconds inside device calls, and between the end of
    # one device call and the start of the next while work was pending (the host's critical
    # path: sampling, scheduling, inputs, the embedder's loop); `host_gaps` such intervals.
    # device_s / (device_s + host_gap_s) is the share of the busy time the device computed.
    device_s: float = 0.0
    host_gap_s: float = 0.0
    host_gaps: int = 0
    # device calls the device thread launched right after the step before it, their inputs
    # built while that one ran (`Batcher(overlap=True)`, atombatch/engine/pipeline.py); of which
    # prefill chunks of requests admitted while a decode ran; and decodes right after such a
    # chunk that its request joined (its first token the chunk's greedy pick, written in on the
    # device thread); and chunks launched right after another chunk, decided with it (a wave of
    # arrivals planned as one chain: `Batcher._chain_wave`)
    overlapped_steps: int = 0
    overlapped_prefills: int = 0
    overlapped_joins: int = 0
    chained_chunks: int = 0
    prefix_cache: bool = False          # the engine runs a prefix cache
    evictable_blocks: int = 0           # of the cached blocks, those no request holds (refcount 0)


class ProducerState(msgspec.Struct):
    """One producer as this decoder sees it."""

    name: str
    endpoint: str                        # ZeroMQ endpoint of its ROUTER socket
    in_flight: int = 0                   # sources this decoder has open on it
    opened: int = 0                      # sources opened so far
    failed: int = 0                      # sources that failed on the transport
    suspect: bool = False                # a source failed: no new requests until `check`
    last_used: int = 0                   # order of the last open (tie-break: least recent)
    retired: bool = False                # removed: no new requests; kept while some in flight


DEFAULT_SUMMARY_BITS = 1 << 16          # 8 KiB per replica report
DEFAULT_HASHES = 7
BITS_PER_DIGEST = 10                    # ~1% false positives at capacity with 7 hashes
MAX_SUMMARY_BITS = 1 << 23              # 1 MiB: the most a report may carry


def _positions(digests: Sequence[bytes], bits: int, hashes: int) -> npt.NDArray[np.int64]:
    """Bit positions [len(digests), hashes] of each digest (double hashing of its two halves;
    a digest is already a uniform 128-bit hash)."""
    if not digests:
        return np.zeros((0, hashes), dtype=np.int64)
    raw = np.frombuffer(b"".join(d[:16].ljust(16, b"\0") for d in digests),
                        dtype=np.uint64).reshape(-1, 2)
    h1, h2 = raw[:, 0:1], raw[:, 1:2] | np.uint64(1)
    steps = np.arange(hashes, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        return ((h1 + steps * h2) % np.uint64(bits)).astype(np.int64)


class CacheSummary(msgspec.Struct, frozen=True):
    """A Bloom filter of the routing digests a replica's prefix cache holds."""

    bits: bytes                          # the filter, `len(bits) * 8` bits
    hashes: int = DEFAULT_HASHES
    count: int = 0                       # digests added
    route_block: int = 64                # tokens per routing digest it was built with
    truncated: bool = False              # the cache held more than `capacity` digests

    @property
    def num_bits(self) -> int:
        return len(self.bits) * 8

    @classmethod
    def build(cls, digests: Iterable[bytes], *, bits: int = DEFAULT_SUMMARY_BITS,
              hashes: int = DEFAULT_HASHES, route_block: int = 64,
              truncated: bool = False) -> CacheSummary:
        check_summary_size(bits, hashes)
        found = list(digests)
        array = np.zeros(bits // 8, dtype=np.uint8)
        pos = _positions(found, bits, hashes).reshape(-1)
        np.bitwise_or.at(array, pos >> 3, (1 << (pos & 7)).astype(np.uint8))
        return cls(bytes(array), hashes, len(found), route_block, truncated)

    def run(self, digests: Sequence[bytes],
            positions: npt.NDArray[np.int64] | None = None) -> int:
        """How many of the leading `digests` the filter holds (a run from the first)."""
        if not digests or not self.bits:
            return 0
        pos = positions if positions is not None else \
            _positions(digests, self.num_bits, self.hashes)
        array = np.frombuffer(self.bits, dtype=np.uint8)
        present = ((array[pos >> 3] >> (pos & 7)) & 1).all(axis=1)
        misses = np.flatnonzero(~present)
        return int(misses[0]) if misses.size else len(digests)

    def __contains__(self, digest: object) -> bool:
        return isinstance(digest, bytes) and self.run((digest,)) == 1


def check_summary_size(bits: int, hashes: int) -> None:
    if not (64 <= bits <= MAX_SUMMARY_BITS and bits % 64 == 0):
        raise ConfigError(f"summary bits={bits} must be a multiple of 64 in 64..{MAX_SUMMARY_BITS}")
    if not 1 <= hashes <= 16:
        raise ConfigError(f"summary hashes={hashes} must be in 1..16")

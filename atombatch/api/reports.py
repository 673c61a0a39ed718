"""Reports: what the engine, a PD producer pool and a prefix-cache summarizer tell their readers.

Plain structs (msgspec) that the front/core wire (atombatch/core/messages.py), the metrics and the
router read: a leaf of the import graph, so the wire never imports the engine or the cluster code
that fills them. Their old homes re-export them (`atombatch.engine.batcher.EngineStats`,
`atombatch.cluster.pd_pool.ProducerState`, `atombatch.cluster.summary.CacheSummary`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.errors import ConfigError

__all__ = ["BITS_PER_DIGEST", "DEFAULT_HASHES", "DEFAULT_SUMMARY_BITS", "MAX_SUMMARY_BITS",
           "CacheSummary", "EngineStats", "ProducerState", "check_summary_size"]


class EngineStats(msgspec.Struct, frozen=True):
    """A snapshot a server can export (gauges and counters)."""

    occupied_lanes: int                 # lanes holding a request now
    decoding_lanes: int                 # of those, decoding
    queue_length: int                   # requests without a lane (waiting + staging/staged, and
                                        #   n > 1 choices waiting for choice 0's prefill)
    free_blocks: int
    spare_blocks: int
    staged_blocks: int
    lane_blocks: int
    cached_blocks: int
    steps: int                          # device calls so far
    imports: int                        # KV import steps (PD)
    prefill_chunks: int
    staged_chunks: int                  # prefill chunks or KV imports run into the spare
    decode_steps: int
    generated_tokens: int
    rotations: int                      # staged requests that took over a finished lane's slot
    preemptions: int
    prefix_hits: int                    # lanes started from a cached prefix
    prefix_misses: int
    prefix_hit_tokens: int              # prompt tokens whose prefill the cache saved
    host_restores: int                  # blocks written back from the host cache
    evictions: int                      # CACHED blocks evicted from the device
    prompt_forks: int                   # n > 1 choices started from a device copy of choice 0's
                                        #   prompt KV (prefix cache off)
    fork_saved_tokens: int              # prompt tokens those choices did not prefill
    finished: dict[str, int]            # requests by finish reason
    lane_histogram: tuple[int, ...]     # decode steps by number of decoding lanes (index = lanes)
    bucket_steps: dict[int, int]        # decode steps by compiled decode batch size that ran
    slot_saves: int = 0                 # sliding-slot checkpoints read to the host (hybrid)
    slot_restores: int = 0              # sliding-slot checkpoints written into a lane (hybrid)
    checkpoint_bytes: int = 0           # host bytes the sliding-slot checkpoints hold now (hybrid)
    # Where the device's time went: wall seconds inside device calls, and between the end of
    # one device call and the start of the next while work was pending (the host's critical
    # path: sampling, scheduling, inputs, the embedder's loop); `host_gaps` such intervals.
    # device_s / (device_s + host_gap_s) is the share of the busy time the device computed.
    device_s: float = 0.0
    host_gap_s: float = 0.0
    host_gaps: int = 0
    # device calls the device thread launched right after the step before it, their inputs
    # built while that one ran (`Batcher(overlap=True)`, atombatch/engine/pipeline.py); of which prefill
    # chunks of requests admitted while a decode ran; and decodes right after such a chunk
    # that its request joined (its first token the chunk's greedy pick, written in on the device
    # thread); and chunks launched right after another chunk, decided with it (a wave of
    # arrivals planned as one chain: `PipelineRunner._chain_wave`)
    overlapped_steps: int = 0
    overlapped_prefills: int = 0
    overlapped_joins: int = 0
    chained_chunks: int = 0
    # vLLM's prefix-cache queries (tokens of every lookup; the hits are `prefix_hit_tokens`), and
    # device calls by the tokens they computed: counts over `request.ITERATION_TOKEN_BUCKETS`
    # (the last: above every bound) and their sum (`vllm:iteration_tokens_total`)
    prefix_query_tokens: int = 0
    prefix_cache: bool = False          # the engine runs a prefix cache
    evictable_blocks: int = 0           # of the cached blocks, those no request holds (refcount 0)
    iteration_tokens: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0


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

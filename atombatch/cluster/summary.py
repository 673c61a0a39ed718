"""What a replica's prefix cache holds, as a bounded summary the router can read.

A replica's prefix cache (atombatch/kernel/prefix.py) indexes its blocks by digests with a random seed
and its own block size, so the router cannot compare them with a prompt. The replica therefore
re-expresses what it holds in the router's terms: for every cached chain of blocks (device index
and host cache), the routing digests (`atombatch.cluster.route_digests`: `route_block` tokens per
digest, the prefix cache's chained digest function with seed 0) of the leading route blocks its
tokens cover. These go into a Bloom filter of a fixed number of bits, so the summary a replica
reports has the same size whatever its cache holds; a digest the filter holds is cached on the
replica with the probability the filter's false-positive rate leaves (about 1% at the capacity).

Computing it: the cached blocks form a tree (a block's parent is the block before it). The
summarizer walks the tree from its roots, breadth first (leading blocks first: a deeper digest is
useless to the router without the ones before it), carrying a running route-block hash down each
branch. What a block contributes depends only on its digest (the digest names every token up to
its end), so it is memoized by digest and only blocks new since the last summary are hashed; the
memo keeps only blocks still cached. At most `capacity` digests and `max_blocks` route blocks of
depth go in.

Reading the cache needs no engine lock: the walk copies each index's dict of entries in one call
(atomic under the GIL) and a cache entry never changes its tokens; a summary taken while the
engine steps is a consistent enough picture of a cache that changes every step anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import xxhash

from atombatch.api.reports import (
    BITS_PER_DIGEST,
    DEFAULT_HASHES,
    DEFAULT_SUMMARY_BITS,
    MAX_SUMMARY_BITS,
    CacheSummary,
    _positions,
    check_summary_size,
)
from atombatch.errors import ConfigError
from atombatch.kernel import prefix

__all__ = ["BITS_PER_DIGEST", "DEFAULT_HASHES", "DEFAULT_SUMMARY_BITS", "MAX_SUMMARY_BITS",
           "CacheSummarizer", "CacheSummary", "_positions", "check_summary_size"]


def route_root(lora: str | None) -> bytes:
    """The parent of a prompt's first routing digest: `prefix.ROOT` for the base model, a
    digest of the adapter's name for a request under a LoRA adapter (the router knows requests'
    adapters by name, as clients send them), so routing digests of one adapter's prompts never
    match another's, as in the replicas' caches (docs/lora.md)."""
    if lora is None:
        return prefix.ROOT
    return xxhash.xxh3_128(b"atombatch-route-lora\0" + lora.encode()).digest()


def cache_roots(adapters: Iterable[Any]) -> dict[bytes, bytes]:
    """The roots a summary walks a replica's cache from: each cached chain's own root (the base
    model's, and each loaded adapter's `prefix.adapter_root(identity)`) -> its routing root."""
    roots = {prefix.ROOT: prefix.ROOT}
    for adapter in adapters:
        roots[prefix.adapter_root(adapter.identity)] = route_root(adapter.name)
    return roots


class _Node(msgspec.Struct):
    """What one cached block contributes: the route digests completed inside it and the running
    hash of the route block open at its end."""

    completed: tuple[bytes, ...]
    depth: int                          # route blocks completed up to its end
    last: bytes                         # the last completed route digest (ROOT if none)
    open_tokens: npt.NDArray[np.int64]  # tokens of the open route block (fewer than route_block)


class CacheSummarizer:
    """Summaries of one replica's prefix cache (device index and host cache), memoized by block
    digest between calls (see the module docstring).

    Args:
        route_block: tokens per routing digest (the router's `--route-block`).
        max_blocks: route blocks of depth summarized (the router digests no deeper).
        bits, hashes: the Bloom filter's size (the same for every replica of a router).
        capacity: digests at most (default: bits / 10, about 1% false positives).
    """

    def __init__(self, route_block: int = 64, max_blocks: int = 64, *,
                 bits: int = DEFAULT_SUMMARY_BITS, hashes: int = DEFAULT_HASHES,
                 capacity: int | None = None) -> None:
        if route_block < 1 or max_blocks < 1:
            raise ConfigError(f"route_block={route_block} and max_blocks={max_blocks} must be "
                              ">= 1")
        check_summary_size(bits, hashes)
        self.route_block = route_block
        self.max_blocks = max_blocks
        self.bits = bits
        self.hashes = hashes
        self.capacity = capacity if capacity is not None else bits // BITS_PER_DIGEST
        self._memo: dict[bytes, _Node] = {}
        self.hashed_tokens = 0          # tokens hashed so far (tests: memoization works)

    def digests(self, *indexes: Any, roots: Mapping[bytes, bytes] | None = None
                ) -> tuple[list[bytes], bool]:
        """Routing digests of every chain cached in `indexes` (`PrefixIndex`, `HostCache` or
        anything with their `entries()`), shallowest first, and whether
        the capacity cut some off. `roots`: the chains' roots to walk from -> their routing
        roots (`cache_roots`; default: the base model's alone)."""
        children: dict[bytes, list[Any]] = {}
        for index in indexes:
            if index is None:
                continue
            for entry in index.entries():
                children.setdefault(entry.parent, []).append(entry)
        roots = roots or {prefix.ROOT: prefix.ROOT}
        memo: dict[bytes, _Node] = {}
        out: list[bytes] = []
        seen: set[bytes] = set()
        truncated = False
        level: list[tuple[bytes, _Node]] = [
            (cache_root, _Node((), 0, routing, np.zeros(0, dtype=np.int64)))
            for cache_root, routing in roots.items()]
        while level and not truncated:
            following: list[tuple[bytes, _Node]] = []
            for parent_digest, parent in level:
                for entry in children.get(parent_digest, ()):
                    node = memo.get(entry.digest) or self._memo.get(entry.digest)
                    if node is None:
                        node = self._extend(parent, entry.tokens)
                    memo[entry.digest] = node
                    for digest in node.completed:
                        if digest not in seen:
                            if len(out) >= self.capacity:
                                truncated = True
                                break
                            seen.add(digest)
                            out.append(digest)
                    if entry.full and node.depth < self.max_blocks:
                        following.append((entry.digest, node))
            level = following
        self._memo = memo
        return out, truncated

    def summary(self, *indexes: Any, roots: Mapping[bytes, bytes] | None = None
                ) -> CacheSummary:
        digests, truncated = self.digests(*indexes, roots=roots)
        return CacheSummary.build(digests, bits=self.bits, hashes=self.hashes,
                                  route_block=self.route_block, truncated=truncated)

    def _extend(self, parent: _Node, tokens: npt.NDArray[np.int64]) -> _Node:
        rb = self.route_block
        data = np.concatenate([parent.open_tokens, np.asarray(tokens, dtype=np.int64)])
        completed: list[bytes] = []
        last, depth, start = parent.last, parent.depth, 0
        while len(data) - start >= rb and depth < self.max_blocks:
            last = prefix.chain_digest(last, data[start:start + rb], True)
            self.hashed_tokens += rb
            completed.append(last)
            depth += 1
            start += rb
        rest = data[start:] if depth < self.max_blocks else np.zeros(0, dtype=np.int64)
        return _Node(tuple(completed), depth, last, rest.copy())

"""Prefix cache index and host cache: which cached block holds the KV of which token prefix.

A cached block is identified by a digest of every token from position 0 up to its last valid
position (KV at a position depends on all tokens before it), chained block by block:

    digest(block j) = blake2b(digest(block j-1) || tokens of block j || full-or-partial)

Full blocks (block_size valid tokens) are found by digest in O(1) per block. The last, partial block
of a finished sequence is cached too (with an eager artifact a block is a whole sequence, so
partial blocks are where the hits are); a lookup compares the prompt against the partial children
of the matched chain and takes the longest common token prefix.

The host cache keeps blocks the device cache evicted, by the same digests, in an LRU bounded in
bytes; a lookup that runs off the device chain continues into it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

ROOT = b""


def chain_digest(parent: bytes, tokens: npt.NDArray[np.int64], full: bool) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
    h.update(b"F" if full else b"P")
    return h.digest()


@dataclass(eq=False)
class Entry:
    """One cached prefix block (on the device or on the host)."""

    digest: bytes                       # identity of the prefix up to this block's last token
    parent: bytes                       # the previous block's digest (ROOT for block 0)
    tokens: npt.NDArray[np.int64]       # the tokens whose KV the block holds, in order
    full: bool                          # holds block_size tokens
    block: int = -1                     # device block, -1 when only on the host
    data: npt.NDArray[np.generic] | None = None  # host copy (host cache only)


@dataclass
class Match:
    """The longest cached prefix of a prompt."""

    entries: list[Entry] = field(default_factory=list)  # chain from block 0; the last may be partial
    tokens: int = 0                     # prompt tokens covered by the chain


def _common_prefix(a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class _Index:
    """Digest -> entry, and parent digest -> children (for partial matches)."""

    def __init__(self) -> None:
        self.by_digest: dict[bytes, Entry] = {}
        self.children: dict[bytes, dict[bytes, Entry]] = {}

    def add(self, entry: Entry) -> None:
        self.by_digest[entry.digest] = entry
        self.children.setdefault(entry.parent, {})[entry.digest] = entry

    def remove(self, entry: Entry) -> None:
        del self.by_digest[entry.digest]
        siblings = self.children[entry.parent]
        del siblings[entry.digest]
        if not siblings:
            del self.children[entry.parent]

    def walk(self, prompt: npt.NDArray[np.int64], block_size: int, parent: bytes, start: int,
             match: Match) -> bytes:
        """Extend `match` from `start` through full blocks, then the best partial child."""
        position = start
        while position + block_size <= len(prompt):
            digest = chain_digest(parent, prompt[position:position + block_size], True)
            entry = self.by_digest.get(digest)
            if entry is None:
                break
            match.entries.append(entry)
            parent, position = digest, position + block_size
        match.tokens = position
        best, best_len = None, 0
        rest = prompt[position:position + block_size]
        for child in self.children.get(parent, {}).values():
            length = _common_prefix(child.tokens, rest)
            if length > best_len:
                best, best_len = child, length
        if best is not None:
            match.entries.append(best)
            match.tokens = position + best_len
        return parent


class PrefixIndex:
    """The device prefix cache's index: CACHED blocks by prefix digest."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._index = _Index()
        self._by_block: dict[int, Entry] = {}

    def __len__(self) -> int:
        return len(self._by_block)

    def lookup(self, prompt: npt.NDArray[np.int64]) -> Match:
        match = Match()
        self._index.walk(prompt, self.block_size, ROOT, 0, match)
        return match

    def entry(self, block: int) -> Entry | None:
        return self._by_block.get(block)

    def find(self, digest: bytes) -> Entry | None:
        return self._index.by_digest.get(digest)

    def insert(self, block: int, parent: bytes, tokens: npt.NDArray[np.int64]) -> Entry | None:
        """Index `block` as holding `tokens` after the prefix `parent`; None if already cached."""
        full = len(tokens) == self.block_size
        digest = chain_digest(parent, tokens, full)
        if digest in self._index.by_digest:
            return None
        entry = Entry(digest=digest, parent=parent, tokens=np.array(tokens, dtype=np.int64),
                      full=full, block=block)
        self._index.add(entry)
        self._by_block[block] = entry
        return entry

    def remove(self, block: int) -> Entry:
        """The block left the cache (evicted or adopted by a lane)."""
        entry = self._by_block.pop(block)
        self._index.remove(entry)
        return entry


class HostCache:
    """Evicted prefix blocks kept in host memory: an LRU bounded in bytes."""

    def __init__(self, capacity_bytes: int, block_size: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.block_size = block_size
        self.used_bytes = 0
        self._index = _Index()
        self._lru: OrderedDict[bytes, Entry] = OrderedDict()
        self.hits = 0
        self.stores = 0
        self.drops = 0

    def __len__(self) -> int:
        return len(self._lru)

    def put(self, entry: Entry, data: npt.NDArray[np.generic]) -> None:
        """Keep a copy of an evicted block (dropping least recently used copies to fit)."""
        size = int(data.nbytes)
        if size > self.capacity_bytes or entry.digest in self._lru:
            return
        while self.used_bytes + size > self.capacity_bytes:
            _, old = self._lru.popitem(last=False)
            self._index.remove(old)
            self.used_bytes -= int(old.data.nbytes)  # type: ignore[union-attr]
            self.drops += 1
        copy = Entry(digest=entry.digest, parent=entry.parent, tokens=entry.tokens,
                     full=entry.full, data=np.array(data, copy=True))
        self._index.add(copy)
        self._lru[copy.digest] = copy
        self.used_bytes += size
        self.stores += 1

    def extend(self, prompt: npt.NDArray[np.int64], match: Match) -> list[Entry]:
        """Continue a device match into host copies when that covers more of the prompt; returns
        the host entries now in the match. A device chain ending in a partly matched block is
        compared with the host's continuation of its wholly matched part; the longer wins."""
        # only blocks matched to their last token can be continued (a partly matched entry,
        # full or not, ends the device chain)
        full = match.entries[: match.tokens // self.block_size]
        parent = full[-1].digest if full else ROOT
        host_match = Match()
        self._index.walk(prompt, self.block_size, parent, len(full) * self.block_size,
                         host_match)
        if host_match.tokens <= match.tokens:
            return []
        match.entries = [*full, *host_match.entries]
        match.tokens = host_match.tokens
        for entry in host_match.entries:
            self._lru.move_to_end(entry.digest)
        self.hits += 1
        return host_match.entries

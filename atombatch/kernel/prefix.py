"""Prefix cache index and host cache: which cached block holds the KV of which token prefix.

A cached block is identified by a digest of every token from position 0 up to its last valid
position (KV at a position depends on all tokens before it), chained block by block:

    digest(block j) = xxh3_128(digest(block j-1) || tokens of block j || b"F" or b"P", seed)

(`digest(block -1)` is 16 zero bytes; tokens are int64 in native byte order; "F" marks a full
block of `block_size` tokens, "P" a partial last block; the seed is random per index). Why this
is safe and why xxh3-128 is in docs/prefix-cache.md.

Digests are computed once per request, as its tokens arrive (`TokenChain`): the prompt when the
request is submitted, generated tokens when the cache next needs them (a lookup after preemption,
or caching the finished sequence), so a decode step does no hashing. Every token is fed to the
hash function exactly once: a full block's digest is finished when its last token arrives, and
the open (last, partial) block is kept as a running hash state whose partial digest is a copy.
Lookup walks the request's stored digests; caching a finished request reuses them.

Full blocks are found by digest in O(1) per block (one compiled pass over the stored digests). The
last, partial block of a finished sequence is cached too (with an eager artifact a block is a whole
sequence, so partial blocks are where the hits are); where the full digests stop, a lookup takes
the child of the matched chain sharing the longest token prefix with the prompt. A parent's
children sit in a radix trie over their tokens (a lone child as itself), so that costs what the
prompt block's tokens cost, never one comparison per cached sibling (docs/prefix-cache.md).
Full-block digests are computed by `blocks.chain_digests` (compiled xxh3-128, or its twin) in one
call per extension of a chain, into the chain's digest array; the device index keeps its blocks in
a compiled `blocks.PrefixTable` (arrays and open addressing, no Python object per block).

The host cache keeps blocks the device cache evicted, by the same digests, in an LRU bounded in
bytes; a lookup that runs off the device chain continues into it.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from atombatch.kernel.blocks import PrefixTable, chain_digests, common_prefix

ROOT = b""          # the parent digest of block 0 (as a key)
ROOT_INPUT = bytes(16)  # what block 0's hash input starts with: every input is 16 + 8n + 1 bytes
FULL = b"F"         # suffix of a full block's hash input
PARTIAL = b"P"      # suffix of a partial block's hash input
HASH_NAME = "xxh3_128"


def adapter_root(identity: str) -> bytes:
    """The parent digest of block 0 for a chain computed under a LoRA adapter (`identity`: the
    adapter's hex digest, `LoraAdapter.identity`); the base model's is `ROOT`. Every digest of
    the chain, and the key its first block's siblings are found by, follow from it, so a
    prefix computed under one adapter never matches under another (docs/prefix-cache.md). A
    fixed hash (seed 0): the router computes the same roots as the engines it routes to."""
    if not identity:
        return ROOT
    return xxhash.xxh3_128(b"atombatch-lora\0" + identity.encode()).digest()


def new_seed() -> int:
    """A random 64-bit hash seed: digests are unpredictable outside the process."""
    return int.from_bytes(os.urandom(8), "little")


def chain_digest(parent: bytes, tokens: npt.ArrayLike, full: bool, seed: int = 0) -> bytes:
    """One block's digest with the cache's encoding and a fixed seed (default 0), the same in
    every process: for code outside a cache that must agree across processes, such as a router's
    table of where it sent which prefixes. A cache's own digests use its random seed (see
    `BlockHasher`), so these never equal them; a collision here can only misroute."""
    state = xxhash.xxh3_128(parent or ROOT_INPUT, seed=seed)
    state.update(np.ascontiguousarray(tokens, dtype=np.int64).data)
    state.update(FULL if full else PARTIAL)
    return state.digest()


class BlockHasher:
    """The block digest function of one prefix cache, with counters of the work it did.

    `tokens_hashed` counts tokens fed to the hash function and `digests_made` the digests it
    finished; tests use them to prove that lookups and inserts hash nothing.
    """

    __slots__ = ("block_size", "digests_made", "seed", "tokens_hashed")

    def __init__(self, block_size: int, seed: int | None = None) -> None:
        self.block_size = block_size
        self.seed = new_seed() if seed is None else seed
        self.tokens_hashed = 0
        self.digests_made = 0

    def digest(self, parent: bytes, tokens: npt.ArrayLike, full: bool) -> bytes:
        """One block's digest in one shot (what `TokenChain` computes incrementally)."""
        data = np.ascontiguousarray(tokens, dtype=np.int64)
        state = xxhash.xxh3_128(parent or ROOT_INPUT, seed=self.seed)
        state.update(data.data)
        state.update(FULL if full else PARTIAL)
        self.tokens_hashed += len(data)
        self.digests_made += 1
        return state.digest()

    def chain(self, tokens: npt.ArrayLike = (), root: bytes = ROOT) -> TokenChain:
        """A chain over `tokens` (hashed now); more tokens are appended with `extend`. `root`:
        the parent of its block 0 (`adapter_root`)."""
        return TokenChain(self, tokens, root)


class TokenChain:
    """One sequence's tokens and the digests of its blocks, computed as the tokens arrive.

    `digest(j)` is the digest of full block j; the digests live in one uint8 `[n, 16]` array
    (`digest_rows`), written by one compiled pass per extension (`blocks.chain_digests`), so a
    prompt's blocks cost no Python object each. The open (last, partial) block is a running hash
    state fed with every token appended so far, so `partial_digest(length)` costs a copy, not a
    re-hash. Tokens are kept in a growing int64 buffer; views handed out (`tokens`) stay valid
    because positions, once written, never change.
    """

    __slots__ = ("_buffer", "_digest_list", "_digest_rows", "_hasher", "_open", "_open_start",
                 "length", "num_digests", "root")

    def __init__(self, hasher: BlockHasher, tokens: npt.ArrayLike = (),
                 root: bytes = ROOT) -> None:
        self._hasher = hasher
        # the parent of block 0: ROOT for the base model, `adapter_root` under a LoRA adapter
        self.root = root
        data = np.asarray(tokens, dtype=np.int64).reshape(-1)
        self._buffer = np.empty(len(data) + 64, dtype=np.int64)  # room for some output
        self._digest_rows = np.empty((len(self._buffer) // hasher.block_size + 1, 16),
                                     dtype=np.uint8)
        self._digest_list: list[bytes] = []     # `digests`, made on demand
        self.length = 0
        self.num_digests = 0                    # full blocks digested
        self._open = xxhash.xxh3_128(root or ROOT_INPUT, seed=hasher.seed)
        self._open_start = 0            # first position of the open block
        self.extend(data)

    @property
    def tokens(self) -> npt.NDArray[np.int64]:
        """Every token appended so far (a view)."""
        return self._buffer[:self.length]

    @property
    def digest_rows(self) -> npt.NDArray[np.uint8]:
        """The full blocks' digests, one 16-byte row each (a view)."""
        return self._digest_rows[:self.num_digests]

    @property
    def digests(self) -> list[bytes]:
        """The full blocks' digests as bytes (made on demand and kept; do not modify)."""
        made = self._digest_list
        if len(made) < self.num_digests:
            rows = self._digest_rows
            made.extend(rows[j].tobytes() for j in range(len(made), self.num_digests))
        return made

    def digest(self, block: int) -> bytes:
        """Full block `block`'s digest."""
        if not 0 <= block < self.num_digests:
            raise IndexError(f"block={block} is not one of the chain's {self.num_digests} full "
                             "blocks")
        return self._digest_rows[block].tobytes()

    def _rows_for(self, count: int) -> npt.NDArray[np.uint8]:
        rows = self._digest_rows
        if self.num_digests + count > len(rows):
            grown = np.empty((max(len(rows) * 3 // 2, self.num_digests + count + 8), 16),
                             dtype=np.uint8)
            grown[:self.num_digests] = rows[:self.num_digests]
            self._digest_rows = rows = grown
        return rows

    def extend(self, tokens: npt.ArrayLike | Sequence[int]) -> None:
        """Append tokens and hash them: the open block's running state takes the tokens up to its
        end, the full blocks after it are hashed in one compiled call (`blocks.chain_digests`),
        and the rest starts a new open block."""
        data = np.asarray(tokens, dtype=np.int64).reshape(-1)
        start, end = self.length, self.length + len(data)
        if end == start:
            return
        if end > len(self._buffer):
            # a new buffer: views of the old one (held by cache entries) stay valid
            grown = np.empty(max(len(self._buffer) * 3 // 2, end + 64), dtype=np.int64)
            grown[:start] = self._buffer[:start]
            self._buffer = grown
        buffer = self._buffer
        buffer[start:end] = data
        self.length = end
        hasher, block_size = self._hasher, self._hasher.block_size
        hasher.tokens_hashed += end - start
        position = start
        last = b""
        if position > self._open_start:  # the open block holds tokens: its state takes more
            block_end = self._open_start + block_size
            stop = min(end, block_end)
            self._open.update(buffer[position:stop].data)
            position = stop
            if position < block_end:
                return
            self._open.update(FULL)
            last = self._open.digest()
            self._rows_for(1)[self.num_digests] = np.frombuffer(last, dtype=np.uint8)
            self.num_digests += 1
            hasher.digests_made += 1
            self._open_start = block_end
        full = (end - position) // block_size
        if full:
            parent = last or (self.digest(self.num_digests - 1) if self.num_digests else
                              self.root)
            chain_digests(buffer, position, position + full * block_size, block_size, parent,
                          hasher.seed, self._rows_for(full), self.num_digests)
            self.num_digests += full
            hasher.digests_made += full
            position += full * block_size
            self._open_start = position
            last = b""
        if not last:
            last = self.digest(self.num_digests - 1) if self.num_digests else \
                (self.root or ROOT_INPUT)
        self._open = xxhash.xxh3_128(last, seed=hasher.seed)
        if position < end:
            self._open.update(buffer[position:end].data)

    def parent(self, block: int) -> bytes:
        """The digest block `block` is chained to."""
        return self.digest(block - 1) if block else self.root

    def partial_digest(self, end: int) -> bytes:
        """The digest of the partial block that ends at position `end` (not a block boundary).

        At the end of the chain this finishes a copy of the running state (no token is hashed
        again); a sequence cached at fewer positions than it holds (aborted while re-prefilling
        after a preemption) hashes that one block's tokens."""
        hasher = self._hasher
        block = end // hasher.block_size
        if end == self.length and block * hasher.block_size == self._open_start:
            state = self._open.copy()
            state.update(PARTIAL)
            hasher.digests_made += 1
            return state.digest()
        start = block * hasher.block_size
        return hasher.digest(self.parent(block), self._buffer[start:end], False)


@dataclass(eq=False, slots=True)
class Entry:
    """One cached prefix block (on the device or on the host)."""

    digest: bytes                       # identity of the prefix up to this block's last token
    parent: bytes                       # the previous block's digest (ROOT for block 0)
    tokens: npt.NDArray[np.int64]       # the tokens whose KV the block holds, in order
    full: bool                          # holds block_size tokens
    block: int = -1                     # device block, -1 when only on the host
    data: npt.NDArray[np.generic] | None = None  # host copy (host cache only)
    # hybrid models: the sliding-slot checkpoints at boundaries inside this block
    # (`atombatch.engine.checkpoints.Checkpoint`); they leave the caches with the block
    checkpoints: list[Any] | None = None


class Match:
    """The longest cached prefix of a prompt: the matched blocks from block 0 (the last may be
    partly matched) and how many prompt tokens they cover."""

    __slots__ = ("_host", "_index", "blocks", "tokens")

    def __init__(self, blocks: npt.NDArray[np.int32] | None = None, tokens: int = 0,
                 index: PrefixIndex | None = None) -> None:
        # the device block of each matched block, int32 (-1 where it is a host copy)
        self.blocks = np.zeros(0, dtype=np.int32) if blocks is None else blocks
        self.tokens = tokens            # prompt tokens covered by the chain
        self._host: dict[int, Entry] = {}   # position in `blocks` -> host entry
        self._index = index             # the device index the blocks are in

    @property
    def has_host(self) -> bool:
        """Whether some matched block is only a host copy."""
        return bool(self._host)

    def entry(self, j: int) -> Entry:
        """The cached entry of matched block j (a device entry is made on demand)."""
        block = int(self.blocks[j])
        if block < 0:
            return self._host[j]
        entry = self._index.entry(block) if self._index is not None else None
        if entry is None:
            raise KeyError(f"matched block {j} (device block {block}) left the cache")
        return entry

    @property
    def entries(self) -> list[Entry]:
        return [self.entry(j) for j in range(len(self.blocks))]

    def host_entries(self) -> list[tuple[int, Entry]]:
        """(position, host entry) of the matched blocks that are host copies."""
        return list(self._host.items())

    def continue_on_host(self, full: int, entries: list[Entry], tokens: int) -> None:
        """Keep the first `full` matched blocks and continue with host `entries`."""
        self.blocks = np.concatenate([self.blocks[:full],
                                      np.full(len(entries), -1, dtype=np.int32)])
        self._host = {full + k: entry for k, entry in enumerate(entries)}
        self.tokens = tokens

    def on_device(self, j: int, block: int) -> None:
        """Matched block j, a host copy, is on the device as `block` (its digest is cached)."""
        del self._host[j]
        self.blocks[j] = block


class _Node:
    """A node of a parent's children trie: the tokens on the edge into it, the edges out of it by
    their first token, and the child whose tokens end here (if one does)."""

    __slots__ = ("edges", "entry", "label", "up")

    def __init__(self, label: npt.NDArray[np.int64], up: _Node | None) -> None:
        self.label = label                  # tokens from `up` to this node (a view, never empty
                                            #   below the root)
        self.up = up                        # the node above (None at the root)
        self.edges: dict[int, _Node] = {}   # first token of a child node's label -> child node
        self.entry: Entry | None = None     # the child entry whose tokens end at this node


_EMPTY = np.zeros(0, dtype=np.int64)


class _Children:
    """The cached blocks chained to one parent digest, in a radix trie over their tokens
    (SGLang's radix cache, one level of it): the child sharing the longest token prefix with a
    prompt block is found by walking the prompt's tokens down the trie, so it costs what that
    block's tokens cost, never one comparison per sibling.

    Every leaf holds an entry and every node without one has two or more edges (removal prunes
    and merges), so each node on a path is a point where cached children diverge; a walk visits
    at most `block_size + 1` nodes and reaches an entry from any node by following any edge.
    """

    __slots__ = ("node_of", "root")

    def __init__(self) -> None:
        self.root = _Node(_EMPTY, None)
        self.node_of: dict[bytes, _Node] = {}   # entry digest -> the node it ends at

    def __len__(self) -> int:
        return len(self.node_of)

    def add(self, entry: Entry) -> None:
        tokens = entry.tokens
        node, depth, n = self.root, 0, len(tokens)
        while depth < n:
            child = node.edges.get(int(tokens[depth]))
            if child is None:  # nothing shares the next token: a new leaf
                leaf = _Node(tokens[depth:], node)
                node.edges[int(tokens[depth])] = leaf
                node = leaf
                break
            label = child.label
            shared = common_prefix(label, tokens[depth:])
            if shared < len(label):  # diverges inside the edge: split it
                middle = _Node(label[:shared], node)
                node.edges[int(label[0])] = middle
                child.label, child.up = label[shared:], middle
                middle.edges[int(child.label[0])] = child
                child = middle
            node, depth = child, depth + shared
        if node.entry is not None:  # same parent and tokens is the same digest
            raise ValueError(f"tokens already cached as {node.entry.digest.hex()}")
        node.entry = entry
        self.node_of[entry.digest] = node

    def remove(self, entry: Entry) -> None:
        node = self.node_of.pop(entry.digest)
        node.entry = None
        up = node.up
        while up is not None and node.entry is None and not node.edges:  # prune empty leaves
            del up.edges[int(node.label[0])]
            node, up = up, up.up
        if up is not None and node.entry is None and len(node.edges) == 1:  # merge a pass-through
            (child,) = node.edges.values()
            child.label = np.concatenate([node.label, child.label])
            child.up = up
            up.edges[int(child.label[0])] = child

    def longest(self, tokens: npt.NDArray[np.int64]) -> tuple[Entry | None, int, int]:
        """A child sharing the longest token prefix with `tokens` (None if none shares one),
        how many tokens it shares, and how many trie nodes the search visited."""
        node, depth, n, visited = self.root, 0, len(tokens), 0
        while depth < n:
            child = node.edges.get(int(tokens[depth]))
            if child is None:
                break
            visited += 1
            shared = common_prefix(child.label, tokens[depth:])
            node, depth = child, depth + shared
            if shared < len(child.label):
                break
        if depth == 0:
            return None, 0, visited
        # every child below `node` shares exactly `depth` tokens, none elsewhere shares as many
        while node.entry is None:
            node = next(iter(node.edges.values()))
            visited += 1
        return node.entry, depth, visited


class _Index:
    """Digest -> entry, and parent digest -> children (for partial matches): the one child most
    parents have (a chain), or the `_Children` trie of two or more."""

    def __init__(self) -> None:
        self.by_digest: dict[bytes, Entry] = {}
        self.children: dict[bytes, Entry | _Children] = {}
        self.nodes_visited = 0          # trie nodes partial matches visited (tests: no scan)

    def add(self, entry: Entry) -> None:
        children = self.children
        siblings = children.get(entry.parent)
        if siblings is None:
            children[entry.parent] = entry
        elif isinstance(siblings, _Children):
            siblings.add(entry)
        else:  # a second child: the parent's children become a trie
            trie = _Children()
            trie.add(siblings)
            trie.add(entry)
            children[entry.parent] = trie
        self.by_digest[entry.digest] = entry

    def remove(self, entry: Entry) -> None:
        del self.by_digest[entry.digest]
        siblings = self.children[entry.parent]
        if not isinstance(siblings, _Children):
            del self.children[entry.parent]
            return
        siblings.remove(entry)
        if len(siblings) == 1:  # a lone child again: kept as itself
            (last,) = siblings.node_of
            self.children[entry.parent] = self.by_digest[last]

    def walk(self, chain: TokenChain, length: int, start_block: int) -> tuple[list[Entry], int]:
        """The entries extending a match of the first `length` tokens of `chain` from block
        `start_block`, and the tokens the whole match then covers: through full blocks by the
        chain's digests, then the child of the last matched block that shares the most of the
        next tokens (one trie walk, whatever the number of siblings)."""
        block_size = chain._hasher.block_size
        by_digest, entries = self.by_digest, []
        block, stop = start_block, min(length // block_size, chain.num_digests)
        while block < stop:
            entry = by_digest.get(chain.digest(block))
            if entry is None:
                break
            entries.append(entry)
            block += 1
        position = block * block_size
        if position >= length:
            return entries, position
        siblings = self.children.get(chain.parent(block))
        if siblings is None:
            return entries, position
        rest = chain.tokens[position:min(position + block_size, length)]
        best: Entry | None
        if isinstance(siblings, _Children):
            best, shared, visited = siblings.longest(rest)
            self.nodes_visited += visited
        else:
            best, shared = siblings, common_prefix(siblings.tokens, rest)
            self.nodes_visited += 1
        if best is not None and shared:
            entries.append(best)
            return entries, position + shared
        return entries, position


class PrefixIndex:
    """The device prefix cache's index: CACHED blocks by prefix digest.

    The blocks live in a `blocks.PrefixTable` (compiled: arrays indexed by block, open
    addressing over the digests), so caching a finished sequence or matching a prompt costs no
    Python object per block. An `Entry` is made for a block only when something asks for it
    (`entry`, `find`, `remove`, a trie) and kept while the block is cached, so the same block
    always gives the same entry. A parent with two or more children also has a `_Children`
    trie over their tokens (partial matches walk it instead of scanning siblings); a lone child
    is compared in the table.
    """

    def __init__(self, block_size: int, seed: int | None = None, num_blocks: int = 1024) -> None:
        self.block_size = block_size
        self.hasher = BlockHasher(block_size, seed)
        self._table = PrefixTable(num_blocks, block_size)
        self._capacity = num_blocks          # blocks 0..num_blocks-1 (grows if asked for more)
        self._entries: dict[int, Entry] = {}  # the entries made so far, by block
        self._tries: dict[bytes, _Children] = {}  # parent digest -> trie of its 2+ children
        self.nodes_visited = 0          # trie nodes (and lone children) partial matches visited

    def __len__(self) -> int:
        return len(self._table)

    def blocks(self) -> list[int]:
        """The cached blocks, ascending."""
        return self._table.blocks()

    def entries(self) -> list[Entry]:
        """Every cached block's entry (made for the call, not kept, where none was)."""
        return [self._entries.get(b) or self._make(b) for b in self._table.blocks()]

    def chain(self, tokens: npt.ArrayLike = (), root: bytes = ROOT) -> TokenChain:
        """A new request's chain: its prompt hashed once, here (`root`: `adapter_root`)."""
        return self.hasher.chain(tokens, root)

    def lookup(self, prompt: npt.ArrayLike, root: bytes = ROOT) -> Match:
        """The longest cached prefix of `prompt` (hashes it; the scheduler uses `match`)."""
        chain = self.hasher.chain(prompt, root)
        return self.match(chain, chain.length)

    def match(self, chain: TokenChain, length: int) -> Match:
        """The longest cached prefix of the first `length` tokens of `chain`; hashes nothing.
        Full blocks are probed in one compiled pass over the chain's digest rows; where they
        stop, the child of the last matched block sharing the most of the next tokens."""
        if chain.length < length:
            raise ValueError(f"length={length} is past the chain's {chain.length} tokens")
        table, bs = self._table, self.block_size
        full = min(length // bs, chain.num_digests)
        blocks = np.empty(full + 1, dtype=np.int32)  # room for a partly matched last block
        matched = table.match(chain._digest_rows, 0, full, blocks)
        position = matched * bs
        match = Match(blocks[:matched], position, self)
        if position >= length:
            return match
        parent = chain.digest(matched - 1) if matched else chain.root
        rest = chain.tokens[position:min(position + bs, length)]
        trie = self._tries.get(parent)
        if trie is not None:
            best, shared, visited = trie.longest(rest)
            self.nodes_visited += visited
            block = best.block if best is not None else -1
        else:
            block = table.first_child(parent)
            shared = table.common_prefix(block, rest) if block >= 0 else 0
            self.nodes_visited += block >= 0
        if block >= 0 and shared:
            blocks[matched] = block
            match.blocks = blocks[:matched + 1]
            match.tokens = position + shared
        return match

    def _make(self, block: int) -> Entry:
        table = self._table
        return Entry(digest=table.digest(block), parent=table.parent(block),
                     tokens=table.tokens(block), full=table.num_tokens(block) == self.block_size,
                     block=block)

    def entry(self, block: int) -> Entry | None:
        entry = self._entries.get(block)
        if entry is None:
            if not 0 <= block < self._capacity or not self._table.holds(block):
                return None
            entry = self._entries[block] = self._make(block)
        return entry

    def block_of(self, digest: bytes) -> int:
        """The device block cached under `digest`, or -1."""
        return self._table.find(digest)

    def find(self, digest: bytes) -> Entry | None:
        block = self._table.find(digest)
        return self.entry(block) if block >= 0 else None

    def _fit(self, block: int) -> None:
        """Blocks past the table's size (an index built without `num_blocks`): a bigger table,
        holding the same blocks."""
        if block < self._capacity:
            return
        old = self._table
        size = max(2 * self._capacity, block + 1)
        table = PrefixTable(size, self.block_size)
        for b in old.blocks():
            table.insert(b, old.digest(b), old.parent(b), old.tokens(b))
        self._table, self._capacity = table, size

    def _branch(self, parent: bytes, block: int) -> None:
        """`block` joined a parent with other children: their trie gains it (or is built)."""
        trie = self._tries.get(parent)
        if trie is None:
            trie = self._tries[parent] = _Children()
            for sibling in reversed(self._table.siblings(parent)):  # oldest first
                trie.add(self.entry(sibling))  # type: ignore[arg-type]
        else:
            trie.add(self.entry(block))  # type: ignore[arg-type]

    def insert(self, block: int, parent: bytes, tokens: npt.ArrayLike) -> Entry | None:
        """Index `block` as holding `tokens` after the prefix `parent` (hashes the tokens);
        None if already cached."""
        data = np.array(tokens, dtype=np.int64)
        full = len(data) == self.block_size
        return self.insert_digest(block, self.hasher.digest(parent, data, full), parent, data,
                                  full)

    def insert_block(self, block: int, digest: bytes, parent: bytes,
                     tokens: npt.NDArray[np.int64]) -> bool:
        """Index `block` under a digest already computed (full when it holds `block_size`
        tokens); False, changing nothing, if that digest is cached."""
        self._fit(block)
        data = np.ascontiguousarray(tokens, dtype=np.int64)
        others = self._table.insert(block, digest, parent, data)
        if others < 0:
            return False
        if others:
            self._branch(parent, block)
        return True

    def insert_digest(self, block: int, digest: bytes, parent: bytes,
                      tokens: npt.NDArray[np.int64], full: bool) -> Entry | None:
        """`insert_block`, returning the block's entry; None if that digest is cached."""
        if len(tokens) != self.block_size if full else not 0 < len(tokens) < self.block_size:
            raise ValueError(f"{len(tokens)} tokens is not a {'full' if full else 'partial'} "
                             f"block of {self.block_size}")
        if not self.insert_block(block, digest, parent, tokens):
            return None
        return self.entry(block)

    def insert_full_blocks(self, blocks: Sequence[int], chain: TokenChain, first: int,
                           stop: int) -> list[int]:
        """Index `blocks[j]` as holding full block j of `chain`, for j = first..stop-1, under the
        chain's stored digests (what `insert_block` does block by block, in one compiled call);
        returns the blocks not indexed because their digest is cached already."""
        if stop <= first:
            return []
        self._fit(max(blocks[first:stop]))
        duplicates, branched = self._table.insert_run(
            blocks, chain._digest_rows, first, min(stop, chain.num_digests),
            chain.digest(first - 1) if first else chain.root, chain._buffer)
        for block in branched:
            self._branch(self._table.parent(block), block)
        return duplicates

    def _unlink(self, block: int, parent: bytes, entry: Entry | None) -> None:
        trie = self._tries.get(parent)
        if trie is not None:  # its entry was made when it joined the trie
            trie.remove(entry)  # type: ignore[arg-type]
            if len(trie) == 1:  # a lone child again: compared in the table
                del self._tries[parent]
        self._table.remove(block)

    def remove(self, block: int) -> Entry:
        """The block left the cache (evicted or adopted by a lane); its entry."""
        entry = self._entries.pop(block, None) or self._make(block)
        self._unlink(block, entry.parent, entry)
        return entry

    def discard_blocks(self, blocks: Sequence[int]) -> list[Entry]:
        """`discard` each block; the entries that had been made."""
        entries, tries, table, made = self._entries, self._tries, self._table, []
        for block in blocks:
            entry = entries.pop(block, None)
            if entry is not None:
                made.append(entry)
            if tries:  # a trie is kept only for parents with two or more children
                self._unlink(block, entry.parent if entry is not None else table.parent(block),
                             entry)
            else:
                table.remove(block)
        return made

    def discard(self, block: int) -> Entry | None:
        """`remove` without making an entry: the block's entry if one was made, else None."""
        entry = self._entries.pop(block, None)
        self._unlink(block, entry.parent if entry is not None else self._table.parent(block),
                     entry)
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
        # hybrid models (`atombatch.engine.checkpoints`): sliding-slot checkpoints share this budget.
        # `on_drop(entry)` lets an entry leaving the host go of its checkpoints; `reclaim(n)`
        # frees checkpoint bytes when no host block is left to drop (True if it freed any)
        self.on_drop: Callable[[Entry], None] | None = None
        self.reclaim: Callable[[int], bool] | None = None

    def __len__(self) -> int:
        return len(self._lru)

    def put(self, entry: Entry, data: npt.NDArray[np.generic]) -> None:
        """Keep a copy of an evicted block (dropping least recently used copies to fit); the
        entry's sliding-slot checkpoints travel with it (or are let go with it)."""
        size = int(data.nbytes)
        if size > self.capacity_bytes or entry.digest in self._lru:
            self.refuse(entry)
            return
        while self.used_bytes + size > self.capacity_bytes:
            if not self.drop_lru() and not (self.reclaim is not None and self.reclaim(size)):
                self.refuse(entry)
                return
        copy = Entry(digest=entry.digest, parent=entry.parent, tokens=entry.tokens,
                     full=entry.full, data=np.array(data, copy=True),
                     checkpoints=entry.checkpoints)
        entry.checkpoints = None  # moved to the host copy
        self._index.add(copy)
        self._lru[copy.digest] = copy
        self.used_bytes += size
        self.stores += 1

    def refuse(self, entry: Entry) -> None:
        """An evicted block that is not kept (too big, already here, or its save failed)."""
        if self.on_drop is not None:
            self.on_drop(entry)

    def drop_lru(self) -> bool:
        """Drop the least recently used host copy; False if there is none."""
        if not self._lru:
            return False
        _, old = self._lru.popitem(last=False)
        self._index.remove(old)
        self.used_bytes -= int(old.data.nbytes)  # type: ignore[union-attr]
        self.drops += 1
        if self.on_drop is not None:
            self.on_drop(old)
        return True

    def entries(self) -> list[Entry]:
        """Every host copy's entry."""
        return list(self._lru.values())

    def extend(self, chain: TokenChain, length: int, match: Match) -> list[Entry]:
        """Continue a device match of the first `length` tokens of `chain` into host copies when
        that covers more of them; returns the host entries now in the match. A device chain
        ending in a partly matched block is compared with the host's continuation of its wholly
        matched part; the longer wins. Hashes nothing."""
        # only blocks matched to their last token can be continued (a partly matched entry,
        # full or not, ends the device chain)
        full = match.tokens // self.block_size
        entries, tokens = self._index.walk(chain, length, full)
        if tokens <= match.tokens:
            return []
        match.continue_on_host(full, entries, tokens)
        for entry in entries:
            self._lru.move_to_end(entry.digest)
        self.hits += 1
        return entries

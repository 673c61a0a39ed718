"""The prefix index: lookups equal a brute-force scan of every cached block over random inserts,
removals and lookups; a miss visits what the prompt's blocks cost, not what the cache holds; and
the compiled block digests equal the twin's and xxhash's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atombatch.prefix import ROOT, BlockHasher, Entry, Match, PrefixIndex, _Children, _Node


def brute_force(index: PrefixIndex, prompt: np.ndarray, length: int) -> int:
    """The longest cached prefix by the definition: full blocks by digest, then the cached child
    of the last matched block sharing the most tokens, found by comparing every cached block."""
    bs = index.block_size
    chain = BlockHasher(bs, seed=index.hasher.seed).chain(prompt)
    cached = {index.entry(b).digest: index.entry(b) for b in list(index._by_block)}
    block = 0
    while block < length // bs and chain.digests[block] in cached:
        block += 1
    position, parent = block * bs, chain.parent(block)
    rest = prompt[position:min(position + bs, length)]
    best = 0
    for entry in cached.values():  # the scan the index must not do
        if entry.parent == parent:
            n = min(len(entry.tokens), len(rest))
            same = entry.tokens[:n] == rest[:n]
            best = max(best, n if same.all() else int(np.argmin(same)))
    return position + best


def check_trie(children: _Children | Entry) -> int:
    """The trie's shape: every leaf holds an entry, a node without one branches (two or more
    edges), edges are keyed by their label's first token and point back up; a trie holds two
    or more children (a lone child is kept as itself). Returns entries."""
    if isinstance(children, Entry):
        return 1
    count, stack = 0, [children.root]
    while stack:
        node: _Node = stack.pop()
        if node is not children.root:
            assert len(node.label) > 0
            assert node.entry is not None or len(node.edges) >= 2
        if node.entry is not None:
            count += 1
            assert children.node_of[node.entry.digest] is node
        for key, child in node.edges.items():
            assert int(child.label[0]) == key and child.up is node
            stack.append(child)
    assert count == len(children.node_of) >= 2
    return count


def check_match(index: PrefixIndex, prompt: np.ndarray, match: Match) -> None:
    """The entries chain from block 0, are cached, and hold the prompt's tokens."""
    bs, parent = index.block_size, ROOT
    for j, entry in enumerate(match.entries):
        assert index.entry(entry.block) is entry and entry.parent == parent
        start = j * bs
        covered = min(match.tokens - start, bs)
        assert covered > 0 and (entry.tokens[:covered] == prompt[start:start + covered]).all()
        if j < len(match.entries) - 1:
            assert entry.full and covered == bs
        parent = entry.digest
    assert match.tokens <= len(match.entries) * bs


operations = st.lists(st.tuples(st.sampled_from(["insert", "insert", "remove", "lookup"]),
                                st.lists(st.integers(1, 3), min_size=1, max_size=30),
                                st.integers(0, 10**6)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(block_size=st.integers(1, 8), ops=operations, seed=st.integers(0, 2**64 - 1))
def test_lookup_equals_a_scan_of_every_cached_block(block_size, ops, seed):
    index = PrefixIndex(block_size, seed=seed)
    next_block = 0
    for op, tokens, pick in ops:
        prompt = np.array(tokens, dtype=np.int64)
        if op == "insert":  # a finished sequence's blocks, the last one partial or full
            chain = index.chain(prompt)
            first = 0
            if pick % 2:  # the full blocks in one call, as caching a finished lane does
                full = len(prompt) // block_size
                blocks = list(range(next_block, next_block + full))
                duplicates = index.insert_full_blocks(blocks, chain, 0, full)
                assert all(index.entry(b) is None for b in duplicates)
                assert all(index.entry(b) is not None for b in blocks if b not in duplicates)
                next_block += full
                first = full
            for j in range(first, -(-len(prompt) // block_size)):
                start, end = j * block_size, min((j + 1) * block_size, len(prompt))
                full = end - start == block_size
                digest = chain.digests[j] if full else chain.partial_digest(end)
                if index.insert_digest(next_block, digest, chain.parent(j),
                                       chain.tokens[start:end], full) is not None:
                    next_block += 1
        elif op == "remove" and len(index):  # eviction takes any block, parents included
            blocks = sorted(index._by_block)
            index.remove(blocks[pick % len(blocks)])
        else:
            length = 1 + pick % len(prompt)
            match = index.match(index.chain(prompt), length)
            assert match.tokens == brute_force(index, prompt, length)
            check_match(index, prompt, match)
        assert sum(check_trie(c) for c in index._index.children.values()) == len(index)
        assert len(index._index.by_digest) == len(index)
    for block in list(index._by_block):  # everything removed: nothing is left behind
        index.remove(block)
    assert not index._index.children and not index._index.by_digest


@pytest.mark.parametrize("block_size", [16, 512])
def test_a_miss_visits_what_the_prompt_costs_not_what_the_cache_holds(block_size):
    """Thousands of cached siblings under the root (eager artifacts: one per cached sequence) and
    under one shared block; a lookup visits at most `2 * (block_size + 1)` trie nodes per
    partial match, the same bound with 30 or 3 000 siblings."""
    rng = np.random.default_rng(1)
    visited = {}
    for siblings in (30, 3000):
        index = PrefixIndex(block_size, seed=7)
        stem = rng.integers(1, 50, size=block_size)
        for b in range(siblings):
            # half start from scratch (root siblings), half follow one shared full block
            tokens = rng.integers(1, 50, size=block_size - 1 - b % 3)
            if b % 2:
                tokens = np.concatenate([stem, tokens])
            chain = index.chain(tokens)
            j = len(chain.digests)
            index.insert_digest(2 * b, chain.partial_digest(len(tokens)), chain.parent(j),
                                chain.tokens[j * block_size:], False)
            if j:
                index.insert_digest(2 * b + 1, chain.digests[0], ROOT, chain.tokens[:block_size],
                                    True)
        counter = index._index
        counter.nodes_visited = 0
        lookups = 0
        for probe in range(50):
            prompt = rng.integers(1, 50, size=4 * block_size)
            if probe % 2:
                prompt[:block_size] = stem
            match = index.match(index.chain(prompt), len(prompt))
            assert match.tokens == brute_force(index, prompt, len(prompt))
            lookups += 1
        assert counter.nodes_visited <= lookups * 2 * (block_size + 1)
        visited[siblings] = counter.nodes_visited / lookups
    assert visited[3000] <= 2 * (block_size + 1)


def test_removing_merges_and_prunes_the_trie():
    children = _Children()  # the trie alone (an index keeps a lone child as itself)
    entries = [Entry(digest=bytes([i]) * 16, parent=ROOT, tokens=np.array(t, dtype=np.int64),
                     full=False) for i, t in enumerate([[1, 2, 3], [1, 2, 4], [1, 2], [5]])]
    for entry in entries:
        children.add(entry)
    assert check_trie(children) == 4
    assert children.longest(np.array([1, 2, 3, 9]))[:2] == (entries[0], 3)
    assert children.longest(np.array([1, 2, 7]))[1] == 2
    assert children.longest(np.array([6]))[:2] == (None, 0)
    with pytest.raises(ValueError, match="already cached"):
        children.add(Entry(digest=b"x" * 16, parent=ROOT, tokens=np.array([1, 2]), full=False))
    children.remove(entries[2])  # [1, 2] becomes a branch point without an entry
    children.remove(entries[1])  # ... with one edge left: merged into [1, 2, 3]
    assert check_trie(children) == 2
    assert [len(n.label) for n in children.root.edges.values()] == [3, 1]
    children.remove(entries[0])
    children.remove(entries[3])
    assert not children.root.edges and not children.node_of


def test_a_lone_child_is_kept_without_a_trie_and_siblings_share_one():
    index = PrefixIndex(4, seed=2)
    chain = index.chain([1, 2, 3, 4, 5, 6])
    index.insert_digest(0, chain.digests[0], ROOT, chain.tokens[:4], True)
    index.insert_digest(1, chain.partial_digest(6), chain.digests[0], chain.tokens[4:], False)
    assert all(isinstance(c, Entry) for c in index._index.children.values())
    other = index.chain([1, 2, 9])
    index.insert_digest(2, other.partial_digest(3), ROOT, other.tokens, False)
    assert isinstance(index._index.children[ROOT], _Children)
    assert index.match(index.chain([1, 2, 3, 7]), 4).tokens == 3
    assert index.match(index.chain([1, 2, 9, 9]), 4).tokens == 3
    index.remove(0)
    assert isinstance(index._index.children[ROOT], Entry)
    assert index.match(index.chain([1, 2, 3, 7]), 4).tokens == 2


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # `impl` is stateless
@given(block_size=st.integers(1, 40), blocks=st.integers(0, 6), extra=st.integers(0, 39),
       parent=st.sampled_from([b"", bytes(range(16))]), seed=st.integers(0, 2**64 - 1),
       data=st.data())
def test_block_digests_equal_xxhash_per_block(impl, block_size, blocks, extra, parent, seed,
                                              data):
    n = blocks * block_size + extra
    tokens = np.array(data.draw(st.lists(st.integers(-2**63, 2**63 - 1), min_size=n,
                                         max_size=n)), dtype=np.int64)
    start = extra // 2
    stop = start + blocks * block_size
    hasher = BlockHasher(block_size, seed=seed)
    want, last = [], parent
    for j in range(blocks):
        last = hasher.digest(last, tokens[start + j * block_size:start + (j + 1) * block_size],
                             True)
        want.append(last)
    assert impl.block_digests(tokens, start, stop, block_size, parent, seed) == want


def test_block_digests_refuse_a_range_that_is_not_whole_blocks(impl):
    tokens = np.arange(10, dtype=np.int64)
    for start, stop, bs in ((0, 5, 2), (0, 12, 2), (3, 1, 2), (0, 4, 0)):
        with pytest.raises(ValueError, match="whole number"):
            impl.block_digests(tokens, start, stop, bs, b"", 0)
    with pytest.raises(ValueError, match="16 bytes"):
        impl.block_digests(tokens, 0, 4, 2, b"abc", 0)


def test_common_prefix(impl):
    a = np.array([1, 2, 3, 4], dtype=np.int64)
    assert impl.common_prefix(a, a) == 4
    assert impl.common_prefix(a, a[:2]) == 2
    assert impl.common_prefix(a, np.array([1, 2, 9], dtype=np.int64)) == 2
    assert impl.common_prefix(a, np.zeros(0, dtype=np.int64)) == 0
    assert impl.common_prefix(a[1:], np.array([2, 3], dtype=np.int64)) == 2


def test_match_digests_stops_at_the_first_missing_digest(impl):
    table = {b"a": 1, b"b": 2, b"d": 4}
    out: list[int] = []
    assert impl.match_digests(table, [b"a", b"b", b"c", b"d"], 0, 4, out) == 2 and out == [1, 2]
    out = []
    assert impl.match_digests(table, [b"a", b"b", b"c", b"d"], 3, 9, out) == 4 and out == [4]
    assert impl.match_digests(table, [b"a"], 0, 0, out) == 0 and out == [4]


def test_acquire_blocks_and_push_blocks_equal_one_at_a_time_and_check_first(impl):
    from atombatch.errors import CapacityError, StateError

    one, many = impl.BlockPool(8), impl.BlockPool(8)
    for pool in (one, many):
        for _ in range(6):
            pool.cache(pool.allocate(impl.LANE, 0))
    for block in (4, 1, 4):
        one.acquire(block)
    many.acquire_blocks([4, 1, 4])
    assert one.lru_blocks() == many.lru_blocks() and one.counts() == many.counts()
    assert [many.refcount(b) for b in range(6)] == [0, 1, 0, 0, 2, 0]
    with pytest.raises(StateError, match="cannot acquire block=6"):
        many.acquire_blocks([0, 6])  # block 6 is FREE: nothing was pinned
    assert many.refcount(0) == 0 and one.lru_blocks() == many.lru_blocks()

    table = impl.LaneTable(2, 4, 16)
    lane = table.assign()
    table.push_blocks(lane, [3, 5])
    table.push_blocks(lane, [])
    assert list(table.blocks(lane)) == [3, 5]
    with pytest.raises(CapacityError, match="exceed the row's 4 entries"):
        table.push_blocks(lane, [6, 7, 8])
    with pytest.raises(StateError, match="int16 block-table range"):
        table.push_blocks(lane, [6, -1])
    assert list(table.blocks(lane)) == [3, 5]
    with pytest.raises(StateError):
        table.push_blocks(1, [2])  # an idle lane

"""The prefix index: lookups equal a brute-force scan of every cached block over random inserts,
removals and lookups; a miss visits what the prompt's blocks cost, not what the cache holds; and
the compiled block digests equal the twin's and xxhash's."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atombatch.kernel.prefix import ROOT, BlockHasher, Entry, Match, PrefixIndex, _Children, _Node


def brute_force(index: PrefixIndex, prompt: np.ndarray, length: int) -> int:
    """The longest cached prefix by the definition: full blocks by digest, then the cached child
    of the last matched block sharing the most tokens, found by comparing every cached block."""
    bs = index.block_size
    chain = BlockHasher(bs, seed=index.hasher.seed).chain(prompt)
    cached = {index.entry(b).digest: index.entry(b) for b in index.blocks()}
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


def check_index(index: PrefixIndex) -> None:
    """A trie exactly for the parents with two or more cached children, holding those children;
    the table's sibling lists hold every cached block under its parent."""
    table = index._table
    table.check()
    parents: dict[bytes, list[int]] = {}
    for block in index.blocks():
        parents.setdefault(table.parent(block), []).append(block)
    assert set(index._tries) == {p for p, kids in parents.items() if len(kids) >= 2}
    for parent, trie in index._tries.items():
        assert check_trie(trie) == len(parents[parent])
        assert set(trie.node_of) == {index.entry(b).digest for b in parents[parent]}
    for parent, kids in parents.items():
        assert sorted(table.siblings(parent)) == kids
        for block in kids:
            assert table.find(table.digest(block)) == block
    assert len(index) == sum(len(kids) for kids in parents.values())


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


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # `core` is set once
@given(block_size=st.integers(1, 8), ops=operations, seed=st.integers(0, 2**64 - 1))
def test_lookup_equals_a_scan_of_every_cached_block(core, block_size, ops, seed):
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
            blocks = index.blocks()
            if pick % 3:
                index.remove(blocks[pick % len(blocks)])
            else:  # as an eviction without a host cache does: no entry is made
                index.discard(blocks[pick % len(blocks)])
        else:
            length = 1 + pick % len(prompt)
            match = index.match(index.chain(prompt), length)
            assert match.tokens == brute_force(index, prompt, length)
            check_match(index, prompt, match)
        check_index(index)
    for block in index.blocks():  # everything removed: nothing is left behind
        index.remove(block)
    assert not index._tries and not index._entries and not index.blocks() and len(index) == 0


@pytest.mark.parametrize("block_size", [16, 512])
def test_a_miss_visits_what_the_prompt_costs_not_what_the_cache_holds(core, block_size):
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
        counter = index
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
    assert not index._tries
    other = index.chain([1, 2, 9])
    index.insert_digest(2, other.partial_digest(3), ROOT, other.tokens, False)
    assert list(index._tries) == [ROOT] and isinstance(index._tries[ROOT], _Children)
    assert index.match(index.chain([1, 2, 3, 7]), 4).tokens == 3
    assert index.match(index.chain([1, 2, 9, 9]), 4).tokens == 3
    index.remove(0)
    assert not index._tries
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


table_ops = st.lists(st.tuples(st.sampled_from(["insert", "run", "remove", "remove", "bad"]),
                               st.integers(0, 11), st.integers(0, 5), st.integers(1, 4)),
                     max_size=80)


@settings(max_examples=300, deadline=None)
@given(ops=table_ops)
def test_the_compiled_prefix_table_equals_the_twin(ops):
    """Both `PrefixTable`s driven by the same random inserts (one block or a run; digests drawn
    from a small set, so duplicates and shared parents are common), removals of any block and
    refused calls: every answer, error and query agrees, and probing collides often (12 blocks
    in 32 slots)."""
    from atombatch.kernel import _blocks as c_core
    from atombatch.kernel import _blocks_py as py_core

    tables = [c_core.PrefixTable(12, 4), py_core.PrefixTable(12, 4)]
    names = [bytes([7 * i + 1]) * 15 + bytes([i]) for i in range(6)]  # 6 digests

    def both(method, *args):
        """`method(*args)` on both tables (a name, or a function of the table): the same
        answer, or the same error type and message."""
        out = []
        for table in tables:
            call = getattr(table, method) if isinstance(method, str) else partial(method, table)
            try:
                answer = call(*args)
                out.append(("ok", answer.tolist() if isinstance(answer, np.ndarray) else answer))
            except Exception as exc:  # the same type and message from both
                out.append((type(exc).__name__, str(exc)))
        assert out[0] == out[1], out
        return out[0]

    def matched(table, rows, start, stop):
        out = np.full(6, -1, dtype=np.int32)
        return table.match(rows, start, stop, out), out.tolist()

    tokens = np.arange(48, dtype=np.int64)
    for op, block, name, count in ops:
        digest, parent = names[name], [b"", *names][(name + count) % 7]
        if op == "insert":
            both("insert", block, digest, parent, tokens[block:block + count])
        elif op == "run":
            rows = np.array([list(names[(name + j) % 6]) for j in range(count + 1)],
                            dtype=np.uint8)
            blocks = [(block + 5 * j) % 12 for j in range(count + 1)]
            both("insert_run", blocks, rows, 1, count + 1, parent, tokens)
        elif op == "remove":
            both("remove", block)
        else:  # refused: nothing changes
            both("insert", block, b"short", parent, tokens[:2])
            both("insert", block, digest, parent, tokens[:5])
            both("insert", 12, digest, parent, tokens[:2])
            both("find", b"")
            twice = np.array([list(names[name]), list(names[(name + 1) % 6])], dtype=np.uint8)
            both("insert_run", [block, block], twice, 0, 2, parent, tokens)  # a block twice
        assert both("__len__") == ("ok", len(both("blocks")[1]))
        assert both("check") == ("ok", None)
        for key in [b"", *names]:
            both("siblings", key)
            both("first_child", key)
            if key:
                both("find", key)
        for b in range(12):
            both("holds", b)
            for method in ("digest", "parent", "num_tokens", "tokens"):
                both(method, b)
            both("common_prefix", b, tokens[b:b + 3])
        rows = np.array([list(n) for n in names], dtype=np.uint8)
        for start, stop in ((0, 6), (2, 9), (5, 3)):
            both(matched, rows, start, stop)
        both("match", rows, 0, 6, np.zeros(2, np.int32))  # too small an output: refused


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # `impl` is stateless
@given(block_size=st.integers(1, 12), blocks=st.integers(0, 5), start=st.integers(0, 7),
       row=st.integers(0, 3), seed=st.integers(0, 2**64 - 1))
def test_chain_digests_equal_block_digests(impl, block_size, blocks, start, row, seed):
    tokens = np.random.default_rng(seed % 1000).integers(-2**40, 2**40, size=start + 60)
    stop = start + blocks * block_size
    out = np.zeros((row + blocks + 1, 16), dtype=np.uint8)
    impl.chain_digests(tokens, start, stop, block_size, b"", seed, out, row)
    want = impl.block_digests(tokens, start, stop, block_size, b"", seed)
    assert [out[row + j].tobytes() for j in range(blocks)] == want
    assert not out[:row].any() and not out[row + blocks:].any()
    with pytest.raises(ValueError, match="do not fit"):
        impl.chain_digests(tokens, start, start + 2 * block_size, block_size, b"", seed,
                           np.zeros((1, 16), dtype=np.uint8), 0)


def test_grow_lane_takes_what_one_block_at_a_time_takes(impl):
    """`StepKernel.grow_lane` hands out the blocks `allocate` + `push_block` would, in the same
    order, stops when the free list is dry, and reports what is missing."""
    from atombatch.errors import CapacityError, StateError

    def kernel_on(pool):
        lanes = impl.LaneTable(2, 8, 4)
        return impl.StepKernel(pool, lanes, impl.DecodeInputs(2, 8)), lanes

    one, many = impl.BlockPool(12), impl.BlockPool(12)
    for pool in (one, many):  # a scattered free list
        taken = [pool.allocate(impl.LANE, 0) for _ in range(12)]
        for block in taken[::2] + taken[1::2]:
            pool.free(block)
    k_one, lanes_one = kernel_on(one)
    k_many, lanes_many = kernel_on(many)
    for lanes in (lanes_one, lanes_many):
        lanes.assign()
        lanes.assign()
    lanes_one.push_block(0, one.allocate(impl.LANE, 0))
    lanes_many.push_block(0, many.allocate(impl.LANE, 0))
    while lanes_one.num_held(0) < 6:
        lanes_one.push_block(0, one.allocate(impl.LANE, 0))
    assert k_many.grow_lane(0, 21) == 0      # 21 positions: 6 blocks of 4
    assert lanes_one.blocks(0) == lanes_many.blocks(0) and one.counts() == many.counts()
    assert k_many.grow_lane(0, 10) == 0 and lanes_many.num_held(0) == 6  # covered already
    assert k_many.grow_lane(1, 32) == 2      # 8 blocks wanted, 6 free
    assert lanes_many.num_held(1) == 6 and many.num_free == 0
    assert all(many.owner(b) == 1 for b in lanes_many.blocks(1))
    with pytest.raises(CapacityError, match="row has 8 entries"):
        k_many.grow_lane(1, 33)
    lanes_many.release(1)
    with pytest.raises(StateError, match="idle"):
        k_many.grow_lane(1, 4)


def test_acquire_blocks_and_push_blocks_take_int32_arrays_as_lists(impl):
    """A prefix match hands its blocks over as an int32 array: the same transitions, the same
    refusals (nothing changed), as a list of ints."""
    from atombatch.errors import CapacityError, StateError

    listed, arrayed = impl.BlockPool(8), impl.BlockPool(8)
    for pool in (listed, arrayed):
        for _ in range(6):
            pool.cache(pool.allocate(impl.LANE, 0))
    listed.acquire_blocks([4, 1, 4, 2])
    arrayed.acquire_blocks(np.array([9, 4, 1, 4, 2], dtype=np.int32)[1:])  # a view
    assert listed.lru_blocks() == arrayed.lru_blocks() and listed.counts() == arrayed.counts()
    assert [arrayed.refcount(b) for b in range(6)] == [listed.refcount(b) for b in range(6)]
    with pytest.raises(StateError, match="cannot acquire block=6"):
        arrayed.acquire_blocks(np.array([0, 6], dtype=np.int32))
    assert arrayed.refcount(0) == 0 and listed.lru_blocks() == arrayed.lru_blocks()
    arrayed.acquire_blocks(np.array([5, 3], dtype=np.int32)[::-1].copy())
    assert arrayed.refcount(3) == 1 and arrayed.refcount(5) == 1

    table = impl.LaneTable(2, 4, 16)
    lane = table.assign()
    table.push_blocks(lane, np.array([3, 5], dtype=np.int32))
    table.push_blocks(lane, np.zeros(0, dtype=np.int32))
    assert list(table.blocks(lane)) == [3, 5]
    with pytest.raises(CapacityError, match="exceed the row's 4 entries"):
        table.push_blocks(lane, np.array([6, 7, 8], dtype=np.int32))
    with pytest.raises(StateError, match="int16 block-table range"):
        table.push_blocks(lane, np.array([6, -1], dtype=np.int32))
    assert list(table.blocks(lane)) == [3, 5]


def test_evict_many_evicts_what_evict_does_one_at_a_time(impl):
    from atombatch.errors import CapacityError

    one, many = impl.BlockPool(10), impl.BlockPool(10)
    for pool in (one, many):
        blocks = [pool.allocate(impl.LANE, 0) for _ in range(8)]
        for block in blocks[::-1]:
            pool.cache(block)
        pool.acquire(blocks[3])
    with pytest.raises(CapacityError, match="Cannot evict 8 blocks: 7 of the 8"):
        many.evict_many(8)
    assert many.lru_blocks() == one.lru_blocks()  # refused: nothing changed
    assert many.evict_many(5) == [one.evict() for _ in range(5)]
    assert many.free_blocks() == one.free_blocks() and many.counts() == one.counts()
    assert many.evict_many(0) == [] and many.num_evictable == 2

"""Prefix digests are computed once: incrementally as tokens arrive, equal to one-shot hashing,
and never again by a lookup, an insert or caching a finished request."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.driving import run_to_end
from support.ledger import LedgerRuntime, ledger_spec, reference

from atombatch import ArtifactConfig, Batcher, SamplingParams
from atombatch.kernel.prefix import ROOT, BlockHasher, PrefixIndex, chain_digest


def one_shot_digests(hasher: BlockHasher, tokens: list[int]) -> list[bytes]:
    """Every full block's chained digest, each block hashed from scratch."""
    bs, parent, out = hasher.block_size, ROOT, []
    for start in range(0, len(tokens) - bs + 1, bs):
        parent = hasher.digest(parent, tokens[start:start + bs], True)
        out.append(parent)
    return out


@settings(max_examples=200, deadline=None)
@given(block_size=st.integers(1, 9),
       tokens=st.lists(st.integers(-2**63, 2**63 - 1), max_size=200),
       cuts=st.lists(st.integers(0, 200), max_size=8),
       seed=st.integers(0, 2**64 - 1))
def test_incremental_digests_equal_one_shot_digests(block_size, tokens, cuts, seed):
    hasher = BlockHasher(block_size, seed=seed)
    bounds = sorted({0, len(tokens), *(c for c in cuts if c <= len(tokens))})
    chain = hasher.chain(tokens[:bounds[1]] if len(bounds) > 1 else [])
    for a, b in itertools.pairwise(bounds[1:]):
        chain.extend(tokens[a:b])
    assert chain.length == len(tokens) and chain.tokens.tolist() == tokens  # across regrowth
    reference_hasher = BlockHasher(block_size, seed=seed)
    assert chain.digests == one_shot_digests(reference_hasher, tokens)
    # every token went through the hash function exactly once
    assert hasher.tokens_hashed == len(tokens)
    assert hasher.digests_made == len(tokens) // block_size
    for end in range(1, len(tokens) + 1):
        if end % block_size:
            block = end // block_size
            start = block * block_size
            want = reference_hasher.digest(chain.parent(block), tokens[start:end], False)
            assert chain.partial_digest(end) == want
    # a partial digest is not a full one, and digests depend on the seed
    if tokens:
        full = reference_hasher.digest(ROOT, tokens[:1], True)
        assert full != reference_hasher.digest(ROOT, tokens[:1], False)
        assert full != BlockHasher(block_size, seed=seed ^ 1).digest(ROOT, tokens[:1], True)


def test_partial_digest_at_the_end_of_the_chain_hashes_nothing():
    hasher = BlockHasher(4, seed=1)
    chain = hasher.chain(range(10))
    before = hasher.tokens_hashed
    digest = chain.partial_digest(10)
    assert hasher.tokens_hashed == before
    assert digest == BlockHasher(4, seed=1).digest(chain.digests[1], [8, 9], False)


def test_lookup_and_insert_walk_stored_digests_without_hashing():
    index = PrefixIndex(block_size=16, seed=3)
    prompt = np.arange(8192, dtype=np.int64)
    chain = index.chain(prompt)
    assert index.hasher.tokens_hashed == 8192
    for j in range(8192 // 16):
        entry = index.insert_digest(j, chain.digests[j], chain.parent(j),
                                    chain.tokens[16 * j:16 * (j + 1)], True)
        assert entry is not None
    match = index.match(chain, 8192)
    assert [e.block for e in match.entries] == list(range(512)) and match.tokens == 8192
    shorter = index.match(chain, 100)
    assert shorter.tokens == 100 and len(shorter.entries) == 7  # six full, one partial (4 of 16)
    assert index.hasher.tokens_hashed == 8192
    assert index.hasher.digests_made == 512
    with pytest.raises(ValueError, match="past the chain"):
        index.match(chain, 8193)


def artifact(block_size=8, num_blocks=None, batch_size=2, max_seq_len=64, chunk=4):
    bps = max_seq_len // block_size
    return ArtifactConfig(model=ledger_spec(), batch_size=batch_size, max_seq_len=max_seq_len,
                          block_size=block_size, prefill_chunk_size=chunk,
                          num_blocks=num_blocks or batch_size * bps + 1)


@pytest.mark.parametrize("layout", [dict(), dict(block_size=64, num_blocks=3)],
                         ids=["partitioned", "eager"])
def test_the_engine_hashes_each_token_once(layout):
    """The prompt at submit, generated tokens when the finished sequence is cached; the second
    request's lookup and caching reuse its own digests."""
    batcher = Batcher(LedgerRuntime(artifact(**layout)), prefix_cache=True)
    hasher = batcher.scheduler.prefix.hasher
    prompt = [random.Random(5).randint(1, 90) for _ in range(37)]
    params = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)
    first = batcher.submit(prompt, params)
    assert hasher.tokens_hashed == 37
    finals = run_to_end(batcher)
    assert list(finals[first].completion.token_ids) == reference(prompt, 11, 97)
    # KV is written for 37 + 10 positions (the last token's is not): each hashed once
    assert hasher.tokens_hashed == 47
    second = batcher.submit(prompt, params)
    assert hasher.tokens_hashed == 47 + 37
    finals = run_to_end(batcher)
    assert list(finals[second].completion.token_ids) == reference(prompt, 11, 97)
    assert batcher.stats().prefix_hits == 1
    assert hasher.tokens_hashed == 2 * 47


@pytest.mark.parametrize("seed", range(6))
def test_no_token_is_hashed_twice_under_preemption_and_host_restores(seed):
    """An oversubscribed pool preempts and re-prefills from cached prefixes; every request's
    tokens are hashed once in all, and the outputs stay exact."""
    rnd = random.Random(seed)
    art = artifact(block_size=4, num_blocks=rnd.randint(17, 24), batch_size=3, chunk=4)
    batcher = Batcher(LedgerRuntime(art), prefix_cache=True,
                      host_cache_bytes=rnd.choice([0, 1 << 16]))
    stem = [rnd.randint(1, 3) for _ in range(40)]
    requests, want, finals = [], {}, {}
    for _ in range(10):
        n = rnd.randint(1, 40)
        prompt = stem[:rnd.randint(0, n)] + [rnd.randint(1, 3) for _ in range(n)]
        prompt = prompt[:n]
        max_tokens = rnd.randint(1, 64 - n)
        rid = batcher.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                    ignore_eos=True))
        requests.append(batcher.scheduler.requests[rid])
        want[rid] = reference(prompt, max_tokens, 97)
        for _ in range(rnd.randint(0, 6)):
            finals.update((out.request_id, out) for out in batcher.step() if out.finished)
    finals.update(run_to_end(batcher))
    assert {rid: list(out.completion.token_ids) for rid, out in finals.items()} == want
    hasher = batcher.scheduler.prefix.hasher
    stats = batcher.stats()
    assert stats.preemptions > 0 and stats.prefix_hits > 0
    assert hasher.tokens_hashed == sum(r.chain.length for r in requests)
    for r in requests:
        assert r.chain.length <= len(r.prompt) + len(r.output)


def test_chain_digest_is_the_cache_encoding_with_a_fixed_seed():
    """Routers outside the cache use `chain_digest`: the same in every process (seed 0 unless
    told), equal to a cache hasher's digest under that seed, different under the cache's own."""
    tokens = np.arange(16, dtype=np.int64)
    block0 = chain_digest(ROOT, tokens, True)
    assert block0 == BlockHasher(16, seed=0).digest(ROOT, tokens, True)
    assert chain_digest(block0, tokens, False) == BlockHasher(16, seed=0).digest(block0, tokens,
                                                                                 False)
    assert chain_digest(ROOT, tokens, True, seed=9) == BlockHasher(16, seed=9).digest(
        ROOT, tokens, True)
    assert chain_digest(ROOT, tokens, True, seed=9) != block0

"""Prefix and host caching on real decoder math: same tokens, fewer prefill chunks."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from support.driving import run_to_end
from support.ledger import LedgerRuntime, ledger_spec, reference

from atombatch import ArtifactConfig, Batcher, ConfigError, ModelSpec, SamplingParams
from atombatch.kernel.prefix import PrefixIndex
from atombatch.runtime import NumpyRuntime

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run

SPEC = ModelSpec(name="tiny-llama", family="llama", vocab_size=256, hidden_size=32,
                 intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def artifact(batch_size=2, block_size=128, num_blocks=None, chunk=16, max_seq_len=128):
    bps = max_seq_len // block_size
    return ArtifactConfig(model=SPEC, batch_size=batch_size, max_seq_len=max_seq_len,
                          block_size=block_size, prefill_chunk_size=chunk,
                          num_blocks=num_blocks or batch_size * bps + 1)


def rng_prompts(n, length, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, size=length).tolist() for _ in range(n)]


def run(art, prompts, prefix_cache, host_cache_bytes=0, one_by_one=True, seed=4):
    rt = NumpyRuntime.random(art, seed=seed)
    batcher = Batcher(rt, prefix_cache=prefix_cache, host_cache_bytes=host_cache_bytes)
    if one_by_one:
        out = [batcher.generate([p], GREEDY)[0].token_ids for p in prompts]
    else:
        out = [c.token_ids for c in batcher.generate(prompts, GREEDY)]
    batcher.check_invariants()
    return out, rt, batcher


@pytest.mark.parametrize("layout", [dict(), dict(block_size=16), dict(block_size=32, chunk=32)])
def test_repeated_prompt_prefills_only_its_uncached_suffix(layout):
    art = artifact(**layout)
    [prompt] = rng_prompts(1, 53)
    cold, cold_rt, _ = run(art, [prompt], prefix_cache=False)
    warm, rt, batcher = run(art, [prompt, prompt, prompt], prefix_cache=True)
    assert warm == [cold[0]] * 3
    chunk = art.prefill_chunk_size
    full = -(-53 // chunk)
    # first run prefills everything; repeats resume at the chunk boundary below token 52
    resume = (52 // chunk) * chunk
    assert cold_rt.prefill_calls == full
    assert rt.prefill_calls == full + 2 * (full - resume // chunk)
    stats = batcher.stats()
    assert stats.prefix_hits == 2 and stats.prefix_hit_tokens == 2 * resume


def test_shared_system_prompt_prefills_only_the_suffixes():
    art = artifact(batch_size=2, block_size=16)
    system = rng_prompts(1, 48, seed=1)[0]
    prompts = [system + tail for tail in rng_prompts(5, 20, seed=2)]
    cold, cold_rt, _ = run(art, prompts, prefix_cache=False)
    warm, rt, batcher = run(art, prompts, prefix_cache=True)
    assert warm == cold
    # 68 tokens = 5 chunks of 16 cold; warm requests resume at 48 and run 2 chunks
    assert cold_rt.prefill_calls == 5 * 5
    assert rt.prefill_calls == 5 + 4 * 2
    assert batcher.stats().prefix_hit_tokens == 4 * 48


def test_concurrent_sharers_pin_blocks_and_copy_the_resume_block():
    art = artifact(batch_size=4, block_size=16, chunk=8)
    system = rng_prompts(1, 60, seed=5)[0]
    warmup = system + [7]
    tails = rng_prompts(2, 9, seed=6)
    sharer = system[:52] + tails[0]   # resumes at 48: shares blocks 0-2 read-only (pins them)
    copier = system[:42] + tails[1]   # resumes at 40, inside block 2, which the sharer pins
    cold, _, _ = run(art, [warmup, sharer, copier], prefix_cache=False)
    rt = NumpyRuntime.random(art, seed=4)
    batcher = Batcher(rt, prefix_cache=True)
    assert batcher.generate([warmup], GREEDY)[0].token_ids == cold[0]
    copies = []
    original = rt.copy_block

    def recording_copy(src, dst):
        copies.append((src, dst))
        original(src, dst)

    rt.copy_block = recording_copy
    ids = [batcher.submit(p, GREEDY) for p in (sharer, copier)]
    finals = run_to_end(batcher)
    assert [finals[i].completion.token_ids for i in ids] == cold[1:]
    assert len(copies) == 1
    assert batcher.stats().prefix_hit_tokens == 48 + 40


def test_eviction_under_pressure_keeps_outputs_identical_and_host_cache_restores():
    art = artifact(batch_size=2, block_size=16, num_blocks=2 * 8 + 1)
    prompts = rng_prompts(6, 60, seed=3)
    sequence = prompts + prompts[:2]  # the first two return after being evicted
    cold, cold_rt, _ = run(art, sequence, prefix_cache=False)
    warm, warm_rt, warm_b = run(art, sequence, prefix_cache=True)
    assert warm == cold
    assert warm_b.stats().evictions > 0
    hosted, host_rt, host_b = run(art, sequence, prefix_cache=True, host_cache_bytes=1 << 20)
    assert hosted == cold
    stats = host_b.stats()
    assert stats.host_restores > 0
    assert host_rt.prefill_calls < warm_rt.prefill_calls
    assert host_b.host_cache.used_bytes <= 1 << 20


def test_eager_blocks_match_a_partial_prefix():
    """With block_size == max_seq_len a block is a whole sequence: hits are partial blocks."""
    art = artifact(batch_size=1, num_blocks=2)
    base = rng_prompts(1, 70, seed=9)[0]
    variant = base[:40] + rng_prompts(1, 30, seed=10)[0]
    cold, _, _ = run(art, [base, variant], prefix_cache=False)
    warm, rt, batcher = run(art, [base, variant], prefix_cache=True)
    assert warm == cold
    assert batcher.stats().prefix_hit_tokens == 32  # 40 common tokens, resumed at chunk 32


def test_errored_requests_leave_nothing_in_the_cache():
    art = ArtifactConfig(model=ledger_spec(), batch_size=2, max_seq_len=64, block_size=16,
                         num_blocks=9, prefill_chunk_size=8)

    class Failing(LedgerRuntime):
        def decode(self, inputs):
            if 77 in inputs.input_ids:
                raise RuntimeError("lane fault")
            return super().decode(inputs)

    batcher = Batcher(Failing(art), prefix_cache=True)
    prompt = next(p for p in ([t] + [5] * 19 for t in range(1, 97))
                  if reference(p, 1, 97)[0] == 77)
    [failed] = batcher.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert failed.finish_reason == "error"
    assert len(batcher.scheduler.prefix) == 0 and batcher.scheduler.pool.num_cached == 0


def test_prefix_index_digest_chain_and_longest_partial():
    index = PrefixIndex(block_size=4)
    tokens = np.arange(10, dtype=np.int64)
    a = index.insert(0, b"", tokens[:4])
    b = index.insert(1, a.digest, tokens[4:8])
    index.insert(2, b.digest, tokens[8:10])
    assert index.insert(5, b"", tokens[:4]) is None  # identical content is not cached twice
    match = index.lookup(np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 99], dtype=np.int64))
    assert [e.block for e in match.entries] == [0, 1, 2] and match.tokens == 9
    other = index.lookup(np.array([0, 1, 2, 9], dtype=np.int64))
    assert [e.block for e in other.entries] == [0] and other.tokens == 3
    index.remove(1)
    assert index.lookup(tokens).tokens == 4


def test_caches_need_a_host_budget_for_hybrid_and_are_rejected_for_single_block():
    hybrid = ArtifactConfig(model=ledger_spec(hybrid=True), batch_size=2, max_seq_len=64,
                            block_size=64, num_blocks=3, prefill_chunk_size=8)
    with pytest.raises(ConfigError, match="keeps sliding-slot checkpoints in the host cache"):
        Batcher(LedgerRuntime(hybrid), prefix_cache=True)
    single = ArtifactConfig(model=ledger_spec(), batch_size=1, max_seq_len=64, block_size=64,
                            num_blocks=1, prefill_chunk_size=8)
    with pytest.raises(ConfigError, match="single-block mode"):
        Batcher(LedgerRuntime(single), prefix_cache=True)
    with pytest.raises(ConfigError, match="needs prefix_cache=True"):
        Batcher(LedgerRuntime(single), host_cache_bytes=10)


@pytest.mark.parametrize("layout", [dict(num_blocks=5), dict(block_size=16, chunk=8)])
def test_staged_requests_start_from_the_cached_prefix_too(layout, caplog):
    """Under load (every lane decoding) the next request is prefilled into the spare; with a
    prefix hit it copies/shares the cached prefix instead of recomputing it."""
    art = artifact(batch_size=2, **layout)
    system = rng_prompts(1, 40, seed=12)[0]
    prompts = [system + tail for tail in rng_prompts(6, 12, seed=13)]
    cold, cold_rt, cold_b = run(art, prompts, prefix_cache=False, one_by_one=False)
    rt = NumpyRuntime.random(art, seed=4)
    batcher = Batcher(rt, prefix_cache=True)
    assert batcher.generate(prompts[:1], GREEDY)[0].token_ids == cold[0]
    ids = [batcher.submit(p, GREEDY) for p in prompts[1:]]
    finals = {}
    with caplog.at_level(logging.INFO, logger="atombatch"):
        while batcher.has_unfinished():
            for out in batcher.step():
                if out.finished:
                    finals[out.request_id] = out.completion.token_ids
            batcher.check_invariants()
    assert [finals[i] for i in ids] == cold[1:]
    stats = batcher.stats()
    assert stats.staged_chunks > 0 and stats.rotations > 0
    events = [json.loads(r.getMessage()) for r in caplog.records]
    staged_hits = [e for e in events if e["event"] == "prefix.hit" and e["lane"] == -1]
    assert staged_hits and all(e["tokens"] >= 32 for e in staged_hits)
    assert rt.prefill_calls < cold_rt.prefill_calls


def test_staged_request_restores_its_prefix_from_the_host_cache(caplog):
    art = artifact(batch_size=2, block_size=16, chunk=8, num_blocks=2 * 8 + 1)
    system = rng_prompts(1, 40, seed=20)[0]
    first, later = (system + tail for tail in rng_prompts(2, 10, seed=21))
    flood = rng_prompts(4, 60, seed=22)   # distinct prompts that push the system prompt out
    busy = rng_prompts(2, 20, seed=23)    # two long runs that keep both lanes decoding
    long_run = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    rt = NumpyRuntime.random(art, seed=4)
    batcher = Batcher(rt, prefix_cache=True, host_cache_bytes=1 << 22)
    want = run(art, [later], prefix_cache=False)[0][0]
    batcher.generate([first], GREEDY)
    batcher.generate(flood, GREEDY)
    assert batcher.stats().evictions > 0 and len(batcher.host_cache) > 0
    for prompt in busy:
        batcher.submit(prompt, long_run)
    while batcher.stats().decoding_lanes < 2:
        batcher.step()
    rid = batcher.submit(later, GREEDY)
    with caplog.at_level(logging.INFO, logger="atombatch"):
        finals = run_to_end(batcher)
    assert finals[rid].completion.token_ids == want
    hits = [json.loads(r.getMessage()) for r in caplog.records]
    staged = [e for e in hits if e["event"] == "prefix.hit" and e["lane"] == -1]
    assert staged and staged[0]["restored"] > 0 and staged[0]["tokens"] == 40


def test_host_lookup_never_continues_from_a_partly_matched_block():
    """Regression: a cached full block that matches only the first tokens of a prompt must not
    count as matched; the host continuation starts after wholly matched blocks only."""
    from atombatch.kernel.prefix import HostCache

    index, host = PrefixIndex(block_size=4), HostCache(1 << 20, block_size=4)
    index.insert(0, b"", np.array([1, 1, 4, 16], dtype=np.int64))
    prompt = np.array([1, 1, 1, 1, 1, 1], dtype=np.int64)
    chain = index.chain(prompt)
    match = index.match(chain, len(prompt))
    assert match.tokens == 2
    assert host.extend(chain, len(prompt), match) == [] and match.tokens == 2
    evicted = PrefixIndex(4, seed=index.hasher.seed)  # the same digests, another index
    entry = evicted.insert(9, b"", np.array([1, 1, 1, 1], dtype=np.int64))
    host.put(entry, np.zeros(8))
    assert [e.block for e in host.extend(chain, len(prompt), match)] == [-1] and match.tokens == 4

"""Chunk sizes that do not divide the block size (and block sizes that do not divide the chunk),
with prefix and host caches, oversubscription, preemption and every policy, give the cache-free
reference tokens (the exact ledger runtime); the config accepts such chunks and refuses what
cannot be laid out."""

from __future__ import annotations

import random

import pytest
from support.ledger import LedgerRuntime, ledger_spec, reference

from atombatch import ArtifactConfig, Batcher, ConfigError, SamplingParams


# -- chunk / block combinations through the whole engine (exact ledger runtime) --------------------
def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _ledger_case(seed):
    rng = random.Random(seed)
    msl = rng.choice([24, 32, 48])
    bs = rng.choice([d for d in _divisors(msl) if d >= 2])
    chunk = rng.choice(_divisors(msl))
    batch = rng.randint(1, 3)
    hybrid = rng.random() < 0.25
    window = rng.randint(1, 12)
    spec = ledger_spec(hybrid=hybrid, window=window)
    bps = msl // bs
    choices = [batch * bps + 1]
    if bs < msl and bps + 1 <= batch * bps:
        choices.append(rng.randint(bps + 1, batch * bps))  # oversubscribed: preemption
    if batch == 1 and not hybrid:
        choices.append(bps)                                 # single-block mode
    art = ArtifactConfig(model=spec, batch_size=batch, max_seq_len=msl, block_size=bs,
                         num_blocks=rng.choice(choices), prefill_chunk_size=chunk)
    prefix = not hybrid and not art.single_block and rng.random() < 0.6
    host = bs * 8 * rng.randint(1, 4) if prefix and rng.random() < 0.5 else 0
    policy = rng.choice(["prefill-first", "decode-first", "interleave:2", "fill-first:1"])
    return rng, art, spec, window if hybrid else 0, prefix, host, policy


@pytest.mark.parametrize("seed", range(40))
def test_any_chunk_block_combination_gives_reference_tokens(seed):
    rng, art, spec, window, prefix, host, policy = _ledger_case(seed)
    batcher = Batcher(LedgerRuntime(art), prefix_cache=prefix, host_cache_bytes=host,
                      policy=policy)
    msl = art.max_seq_len
    base = [rng.randint(1, 3) for _ in range(msl)]   # small alphabet: long shared prefixes
    work = []
    for _ in range(rng.randint(2, 7)):
        length = rng.randint(1, msl - 1)
        keep = rng.randint(0, length)
        work.append((base[:keep] + [rng.randint(1, 3) for _ in range(length - keep)],
                     rng.randint(1, msl - length)))
    finals, ids = {}, {}
    while work or batcher.has_unfinished():
        if work and (rng.random() < 0.5 or not batcher.has_unfinished()):
            prompt, max_tokens = work.pop(0)
            ids[batcher.submit(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                      ignore_eos=True))] = (prompt, max_tokens)
        for out in batcher.step():
            if out.finished:
                finals[out.request_id] = out
        batcher.check_invariants()
    for request_id, (prompt, max_tokens) in ids.items():
        out = finals[request_id]
        assert out.finish_reason == "length", out.error
        assert list(out.completion.token_ids) == reference(prompt, max_tokens, spec.vocab_size,
                                                           window)


def test_config_accepts_chunks_that_do_not_divide_the_block_and_rejects_non_divisors():
    spec = ledger_spec()
    ArtifactConfig(model=spec, batch_size=2, max_seq_len=96, block_size=48, num_blocks=5,
                   prefill_chunk_size=32)
    ArtifactConfig(model=spec, batch_size=2, max_seq_len=96, block_size=32, num_blocks=7,
                   prefill_chunk_size=48)
    with pytest.raises(ConfigError, match="prefill_chunk_size=40"):
        ArtifactConfig(model=spec, batch_size=2, max_seq_len=96, block_size=48, num_blocks=5,
                       prefill_chunk_size=40)
    with pytest.raises(ConfigError, match="int16"):
        ArtifactConfig(model=spec, batch_size=1, max_seq_len=32768 * 2, block_size=2,
                       num_blocks=32768, prefill_chunk_size=16)

"""Speculative decoding through the emulated ATOM (`tests/fakerebel/`): an optimum-rbln
directory compiled with `logits_to_keep=0` verifies drafts in its prefill graph, each verify call
starting at a chunk boundary (eager and flash attention, whose chunks must stay inside one KV
partition); greedy tokens equal decoding without speculation token for token. A directory
compiled with `logits_to_keep=1` is refused naming the rule."""

from __future__ import annotations

import numpy as np
import pytest
from fakerebel.compiler import compile_dir
from support.hf_models import save_checkpoint
from support.speculative import OracleDrafts, chi_square_limit, repeating_prompts, sampled_experiment

from atombatch import Batcher, ConfigError, SamplingParams
from atombatch.api.speculative import SpeculativeConfig
from atombatch.runtime import RebelRuntime
from atombatch.sampling import ngram

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=("llama", "qwen3"))
def checkpoint(request, tmp_path_factory):
    return save_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize(("batch_size", "block_size"), [(1, None), (2, 32)])
def test_greedy_identical_through_the_emulated_device(fake_rebel, tmp_path, checkpoint,
                                                      monkeypatch, batch_size, block_size):
    directory = compile_dir(tmp_path / "compiled", checkpoint, batch_size=batch_size,
                            max_seq_len=128, prefill_chunk_size=16,
                            kvcache_block_size=block_size,
                            kvcache_num_blocks=batch_size * (128 // (block_size or 128)) + 1,
                            logits_to_keep=0)
    prompts = repeating_prompts(np.random.default_rng(7))
    reference = Batcher(RebelRuntime.from_optimum(directory)).generate(prompts, GREEDY)
    tokens = [list(c.token_ids) for c in reference]
    oracle = OracleDrafts(prompts, tokens, miss_rate=0.25, seed=7)
    monkeypatch.setattr(ngram, "propose", oracle.propose)
    batcher = Batcher(RebelRuntime.from_optimum(directory), speculative=SpeculativeConfig(
        num_speculative_tokens=5, auto_off=False))
    done = batcher.generate(prompts, GREEDY)
    assert [list(c.token_ids) for c in done] == tokens
    stats = batcher.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    batcher.check_invariants()


def test_logits_to_keep_1_refused(fake_rebel, tmp_path, checkpoint):
    directory = compile_dir(tmp_path / "compiled", checkpoint, batch_size=1, max_seq_len=128,
                            prefill_chunk_size=16, kvcache_num_blocks=2, logits_to_keep=1)
    with pytest.raises(ConfigError, match="logits_to_keep=0"):
        Batcher(RebelRuntime.from_optimum(directory),
                speculative=SpeculativeConfig(num_speculative_tokens=3))


def test_sampled_distribution_through_the_emulated_device(fake_rebel, tmp_path, monkeypatch):
    """vLLM's rejection rule on the device's every-position logits: the first three sampled
    tokens' joint counts with and without speculation pass a two-sample chi-square test."""
    checkpoint = save_checkpoint("qwen3", tmp_path / "ckpt")
    directory = compile_dir(tmp_path / "compiled", checkpoint, batch_size=1, max_seq_len=128,
                            prefill_chunk_size=16, kvcache_num_blocks=2, logits_to_keep=0)
    prompt = np.random.default_rng(8).integers(3, 512, size=12).tolist()
    n = 1000
    stat, df, stats = sampled_experiment(lambda: RebelRuntime.from_optimum(directory), prompt,
                                         n, monkeypatch)
    assert 0.2 * n < stats.spec_decode_num_accepted_tokens < 1.8 * n
    assert df >= 3
    assert stat < chi_square_limit(df), (stat, df)

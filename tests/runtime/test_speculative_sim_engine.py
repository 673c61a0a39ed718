"""Speculative decoding on the calibrated simulator (virtual time from the ATOM cost model):
the auto-off rule's cost measured in the runtime's own clock. Drafts that always hit cut a
B1 run's device time several-fold; drafts that always miss cost no more than the stated margin
(docs/speculative.md: `(ratio - 1) / PROBE_EVERY` plus the first probe); tokens are the same
in every case. Virtual time is the cost model's, so these figures are exact, not timings."""

from __future__ import annotations

import pytest
from support.speculative import OracleDrafts

from atombatch import ArtifactConfig, Batcher, ModelSpec, SamplingParams
from atombatch.api.speculative import SpeculativeConfig
from atombatch.engine import speculative as engine_speculative
from atombatch.runtime import SimRuntime
from atombatch.sampling import ngram

PARAMS = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


def art():
    return ArtifactConfig(model=ModelSpec.preset("qwen3-0.6b"), batch_size=1, max_seq_len=1024,
                          block_size=1024, prefill_chunk_size=128, num_blocks=2)


def timed(batcher: Batcher, runtime: SimRuntime, prompts: list[list[int]]):
    start = runtime.clock()
    done = batcher.generate(prompts, PARAMS)
    return [list(c.token_ids) for c in done], runtime.clock() - start


@pytest.mark.parametrize("miss_rate", [0.0, 0.3, 1.0])
def test_speculation_pays_or_stays_within_its_margin(monkeypatch, miss_rate):
    prompts = [list(range(3, 200))]
    runtime = SimRuntime(art())
    reference, plain_s = timed(Batcher(runtime), runtime, prompts)
    monkeypatch.setattr(ngram, "propose", OracleDrafts(prompts, reference, miss_rate,
                                                       seed=1).propose)
    runtime = SimRuntime(art())
    batcher = Batcher(runtime, speculative=SpeculativeConfig(num_speculative_tokens=4))
    tokens, spec_s = timed(batcher, runtime, prompts)
    assert tokens == reference
    stats = batcher.stats()
    if miss_rate == 0.0:
        assert spec_s < plain_s / 3      # up to 5 tokens per verify call at ~1.1-1.6 steps each
    elif miss_rate == 1.0:
        assert stats.spec_decode_num_accepted_tokens == 0
        # the verify/decode cost ratio as the engine measured it in virtual time (the cost
        # model's own: ~1.14 for a 128-token chunk of this model at B1)
        ratio = batcher._speculator.cost_ratio()
        assert 1.0 < ratio < 1.6
        steps = PARAMS.max_tokens
        assert stats.spec_decode_num_drafts <= 1 + steps // engine_speculative.PROBE_EVERY
        # the stated margin at the ratio's bound (a chunk's cost grows with its position, so
        # one probe may cost a little more than the measured average)
        bound = 1.6
        margin = (bound - 1) / engine_speculative.PROBE_EVERY + (bound - 1) / steps
        assert spec_s <= plain_s * (1 + margin)
    else:
        assert spec_s < plain_s

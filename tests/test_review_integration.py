"""Where merged features meet: PD × the sampler, AsyncBatcher × n > 1, stop strings × max_tokens.

Each test drives real computation (the NumPy runtime, the engine's detokenizer on a real
`tokenizers` tokenizer) and compares against the same request run the plain way.
"""

from __future__ import annotations

from driving import run_to_end
from test_pd import SEED, SPECS, artifact, producer_for, prompts

from atombatch import Batcher, SamplingParams
from atombatch.pd import InProcessSource
from atombatch.runtime import NumpyRuntime


def test_pd_seeded_sampling_matches_the_colocated_run() -> None:
    """A seeded request gives the same tokens whether its prefill ran on a PD producer or on the
    decoder: the producer drew the first token's uniform from `default_rng(seed)`, so the decoder
    must continue that stream, not draw the first uniform again for the second token."""
    spec = SPECS["llama"]
    producer = producer_for(spec)
    art = artifact(spec, 4, 5)
    work = prompts(3, seed=11)
    params = [SamplingParams(temperature=1.5, top_k=40, seed=100 + i, max_tokens=12,
                             ignore_eos=True) for i in range(len(work))]
    colocated = Batcher(NumpyRuntime.random(art, SEED)).generate(work, params)
    batcher = Batcher(NumpyRuntime.random(art, SEED))
    ids = [batcher.submit(p, sp, kv=InProcessSource.from_producer(producer, f"pd-{i}", p, sp))
           for i, (p, sp) in enumerate(zip(work, params, strict=True))]
    finals = run_to_end(batcher)
    assert batcher.runtime.prefill_calls == 0  # every first token came from the producer
    for rid, want in zip(ids, colocated, strict=True):
        got = finals[rid].completion
        assert got.token_ids[0] == want.token_ids[0]  # same first-token sampler and seed
        assert got.token_ids == want.token_ids

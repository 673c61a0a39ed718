"""The tiny models and helpers of the PD tests: specs of every family, artifacts, producers,
prompts and the native reference."""

from __future__ import annotations

import numpy as np

from atombatch import ArtifactConfig, Batcher, ModelSpec, SamplingParams
from atombatch.pd import (
    Producer,
)
from atombatch.runtime import NumpyRuntime
from support.driving import run_to_end

TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
            head_dim=8)


SPECS = {
    "llama": ModelSpec(name="pd-llama", family="llama", num_layers=2, **TINY),
    "qwen3": ModelSpec(name="pd-qwen3", family="qwen3", num_layers=2, tie_word_embeddings=True,
                       **TINY),
    "gemma3": ModelSpec(name="pd-gemma3", family="gemma3", num_layers=4, sliding_window=8,
                        layer_types=("sliding_attention", "full_attention") * 2,
                        query_pre_attn_scalar=8.0, tie_word_embeddings=True, **TINY),
}


PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


SEED = 7


def artifact(spec, batch_size, num_blocks, block_size=96, chunk=16, max_seq_len=96):
    return ArtifactConfig(model=spec, batch_size=batch_size, max_seq_len=max_seq_len,
                          block_size=block_size, num_blocks=num_blocks, prefill_chunk_size=chunk)


def producer_for(spec):
    # a different layout than any decoder below: partitioned, batch 2, chunk 32
    return Producer(NumpyRuntime.random(artifact(spec, 2, 7, block_size=32, chunk=32), SEED))


def prompts(n=4, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, size=int(rng.integers(12, 60))).tolist() for _ in range(n)]


def native(spec, work, art):
    return [c.token_ids for c in Batcher(NumpyRuntime.random(art, SEED)).generate(work, PARAMS)]


def run_pd(batcher, work, make_source, native_extra=()):
    ids = [batcher.submit(p, PARAMS, kv=make_source(f"pd-{i}", p)) for i, p in enumerate(work)]
    extra = [batcher.submit(p, PARAMS) for p in native_extra]
    finals = run_to_end(batcher)
    return [finals[i] for i in ids], [finals[i] for i in extra]


def decoder_layouts(spec):
    layouts = {"B4/k5": artifact(spec, 4, 5)}
    if spec.is_hybrid:
        layouts["B1/k2"] = artifact(spec, 1, 2)
    else:
        layouts["B1/k1 single-block"] = artifact(spec, 1, 1)
    return layouts


PRODUCER_LAYOUT = dict(batch_size=2, max_seq_len=96, block_size=32, num_blocks=7,
                       prefill_chunk_size=32)   # producer_for's layout, for producer processes


def pd_decoder(family: str = "llama", batch_size: int = 4, num_blocks: int = 5,
               **options: object) -> Batcher:
    """A decoder an engine core can build (module-level: it pickles): the family's tiny spec
    with the weights every producer of these tests has."""
    return Batcher(NumpyRuntime.random(artifact(SPECS[family], batch_size, num_blocks), SEED),
                   **options)  # type: ignore[arg-type]

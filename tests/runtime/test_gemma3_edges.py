"""Gemma3's greedy output equals transformers' at prompts exactly at and around the sliding
window, with chunk == window, an oversubscribed pool and chunk > window, up to the last position
of the context."""

from __future__ import annotations

import numpy as np
import pytest
from support.driving import run_to_end
from support.numerics import greedy_reference

from atombatch import ArtifactConfig, Batcher, SamplingParams

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run

# -- Gemma3 parity with transformers at the sliding-window and context boundaries ------------------
@pytest.fixture(scope="module")
def gemma3_case(tmp_path_factory):
    pytest.importorskip("transformers")
    from support.hf_models import SLIDING_WINDOW, build_model, hf_logits, save_checkpoint

    from atombatch import ModelSpec

    path = save_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3-review"))
    model = build_model("gemma3")
    msl = 48
    rng = np.random.default_rng(5)
    cases = []
    for length in (1, SLIDING_WINDOW - 1, SLIDING_WINDOW, SLIDING_WINDOW + 1, 2 * SLIDING_WINDOW,
                   msl - 1):
        prompt = rng.integers(3, 512, size=length).tolist()
        # up to the last position of the context; near ties decided as in support/numerics.py
        cases.append((prompt, greedy_reference(model, prompt, msl - length,
                                               lambda m, seq: hf_logits(m, seq)[-1])))
    return path, ModelSpec.from_pretrained(path), msl, cases


@pytest.mark.parametrize("layout", [dict(chunk=16, block_size=48, num_blocks=3),
                                    dict(chunk=16, block_size=16, num_blocks=4),
                                    dict(chunk=48, block_size=16, num_blocks=7)],
                         ids=["chunk==window", "oversubscribed", "chunk>window"])
def test_gemma3_matches_transformers_at_window_and_context_edges(gemma3_case, layout):
    from atombatch.runtime import NumpyRuntime

    path, spec, msl, cases = gemma3_case
    art = ArtifactConfig(model=spec, batch_size=2, max_seq_len=msl,
                         block_size=layout["block_size"], num_blocks=layout["num_blocks"],
                         prefill_chunk_size=layout["chunk"])
    batcher = Batcher(NumpyRuntime.from_pretrained(path, artifact=art))
    done = [batcher.submit(prompt, SamplingParams(temperature=0.0, max_tokens=len(want), ignore_eos=True))
            for prompt, want in cases]
    finals = run_to_end(batcher)
    for request_id, (_, want) in zip(done, cases, strict=True):
        assert list(finals[request_id].completion.token_ids) == want

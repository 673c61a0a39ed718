"""Greedy parity through the Batcher on real decoder math, against independent references.

For Llama (llama3 RoPE scaling), Qwen3 (tied embeddings) and Gemma3 (hybrid, window 16 < prompts),
the tokens the Batcher generates through the device tables must equal:
  - Hugging Face transformers' greedy tokens (full forward per token, no cache at all),
  - the NumPy runtime's own full recompute without a cache,
  - each prompt alone at B1,
whatever the batch, arrival pattern, aborts of other requests, lane reuse, prefill chunk size,
eager or partitioned layout, or an oversubscribed pool that preempts.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.hf_models import FAMILIES, build_model, hf_logits, save_checkpoint
from support.numerics import greedy_reference

from atombatch import ArtifactConfig, Batcher, ModelSpec, SamplingParams
from atombatch.runtime import NumpyRuntime

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run

NEW_TOKENS = 10
PROMPT_LENS = (5, 17, 33, 47)  # cross 16-token blocks and Gemma3's 16-token window


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request, tmp_path_factory):
    family = request.param
    path = save_checkpoint(family, tmp_path_factory.mktemp(family))
    model = build_model(family)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in PROMPT_LENS]
    # transformers, full forward per token, no KV cache; each reference knows where a near tie
    # would let another float32 evaluation pick otherwise (support/numerics.py GreedyTokens)
    references = [greedy_reference(model, prompt, NEW_TOKENS, lambda m, s: hf_logits(m, s)[-1])
                  for prompt in prompts]
    return family, path, ModelSpec.from_pretrained(path), prompts, references


def runtime(path, spec, batch_size, block_size=128, num_blocks=None, chunk=16, max_seq_len=128,
            buckets=()):
    bps = max_seq_len // block_size
    if num_blocks is None:
        num_blocks = batch_size * bps + 1
    art = ArtifactConfig(model=spec, batch_size=batch_size, max_seq_len=max_seq_len,
                         block_size=block_size, num_blocks=num_blocks, prefill_chunk_size=chunk,
                         decoder_batch_sizes=buckets)
    return NumpyRuntime.from_pretrained(path, artifact=art)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_numpy_full_recompute_matches_transformers(family_case):
    _, path, spec, prompts, references = family_case
    rt = runtime(path, spec, 1, num_blocks=2)
    for prompt, want in zip(prompts, references, strict=True):
        seq = list(prompt)
        for _ in range(NEW_TOKENS):
            seq.append(int(np.argmax(rt.reference_logits(seq)[-1])))
        assert seq[len(prompt):] == want


def test_each_prompt_alone_at_b1(family_case):
    family, path, spec, prompts, references = family_case
    # single-block (k1, cache off) for the non-hybrid families; hybrid needs lanes + 1
    rt = runtime(path, spec, 1, num_blocks=2 if spec.is_hybrid else 1)
    batcher = Batcher(rt)
    for prompt, want in zip(prompts, references, strict=True):
        [completion] = batcher.generate([prompt], GREEDY)
        assert list(completion.token_ids) == want
        batcher.check_invariants()


LAYOUTS = {
    "eager-B4-k5-chunk16": dict(batch_size=4),
    "eager-B4-k5-chunk32": dict(batch_size=4, chunk=32),
    "partitioned-B4-bs16-chunk8": dict(batch_size=4, block_size=16, chunk=8),
    "partitioned-B3-bs32-chunk16": dict(batch_size=3, block_size=32),
    "oversubscribed-B4-bs16-k10": dict(batch_size=4, block_size=16, num_blocks=10),
    "eager-B2-k3-chunk64": dict(batch_size=2, chunk=64),
    # decode buckets: rows packed into the smallest compiled batch, padding rows on idle slots
    "eager-B4-k5-dbs1,2,4": dict(batch_size=4, buckets=(1, 2, 4)),
    "partitioned-B4-bs16-dbs1,3,4": dict(batch_size=4, block_size=16, chunk=32, buckets=(1, 3, 4)),
    "oversubscribed-B4-bs16-k10-dbs2,4": dict(batch_size=4, block_size=16, num_blocks=10,
                                             buckets=(2, 4)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batched_staggered_with_aborts_and_lane_reuse(family_case, layout):
    _, path, spec, prompts, references = family_case
    batcher = Batcher(runtime(path, spec, **LAYOUTS[layout]))
    rng = np.random.default_rng(5)
    # arrivals: the parity prompts, interleaved with doomed requests aborted mid-flight
    schedule = {0: [0], 1: [1], 4: [2], 9: [3]}
    doomed = {0: 2, 3: 5, 7: 12}  # submit step -> abort after this many more steps
    ids: dict[str, int] = {}
    aborts: dict[int, list[str]] = {}
    finals = {}
    step = 0
    while step < 3 or batcher.has_unfinished():
        for index in schedule.get(step, []):
            ids[batcher.submit(prompts[index], GREEDY)] = index
        if step in doomed:
            noise = rng.integers(3, 512, size=int(rng.integers(4, 40))).tolist()
            rid = batcher.submit(noise, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            aborts.setdefault(step + doomed[step], []).append(rid)
        for rid in aborts.get(step, []):
            batcher.abort(rid)
        for out in batcher.step():
            if out.finished:
                finals[out.request_id] = out
        batcher.check_invariants()
        step += 1
    for rid, index in ids.items():
        assert finals[rid].finish_reason == "length"
        assert list(finals[rid].completion.token_ids) == references[index], (layout, index)
    assert sum(1 for out in finals.values() if out.finish_reason == "abort") == len(doomed)
    stats = batcher.stats()
    if "oversubscribed" not in layout:
        assert max(i for i, n in enumerate(stats.lane_histogram) if n) >= 2
    buckets = LAYOUTS[layout].get("buckets", (LAYOUTS[layout]["batch_size"],))
    assert set(stats.bucket_steps) <= set(buckets)
    if len(buckets) > 1:  # the smaller compiled batches ran, and padding rows were needed too
        assert min(stats.bucket_steps) < buckets[-1]
        assert batcher.runtime.decode_rows == sum(b * n for b, n in stats.bucket_steps.items())
        assert batcher.runtime.decode_rows < stats.decode_steps * buckets[-1]


def test_stop_at_eos_and_generate_through_it_with_ignore_eos(family_case):
    _, path, spec, prompts, references = family_case
    rt = runtime(path, spec, 2)
    stop_token = references[1][3]
    first_hit = references[1].index(stop_token)
    stopping = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=(stop_token,))
    through = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=(stop_token,),
                             ignore_eos=True)
    # ignore_eos concerns the model's EOS ids; give this spec our token as its EOS to test both
    eos_spec = spec.__class__(**{**{f: getattr(spec, f) for f in spec.__struct_fields__},
                                 "eos_token_ids": (stop_token,)})
    eos_rt = NumpyRuntime.from_pretrained(path, artifact=ArtifactConfig(
        model=eos_spec, batch_size=2, max_seq_len=128, block_size=128, num_blocks=3,
        prefill_chunk_size=16))
    stop_done, eos_done = Batcher(rt).generate([prompts[1]], stopping)[0], \
        Batcher(eos_rt).generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))[0]
    assert list(stop_done.token_ids) == references[1][: first_hit + 1]
    assert stop_done.finish_reason == "stop"
    assert eos_done.token_ids == stop_done.token_ids and eos_done.finish_reason == "stop"
    past = Batcher(eos_rt).generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                                 ignore_eos=True))[0]
    assert list(past.token_ids) == references[1] and past.finish_reason == "length"
    explicit = Batcher(rt).generate([prompts[1]], through)[0]
    assert explicit.finish_reason == "stop"


def test_repeating_a_run_gives_the_same_tokens(family_case):
    _, path, spec, prompts, _ = family_case
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_k=50, top_p=0.9, seed=3)
    first = Batcher(runtime(path, spec, 4)).generate(prompts, params)
    second = Batcher(runtime(path, spec, 4)).generate(prompts, params)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    alone = Batcher(runtime(path, spec, 1, num_blocks=2)).generate(prompts[2:3], params)
    assert alone[0].token_ids == first[2].token_ids  # seeded sampling is batch-independent


class Recording(NumpyRuntime):
    """The NumPy runtime, keeping every decode step's logits."""

    def decode(self, inputs):
        logits = super().decode(inputs)
        self.seen.append(logits.copy())
        return logits


def test_corrupting_an_idle_lanes_padding_row_changes_a_live_request(family_case, monkeypatch):
    """Padding rows matter: point idle lanes at a live block and the live output changes,
    because the runtime writes K/V for idle lanes too (at position 0, over the live token 0)."""
    _, path, spec, prompts, _ = family_case

    def run(corrupt: bool):
        rt = runtime(path, spec, 2)
        rt.__class__ = Recording
        rt.seen = []
        batcher = Batcher(rt)
        scheduler = batcher.scheduler
        if corrupt:
            def live_block_as_padding():
                busy = [lane for lane in range(2) if scheduler.lanes.num_held(lane)]
                return scheduler.lanes.blocks(busy[0])[0]

            monkeypatch.setattr(scheduler.kv, "padding_block", live_block_as_padding)
        [completion] = batcher.generate([prompts[0]], GREEDY)
        return completion.token_ids, np.stack([logits[0] for logits in rt.seen])

    clean_tokens, clean = run(False)
    bad_tokens, bad = run(True)
    assert np.abs(clean - bad).max() > 1e-2
    run_again_tokens, again = run(False)
    assert np.array_equal(clean, again) and run_again_tokens == clean_tokens

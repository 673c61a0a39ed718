"""`prompt_logprobs` against transformers: the log-softmax of its full-prompt logits.

For Llama, Qwen3 and Gemma3 (tiny random checkpoints), prompts longer than the prefill chunk (so
the logprobs come from several chunks), B4 lanes where only some requests ask, the emulated rebel
with a `logits_to_keep=0` directory, with a prefix cache (the cached positions have no logits:
such a request prefills everything), n > 1, and over HTTP (completions and chat, vLLM's shape).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from fakerebel.compiler import compile_dir
from support.hf_models import FAMILIES, build_model, hf_logits, save_checkpoint
from support.numerics import f32_logprob_atol

from atombatch import (
    ArtifactConfig,
    Batcher,
    ConfigError,
    ModelSpec,
    RequestError,
    SamplingParams,
)
from atombatch.runtime import NumpyRuntime, RebelRuntime, SimRuntime
from atombatch.sampling.sampler import PromptLogprobs

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run

PROMPT_LENS = (37, 5, 21, 2)   # chunk 8: 5, 1, 3 and 1 chunks
TOL = 2e-4


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory):
    family = request.param
    path = save_checkpoint(family, tmp_path_factory.mktemp(family))
    model = build_model(family)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in PROMPT_LENS]
    refs = []
    for prompt in prompts:
        logits = hf_logits(model, prompt).astype(np.float64)
        shifted = logits - logits.max(axis=1, keepdims=True)
        refs.append(shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True)))
    return family, path, ModelSpec.from_pretrained(path), prompts, refs


def artifact(spec, batch_size=4, block_size=16, chunk=8, num_blocks=None):
    bps = 128 // block_size
    return ArtifactConfig(model=spec, batch_size=batch_size, max_seq_len=128,
                          block_size=block_size, prefill_chunk_size=chunk,
                          num_blocks=num_blocks or batch_size * bps + 1)


def check_against(entries, prompt, ref, k):
    """Every position's logprob, rank and top k agree with transformers' log-softmax."""
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        e, row = entries[i], ref[i - 1]  # the logits at i-1 predict prompt token i
        assert e.token_id == prompt[i]
        assert abs(e.logprob - row[prompt[i]]) < TOL, (i, e.logprob, row[prompt[i]])
        # rank: 1 + ids more likely; allow ids within the tolerance to go either way
        assert int((row > row[prompt[i]] + TOL).sum()) + 1 <= e.rank <= \
            int((row > row[prompt[i]] - TOL).sum()) + 1
        assert len(e.top) == k
        best = np.sort(row)[::-1][:k]
        for r, t in enumerate(e.top):
            assert t.rank == r + 1
            assert abs(t.logprob - row[t.token_id]) < TOL
            assert abs(t.logprob - best[r]) < TOL


def test_b4_lanes_where_only_some_requests_ask(case):
    family, path, spec, prompts, refs = case
    batcher = Batcher(NumpyRuntime.from_pretrained(path, artifact=artifact(spec)))
    asks = (5, None, 0, 3)
    ids = [batcher.submit(p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                            prompt_logprobs=k))
           for p, k in zip(prompts, asks, strict=True)]
    outs: dict[str, list] = {i: [] for i in ids}
    while batcher.has_unfinished():
        for out in batcher.step():
            outs[out.request_id].append(out)
        batcher.check_invariants()
    for rid, prompt, ref, k in zip(ids, prompts, refs, asks, strict=True):
        carried = [o.prompt_logprobs for o in outs[rid] if o.prompt_logprobs is not None]
        final = outs[rid][-1].completion
        if k is None:
            assert not carried and final.prompt_logprobs is None
            continue
        assert len(carried) == 1 and outs[rid][0].prompt_logprobs is carried[0]  # first output
        check_against(carried[0], prompt, ref, k)
        assert final.prompt_logprobs == carried[0]
        # the first token still comes from the last position's logits
        assert final.token_ids[0] == int(np.argmax(ref[-1]))
    assert batcher.stats().prefill_chunks == sum(-(-n // 8) for n in PROMPT_LENS)


def test_eager_layout_and_a_request_that_ends_at_its_first_token(case):
    family, path, spec, prompts, refs = case
    batcher = Batcher(NumpyRuntime.from_pretrained(
        path, artifact=artifact(spec, block_size=128, chunk=16)))
    [done] = batcher.generate([prompts[0]], SamplingParams(max_tokens=1, prompt_logprobs=2))
    check_against(done.prompt_logprobs, prompts[0], refs[0], 2)


def test_prefix_cache_is_not_read_for_prompt_logprobs(case):
    family, path, spec, prompts, refs = case
    if spec.is_hybrid:  # hybrid models run without a prefix cache: nothing to skip there
        with pytest.raises(ConfigError, match="prefix"):
            Batcher(NumpyRuntime.from_pretrained(path, artifact=artifact(spec)),
                    prefix_cache=True)
        return
    batcher = Batcher(NumpyRuntime.from_pretrained(path, artifact=artifact(spec)),
                      prefix_cache=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    batcher.generate([prompts[0]], greedy)
    chunks = batcher.stats().prefill_chunks
    [again] = batcher.generate([prompts[0]], greedy)                      # reads the cache
    assert batcher.stats().prefix_hits == 1 and batcher.stats().prefill_chunks == chunks + 1
    [lp] = batcher.generate([prompts[0]], SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=4))
    stats = batcher.stats()
    assert stats.prefix_hits == 1 and stats.prefill_chunks == chunks + 1 + 5  # all 5 chunks
    check_against(lp.prompt_logprobs, prompts[0], refs[0], 4)
    assert lp.token_ids == again.token_ids
    batcher.check_invariants()


def test_n_choices_share_choice_0s_prompt_logprobs(case):
    family, path, spec, prompts, refs = case
    batcher = Batcher(NumpyRuntime.from_pretrained(path, artifact=artifact(spec)))
    rid = batcher.submit(prompts[2], SamplingParams(n=3, seed=1, max_tokens=3,
                                                    prompt_logprobs=2))
    outs = []
    while batcher.has_unfinished():
        outs += batcher.step()
    carried = [o for o in outs if o.prompt_logprobs is not None]
    assert len(carried) == 1 and carried[0].index == 0 and carried[0].request_id == rid
    check_against(carried[0].prompt_logprobs, prompts[2], refs[2], 2)
    finals = [o.completion for o in outs if o.completion is not None]
    assert len(finals) == 3 and all(c.prompt_logprobs == carried[0].prompt_logprobs
                                    for c in finals)


def test_choice_0_aborted_before_its_first_token_hands_prompt_logprobs_over(case):
    family, path, spec, prompts, refs = case
    batcher = Batcher(NumpyRuntime.from_pretrained(path, artifact=artifact(spec)))
    rid = batcher.submit(prompts[0], SamplingParams(n=2, seed=1, max_tokens=2,
                                                    prompt_logprobs=1))
    outs = batcher.step()                # choice 0's first chunk
    assert batcher.abort(f"{rid}#0")
    while batcher.has_unfinished():
        outs += batcher.step()
        batcher.check_invariants()
    finals = {o.index: o.completion for o in outs if o.completion is not None}
    assert finals[0].finish_reason == "abort" and finals[0].prompt_logprobs is None
    assert finals[1].finish_reason == "length"
    carried = [o for o in outs if o.prompt_logprobs is not None]
    assert len(carried) == 1 and carried[0].index == 1
    check_against(finals[1].prompt_logprobs, prompts[0], refs[0], 1)


def test_emulated_rebel_with_logits_to_keep_0(fake_rebel, tmp_path, case):
    family, path, spec, prompts, refs = case
    directory = compile_dir(tmp_path / "compiled", path, batch_size=4, max_seq_len=128,
                            prefill_chunk_size=16, kvcache_num_blocks=5, logits_to_keep=0)
    batcher = Batcher(RebelRuntime.from_optimum(directory))
    done = batcher.generate(prompts[:2], [SamplingParams(max_tokens=2, prompt_logprobs=3),
                                          SamplingParams(max_tokens=2)])
    check_against(done[0].prompt_logprobs, prompts[0], refs[0], 3)
    assert done[1].prompt_logprobs is None
    batcher.check_invariants()


def test_emulated_rebel_with_logits_to_keep_1_refuses_at_submit(fake_rebel, tmp_path, case):
    family, path, spec, prompts, refs = case
    directory = compile_dir(tmp_path / "compiled", path, batch_size=4, max_seq_len=128,
                            prefill_chunk_size=16, kvcache_num_blocks=5, logits_to_keep=1)
    batcher = Batcher(RebelRuntime.from_optimum(directory))
    with pytest.raises(RequestError, match=r"prompt_logprobs=2 needs the logits of every prompt "
                                           r"position: .*logits_to_keep=1.*rbln_logits_to_keep=0"):
        batcher.submit(prompts[0], SamplingParams(prompt_logprobs=2))
    assert not batcher.has_unfinished()


def test_refusals():
    spec = ModelSpec.preset("qwen3-0.6b")
    sim = Batcher(SimRuntime(ArtifactConfig(model=spec, batch_size=2, max_seq_len=256,
                                            block_size=256, num_blocks=3,
                                            prefill_chunk_size=64)))
    with pytest.raises(RequestError, match=r"prompt_logprobs=-1 asks for the whole vocabulary "
                                           rf"\({spec.vocab_size} ids\); at most 20"):
        sim.submit([1, 2, 3], SamplingParams(prompt_logprobs=-1))
    with pytest.raises(RequestError, match="prompt_logprobs=21 must be <= 20"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(RequestError, match="prompt_logprobs=-2 must be >= -1"):
        SamplingParams(prompt_logprobs=-2)

    class NoSource:
        def poll(self): return None, []
        def done(self): return False
        def close(self): pass

    with pytest.raises(RequestError, match="a PD producer does not send"):
        sim.submit([1, 2, 3], SamplingParams(prompt_logprobs=1), kv=NoSource())
    assert not sim.has_unfinished()


def test_sim_runtime_serves_its_pseudo_logits():
    """The simulator's every-position rows are its per-position pseudo-logits: the logprob of each
    next prompt token follows from them (a different computation than the collector's)."""
    spec = ModelSpec.preset("qwen3-0.6b")
    rt = SimRuntime(ArtifactConfig(model=spec, batch_size=2, max_seq_len=256, block_size=256,
                                   num_blocks=3, prefill_chunk_size=64))
    prompt = list(range(100, 170))
    [done] = Batcher(rt).generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))
    for i in range(1, len(prompt)):
        row = rt.prompt_logits(prompt[:i]).astype(np.float64)
        lse = np.log(np.exp(row - row.max()).sum()) + row.max()
        assert abs(done.prompt_logprobs[i].logprob - (row[prompt[i]] - lse)) <= f32_logprob_atol(row)
        assert done.prompt_logprobs[i].top[0].token_id == int(np.argmax(row))


def test_collector_bounds_its_scratch_and_overwrites_a_recomputed_chunk(monkeypatch):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50, size=30)
    logits = rng.normal(size=(30, 50)).astype(np.float32)
    one = PromptLogprobs(prompt, 3)
    one.add_chunk(logits, 0)
    monkeypatch.setattr(PromptLogprobs, "ROW_BUDGET", 50 * 4)   # 4 rows at a time
    split = PromptLogprobs(prompt, 3)
    split.add_chunk(logits[:16] + 9.0, 0)                   # garbage, then recomputed
    assert not split.complete
    for start in (0, 8, 16, 24):
        split.add_chunk(logits[start:start + 8], start)
    assert split.complete and split.result() == one.result()


# -- HTTP ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, Any]]:
    from support.serving import ART, NAME, WEIGHT_SEED, ServerThread

    from atombatch.serve import create_app

    app = create_app(Batcher(NumpyRuntime.random(ART, seed=WEIGHT_SEED)), NAME)
    with ServerThread(app) as s:
        yield s, NumpyRuntime.random(ART, seed=WEIGHT_SEED)


def reference(rt, prompt):
    logits = rt.reference_logits(prompt).astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def check_json(entries, prompt, ref, k):
    assert entries[0] is None and len(entries) == len(prompt)
    for i in range(1, len(prompt)):
        position = entries[i]
        assert str(prompt[i]) in position
        mine = position[str(prompt[i])]
        assert abs(mine["logprob"] - ref[i - 1, prompt[i]]) < TOL
        assert mine["decoded_token"] == f"<{prompt[i]}>"
        top = sorted(((v["rank"], int(t), v["logprob"]) for t, v in position.items()
                      if t != str(prompt[i]) or v["rank"] <= k))
        assert [r for r, _, _ in top][:k] == list(range(1, k + 1))
        for _, token, logprob in top:
            assert abs(logprob - ref[i - 1, token]) < TOL


def test_http_completions_and_chat(served):
    server, rt = served
    prompt = list(range(40, 75))  # several prefill chunks of the server's artifact
    ref = reference(rt, prompt)
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 2, "temperature": 0,
                         "prompt_logprobs": 2, "n": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        check_json(choice["prompt_logprobs"], prompt, ref, 2)

    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 3, "temperature": 0,
                         "prompt_logprobs": 1, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    carried = [c["choices"][0]["prompt_logprobs"] for c in chunks
               if c["choices"] and c["choices"][0]["prompt_logprobs"] is not None]
    assert len(carried) == 1 and chunks[0]["choices"][0]["prompt_logprobs"] is not None
    check_json(carried[0], prompt, ref, 1)

    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 2})
    assert r.json()["choices"][0]["prompt_logprobs"] is None

    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"

    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "<40><41><42><43><44>"}],
                         "max_tokens": 2, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    entries = body["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:])


async def test_async_batcher_streams_and_keeps_them():
    from atombatch import AsyncBatcher

    spec = ModelSpec(name="tiny", family="llama", vocab_size=64, hidden_size=32,
                     intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
    art = ArtifactConfig(model=spec, batch_size=2, max_seq_len=64, block_size=64, num_blocks=3,
                         prefill_chunk_size=8)
    ref = reference(NumpyRuntime.random(art, seed=1), list(range(3, 23)))
    prompt = list(range(3, 23))
    params = SamplingParams(max_tokens=3, prompt_logprobs=2)
    async with AsyncBatcher(Batcher(NumpyRuntime.random(art, seed=1)), offload=False) as ab:
        done = await ab.generate(prompt, params)
        streamed = [out.prompt_logprobs async for out in ab.stream(prompt, params)]
        rid = ab.submit(prompt, params)          # finishes before anyone asks for its outputs
        while ab.in_flight:
            await ab.generate([5], SamplingParams(max_tokens=1))
        [kept] = [out async for out in ab.outputs(rid)]
    check_against(done.prompt_logprobs, prompt, ref, 2)
    assert streamed[0] == done.prompt_logprobs and all(s is None for s in streamed[1:])
    assert kept.prompt_logprobs == done.prompt_logprobs

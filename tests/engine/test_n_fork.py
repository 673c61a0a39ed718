"""n > 1 without a prefix cache: choices 1..n-1 start from a device copy of choice 0's prompt KV.

Every choice must equal the same prompt run alone with that choice's seed (`seed + index`), on
the NumPy runtime for Llama, Qwen3 and Gemma3 (paged blocks, eager one-block-per-lane layouts,
decode buckets) and on the emulated rebel; the prefill the copies saved is counted. Hostile cases:
choice 0 ending or aborted before the others start, a lane that frees only after choice 0 decoded
into its last prompt block, a pool too small to copy into, preemption, and a failing copy.
"""

from __future__ import annotations

import numpy as np
import pytest
from fakerebel.compiler import compile_dir
from hypothesis import given, settings
from hypothesis import strategies as st
from support.hf_models import FAMILIES, save_checkpoint

from atombatch import ArtifactConfig, Batcher, ModelSpec, SamplingParams
from atombatch.runtime import NumpyRuntime, RebelRuntime

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run

PROMPT_LEN = 37
CHUNK = 8
N = 3


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory):
    family = request.param
    path = save_checkpoint(family, tmp_path_factory.mktemp(family))
    prompt = np.random.default_rng(9).integers(3, 512, size=PROMPT_LEN).tolist()
    return family, path, ModelSpec.from_pretrained(path), prompt


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = save_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    prompt = np.random.default_rng(9).integers(3, 512, size=PROMPT_LEN).tolist()
    return "llama", path, ModelSpec.from_pretrained(path), prompt


LAYOUTS = {
    "paged-bs16": dict(block_size=16),
    "eager": dict(block_size=128),
    "paged-buckets": dict(block_size=32, decoder_batch_sizes=(1, 2, 4)),
}


def artifact(spec, batch_size=4, block_size=16, num_blocks=None, decoder_batch_sizes=()):
    bps = 128 // block_size
    return ArtifactConfig(model=spec, batch_size=batch_size, max_seq_len=128,
                          block_size=block_size, prefill_chunk_size=CHUNK,
                          num_blocks=num_blocks or batch_size * bps + 1,
                          decoder_batch_sizes=decoder_batch_sizes)


def params(seed, n=N, max_tokens=6, **extra):
    return SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=max_tokens,
                          ignore_eos=True, **extra)


def alone(path, art, prompt, seed, n=N, max_tokens=6, **extra):
    """Each choice as its own request with its own seed, on a fresh engine."""
    out = []
    for i in range(n):
        batcher = Batcher(NumpyRuntime.from_pretrained(path, artifact=art))
        [c] = batcher.generate([prompt], params(seed + i, n=1, max_tokens=max_tokens, **extra))
        out.append(c.token_ids)
    return out


def drive(batcher):
    """Step to the end, invariants after every step; completions by (request id, index)."""
    done = {}
    while batcher.has_unfinished():
        for out in batcher.step():
            if out.completion is not None:
                done[out.request_id, out.index] = out.completion
        batcher.check_invariants()
    return done


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_choice_equals_its_seed_alone_and_the_prefill_is_shared(case, layout):
    family, path, spec, prompt = case
    art = artifact(spec, **LAYOUTS[layout])
    batcher = Batcher(NumpyRuntime.from_pretrained(path, artifact=art))
    got = batcher.generate([prompt], params(seed=11))
    assert [c.token_ids for c in got] == alone(path, art, prompt, 11)
    stats = batcher.stats()
    assert stats.prefill_chunks == -(-PROMPT_LEN // CHUNK)        # choice 0's prefill only
    assert stats.prompt_forks == N - 1 and stats.fork_saved_tokens == (N - 1) * PROMPT_LEN
    assert stats.lane_blocks == 0 and stats.free_blocks + stats.spare_blocks == art.num_blocks


def test_a_choice_forks_after_choice_0_decoded_into_its_last_prompt_block(case):
    """Lanes are busy when choice 0 gets its first token: choice 2 starts only once another
    request ends, after choice 0 has written its own tokens into the partly filled last
    prompt block (the copy brings them along; choice 2 overwrites them before reading)."""
    family, path, spec, prompt = case
    art = artifact(spec, block_size=16)
    batcher = Batcher(NumpyRuntime.from_pretrained(path, artifact=art))
    other = [5, 6, 7, 8]
    batcher.submit(other, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    batcher.submit(other, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    rid = batcher.submit(prompt, params(seed=3, max_tokens=12))
    done = drive(batcher)
    assert [done[rid, i].token_ids for i in range(N)] == alone(path, art, prompt, 3,
                                                                max_tokens=12)
    assert batcher.stats().prompt_forks == N - 1 if not spec.is_hybrid else \
        batcher.stats().prompt_forks >= 1  # hybrid: forks only before choice 0's first decode
    assert done[rid, 2].timings.admitted > done[rid, 1].timings.admitted


def test_emulated_rebel_copies_on_the_device(fake_rebel, tmp_path, case):
    family, path, spec, prompt = case
    directory = compile_dir(tmp_path / "compiled", path, batch_size=4, max_seq_len=128,
                            prefill_chunk_size=CHUNK, kvcache_block_size=32,
                            kvcache_num_blocks=4 * 4 + 1)
    rt = RebelRuntime.from_optimum(directory)
    batcher = Batcher(rt)
    got = batcher.generate([prompt], params(seed=21))
    assert [c.token_ids for c in got] == alone(path, rt.artifact, prompt, 21)
    assert batcher.stats().prompt_forks == N - 1
    assert fake_rebel.KV_CALLS["_copy_kv_cache"] == (N - 1) * 2  # 37 tokens: two 32-token blocks
    if spec.is_hybrid:  # the sliding slot goes through the host, one window per sliding cache
        assert fake_rebel.KV_CALLS["_fetch_kv_cache"] == (N - 1) * 2 * len(spec.sliding_layers)
    batcher.check_invariants()


def test_choice_0_ending_at_its_first_token_lets_the_others_prefill(llama):
    _, path, spec, prompt = llama
    art = artifact(spec)
    batcher = Batcher(NumpyRuntime.from_pretrained(path, artifact=art))
    got = batcher.generate([prompt], params(seed=5, max_tokens=1))
    assert [c.token_ids for c in got] == alone(path, art, prompt, 5, max_tokens=1)
    assert batcher.stats().prompt_forks == 0
    assert batcher.stats().prefill_chunks == N * -(-PROMPT_LEN // CHUNK)


def test_choice_0_aborted_before_or_after_its_first_token(llama):
    _, path, spec, prompt = llama
    art = artifact(spec, batch_size=2)
    want = alone(path, art, prompt, 7)
    # aborted during its prefill: both others prefill on their own
    batcher = Batcher(NumpyRuntime.from_pretrained(path, artifact=art))
    rid = batcher.submit(prompt, params(seed=7))
    batcher.step()
    assert batcher.abort(f"{rid}#0")
    done = drive(batcher)
    assert done[rid, 0].finish_reason == "abort"
    assert [done[rid, i].token_ids for i in (1, 2)] == want[1:]
    assert batcher.stats().prompt_forks == 0
    # aborted after its first token, with choice 2 still waiting for a lane (B2): choice 1
    # forked, choice 2 prefills on its own
    batcher = Batcher(NumpyRuntime.from_pretrained(path, artifact=art))
    rid = batcher.submit(prompt, params(seed=7))
    while batcher.stats().prompt_forks == 0:
        batcher.step()
    assert batcher.abort(f"{rid}#0")
    done = drive(batcher)
    assert [done[rid, i].token_ids for i in (1, 2)] == want[1:]
    assert batcher.stats().prompt_forks == 1


def test_oversubscribed_pool_waits_for_blocks_and_preempts(llama):
    """Too few blocks to copy into at once: choices wait, fork later or are preempted and
    recomputed; every choice still equals its seed alone."""
    _, path, spec, prompt = llama
    art = artifact(spec, block_size=16, num_blocks=12)   # 8 per sequence, 4 lanes
    batcher = Batcher(NumpyRuntime.from_pretrained(path, artifact=art))
    rid = batcher.submit(prompt, params(seed=13, n=4, max_tokens=40))
    done = drive(batcher)
    assert [done[rid, i].token_ids for i in range(4)] == alone(path, art, prompt, 13, n=4,
                                                                 max_tokens=40)
    stats = batcher.stats()
    assert stats.preemptions > 0 and stats.prompt_forks >= 1


class FailingCopy(NumpyRuntime):
    """copy_block fails for one destination block (as a device fault would)."""

    fail_at = 1

    def copy_block(self, src: int, dst: int) -> None:
        self.fail_at -= 1
        if self.fail_at == 0:
            raise RuntimeError("DMA fault")
        super().copy_block(src, dst)


def test_a_failing_copy_fails_that_choice_alone(llama):
    _, path, spec, prompt = llama
    art = artifact(spec)
    rt = FailingCopy.from_pretrained(path, artifact=art)
    batcher = Batcher(rt)
    rid = batcher.submit(prompt, params(seed=17))
    done = drive(batcher)
    assert done[rid, 1].finish_reason == "error"
    assert "starting from choice 0's prompt KV failed: DMA fault" in done[rid, 1].error
    want = alone(path, art, prompt, 17)
    assert [done[rid, i].token_ids for i in (0, 2)] == [want[0], want[2]]
    stats = batcher.stats()
    assert stats.lane_blocks == 0 and stats.free_blocks + stats.spare_blocks == art.num_blocks


# -- random workloads on the exact ledger runtime ------------------------------------------------
SHAPES = [dict(batch_size=2), dict(batch_size=4), dict(batch_size=3, block_size=16),
          dict(batch_size=4, block_size=8, num_blocks=9), dict(batch_size=2, block_size=16,
                                                                num_blocks=5),
          dict(batch_size=3, hybrid=True), dict(batch_size=2, hybrid=True, block_size=16,
                                                num_blocks=5),
          dict(batch_size=4, block_size=16, decoder_batch_sizes=(1, 2, 4))]


@settings(max_examples=120, deadline=None)
@given(shape=st.sampled_from(SHAPES), chunk=st.sampled_from([4, 8, 16]), data=st.data(),
       policy=st.sampled_from(["prefill-first", "decode-first", "interleave:2"]))
def test_random_workloads_of_n_choices_fork_safely(shape, chunk, data, policy):
    """Greedy n > 1 requests among single ones, with aborts of whole requests and of single
    choices at random steps: invariants after every step, every choice's tokens the reference
    (aborted ones a prefix of it), every block back at the end."""
    from support.ledger import LedgerRuntime, ledger_spec, reference

    shape = dict(shape)
    hybrid = shape.pop("hybrid", False)
    block_size = shape.pop("block_size", 64)
    buckets = shape.pop("decoder_batch_sizes", ())
    b = shape["batch_size"]
    art = ArtifactConfig(model=ledger_spec(hybrid=hybrid), batch_size=b, max_seq_len=64,
                         block_size=block_size, prefill_chunk_size=chunk,
                         num_blocks=shape.get("num_blocks", b * (64 // block_size) + 1),
                         decoder_batch_sizes=buckets)
    batcher = Batcher(LedgerRuntime(art), policy=policy)
    window = art.model.sliding_window if hybrid else 0
    arrivals: dict[int, list] = {}
    aborts: dict[int, list[str]] = {}
    for i in range(data.draw(st.integers(1, 5))):
        plen = data.draw(st.integers(1, 40))
        prompt = data.draw(st.lists(st.integers(1, 96), min_size=plen, max_size=plen))
        n = data.draw(st.integers(1, 4))
        params = SamplingParams(n=n, temperature=0.0, ignore_eos=True,
                                max_tokens=data.draw(st.integers(1, 64 - plen)))
        arrivals.setdefault(data.draw(st.integers(0, 20)), []).append((prompt, params, f"r{i}"))
        if data.draw(st.integers(0, 3)) == 0:
            victim = f"r{i}" if n == 1 or data.draw(st.booleans()) else \
                f"r{i}#{data.draw(st.integers(0, n - 1))}"
            aborts.setdefault(data.draw(st.integers(0, 60)), []).append(victim)
    streamed: dict[tuple[str, int], list[int]] = {}
    reasons: dict[tuple[str, int], str] = {}
    step = 0
    while batcher.has_unfinished() or any(s >= step for s in arrivals):
        for prompt, params, rid in arrivals.get(step, []):
            batcher.submit(prompt, params, request_id=rid)
        for rid in aborts.get(step, []):
            batcher.abort(rid)
        for out in batcher.step():
            key = (out.request_id, out.index)
            assert key not in reasons, f"{key} produced output after finishing"
            streamed.setdefault(key, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[key] = out.finish_reason
        batcher.check_invariants()
        step += 1
        assert step < 10_000
    for batch in arrivals.values():
        for prompt, params, rid in batch:
            want = reference(prompt, params.max_tokens, art.model.vocab_size, window)
            for index in range(params.n):
                got = streamed.get((rid, index), [])
                assert reasons[rid, index] in ("length", "abort")
                if reasons[rid, index] == "abort":
                    assert got == want[:len(got)]
                else:
                    assert got == want
    pool = batcher.scheduler.pool
    assert pool.num_free + pool.num_spare == art.num_blocks

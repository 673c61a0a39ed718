"""`Batcher.step_arrays()`: the decode tokens as arrays, everything else as outputs.

A mixed workload (greedy, seeded sampling, logprobs, stop ids, n > 1, an abort) runs on two engines
over the NumPy reference runtime, one driven by `step()` and one by `step_arrays()`; the token
streams rebuilt from the arrays must equal the streamed outputs and the completions, and both must
equal each request run alone on a B1 engine.
"""

from __future__ import annotations

import numpy as np
import pytest

from atombatch import ArtifactConfig, Batcher, ModelSpec, SamplingParams, StepResult
from atombatch.runtime import NumpyRuntime

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run

SPEC = ModelSpec(name="tiny-llama", family="llama", vocab_size=128, hidden_size=32,
                 intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                 eos_token_ids=(5,))


def artifact(batch_size: int, buckets: tuple[int, ...] | None = None) -> ArtifactConfig:
    return ArtifactConfig(model=SPEC, batch_size=batch_size, max_seq_len=128, block_size=16,
                          num_blocks=batch_size * 8 + 1, prefill_chunk_size=16,
                          decoder_batch_sizes=buckets)


def workload() -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(7)
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40),                       # EOS may stop it
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                       stop_token_ids=list(range(40, 60))),                    # > 16 stop ids
        SamplingParams(temperature=0.0, max_tokens=18, n=2, ignore_eos=True),
    ]
    return [(rng.integers(6, 128, size=int(rng.integers(3, 40))).tolist(), kinds[i % len(kinds)])
            for i in range(14)]


def run(batch_size: int, arrays: bool, buckets: tuple[int, ...] | None = None
        ) -> tuple[dict[tuple[str, int], list[int]], dict[tuple[str, int], tuple[int, ...]], int]:
    batcher = Batcher(NumpyRuntime.random(artifact(batch_size, buckets), seed=3))
    ids = [batcher.submit(prompt, params, request_id=str(i))
           for i, (prompt, params) in enumerate(workload())]
    victim = ids[3]
    streamed: dict[tuple[str, int], list[int]] = {}
    final: dict[tuple[str, int], tuple[int, ...]] = {}
    plain_tokens = steps = 0
    while batcher.has_unfinished():
        steps += 1
        if steps == 40:
            batcher.abort(victim)
        if arrays:
            result = batcher.step_arrays()
            assert isinstance(result, StepResult)
            outputs = result.outputs
            assert len(result.lanes) == len(result.tokens) == len(result.plain)
            for lane, token, plain in zip(result.lanes.tolist(), result.tokens.tolist(),
                                          result.plain.tolist(), strict=True):
                if plain:
                    rid = result.request_ids[lane]
                    assert rid is not None
                    streamed.setdefault((rid, 0), []).append(token)
                    plain_tokens += 1
            reported = {o.request_id for o in outputs}
            for lane, plain in zip(result.lanes.tolist(), result.plain.tolist(), strict=True):
                if plain:  # a plain row's request has nothing in `outputs` this step
                    assert result.request_ids[lane] not in reported
        else:
            outputs = batcher.step()
        for out in outputs:
            streamed.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            if out.completion is not None:
                final[(out.request_id, out.index)] = out.completion.token_ids
        batcher.check_invariants()
    assert set(final) == set(streamed)
    for key, tokens in final.items():
        assert tuple(streamed[key]) == tokens, key
    return streamed, final, plain_tokens


@pytest.mark.parametrize("buckets", [None, (1, 2, 4)])
def test_step_arrays_carry_the_same_tokens_as_step(buckets: tuple[int, ...] | None) -> None:
    by_step, final_step, _ = run(4, arrays=False, buckets=buckets)
    by_arrays, final_arrays, plain = run(4, arrays=True, buckets=buckets)
    assert plain > 100  # most tokens came through the arrays, not as outputs
    assert final_arrays == final_step
    assert by_arrays == by_step


def test_each_request_equals_itself_run_alone() -> None:
    _, together, _ = run(4, arrays=True)
    batcher = Batcher(NumpyRuntime.random(artifact(1), seed=3))
    for index, (prompt, params) in enumerate(workload()):
        if index == 3:
            continue  # aborted at a step that depends on the batch
        rid = f"solo{index}"
        batcher.submit(prompt, params, request_id=rid)
        alone: dict[int, tuple[int, ...]] = {}
        while batcher.has_unfinished():
            for out in batcher.step():
                if out.completion is not None:
                    alone[out.index] = out.completion.token_ids
        for choice, tokens in alone.items():
            assert together[(str(index), choice)] == tokens, (index, choice)

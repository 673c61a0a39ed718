"""The decode-step kernel's review helpers (tests/blocks/test_kernel_attacks.py): tiny models and
artifacts, the kernel's bindings checked against the scheduler, a driver that checks them after
every step, and the mixed workload a child process runs on either implementation."""

from __future__ import annotations

from typing import Any

import numpy as np

from atombatch import ArtifactConfig, Batcher, ModelSpec, SamplingParams
from atombatch.engine.request import RequestState
from atombatch.kernel import blocks as core
from atombatch.runtime import NumpyRuntime

TINY = dict(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8)


def spec(vocab: int = 48, hybrid: bool = False, eos: tuple[int, ...] = (3, 4)) -> ModelSpec:
    if hybrid:
        return ModelSpec(name="rk-gemma3", family="gemma3", num_layers=4, sliding_window=8,
                         layer_types=("sliding_attention", "full_attention") * 2,
                         query_pre_attn_scalar=8.0, tie_word_embeddings=True, vocab_size=vocab,
                         eos_token_ids=eos, **TINY)  # type: ignore[arg-type]
    return ModelSpec(name="rk-llama", family="llama", num_layers=2, vocab_size=vocab,
                     eos_token_ids=eos, **TINY)  # type: ignore[arg-type]


def artifact(model: ModelSpec, batch_size: int, num_blocks: int | None = None,
             block_size: int = 8, max_seq_len: int = 64,
             buckets: tuple[int, ...] | None = None) -> ArtifactConfig:
    if model.is_hybrid:
        block_size = max_seq_len
    if num_blocks is None:
        num_blocks = batch_size * (max_seq_len // block_size) + 1
    return ArtifactConfig(model=model, batch_size=batch_size, max_seq_len=max_seq_len,
                          block_size=block_size, num_blocks=num_blocks, prefill_chunk_size=8,
                          decoder_batch_sizes=buckets or ())


def check_kernel_bindings(batcher: Batcher) -> None:
    """Every decoding lane is bound to its request (id, output list, count, flags), every other
    lane is unbound, and the lane table counts its decoding lanes right."""
    scheduler = batcher.scheduler
    kernel, lanes = scheduler.kernel, scheduler.lanes
    decoding = 0
    for lane in range(lanes.batch_size):
        request = scheduler.by_lane[lane]
        if lanes.state(lane) == core.LANE_DECODING:
            decoding += 1
            assert request is not None and request.state is RequestState.DECODING
            assert kernel.ids[lane] == request.request_id, lane
            assert kernel.num_output(lane) == len(request.output), lane
            stops = set(request.params.stop_token_ids)
            if not request.params.ignore_eos:
                stops |= set(batcher.spec.eos_token_ids)
            want = request.lane_flags
            if len(list(request.params.stop_token_ids)) + (
                    0 if request.params.ignore_eos else len(batcher.spec.eos_token_ids)) > 16:
                want |= core.LANE_STOPCHECK
            assert kernel.flags(lane) == want, (lane, kernel.flags(lane), want)
        else:
            assert kernel.ids[lane] is None, (lane, kernel.ids[lane])
            assert kernel.flags(lane) == 0, lane
    assert lanes.num_decoding() == decoding


def drive(batcher: Batcher, aborts: dict[int, list[str]] | None = None,
          arrays: bool = False, until: Any = None) -> dict[tuple[str, int], Any]:
    """Run to the end (or until `until()`), checking invariants and kernel bindings after every
    step; returns the completions by (id, choice), and checks that the tokens streamed to each
    request (kept on the batcher across calls) rebuild its completion."""
    finals: dict[tuple[str, int], Any] = {}
    streamed: dict[tuple[str, int], list[int]] = batcher.__dict__.setdefault("_review_stream", {})
    step = 0
    while batcher.has_unfinished() and not (until is not None and until()):
        for rid in (aborts or {}).get(step, ()):
            batcher.abort(rid)
        if arrays:
            result = batcher.step_arrays()
            outputs = result.outputs
            for lane, token, plain in zip(result.lanes.tolist(), result.tokens.tolist(),
                                          result.plain.tolist(), strict=True):
                if plain:
                    streamed.setdefault((result.request_ids[lane], 0), []).append(token)
        else:
            outputs = batcher.step()
        for out in outputs:
            key = (out.request_id, out.index)
            assert key not in finals, f"{key} produced output after finishing"
            streamed.setdefault(key, []).extend(out.new_token_ids)
            if out.completion is not None:
                finals[key] = out.completion
        batcher.check_invariants()
        check_kernel_bindings(batcher)
        step += 1
        assert step < 5000
    for key, completion in finals.items():
        assert tuple(streamed.get(key, ())) == completion.token_ids, key
    return finals


def mixed_workload() -> dict[str, Any]:
    """A mixed workload on an oversubscribed pool with the prefix cache; returns what came out."""
    model = spec(64)
    art = artifact(model, 3, num_blocks=14)
    batcher = Batcher(NumpyRuntime.random(art, seed=2), prefix_cache=True)
    kinds = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
             SamplingParams(temperature=0.9, seed=5, max_tokens=30),
             SamplingParams(temperature=0.0, max_tokens=35, stop_token_ids=list(range(30, 50))),
             SamplingParams(temperature=0.0, max_tokens=25, min_tokens=10, stop_token_ids=[9]),
             SamplingParams(temperature=0.0, max_tokens=20, n=2, seed=1)]
    rng = np.random.default_rng(4)
    for i in range(10):
        prompt = rng.integers(0, 64, size=int(rng.integers(2, 20))).tolist()
        batcher.submit(prompt, kinds[i % len(kinds)], request_id=f"m{i}")
    finals = drive(batcher, aborts={25: ["m3"]}, arrays=True)
    stats = batcher.stats()
    return {"impl": core.IMPLEMENTATION, "preemptions": stats.preemptions,
            "out": {f"{k[0]}/{k[1]}": [list(c.token_ids), c.finish_reason, c.stop_reason]
                    for k, c in sorted(finals.items())}}

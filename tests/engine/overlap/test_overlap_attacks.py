"""Attacks on `Batcher(overlap=True)` (atombatch/engine/pipeline.py): edges of the decode pipeline that
tests/engine/overlap/test_overlap.py does not reach, each compared against the same requests run
synchronously or alone on a fresh engine (the NumPy runtime does real decoder math: a row fed
the wrong token, position or block shows up as different tokens)."""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import numpy as np
import pytest
from support.driving import run_to_end
from support.pd_models import SEED, SPECS, artifact, prompts

from atombatch import ArtifactConfig, Batcher, SamplingParams
from atombatch.runtime import NumpyRuntime

pytestmark = pytest.mark.numerics


def greedy(max_tokens: int | None, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def outcome(finals: dict[str, Any], ids: list[str]) -> list[tuple[tuple[int, ...], str | None]]:
    return [(finals[i].completion.token_ids, finals[i].finish_reason) for i in ids]


def submit_all(batcher: Batcher, work: list[list[int]], params: list[SamplingParams]
               ) -> list[tuple[tuple[int, ...], str | None]]:
    """Submit every request, step to the end; each request's tokens and finish reason."""
    ids = [batcher.submit(p, sp) for p, sp in zip(work, params, strict=True)]
    return outcome(run_to_end(batcher), ids)


def alone(art: ArtifactConfig, work: list[list[int]], params: list[SamplingParams],
          **options: Any) -> list[tuple[tuple[int, ...], str | None]]:
    out = []
    for p, sp in zip(work, params, strict=True):
        solo = Batcher(NumpyRuntime.random(art, SEED), **options)
        out.append(submit_all(solo, [p], [sp])[0])
    return out


def test_requests_that_run_to_the_context_end() -> None:
    """max_tokens=None: every lane decodes to max_seq_len, its last blocks at the row's end
    (grow(ahead=1) reports the lane short there); the last block ends the row."""
    spec = SPECS["llama"]
    art = ArtifactConfig(model=spec, batch_size=3, max_seq_len=48, block_size=8, num_blocks=19,
                         prefill_chunk_size=16)
    work = [p[:30] for p in prompts(5, seed=11)]
    params = [greedy(None) for _ in work]
    want = alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    got = submit_all(over, work, params)
    assert got == want
    assert over.stats().overlapped_steps > 0


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_buckets_and_padding_rows_with_stops_everywhere(family: str) -> None:
    """Decode buckets (padding rows, their sliding slots), stop ids on many lanes and length
    finishes of different lengths, more requests than lanes."""
    spec = SPECS[family]
    art = ArtifactConfig(model=spec, batch_size=4, max_seq_len=96, block_size=8, num_blocks=40,
                         prefill_chunk_size=16, decoder_batch_sizes=(1, 2, 4))
    work = prompts(9, seed=21)
    probe = alone(art, work, [greedy(20) for _ in work])
    params = []
    for i, (tokens, _) in enumerate(probe):
        if i % 3 == 2:
            params.append(greedy(3 + i))
        else:
            params.append(greedy(20, stop_token_ids=[tokens[2 + i]]))
    want = alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    got = submit_all(over, work, params)
    assert got == want
    assert over.stats().overlapped_steps > 0


def test_single_block_lane() -> None:
    spec = SPECS["llama"]
    art = artifact(spec, 1, 1)
    work = prompts(3, seed=5)
    params = [greedy(12) for _ in work]
    want = alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    got = submit_all(over, work, params)
    assert got == want


def test_hybrid_prefix_cache_with_host_cache() -> None:
    spec = SPECS["gemma3"]
    art = ArtifactConfig(model=spec, batch_size=3, max_seq_len=96, block_size=16, num_blocks=14,
                         prefill_chunk_size=16)
    rng = np.random.default_rng(8)
    stem = rng.integers(1, 256, size=34).tolist()
    work = [stem + rng.integers(1, 256, size=int(rng.integers(1, 9))).tolist() for _ in range(6)]
    params = [greedy(14 + i) for i in range(len(work))]
    want = alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True, prefix_cache=True,
                   host_cache_bytes=1 << 22)
    got = submit_all(over, work, params)
    assert got == want


def test_prefix_cache_host_cache_and_eos() -> None:
    """Stop on EOS (the spec's eos ids) with a prefix cache whose blocks the pipeline's stale
    rows write past; requests resubmitted so they hit the cached tails of finished ones."""
    spec = SPECS["qwen3"]
    art = ArtifactConfig(model=spec, batch_size=4, max_seq_len=96, block_size=4, num_blocks=40,
                         prefill_chunk_size=8, decoder_batch_sizes=(2, 4))
    work = prompts(6, seed=13)
    work = [p[:20] for p in work]
    probe = alone(art, work, [greedy(16) for _ in work])
    params = [greedy(16, stop_token_ids=[t[5 + i % 4]]) for i, (t, _) in enumerate(probe)]
    want = alone(art, work, params)
    # continuations of the outputs: the prompt is the prompt plus what the first run produced
    cont = [p + list(t) for p, (t, _) in zip(work, want, strict=True)]
    cparams = [greedy(10) for _ in cont]
    want_cont = alone(art, cont, cparams)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True, prefix_cache=True,
                   host_cache_bytes=1 << 20)
    got = submit_all(over, work, params)
    assert got == want
    got_cont = submit_all(over, cont, cparams)
    assert got_cont == want_cont
    assert over.stats().prefix_hits > 0


def test_preemption_in_an_oversubscribed_pool() -> None:
    """Growing ahead runs the free list dry again and again; the synchronous steps between
    pipelines evict and preempt, and preempted requests recompute: every request's tokens are
    those it gets alone."""
    spec = SPECS["llama"]
    art = ArtifactConfig(model=spec, batch_size=4, max_seq_len=64, block_size=4, num_blocks=20,
                         prefill_chunk_size=8, decoder_batch_sizes=(2, 4))
    work = [p[:14] for p in prompts(8, seed=23)]
    params = [greedy(18 + i) for i in range(len(work))]
    want = alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True, prefix_cache=True)
    got = submit_all(over, work, params)
    assert got == want
    stats = over.stats()
    assert stats.overlapped_steps > 0 and stats.preemptions > 0


def test_step_arrays_report_the_landed_step() -> None:
    """Tokens gathered from `step_arrays()` (the plain rows' arrays plus the outputs) are the
    tokens of `step()`, in order, for every request."""
    spec = SPECS["llama"]
    art = ArtifactConfig(model=spec, batch_size=4, max_seq_len=96, block_size=8, num_blocks=40,
                         prefill_chunk_size=16, decoder_batch_sizes=(1, 2, 4))
    work = prompts(6, seed=3)
    params = [greedy(6 + 4 * i) for i in range(len(work))]
    want = alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    ids = [over.submit(p, sp) for p, sp in zip(work, params, strict=True)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    reasons: dict[str, str | None] = {}
    while over.has_unfinished():
        result = over.step_arrays()
        for row in np.flatnonzero(result.plain):
            lane = int(result.lanes[row])
            tokens[result.request_ids[lane]].append(int(result.tokens[row]))
        for out in result.outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        over.check_invariants()
    assert [(tuple(tokens[i]), reasons[i]) for i in ids] == want
    assert over.stats().overlapped_steps > 0


def test_aborts_from_another_thread_while_the_pipeline_runs() -> None:
    """A thread aborts requests at random moments while the engine steps; every request that
    was not aborted gets the tokens it gets alone, aborted ones a prefix of them."""
    spec = SPECS["llama"]
    art = ArtifactConfig(model=spec, batch_size=4, max_seq_len=96, block_size=4, num_blocks=60,
                         prefill_chunk_size=16, decoder_batch_sizes=(2, 4))
    work = prompts(10, seed=17)
    params = [greedy(25) for _ in work]
    want = alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    ids = [over.submit(p, sp) for p, sp in zip(work, params, strict=True)]
    victims = ids[1::3]
    done = threading.Event()

    def aborter() -> None:
        rng = np.random.default_rng(1)
        for victim in victims:
            done.wait(float(rng.uniform(0.001, 0.02)))
            over.abort(victim)

    thread = threading.Thread(target=aborter)
    thread.start()
    finals = run_to_end(over)
    while thread.is_alive() or over.has_unfinished():
        finals.update(run_to_end(over))
        thread.join(0.01)
    got = outcome(finals, ids)
    for i, request_id in enumerate(ids):
        tokens, reason = got[i]
        if request_id in victims and reason == "abort":
            assert tokens == want[i][0][:len(tokens)]
        else:
            assert got[i] == want[i]


CORE_PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [3] * 17, list(range(100, 163)), [9, 9, 1],
                list(range(50, 71))]
CORE_PARAMS = [greedy(20), greedy(33), greedy(12), greedy(7), greedy(40), greedy(25)]


def core_reference() -> list[list[int]]:
    from support.engines import numpy_batcher

    out = []
    for prompt, params in zip(CORE_PROMPTS, CORE_PARAMS, strict=True):
        [done] = numpy_batcher().generate([prompt], params)
        out.append(list(done.token_ids))
    return out


@pytest.mark.parametrize("offload", [True, False])
async def test_async_batcher_with_the_pipeline(offload: bool) -> None:
    import asyncio

    from support.engines import numpy_batcher

    from atombatch import AsyncBatcher

    want = core_reference()
    batcher = numpy_batcher(overlap=True)
    async with AsyncBatcher(batcher, offload=offload) as engine:
        done = await asyncio.gather(*(engine.generate(p, sp) for p, sp in
                                      zip(CORE_PROMPTS, CORE_PARAMS, strict=True)))
        # and a stream cancelled half-way (its abort reaches the engine mid-pipeline)
        stream = engine.stream(list(range(30, 60)), greedy(40))
        async for out in stream:
            if out.new_token_ids:
                break
        await stream.aclose()
        again = await asyncio.gather(*(engine.generate(p, sp) for p, sp in
                                       zip(CORE_PROMPTS, CORE_PARAMS, strict=True)))
    assert [list(c.token_ids) for c in done] == want
    assert [list(c.token_ids) for c in again] == want
    assert batcher.stats().overlapped_steps > 0
    assert batcher.stats().lane_blocks == 0


async def test_engine_core_process_with_the_pipeline() -> None:
    import asyncio
    import functools

    from support.engines import numpy_batcher

    from atombatch.core import CoreClient

    want = core_reference()

    async def collect(client: Any, prompt: list[int], params: SamplingParams) -> list[int]:
        tokens: list[int] = []
        async for out in client.stream(prompt, params):
            tokens.extend(out.new_token_ids)
        return tokens

    async with CoreClient(functools.partial(numpy_batcher, overlap=True)) as client:
        got = await asyncio.gather(*(collect(client, p, s)
                                     for p, s in zip(CORE_PROMPTS, CORE_PARAMS, strict=True)))
        await asyncio.sleep(0.1)
        stats = client.stats()
    assert got == want
    assert stats.overlapped_steps > 0 and stats.occupied_lanes == 0


class FailingClock:
    """A clock that raises once, the `at`-th time the engine reads it while completing a decode
    step (in `_land` for the pipeline, `_decode_and_complete` for a synchronous step): an
    exception in the engine thread after the step came back and before its tokens were
    appended."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.reads = 0
        self.raised = False

    def __call__(self) -> float:
        import sys
        import time

        caller = sys._getframe(1).f_code.co_name
        if caller in ("_land", "_decode_and_complete") and not self.raised:
            self.reads += 1
            if self.reads == self.at:
                self.raised = True
                raise RuntimeError("clock failed")
        return time.perf_counter()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_that_raises_while_landing_loses_nothing(overlap: bool) -> None:
    """The engine thread raises after a decode step came back and before its tokens were
    appended. A synchronous engine stepped on afterwards recomputes that step (its lanes did
    not move); so must the pipeline: no token may go missing or land at the wrong position
    (the step on the device was built from the lost step's tokens)."""
    spec = SPECS["llama"]
    art = ArtifactConfig(model=spec, batch_size=4, max_seq_len=96, block_size=8, num_blocks=40,
                         prefill_chunk_size=16)
    work = prompts(4, seed=31)
    params = [greedy(18 + 2 * i) for i in range(len(work))]
    want = alone(art, work, params)
    clock = FailingClock(at=6)
    batcher = Batcher(NumpyRuntime.random(art, SEED), overlap=overlap, clock=clock)
    ids = [batcher.submit(p, sp) for p, sp in zip(work, params, strict=True)]
    finals: dict[str, Any] = {}
    failures = 0
    for _ in range(400):
        if not batcher.has_unfinished():
            break
        try:
            outs = batcher.step()
        except RuntimeError as exc:
            assert "clock failed" in str(exc)
            failures += 1
            continue
        for out in outs:
            if out.finished:
                finals[out.request_id] = out
        batcher.check_invariants()
    assert clock.raised and failures == 1
    assert outcome(finals, ids) == want


class Cancelled(NumpyRuntime):
    """Decode call `at` raises a BaseException that is not an Exception (asyncio's
    CancelledError is one: a runtime over an event loop can let it out)."""

    at = 0
    calls = 0

    def decode(self, inputs: Any) -> Any:
        import asyncio

        self.calls += 1
        if self.calls == self.at:
            raise asyncio.CancelledError("device call cancelled")
        return super().decode(inputs)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_base_exception_from_the_device_does_not_hang_the_engine(overlap: bool) -> None:
    """Out of a synchronous step the BaseException propagates, and stepping on recomputes the
    step; the pipeline's device thread must not die with it (leaving `step()` waiting forever
    for a flight that never lands, with the engine's lock held)."""
    import asyncio

    spec = SPECS["llama"]
    art = ArtifactConfig(model=spec, batch_size=4, max_seq_len=96, block_size=8, num_blocks=40,
                         prefill_chunk_size=16)
    work = prompts(3, seed=41)
    params = [greedy(16) for _ in work]
    want = alone(art, work, params)
    runtime = Cancelled.random(art, SEED)
    runtime.at = 12
    batcher = Batcher(runtime, overlap=overlap)
    ids = [batcher.submit(p, sp) for p, sp in zip(work, params, strict=True)]
    finals: dict[str, Any] = {}
    raised: list[BaseException] = []

    def drive() -> None:
        for _ in range(400):
            if not batcher.has_unfinished():
                return
            try:
                outs = batcher.step()
            except asyncio.CancelledError as exc:
                raised.append(exc)
                continue
            for out in outs:
                if out.finished:
                    finals[out.request_id] = out

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "step() hangs"
    assert [str(exc) for exc in raised] == ["device call cancelled"]
    assert outcome(finals, ids) == want
    assert (batcher.stats().overlapped_steps > 0) is overlap


def test_stop_strings_and_eos_beside_plain_requests() -> None:
    """A tokenizer, outputs without text (`detokenize=False`): plain greedy requests pipeline,
    requests with stop strings (detected outside the kernel) and EOS stops arrive mid-pipeline;
    every request's tokens, text, finish and stop reason are those of synchronous steps."""
    from support import sampling_models as sm

    art = sm.artifact()
    tok = sm.piece_tokenizer()
    rng = np.random.default_rng(5)
    work = [rng.integers(2, sm.VOCAB, size=int(rng.integers(4, 20))).tolist() for _ in range(8)]
    probe = Batcher(NumpyRuntime.random(art, SEED))
    ref = probe.generate(work, [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
                                for _ in work])
    params = []
    for i, done in enumerate(ref):
        if i % 3 == 1:  # a stop string: the piece of a token in the middle of its output
            params.append(SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                         stop=[sm.PIECES[done.token_ids[6]]]))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=20))

    def run(overlap: bool) -> list[Any]:
        batcher = Batcher(NumpyRuntime.random(art, SEED), tokenizer=tok, detokenize=False,
                          overlap=overlap)
        ids = [batcher.submit(p, sp) for p, sp in zip(work[:4], params[:4], strict=True)]
        finals = {}
        for _ in range(8):
            finals.update((out.request_id, out) for out in batcher.step() if out.finished)
        ids += [batcher.submit(p, sp) for p, sp in zip(work[4:], params[4:], strict=True)]
        finals.update(run_to_end(batcher))
        if overlap:
            assert batcher.stats().overlapped_steps > 0
        return [(finals[i].completion.token_ids, finals[i].completion.text,
                 finals[i].finish_reason, finals[i].completion.stop_reason) for i in ids]

    want = run(False)
    assert any(reason == "stop" for *_, reason, _ in want)
    assert run(True) == want


def test_resuming_an_aborted_request_from_its_cached_blocks() -> None:
    """Requests aborted while their rows are in the air leave their KV in the prefix cache (the
    positions written before the abort; rows in the air still write past them). Each is then
    resumed as a new request whose prompt is its prompt plus the tokens it got: its prefill
    starts from those cached blocks, partial tails included, and its tokens are those the
    same prompt gets alone."""
    spec = SPECS["llama"]
    art = ArtifactConfig(model=spec, batch_size=4, max_seq_len=96, block_size=4, num_blocks=80,
                         prefill_chunk_size=8, decoder_batch_sizes=(2, 4))
    work = [p[:21] for p in prompts(4, seed=47)]
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True, prefix_cache=True)
    ids = [over.submit(p, greedy(40)) for p in work]
    got: dict[str, list[int]] = {i: [] for i in ids}
    for step in range(40):
        for out in over.step():
            got[out.request_id].extend(out.new_token_ids)
        if step in (14, 17, 19, 22):  # one abort each, at different offsets in their blocks
            victim = ids[(14, 17, 19, 22).index(step)]
            assert over._flight is not None
            assert over.abort(victim)
    run_to_end(over)
    resumed = [p + got[i] for p, i in zip(work, ids, strict=True)]
    params = [greedy(12) for _ in resumed]
    want = alone(art, resumed, params)
    assert submit_all(over, resumed, params) == want
    assert over.stats().prefix_hit_tokens > sum(len(p) for p in work)


def test_n_choices_logprobs_and_sampling_arrive_mid_pipeline() -> None:
    """n > 1 choices (which the pipeline drains for), logprobs and a seeded sampler arrive while
    it runs and end while plain ones go on: every output (tokens, logprobs, choices) is that of
    synchronous steps."""
    spec = SPECS["qwen3"]
    art = ArtifactConfig(model=spec, batch_size=4, max_seq_len=96, block_size=8, num_blocks=60,
                         prefill_chunk_size=16, decoder_batch_sizes=(1, 2, 4))
    work = [p[:30] for p in prompts(6, seed=53)]
    params = [greedy(30), greedy(26),
              SamplingParams(temperature=0.0, max_tokens=6, n=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=7, ignore_eos=True),
              greedy(9)]

    def run(overlap: bool) -> list[Any]:
        batcher = Batcher(NumpyRuntime.random(art, SEED), overlap=overlap)
        outs: list[Any] = []
        ids = [batcher.submit(p, sp) for p, sp in zip(work[:2], params[:2], strict=True)]
        for _ in range(10):
            outs += batcher.step()
        for p, sp in zip(work[2:], params[2:], strict=True):
            ids.append(batcher.submit(p, sp))
            for _ in range(3):
                outs += batcher.step()
        while batcher.has_unfinished():
            outs += batcher.step()
            batcher.check_invariants()
        assert (batcher.stats().overlapped_steps > 0) is overlap
        done = [(o.request_id, o.index, msgspec.structs.replace(o.completion, timings=None))
                for o in outs if o.completion is not None]  # the real clock's times differ
        return sorted(done, key=lambda d: (ids.index(d[0]), d[1]))

    want = run(False)
    assert len(want) == 7
    assert run(True) == want


def test_structured_requests_arrive_mid_pipeline() -> None:
    """A JSON schema and a regex request (compiled on the grammar thread, masked every step)
    arrive while plain greedy requests pipeline (`detokenize=False`: the plain ones carry no
    text); every completion is that of synchronous steps."""
    from support import structured as so

    from atombatch.api.structured import StructuredOutput

    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    tok = so.byte_tokenizer()
    rng = np.random.default_rng(9)
    work = [rng.integers(3, 300, size=int(rng.integers(6, 20))).tolist() for _ in range(4)]
    params = [greedy(40), greedy(35),
              SamplingParams(temperature=0.0, max_tokens=24,
                             structured=StructuredOutput.json_schema(schema)),
              SamplingParams(temperature=0.0, max_tokens=12,
                             structured=StructuredOutput.regex("[a-c]{3,8}x"))]

    def run(overlap: bool) -> list[Any]:
        batcher = Batcher(NumpyRuntime.random(so.ART, seed=3), tokenizer=tok, detokenize=False,
                          overlap=overlap)
        finals: dict[str, Any] = {}
        ids = [batcher.submit(p, sp) for p, sp in zip(work[:2], params[:2], strict=True)]
        for _ in range(8):
            finals.update((o.request_id, o) for o in batcher.step() if o.finished)
        ids += [batcher.submit(p, sp) for p, sp in zip(work[2:], params[2:], strict=True)]
        finals.update(run_to_end(batcher))
        assert (batcher.stats().overlapped_steps > 0) is overlap
        return [msgspec.structs.replace(finals[i].completion, timings=None) for i in ids]

    want = run(False)
    assert all(c.finish_reason in ("stop", "length") for c in want)
    assert run(True) == want


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_pd_imports_arrive_mid_pipeline(family: str) -> None:
    """PD requests (KV and first token from a producer, layer by layer) arrive while native
    greedy requests pipeline, then decode in it themselves: every request's tokens are those a
    native run gives."""
    from support.pd_models import PARAMS, native, producer_for

    from atombatch.pd import InProcessSource

    spec = SPECS[family]
    producer = producer_for(spec)
    art = artifact(spec, 4, 5)
    work = prompts(6, seed=61)
    want = native(spec, work, art)
    batcher = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    finals: dict[str, Any] = {}
    ids = [batcher.submit(p, PARAMS) for p in work[:2]]
    for _ in range(6):
        finals.update((o.request_id, o) for o in batcher.step() if o.finished)
    for i, p in enumerate(work[2:]):
        ids.append(batcher.submit(p, PARAMS, kv=InProcessSource.from_producer(
            producer, f"pd-{i}", p, PARAMS, mode="layer-stream")))
        finals.update((o.request_id, o) for o in batcher.step() if o.finished)
    finals.update(run_to_end(batcher))
    assert [finals[i].completion.token_ids for i in ids] == want
    assert batcher.stats().imports >= 4 and batcher.stats().overlapped_steps > 0


@pytest.mark.parametrize("family", sorted(SPECS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workloads_with_arrivals_stops_and_aborts(family: str, seed: int) -> None:
    """Random layouts (block sizes, decode buckets, pools that run dry), prefix and host cache,
    requests with stop ids, limits and shared stems arriving at random steps, random aborts:
    each request that was not aborted ends as it does alone; an aborted one with a prefix of
    that."""
    rng = np.random.default_rng(seed)
    spec = SPECS[family]
    block_size = int(rng.choice([4, 8]))
    lanes = int(rng.choice([2, 3, 4]))
    max_seq_len = 64
    per_seq = max_seq_len // block_size
    hybrid = spec.is_hybrid
    num_blocks = lanes * per_seq + 1 if hybrid else \
        int(rng.integers(lanes * per_seq // 2 + 2, lanes * per_seq + 2))
    art = ArtifactConfig(model=spec, batch_size=lanes, max_seq_len=max_seq_len,
                         block_size=block_size, num_blocks=num_blocks, prefill_chunk_size=16,
                         decoder_batch_sizes=tuple(sorted({1, 2, lanes})))
    cache = not hybrid and bool(rng.integers(0, 2))
    batcher = Batcher(NumpyRuntime.random(art, SEED), overlap=True, prefix_cache=cache,
                      host_cache_bytes=(1 << 20) if cache and rng.integers(0, 2) else 0)
    stem = rng.integers(1, 256, size=12).tolist()
    arrivals = []
    for _ in range(int(rng.integers(5, 12))):
        prompt = (stem if rng.integers(0, 2) else []) + \
            rng.integers(1, 256, size=int(rng.integers(2, 20))).tolist()
        stops = [int(rng.integers(0, 256)) for _ in range(int(rng.integers(0, 3)))]
        params = greedy(min(int(rng.integers(1, max_seq_len - len(prompt))), 30),
                        stop_token_ids=stops)
        arrivals.append((int(rng.integers(0, 40)), prompt, params))
    arrivals.sort(key=lambda a: a[0])
    requests: dict[str, tuple[list[int], SamplingParams]] = {}
    aborted: set[str] = set()
    finals: dict[str, Any] = {}
    step = 0
    while arrivals or batcher.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            _, prompt, params = arrivals.pop(0)
            requests[batcher.submit(prompt, params)] = (prompt, params)
        if requests and rng.random() < 0.04:
            victim = list(requests)[int(rng.integers(0, len(requests)))]
            if batcher.abort(victim):
                aborted.add(victim)
        for out in batcher.step():
            assert out.request_id not in finals
            if out.finished:
                finals[out.request_id] = out
        batcher.check_invariants()
        step += 1
    ids = list(requests)
    want = alone(art, [requests[i][0] for i in ids], [requests[i][1] for i in ids])
    for request_id, (tokens, reason) in zip(ids, outcome(finals, ids), strict=True):
        expected = want[ids.index(request_id)]
        if request_id in aborted and reason == "abort":
            assert tokens == expected[0][:len(tokens)]
        else:
            assert (tokens, reason) == expected


class WideLogits(NumpyRuntime):
    """Decode logits as float64 in Fortran order, every row's two best entries a float64 hair
    apart (one float32 value): the argmax must be taken on them, not on a float32 copy."""

    def decode(self, inputs: Any) -> Any:
        logits = np.asarray(super().decode(inputs), dtype=np.float64)
        for row in logits:
            best, second = np.argsort(row)[-1], np.argsort(row)[-2]
            row[best] = row[second] = np.float64(np.float32(row[best]))
            row[second] += 1e-12  # the second wins in float64 only
        return np.asfortranarray(logits)


def test_wide_non_contiguous_logits_pick_what_synchronous_steps_pick() -> None:
    spec = SPECS["llama"]
    art = ArtifactConfig(model=spec, batch_size=4, max_seq_len=96, block_size=8, num_blocks=40,
                         prefill_chunk_size=16, decoder_batch_sizes=(2, 4))
    work = prompts(5, seed=71)
    params = [greedy(12 + i) for i in range(len(work))]
    want = submit_all(Batcher(WideLogits.random(art, SEED)), work, params)
    over = Batcher(WideLogits.random(art, SEED), overlap=True)
    assert submit_all(over, work, params) == want
    assert over.stats().overlapped_steps > 0

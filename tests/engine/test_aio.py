"""atombatch/engine/aio.py, `AsyncBatcher`: concurrent streams, client cancellation, lane/block release, B1
parity."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from atombatch import ArtifactConfig, AsyncBatcher, Batcher, ModelSpec, RequestError, SamplingParams
from atombatch.runtime import NumpyRuntime

SPEC = ModelSpec(name="tiny-qwen3", family="qwen3", vocab_size=256, hidden_size=32,
                 intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                 tie_word_embeddings=True)


def artifact(batch_size):
    return ArtifactConfig(model=SPEC, batch_size=batch_size, max_seq_len=96, block_size=96,
                          num_blocks=batch_size + 1, prefill_chunk_size=16)


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, size=int(rng.integers(3, 50))).tolist() for _ in range(n)]


async def test_sixteen_streams_with_random_cancellations_match_b1():
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    work = prompts(16)
    reference = Batcher(NumpyRuntime.random(artifact(1), seed=1)).generate(work, params)
    batcher = Batcher(NumpyRuntime.random(artifact(4), seed=1))
    rnd = random.Random(3)
    cancel_after = {i: rnd.randrange(1, 20) for i in rnd.sample(range(16), 5)}

    async def client(i):
        got = []
        async for out in ab.stream(work[i], params):
            got.extend(out.new_token_ids)
            if i in cancel_after and len(got) >= cancel_after[i]:
                return i, got, "cancelled"
            if out.finished:
                return i, got, out.finish_reason
        raise AssertionError("stream ended without a final output")

    async with AsyncBatcher(batcher) as ab:
        tasks = [asyncio.create_task(client(i)) for i in range(16)]
        # also cancel two consuming tasks outright while they wait
        await asyncio.sleep(0.05)
        victims = [t for i, t in enumerate(tasks) if i not in cancel_after][:2]
        for t in victims:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    finished = [r for r in results if not isinstance(r, BaseException)]
    assert sum(isinstance(r, asyncio.CancelledError) for r in results) <= 2
    for i, got, reason in finished:
        want = list(reference[i].token_ids)
        if reason == "cancelled":
            assert got == want[: len(got)]
        else:
            assert reason == "length" and got == want
    assert sum(1 for _, _, reason in finished if reason == "length") >= 9
    stats = batcher.stats()
    assert stats.occupied_lanes == 0 and stats.queue_length == 0
    assert stats.free_blocks + stats.spare_blocks == batcher.artifact.num_blocks
    assert stats.finished.get("abort", 0) >= 5
    assert max(i for i, n in enumerate(stats.lane_histogram) if n) == 4
    batcher.check_invariants()


async def test_invalid_submit_raises_at_once_and_others_carry_on():
    batcher = Batcher(NumpyRuntime.random(artifact(2), seed=0))
    async with AsyncBatcher(batcher, offload=False) as ab:
        good = asyncio.create_task(ab.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5)))
        with pytest.raises(RequestError, match="outside the vocabulary"):
            ab.submit([1, 999])
        with pytest.raises(RequestError, match="exceeds max_seq_len"):
            ab.submit([1] * 90, SamplingParams(temperature=0.0, max_tokens=10))
        completion = await good
    assert len(completion.token_ids) == 5 and completion.finish_reason == "length"
    assert completion.timings.ttft >= 0 and completion.timings.e2e >= completion.timings.ttft


async def test_close_drains_in_flight_streams():
    batcher = Batcher(NumpyRuntime.random(artifact(2), seed=0))
    ab = AsyncBatcher(batcher)
    await ab.start()
    rid = ab.submit([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    collector = asyncio.create_task(_collect(ab, rid))
    await ab.close(drain=True)
    tokens, reason = await collector
    assert reason == "length" and len(tokens) == 12
    with pytest.raises(RequestError, match="not running"):
        ab.submit([1])


async def _collect(ab, rid):
    tokens = []
    async for out in ab.outputs(rid):
        tokens.extend(out.new_token_ids)
        if out.finished:
            return tokens, out.finish_reason
    return tokens, None


class _LateSource:
    """A KV source whose payload becomes visible only after `delay` seconds (a slow producer)."""

    def __init__(self, items, delay):
        from atombatch.pd import InProcessSource

        self._inner = InProcessSource(items, "whole")
        self._ready_at = asyncio.get_running_loop().time() + delay
        self.polls = 0

    def poll(self):
        self.polls += 1
        if asyncio.get_event_loop().time() < self._ready_at:
            return None, []
        return self._inner.poll()

    def done(self):
        return self._inner.done()

    def close(self):
        self._inner.close()


async def test_waiting_on_a_producer_does_not_spin_the_loop():
    from atombatch.pd import Producer

    art = artifact(2)
    producer = Producer(NumpyRuntime.random(art, seed=1))
    prompt = [3, 4, 5, 6]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    items = list(producer.produce("late", prompt, params).items())
    batcher = Batcher(NumpyRuntime.random(art, seed=1))
    want = Batcher(NumpyRuntime.random(art, seed=1)).generate([prompt], params)[0].token_ids
    async with AsyncBatcher(batcher, offload=False, idle_poll=0.01) as ab:
        source = _LateSource(items, delay=0.3)
        tokens = []
        async for out in ab.stream(prompt, params, kv=source):
            tokens.extend(out.new_token_ids)
    assert tuple(tokens) == want
    assert batcher.runtime.prefill_calls == 0  # the producer's KV was imported
    assert source.polls < 200  # ~0.3 s at a 10 ms poll, not a busy loop of thousands


async def test_outputs_of_a_request_that_already_finished_are_still_delivered():
    batcher = Batcher(NumpyRuntime.random(artifact(2), seed=0))
    async with AsyncBatcher(batcher, offload=False) as ab:
        rid = ab.submit([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        for _ in range(200):
            await asyncio.sleep(0.005)
            if ab.in_flight == 0:
                break
        tokens = [t async for out in ab.outputs(rid) for t in out.new_token_ids]
        assert len(tokens) == 2
        with pytest.raises(RequestError, match="unknown or its outputs were taken"):
            ab.outputs(rid)


async def test_generate_choices_returns_every_choice_as_the_batcher_does():
    params = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=6, ignore_eos=True)
    prompt = prompts(1, seed=4)[0]
    want = Batcher(NumpyRuntime.random(artifact(4), seed=0)).generate([prompt], params)
    async with AsyncBatcher(Batcher(NumpyRuntime.random(artifact(4), seed=0)),
                            offload=False) as ab:
        got = await ab.generate_choices(prompt, params)
        with pytest.raises(RequestError, match="n=3: generate returns one completion; use "
                                               "generate_choices"):
            await ab.generate(prompt, params)
        [single] = await ab.generate_choices(prompt, SamplingParams(temperature=0.0, max_tokens=4))
    assert [c.index for c in got] == [0, 1, 2]
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert len({c.token_ids for c in got}) > 1  # seeds seed + i: the choices differ
    assert len(single.token_ids) == 4

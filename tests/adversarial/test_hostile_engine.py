"""Issue 12, F8: the engine API's contracts hold against a careless or hostile embedding caller.

Each test fails on f4462de: two threads stepping one Batcher silently corrupted tokens, a second
`outputs(id)` split one queue, unclaimed outputs were kept forever, the queue was unbounded by
default, a ragged prompt raised numpy's ValueError, `start()` after `close()` did not restart,
and a transient device fault failed every request of its step.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from support.driving import run_to_end
from support.rss import MiB, rss_bytes

from atombatch import (
    ArtifactConfig,
    AsyncBatcher,
    Batcher,
    CapacityError,
    ModelSpec,
    RequestError,
    SamplingParams,
    StateError,
)
from atombatch.runtime import NumpyRuntime, SimRuntime

SPEC = ModelSpec(name="hostile-llama", family="llama", vocab_size=128, hidden_size=32,
                 intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
ART = ArtifactConfig(model=SPEC, batch_size=2, max_seq_len=64, block_size=64, num_blocks=3,
                     prefill_chunk_size=16)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [13, 14]]


def reference(prompts: list[list[int]] = PROMPTS) -> list[tuple[int, ...]]:
    batcher = Batcher(NumpyRuntime.random(ART, seed=3))
    return [c.token_ids for c in batcher.generate(prompts, GREEDY)]


class GatedDecode:
    """A NumpyRuntime whose decode waits for `gate` after signalling `entered`."""

    def __init__(self) -> None:
        self.inner = NumpyRuntime.random(ART, seed=3)
        self.artifact = ART
        self.entered = threading.Event()
        self.gate = threading.Event()

    def decode(self, inputs: Any) -> Any:
        self.entered.set()
        self.gate.wait(10)
        return self.inner.decode(inputs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_second_thread_inside_step_raises_state_error_and_tokens_stay_right() -> None:
    runtime = GatedDecode()
    batcher = Batcher(runtime)
    ids = [batcher.submit(p, GREEDY) for p in PROMPTS[:2]]
    while not runtime.entered.is_set():  # prefills run ungated; stop inside the first decode
        runner = threading.Thread(target=batcher.step)
        runner.start()
        runner.join(0.5)
        if runner.is_alive():
            break
    assert runtime.entered.is_set()
    try:
        with pytest.raises(StateError, match="one consumer"):
            batcher.step()
    finally:
        runtime.gate.set()
        runner.join(10)
    finals = run_to_end(batcher)
    assert [finals[i].completion.token_ids for i in ids] == reference(PROMPTS[:2])


def test_ragged_and_nested_prompts_are_request_errors() -> None:
    batcher = Batcher(NumpyRuntime.random(ART, seed=3))
    for bad in ([[1, 2], [3]], [1, [2, 3]], [[1, 2], [3, 4]], ["<1>"], [1.5, 2.0]):
        with pytest.raises(RequestError, match="prompt"):
            batcher.submit(bad, GREEDY)
    assert not batcher.has_unfinished()


def test_the_default_queue_is_bounded() -> None:
    from atombatch.engine.batcher import DEFAULT_MAX_WAITING

    batcher = Batcher(SimRuntime(ART))
    assert batcher.max_waiting == DEFAULT_MAX_WAITING
    for _ in range(DEFAULT_MAX_WAITING):
        batcher.submit([1, 2, 3], GREEDY)
    with pytest.raises(CapacityError, match=f"max_waiting={DEFAULT_MAX_WAITING}"):
        batcher.submit([1, 2, 3], GREEDY)


def test_generate_feeds_more_prompts_than_the_queue_holds() -> None:
    batcher = Batcher(NumpyRuntime.random(ART, seed=3), max_waiting=1)
    prompts = PROMPTS * 2
    done = batcher.generate(prompts, GREEDY)
    assert [c.token_ids for c in done] == reference(prompts)


async def test_outputs_has_one_consumer() -> None:
    async with AsyncBatcher(Batcher(NumpyRuntime.random(ART, seed=3)), offload=False) as ab:
        rid = ab.submit(PROMPTS[0], GREEDY)
        first = ab.outputs(rid)
        with pytest.raises(StateError, match="one consumer"):
            ab.outputs(rid)
        tokens = [t async for out in first for t in out.new_token_ids]
    assert tuple(tokens) == reference(PROMPTS[:1])[0]


async def test_unclaimed_outputs_are_compacted_and_bounded() -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    batcher = Batcher(SimRuntime(ART), max_waiting=None)
    async with AsyncBatcher(batcher, offload=False, max_unclaimed=16) as ab:
        ids = [ab.submit([1, 2, 3], params) for _ in range(40)]
        while ab.in_flight:
            await asyncio.sleep(0.01)
        assert ab.unclaimed_dropped == 24
        with pytest.raises(RequestError, match="max_unclaimed=16"):
            ab.outputs(ids[0])
        outs = [out async for out in ab.outputs(ids[-1])]
        assert len(outs) == 1 and outs[0].finished and len(outs[0].new_token_ids) == 3
        assert outs[0].new_token_ids == outs[0].completion.token_ids


async def test_unclaimed_results_are_bounded_by_bytes_too() -> None:
    """Issue 18 item 7: unclaimed results were bounded by count only, and one with prompt
    logprobs weighs megabytes (1.48 MiB each on 21fd0af's server)."""
    from atombatch.engine.aio import output_bytes

    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    batcher = Batcher(NumpyRuntime.random(ART, seed=3), max_waiting=None)
    prompt = list(range(3, 40))
    async with AsyncBatcher(batcher, offload=False, max_unclaimed=1000,
                            max_unclaimed_bytes=40_000) as ab:
        ids = [ab.submit(prompt, params) for _ in range(12)]
        while ab.in_flight:
            await asyncio.sleep(0.01)
        assert 0 < ab.unclaimed_bytes <= 40_000
        kept = len(ids) - ab.unclaimed_dropped
        assert 1 <= kept < len(ids)  # by bytes: the count bound (1000) never bit
        with pytest.raises(RequestError, match="max_unclaimed_bytes=40000"):
            ab.outputs(ids[0])
        outs = [out async for out in ab.outputs(ids[-1])]
        assert outs[-1].finished and outs[-1].prompt_logprobs is not None
        assert sum(output_bytes(out) for out in outs) <= 40_000
    assert ab.unclaimed_bytes == sum(ab._unclaimed_bytes.values())


@pytest.mark.slow
async def test_twenty_thousand_unclaimed_requests_cost_bounded_memory() -> None:
    """f4462de kept every unclaimed request's outputs: 20 000 of them cost +54.5 MiB."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    batcher = Batcher(SimRuntime(ART), max_waiting=None)
    async with AsyncBatcher(batcher, offload=False, max_unclaimed=64) as ab:
        async def wave(n: int) -> None:
            for _ in range(n):
                ab.submit([1, 2, 3], params)
            while ab.in_flight:
                await asyncio.sleep(0.005)

        await wave(2000)  # warm up allocator arenas and lazily built state
        before = rss_bytes()
        for _ in range(6):
            await wave(2000)
        grown = rss_bytes() - before
    print(f"RSS grew {grown / MiB:.2f} MiB")
    assert grown < 12 * MiB, f"RSS grew {grown / MiB:.1f} MiB over 12 000 unclaimed requests"


async def test_start_after_close_restarts_the_loop() -> None:
    ab = AsyncBatcher(Batcher(NumpyRuntime.random(ART, seed=3)), offload=False)
    await ab.start()
    first = await ab.generate(PROMPTS[0], GREEDY)
    await ab.close()
    await ab.start()
    second = await ab.generate(PROMPTS[1], GREEDY)
    await ab.close()
    assert [first.token_ids, second.token_ids] == reference(PROMPTS[:2])


class FaultyDecode:
    """A NumpyRuntime whose decode call number `at` raises `error` before touching the device."""

    def __init__(self, error: BaseException, at: int, times: int = 1) -> None:
        self.inner = NumpyRuntime.random(ART, seed=3)
        self.artifact = ART
        self.error, self.at, self.times = error, at, times
        self.calls = 0

    def decode(self, inputs: Any) -> Any:
        self.calls += 1
        if self.at <= self.calls < self.at + self.times:
            raise self.error
        return self.inner.decode(inputs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_transient_decode_fault_is_retried_once_and_every_request_finishes_right() -> None:
    from atombatch.errors import TransientDeviceError

    runtime = FaultyDecode(TransientDeviceError("link reset before the graph ran"), at=2)
    batcher = Batcher(runtime)
    ids = [batcher.submit(p, GREEDY) for p in PROMPTS]
    finals = run_to_end(batcher)
    assert [finals[i].finish_reason for i in ids] == ["length"] * 3
    assert [finals[i].completion.token_ids for i in ids] == reference()


def test_a_decode_fault_fails_that_steps_requests_only() -> None:
    from atombatch.errors import TransientDeviceError

    # Twice transient (the retry fails too), then a plain error: each fails the step's lanes.
    for error, times in ((TransientDeviceError("still down"), 2), (RuntimeError("device hung"), 1)):
        runtime = FaultyDecode(error, at=1, times=times)
        batcher = Batcher(runtime)
        ids = [batcher.submit(p, GREEDY) for p in PROMPTS]  # 2 lanes: the third waits
        finals = run_to_end(batcher)
        reasons = [finals[i].finish_reason for i in ids]
        assert reasons == ["error", "error", "length"], reasons
        assert "decode step failed" in (finals[ids[0]].error or "")
        assert finals[ids[2]].completion.token_ids == reference(PROMPTS[2:])[0]
        stats = batcher.stats()
        assert stats.lane_blocks == 0 and stats.staged_blocks == 0


def test_submit_and_abort_from_another_thread_wait_for_the_running_step() -> None:
    runtime = GatedDecode()
    batcher = Batcher(runtime)
    first = batcher.submit(PROMPTS[0], GREEDY)
    while not runtime.entered.is_set():
        runner = threading.Thread(target=batcher.step)
        runner.start()
        runner.join(0.5)
        if runner.is_alive():
            break
    done = threading.Event()

    def other_thread() -> None:
        batcher.submit(PROMPTS[1], GREEDY, request_id="late")
        batcher.abort(first)
        done.set()

    helper = threading.Thread(target=other_thread)
    helper.start()
    helper.join(0.3)
    try:
        assert not done.is_set()  # blocked behind the step that is inside the device call
    finally:
        runtime.gate.set()
        runner.join(10)
        helper.join(10)
    finals = run_to_end(batcher)
    assert finals[first].finish_reason == "abort"
    assert finals["late"].completion.token_ids == reference(PROMPTS[1:2])[0]

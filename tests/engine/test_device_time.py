"""`EngineStats.device_s` / `host_gap_s` / `host_gaps`: where a busy engine's time went."""

from __future__ import annotations

import time

from atombatch import ArtifactConfig, Batcher, SamplingParams
from atombatch.runtime.null import NullRuntime
from atombatch.serve.cli import DEFAULT_SPEC


def _batcher(step_ms: float = 1.0) -> tuple[Batcher, NullRuntime]:
    art = ArtifactConfig(model=DEFAULT_SPEC, batch_size=4, max_seq_len=256, block_size=256,
                         num_blocks=5, prefill_chunk_size=32)
    runtime = NullRuntime(art, step_ms=step_ms, prefill_ms=step_ms)
    return Batcher(runtime), runtime


def _run(batcher: Batcher, prompts: int, max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(prompts):
        batcher.submit([3 + i, 4, 5], params)
    started = time.perf_counter()
    while batcher.has_unfinished():
        batcher.step()
    return time.perf_counter() - started


def test_device_time_is_the_runtimes_and_gaps_lie_between_back_to_back_calls() -> None:
    batcher, runtime = _batcher()
    wall = _run(batcher, 3, 10)
    s = batcher.stats()
    inside = runtime.calls.decode_s + runtime.calls.prefill_s  # the runtime's own clock
    assert s.steps == runtime.calls.decode_calls + runtime.calls.prefill_calls
    assert inside <= s.device_s <= wall
    assert s.host_gaps == s.steps - 1          # every call but the first followed another
    assert s.host_gap_s > 0 and s.device_s + s.host_gap_s <= wall


def test_idle_time_between_busy_stretches_is_not_a_gap() -> None:
    batcher, _ = _batcher()
    first = _run(batcher, 2, 5)
    steps = batcher.stats().steps
    batcher.step()            # nothing to run: no device call
    time.sleep(0.3)           # the engine is idle, not waiting for its host
    second = _run(batcher, 1, 4)
    s = batcher.stats()
    assert s.host_gaps == (steps - 1) + (s.steps - steps - 1)
    assert s.host_gap_s <= first + second      # only time inside the two stretches


def test_a_failed_device_call_still_counts_its_time() -> None:
    batcher, runtime = _batcher()

    def broken(inputs: object) -> object:
        time.sleep(0.01)
        raise RuntimeError("the device fell over")

    runtime.decode = broken  # type: ignore[method-assign]
    batcher.submit([3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0))
    outputs = []
    while batcher.has_unfinished():
        outputs += batcher.step()
    assert outputs[-1].finish_reason == "error"
    s = batcher.stats()
    assert s.device_s >= 0.01 and s.host_gaps == 1  # the prefill, then the failed decode

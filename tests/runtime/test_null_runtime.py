"""NullRuntime: the engine runs requests to completion on it, it waits its device time, and its
logits are valid and move with position."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from support.driving import run_to_end

from atombatch import ArtifactConfig, Batcher, SamplingParams
from atombatch.errors import ConfigError, StateError
from atombatch.kernel.blocks import DecodeInputs, LaneTable
from atombatch.runtime import NullRuntime, Runtime
from atombatch.serve.cli import DEFAULT_SPEC


def artifact(batch_size: int = 4, decoder_batch_sizes: tuple[int, ...] = ()) -> ArtifactConfig:
    return ArtifactConfig(model=DEFAULT_SPEC, batch_size=batch_size, max_seq_len=256,
                          block_size=256, num_blocks=batch_size + 1, prefill_chunk_size=16,
                          decoder_batch_sizes=decoder_batch_sizes)


def test_it_is_a_runtime() -> None:
    assert isinstance(NullRuntime(artifact(), step_ms=0), Runtime)


@pytest.mark.parametrize("buckets", [(), (1, 2, 4)], ids=["one-graph", "buckets"])
def test_engine_runs_requests_to_completion_with_the_invariants(buckets: tuple[int, ...]) -> None:
    runtime = NullRuntime(artifact(decoder_batch_sizes=buckets), step_ms=0.0)
    batcher = Batcher(runtime)
    rng = np.random.default_rng(0)
    # more requests than lanes (rotation), prompts longer than a chunk, two stopping on EOS
    prompts = [rng.integers(3, DEFAULT_SPEC.vocab_size, n).tolist() for n in (3, 8, 17, 40, 5, 9)]
    ids = [batcher.submit(p, SamplingParams(max_tokens=12 + i, ignore_eos=True, temperature=0.0))
           for i, p in enumerate(prompts)]
    ids += [batcher.submit(prompts[0], SamplingParams(max_tokens=30, temperature=0.0))]
    finals = run_to_end(batcher)
    assert set(finals) == set(ids)
    # the spike never lands on an EOS id, so the request that honours EOS runs to its limit too
    assert [finals[rid].finish_reason for rid in ids] == ["length"] * len(ids)
    stats = batcher.stats()
    assert stats.prefill_chunks == sum(-(-len(p) // 16) for p in prompts) + 1
    assert runtime.calls.prefill_calls == stats.prefill_chunks
    assert runtime.calls.decode_calls > 0


def test_tokens_differ_by_position_and_are_deterministic() -> None:
    def generate() -> list[list[int]]:
        batcher = Batcher(NullRuntime(artifact(), step_ms=0.0, seed=3))
        done = batcher.generate([[5, 6, 7], [5, 6, 7, 8]],
                                SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0))
        return [list(c.token_ids) for c in done]

    first = generate()
    assert first == generate()
    for tokens in first:
        assert len(tokens) == 40
        assert len(set(tokens)) > 30                     # tokens move every step
        assert not set(tokens) & set(DEFAULT_SPEC.eos_token_ids)
    assert first[0] != first[1]                          # and depend on the prompt
    other = Batcher(NullRuntime(artifact(), step_ms=0.0, seed=4)).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0))
    assert list(other[0].token_ids) != first[0]          # and on the seed


def test_decode_logits_are_valid_float32_with_the_argmax_at_the_spike() -> None:
    art = artifact()
    runtime = NullRuntime(art, step_ms=0.0)
    batcher = Batcher(runtime)
    inputs = batcher._kernel.inputs  # the engine's own decode buffers
    inputs.input_ids[:, 0] = [9, 9, 11, 0]
    inputs.cache_position[:, 0] = [4, 5, 4, 0]
    for _ in range(3):  # reused buffer: the previous spike is cleared
        logits = runtime.decode(inputs)
        assert logits.shape == (4, DEFAULT_SPEC.vocab_size) and logits.dtype == np.float32
        assert np.isfinite(logits).all()
        assert (np.count_nonzero(logits, axis=1) == 1).all()
        expected = [runtime.spike(int(t), int(p)) for t, p in
                    zip(inputs.input_ids[:, 0], inputs.cache_position[:, 0], strict=True)]
        assert logits.argmax(axis=1).tolist() == expected
        assert len(set(expected[:3])) == 3
        inputs.cache_position[:, 0] += 1


def test_positions_past_int32_products_do_not_overflow() -> None:
    runtime = NullRuntime(artifact(), step_ms=0.0)
    inputs = Batcher(runtime)._kernel.inputs
    inputs.input_ids[:, 0] = DEFAULT_SPEC.vocab_size - 1
    inputs.cache_position[:, 0] = 2**31 - 1
    logits = runtime.decode(inputs)
    assert logits.argmax(axis=1).tolist() == [runtime.spike(DEFAULT_SPEC.vocab_size - 1,
                                                            2**31 - 1)] * 4


def test_prefill_every_position_rows_match_the_last_token_row() -> None:
    runtime = NullRuntime(artifact(), step_ms=0.0)
    batcher = Batcher(runtime)
    done = batcher.generate([[4, 5, 6]], SamplingParams(max_tokens=2, ignore_eos=True,
                                                        temperature=0.0, prompt_logprobs=1))
    assert done[0].token_ids[0] == runtime.spike(6, 2)


def test_decode_and_prefill_sleep_their_time_with_the_gil_released() -> None:
    runtime = NullRuntime(artifact(), step_ms=30.0, prefill_ms=10.0)
    batcher = Batcher(runtime)
    counted = 0
    stop = threading.Event()

    def spin() -> None:  # runs only while the step releases the GIL
        nonlocal counted
        while not stop.is_set():
            counted += 1

    rid = batcher.submit([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    thread = threading.Thread(target=spin)
    thread.start()
    try:
        started = time.perf_counter()
        run_to_end(batcher)
        elapsed = time.perf_counter() - started
    finally:
        stop.set()
        thread.join()
    assert rid
    assert runtime.calls.prefill_calls == 1 and runtime.calls.decode_calls == 2
    assert runtime.calls.prefill_s >= 0.010 and runtime.calls.decode_s >= 2 * 0.030
    assert elapsed >= 0.010 + 2 * 0.030
    assert counted > 0


def test_default_prefill_time_is_the_step_time() -> None:
    assert NullRuntime(artifact(), step_ms=7).prefill_ms == 7.0
    assert NullRuntime(artifact(), step_ms=7, prefill_ms=0).prefill_ms == 0.0


@pytest.mark.parametrize("kwargs", [{"step_ms": -1}, {"step_ms": float("nan")},
                                    {"step_ms": 1, "prefill_ms": float("inf")},
                                    {"step_ms": True}])
def test_bad_times_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="must be a finite number of milliseconds"):
        NullRuntime(artifact(), **kwargs)


def test_block_methods_check_their_arguments() -> None:
    runtime = NullRuntime(artifact(), step_ms=0)
    runtime.copy_block(0, 4)
    runtime.write_block(1, runtime.read_block(1))
    with pytest.raises(StateError, match="block 5 is outside 0..4"):
        runtime.copy_block(0, 5)
    with pytest.raises(StateError, match="layer 2 is outside"):
        runtime.write_layer_kv(2, np.zeros((2, 1, 32)), np.zeros((2, 1, 32)), [0])


def test_serve_flags_build_a_null_engine(capsys: pytest.CaptureFixture[str]) -> None:
    from atombatch.serve.cli import build_engine, main, parser

    args = parser().parse_args(["--runtime", "null", "--null-step-ms", "3", "--batch-size", "8",
                                "--max-seq-len", "128"])
    batcher, name, codec = build_engine(args)
    runtime = batcher.runtime
    assert isinstance(runtime, NullRuntime)
    assert (runtime.step_ms, runtime.prefill_ms) == (3.0, 3.0)
    assert batcher.artifact.batch_size == 8 and name == DEFAULT_SPEC.name and codec is None
    args = parser().parse_args(["--runtime", "null", "--model", "qwen3-0.6b", "--batch-size", "1",
                                "--max-seq-len", "128", "--null-prefill-ms", "0"])
    batcher, name, _ = build_engine(args)
    assert name == "qwen3-0.6b" and batcher.runtime.prefill_ms == 0.0  # type: ignore[attr-defined]
    assert main(["--runtime", "null", "--model", "llama-9000", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("atombatch.serve: --model llama-9000: --runtime null needs a preset")
    assert main(["--runtime", "null", "--null-step-ms", "-1", "--port", "0"]) == 2
    assert "step_ms=-1.0 must be a finite number" in capsys.readouterr().err


class _Recording(NullRuntime):
    """A NullRuntime that keeps a copy of each decode call's `lora_int_ids` (the engine's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[list[int]] = []

    def decode(self, inputs: Any, **kwargs: Any) -> Any:
        if kwargs.get("lora_int_ids") is not None:
            self.seen.append(kwargs["lora_int_ids"].tolist())
        return super().decode(inputs, **kwargs)


def test_lora_adapters_are_synthetic_and_their_ids_change_nothing() -> None:
    """`lora_adapters=N`: N adapters requests may name; the engine hands each call its rows'
    ids, the runtime checks and ignores them (the tokens are the base model's)."""
    assert not hasattr(NullRuntime(artifact(), step_ms=0), "lora_adapters")  # off by default
    runtime = _Recording(artifact(decoder_batch_sizes=(1, 2, 4)), step_ms=0, lora_adapters=3)
    assert sorted(runtime.lora_adapters) == ["null-1", "null-2", "null-3"]
    assert sorted(a.lora_int_id for a in runtime.lora_adapters.values()) == [1, 2, 3]
    batcher = Batcher(runtime)
    assert batcher.capabilities.lora and not batcher.capabilities.lora_loadable
    prompts = [[5 + i, 9, 40 + i] for i in range(6)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    loras = [None, "null-1", "null-2", None, "null-3", "null-1"]

    def tokens(batcher: Batcher, ids: list[str]) -> list[list[int]]:
        got: dict[str, list[int]] = {r: [] for r in ids}
        while batcher.has_unfinished():
            for out in batcher.step():
                got[out.request_id] += out.new_token_ids
            batcher.check_invariants()
        return [got[r] for r in ids]

    mixed = tokens(batcher, [batcher.submit(p, params, lora=lora)
                             for p, lora in zip(prompts, loras, strict=True)])
    plain = Batcher(NullRuntime(artifact(decoder_batch_sizes=(1, 2, 4)), step_ms=0))
    assert mixed == tokens(plain, [plain.submit(p, params) for p in prompts])
    assert all(len(t) == 8 for t in mixed)
    # the ids reached the runtime: every adapter, and the base, in the steps' rows
    assert {i for step in runtime.seen for i in step} == {0, 1, 2, 3}
    assert all(len(step) in (1, 2, 4) for step in runtime.seen)


def test_bad_lora_ids_and_counts_are_refused() -> None:
    art = artifact()
    for bad in (-1, True, 1.5, 5000):
        with pytest.raises(ConfigError, match="lora_adapters="):
            NullRuntime(art, step_ms=0, lora_adapters=bad)  # type: ignore[arg-type]
    runtime = NullRuntime(art, step_ms=0, lora_adapters=2)
    lanes = LaneTable(4, 1, 256)
    for lane in range(4):
        lanes.assign()
        lanes.push_block(lane, lane)
        lanes.start_decode(lane, 10, 7)
    inputs = DecodeInputs(4, 1)
    inputs.build(lanes, 4)
    runtime.decode(inputs, lora_int_ids=np.array([0, 1, 2, 0], dtype=np.int32))
    for ids, words in ((np.array([0, 1, 2], dtype=np.int32), "int32 \\[4\\]"),
                       (np.array([0, 1, 2, 0], dtype=np.int64), "int32 \\[4\\]"),
                       ([0, 1, 2, 0], "int32 \\[4\\]"),
                       (np.array([0, 3, 0, 0], dtype=np.int32), "holds \\[0, 3\\]"),
                       (np.array([0, -1, 0, 0], dtype=np.int32), "holds \\[-1, 0\\]")):
        with pytest.raises(StateError, match=words):
            runtime.decode(inputs, lora_int_ids=ids)  # type: ignore[arg-type]
    with pytest.raises(StateError, match="without adapters"):
        NullRuntime(art, step_ms=0).decode(inputs, lora_int_ids=np.zeros(4, dtype=np.int32))

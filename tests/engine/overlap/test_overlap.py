"""`Batcher(overlap=True)`: steady decodes run as a pipeline (atombatch/engine/pipeline.py), each step's
inputs built while the step before it is on the device, its tokens written in once that step's
argmax is known.

Every test runs real decoder math (the NumPy runtime writes KV for every row it is given, idle
and padding rows too) and compares against the same requests stepped synchronously, or run one
at a time: a row built one position off, a table entry of another lane, a token fed to the wrong
row or a block handed out while a stale row still writes it shows up as different tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support.driving import run_to_end
from support.pd_models import SEED, SPECS, artifact, prompts

from atombatch import ArtifactConfig, Batcher, SamplingParams
from atombatch.runtime import NumpyRuntime


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def finish(batcher: Batcher, ids: list[str]) -> list[tuple[tuple[int, ...], str | None]]:
    finals = run_to_end(batcher)
    return [(finals[i].completion.token_ids, finals[i].finish_reason) for i in ids]


def both(make: Any, work: list[list[int]], params: list[SamplingParams], **options: Any
         ) -> tuple[list[Any], list[Any], Batcher]:
    """The same requests through a synchronous and an overlapped Batcher."""
    sync = make(overlap=False, **options)
    want = finish(sync, [sync.submit(p, sp) for p, sp in zip(work, params, strict=True)])
    over = make(overlap=True, **options)
    got = finish(over, [over.submit(p, sp) for p, sp in zip(work, params, strict=True)])
    return want, got, over


def run_alone(art: ArtifactConfig, work: list[list[int]], params: list[SamplingParams]
              ) -> list[Any]:
    """Each request on a fresh synchronous Batcher of its own: the independent reference."""
    out = []
    for p, sp in zip(work, params, strict=True):
        solo = Batcher(NumpyRuntime.random(art, SEED))
        out.append(finish(solo, [solo.submit(p, sp)])[0])
    return out


def stop_ids_from(reference: list[Any], count: int) -> list[SamplingParams]:
    """Greedy params whose stop id is a token the synchronous run produces mid-output: the
    request stops inside the pipeline (its row in the step built ahead is dropped)."""
    out = []
    for i, (tokens, _) in enumerate(reference[:count]):
        out.append(greedy(24, stop_token_ids=[tokens[len(tokens) // 2 + i % 3]]))
    return out


@pytest.mark.parametrize("family", sorted(SPECS))
def test_the_pipeline_gives_the_tokens_of_synchronous_steps(family: str, core: str) -> None:
    spec = SPECS[family]
    art = artifact(spec, 4, 9, block_size=16, chunk=16, max_seq_len=96)

    def make(**kw: Any) -> Batcher:
        return Batcher(NumpyRuntime.random(art, SEED), **kw)

    work = prompts(7, seed=5)
    plain = [greedy(8 + 3 * i) for i in range(len(work))]
    probe = make()
    reference = finish(probe, [probe.submit(p, sp) for p, sp in zip(work, plain, strict=True)])
    params = stop_ids_from(reference, 3) + plain[3:]
    want, got, over = both(make, work, params)
    assert got == want
    assert {reason for _, reason in want[:3]} == {"stop"}  # the stops happened mid-output
    stats = over.stats()
    assert stats.overlapped_steps > stats.decode_steps // 3  # the pipeline ran, and long
    assert stats.lane_blocks == 0 and stats.staged_blocks == 0


def test_the_pipeline_matches_requests_run_alone_with_a_prefix_cache_and_buckets() -> None:
    """Shared prefixes, a pool small enough that growing ahead runs dry (the step falls back and
    evicts), decode buckets (padding rows in steps built ahead): each request's tokens are those
    it gets alone on a fresh engine."""
    spec = SPECS["qwen3"]
    art = ArtifactConfig(model=spec, batch_size=4, max_seq_len=96, block_size=8, num_blocks=26,
                         prefill_chunk_size=16, decoder_batch_sizes=(1, 2, 4))
    rng = np.random.default_rng(3)
    stem = rng.integers(1, 256, size=20).tolist()
    work = [stem + rng.integers(1, 256, size=int(rng.integers(2, 12))).tolist()
            for _ in range(8)]
    params = [greedy(10 + 5 * (i % 4)) for i in range(len(work))]
    alone = run_alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), prefix_cache=True, overlap=True)
    got = finish(over, [over.submit(p, sp) for p, sp in zip(work, params, strict=True)])
    assert got == alone
    stats = over.stats()
    assert stats.overlapped_steps > 0 and stats.prefix_hits > 0 and stats.evictions > 0
    assert len(stats.bucket_steps) > 1  # steps of several buckets ran


def test_an_abort_and_new_requests_while_steps_are_in_the_air() -> None:
    """A request aborted while its row is on the device and another built ahead: its blocks go
    back and are handed out again; requests that arrive mid-pipeline wait for it to drain.
    Every other request's tokens are those it gets alone."""
    spec = SPECS["llama"]
    art = artifact(spec, 4, 24, block_size=8, chunk=16, max_seq_len=96)
    work = prompts(6, seed=9)
    params = [greedy(30) for _ in work]
    alone = run_alone(art, work, params)
    batcher = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    ids = [batcher.submit(p, sp) for p, sp in zip(work[:3], params[:3], strict=True)]
    for _ in range(12):
        batcher.step()
    assert batcher._flight is not None
    assert batcher.abort(ids[1])
    ids += [batcher.submit(p, sp) for p, sp in zip(work[3:], params[3:], strict=True)]
    finals = run_to_end(batcher)
    assert finals[ids[1]].finish_reason == "abort"
    for i in (0, 2, 3, 4, 5):
        assert (finals[ids[i]].completion.token_ids, finals[ids[i]].finish_reason) == alone[i]
    stats = batcher.stats()
    assert stats.lane_blocks == 0 and stats.staged_blocks == 0 and stats.overlapped_steps > 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_sampled_requests_draw_in_the_pipeline_what_synchronous_steps_draw(family: str) -> None:
    """The device thread samples the rows that sample (temperature, top-k/p, penalties, bias,
    min_tokens, logprobs), each request from its own seeded generator, after the engine landed
    the step before (penalties count every token so far): the tokens and logprobs are those
    of synchronous steps, greedy neighbours included."""
    spec = SPECS[family]
    art = artifact(spec, 4, 9, block_size=16, chunk=16, max_seq_len=96)

    def make(**kw: Any) -> Batcher:
        return Batcher(NumpyRuntime.random(art, SEED), **kw)

    work = prompts(6, seed=2)
    params = [greedy(12),
              SamplingParams(temperature=0.8, seed=4, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=5, max_tokens=20,
                             ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3,
                             repetition_penalty=1.2, seed=6, max_tokens=18, ignore_eos=True),
              SamplingParams(temperature=1.0, logit_bias={7: 2.0, 9: -5.0}, min_tokens=6,
                             seed=7, max_tokens=14, logprobs=1),
              greedy(20, logprobs=2)]

    def run(batcher: Batcher) -> list[Any]:
        ids = [batcher.submit(p, sp) for p, sp in zip(work, params, strict=True)]
        finals = run_to_end(batcher)
        return [(finals[i].completion.token_ids, finals[i].finish_reason,
                 [None if lp is None else (lp.token_id, lp.logprob, lp.top)
                  for lp in finals[i].completion.logprobs or ()]) for i in ids]

    want = run(make(overlap=False))
    over = make(overlap=True)
    assert run(over) == want
    stats = over.stats()
    assert stats.overlapped_steps > stats.decode_steps // 3


class Faulty(NumpyRuntime):
    """Decode call `at` (counting from 1) raises `error`, or (error None) returns NaN logits on
    row `row`."""

    at = 0
    row = 0
    error: Exception | None = None
    calls = 0

    def decode(self, inputs: Any) -> Any:
        self.calls += 1
        if self.calls == self.at and self.error is not None:
            raise self.error
        logits = super().decode(inputs)
        if self.calls == self.at:
            logits = np.array(logits, copy=True)
            logits[self.row] = np.nan
        return logits


@pytest.mark.parametrize("fault", ["nan", "error", "transient"])
def test_a_fault_in_a_flight_ends_only_its_requests(fault: str) -> None:
    from atombatch.errors import TransientDeviceError

    spec = SPECS["llama"]
    art = artifact(spec, 2, 13, block_size=16, chunk=16, max_seq_len=96)
    work = prompts(3, seed=4)
    params = [greedy(20) for _ in work]
    alone = run_alone(art, work, params)
    runtime = Faulty.random(art, SEED)
    runtime.at = 10  # a decode well inside the pipeline (prefills are other calls)
    runtime.error = {"nan": None, "error": RuntimeError("device hung"),
                     "transient": TransientDeviceError("link reset")}[fault]
    batcher = Batcher(runtime, overlap=True)
    ids = [batcher.submit(p, sp) for p, sp in zip(work, params, strict=True)]
    finals = run_to_end(batcher)
    outcome = [(finals[i].completion.token_ids, finals[i].finish_reason) for i in ids]
    if fault == "transient":  # retried once: nothing lost
        assert outcome == alone
    elif fault == "nan":  # row 0's request fails, the other lane's goes on
        assert outcome[0][1] == "error" and "non-finite" in (finals[ids[0]].error or "")
        assert outcome[1:] == alone[1:]
    else:  # both lanes of that step fail; the waiting request runs after them
        assert [o[1] for o in outcome[:2]] == ["error", "error"]
        assert "decode step failed: device hung" in (finals[ids[0]].error or "")
        assert outcome[2] == alone[2]
    stats = batcher.stats()
    assert stats.lane_blocks == 0 and stats.staged_blocks == 0 and stats.overlapped_steps > 0


def test_overlap_must_be_a_bool() -> None:
    from atombatch.errors import ConfigError

    art = artifact(SPECS["llama"], 2, 6)
    with pytest.raises(ConfigError, match="overlap='yes' must be True or False"):
        Batcher(NumpyRuntime.random(art, SEED), overlap="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_queue_behind_a_full_batch_keeps_the_pipeline_running(family: str) -> None:
    """More requests than lanes: while every lane decodes and the queue's head waits (staged
    into the spare, or, for a hybrid model, which does not stage, just queued), the steps are
    still built ahead; each request's tokens are those it gets alone."""
    spec = SPECS[family]
    art = artifact(spec, 2, 13, block_size=16, chunk=16, max_seq_len=96)
    work = prompts(6, seed=21)
    params = [greedy(14 + 4 * i) for i in range(len(work))]
    alone = run_alone(art, work, params)
    batcher = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    got = finish(batcher, [batcher.submit(p, sp) for p, sp in zip(work, params, strict=True)])
    assert got == alone
    stats = batcher.stats()
    assert stats.overlapped_steps > stats.decode_steps // 3
    if not spec.is_hybrid:
        assert stats.staged_chunks > 0  # the queue's head was staged while the lanes decoded


def test_stop_strings_and_eos_end_requests_inside_the_pipeline() -> None:
    """Requests whose text the engine builds (a tokenizer, stop strings) and requests that stop on
    the model's EOS run in the pipeline too: a stop string found when a step lands ends the
    request there (its row in the step already built ahead is dropped), with the text, tokens and
    finish of synchronous steps."""
    from support.sampling_models import artifact as sampling_artifact
    from support.sampling_models import piece_tokenizer

    tok = piece_tokenizer()
    art = sampling_artifact()
    work = [[3, 4, 5], [9, 8, 7, 6], [11, 12], [20, 21, 22, 23, 24]]
    base = Batcher(NumpyRuntime.random(art, seed=3), tokenizer=tok).generate(
        work, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    # a stop string each text reaches a few tokens in (the engine finds it after decoding)
    stops = []
    for done in base:
        text = done.text
        stops.append(next(text[k:k + 3] for k in range(6, len(text) - 3)
                          if text.find(text[k:k + 3]) == k))
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], ignore_eos=i == 0)
              for i, stop in enumerate(stops)]

    def run(overlap: bool) -> tuple[list[Any], Batcher]:
        batcher = Batcher(NumpyRuntime.random(art, seed=3), tokenizer=tok, overlap=overlap)
        outs = batcher.generate(work, params)
        return [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outs], batcher

    want, _ = run(False)
    got, over = run(True)
    assert got == want
    assert all(reason == "stop" for _, _, reason, _ in want)
    assert over.stats().overlapped_steps > 0
    assert over.stats().lane_blocks == 0


def test_an_engine_nobody_holds_is_freed_with_its_device_thread() -> None:
    """The device thread holds the engine weakly: dropping the last reference to a Batcher that
    ran a pipeline frees it (its runtime and KV cache) and ends the thread."""
    import gc
    import time
    import weakref

    art = artifact(SPECS["llama"], 2, 13, block_size=16, chunk=16, max_seq_len=96)
    batcher = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    finish(batcher, [batcher.submit(p, greedy(12)) for p in prompts(2, seed=1)])
    assert batcher.stats().overlapped_steps > 0
    device = batcher._device_thread
    assert device is not None and device.alive
    gone = weakref.ref(batcher)
    del batcher
    gc.collect()
    assert gone() is None
    deadline = time.monotonic() + 10
    while device.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not device.alive


def test_an_engine_is_freed_after_a_device_error_in_a_flight() -> None:
    """A flight keeps its device error until the flight is reused; the error must not keep the
    engine alive through its traceback's frames."""
    import gc
    import weakref

    art = artifact(SPECS["llama"], 2, 13, block_size=16, chunk=16, max_seq_len=96)
    runtime = Faulty.random(art, SEED)
    runtime.at, runtime.error = 8, RuntimeError("device hung")
    batcher = Batcher(runtime, overlap=True)
    finals = finish(batcher, [batcher.submit(p, greedy(12)) for p in prompts(2, seed=1)])
    assert [reason for _, reason in finals] == ["error", "error"]
    gone = weakref.ref(batcher)
    del batcher, runtime
    gc.collect()
    assert gone() is None

"""Admission inside the pipeline (`Batcher(overlap=True)`, atombatch/engine/pipeline.py): a request
that arrives while decodes run, with an idle lane for it, is admitted while a decode is on the
device; its first prefill chunk runs right after that decode on the device thread, then the other
lanes' decode, and the request joins the step after (`AheadScheduler.plan_prefill_ahead`,
`AheadScheduler.plan_after_prefill`, `StepKernel.build_ahead`).

The clients here are closed loops (a finished request's lane gets the next request at once, as
a serving client sends it), on the NumPy runtime (real decoder math, KV written for every row it
is given): each request's tokens are compared with the same request run alone on a fresh
synchronous engine, or with the same loop stepped synchronously.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support.overlap import (
    CallLog,
    FaultyPrefill,
    assert_only_aborted_differs,
    closed_loop,
    greedy,
    run_alone,
    short_prompts,
    tokens_of,
)
from support.pd_models import SEED, SPECS, artifact, prompts

from atombatch import ArtifactConfig, Batcher, SamplingParams
from atombatch.runtime import NumpyRuntime


def stem_prompts(seed: int, stems: int, count: int, longest_tail: int) -> list[list[int]]:
    """`count` prompts, each one of `stems` shared 16-token stems and a tail of its own."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(1, 256, size=16).tolist() for _ in range(stems)]
    return [heads[i % stems] + rng.integers(1, 256, size=int(rng.integers(2, longest_tail)))
            .tolist() for i in range(count)]


def staggered(count: int, base: int = 6) -> list[SamplingParams]:
    """Output limits that end the lanes at different steps (one lane frees at a time)."""
    return [greedy(base + (5 * i) % 13) for i in range(count)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_requests_admitted_mid_pipeline_get_the_tokens_they_get_alone(family: str,
                                                                       core: str) -> None:
    """Every admission after the first batch happens while a decode is on the device: its
    chunk runs next on the device thread, the lanes' decode after it (a hybrid model's too:
    that decode's padding rows leave the new lane's sliding slot alone). Tokens are those of
    each request alone."""
    spec = SPECS[family]
    art = artifact(spec, 4, 64, block_size=8, chunk=16, max_seq_len=96)
    work = [p if i % 3 == 0 else p[:16] for i, p in enumerate(prompts(14, seed=31))]
    params = staggered(len(work))
    want = run_alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    assert tokens_of(closed_loop(over, work, params, 4)) == want
    stats = over.stats()
    assert stats.overlapped_prefills >= 5  # most of the 10 later admissions
    assert stats.lane_blocks == 0 and stats.staged_blocks == 0


def test_multi_chunk_prompts_and_prefix_hits_admitted_mid_pipeline() -> None:
    """Prompts of several chunks (the first runs ahead, the rest synchronously), a shared
    stem the prefix cache serves, and a pool small enough that admissions evict cached blocks:
    every request's tokens are those it gets alone."""
    spec = SPECS["qwen3"]
    art = ArtifactConfig(model=spec, batch_size=4, max_seq_len=96, block_size=8, num_blocks=40,
                         prefill_chunk_size=16, decoder_batch_sizes=(1, 2, 4))
    rng = np.random.default_rng(7)
    stem = rng.integers(1, 256, size=24).tolist()
    work = [(stem if i % 2 else []) + rng.integers(1, 256, size=int(rng.integers(3, 40))).tolist()
            for i in range(16)]
    params = staggered(len(work), base=5)
    want = run_alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), prefix_cache=True, overlap=True)
    assert tokens_of(closed_loop(over, work, params, 4)) == want
    stats = over.stats()
    assert stats.overlapped_prefills > 0 and stats.prefix_hits > 0 and stats.evictions > 0
    assert len(stats.bucket_steps) > 1


def test_a_host_cache_admission_runs_its_block_ops_before_its_chunk() -> None:
    """With a host cache, evicting for an admission saves the blocks to the host (a block op
    the device thread does not run): the chunk planned ahead is held for the next step, which
    runs the saves and restores first. Tokens are those of each request alone."""
    spec = SPECS["llama"]
    art = ArtifactConfig(model=spec, batch_size=3, max_seq_len=96, block_size=8, num_blocks=20,
                         prefill_chunk_size=16)
    work = stem_prompts(12, stems=6, count=24, longest_tail=12)
    params = staggered(len(work), base=8)
    want = run_alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), prefix_cache=True, host_cache_bytes=1 << 24,
                   overlap=True)
    held = []
    plan_ahead = over.scheduler.plan_prefill_ahead

    def spy(*args: Any) -> Any:
        plan = plan_ahead(*args)
        if plan is not None:
            held.append(bool(plan.saves or plan.restores or plan.copies))
        return plan

    over.scheduler.plan_prefill_ahead = spy  # type: ignore[method-assign]
    assert tokens_of(closed_loop(over, work, params, 3)) == want
    stats = over.stats()
    assert stats.evictions > 0 and stats.host_restores > 0
    assert any(held) and not all(held)  # chunks held for their ops, and chunks that flew


def test_sampled_requests_admitted_mid_pipeline_draw_what_synchronous_steps_draw() -> None:
    """Requests that sample (seeded), with logprobs and penalties, admitted mid-pipeline: the
    first token is drawn when the chunk lands, the lane joins the decode after; the same closed
    loop stepped synchronously gives the same tokens and logprobs."""
    spec = SPECS["llama"]
    art = artifact(spec, 3, 48, block_size=8, chunk=16, max_seq_len=96)
    work = short_prompts(10, seed=8)
    params = [SamplingParams(temperature=0.9, seed=40 + i, max_tokens=6 + (3 * i) % 7,
                             ignore_eos=True, logprobs=2 if i % 2 else None,
                             presence_penalty=0.4 if i % 3 == 0 else 0.0)
              for i in range(len(work))]

    def run(overlap: bool) -> tuple[list[Any], Batcher]:
        batcher = Batcher(NumpyRuntime.random(art, SEED), overlap=overlap)
        finals = closed_loop(batcher, work, params, 3)
        return [(f.completion.token_ids, f.finish_reason,
                 [None if lp is None else (lp.token_id, lp.logprob, lp.top)
                  for lp in f.completion.logprobs or ()]) for f in finals], batcher

    want, _ = run(False)
    got, over = run(True)
    assert got == want
    assert over.stats().overlapped_prefills > 0


def test_requests_that_end_at_their_first_token_mid_pipeline() -> None:
    """max_tokens=1, and a stop id equal to the first token: the request ends when its chunk
    lands, while the other lanes' decode is on the device (it was never in that step); the
    lanes and blocks it held serve the next admissions."""
    spec = SPECS["llama"]
    art = artifact(spec, 3, 48, block_size=8, chunk=16, max_seq_len=96)
    work = short_prompts(12, seed=17)
    probe = run_alone(art, work, [greedy(1) for _ in work])
    params = []
    for i in range(len(work)):
        if i % 3 == 1:
            params.append(greedy(1))
        elif i % 3 == 2:
            params.append(greedy(9, stop_token_ids=[probe[i][0][0]]))
        else:
            params.append(greedy(7 + i % 5))
    want = run_alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    assert tokens_of(closed_loop(over, work, params, 3)) == want
    assert [reason for _, reason in want[1::3]] == ["length"] * 4
    assert [reason for _, reason in want[2::3]] == ["stop"] * 4
    stats = over.stats()
    assert stats.overlapped_prefills > 0 and stats.lane_blocks == 0


@pytest.mark.parametrize("when", ["prefill in the air", "decode after it in the air"])
@pytest.mark.parametrize("late", [False, True])
def test_an_abort_while_the_admitted_chunk_or_the_decode_after_it_runs(when: str,
                                                                       late: bool) -> None:
    """The request admitted ahead is aborted while its chunk is on the device (or while the
    decode after it is): it ends with finish_reason abort, its lane and blocks go back, and
    every other request's tokens are those it gets alone."""
    spec = SPECS["llama"]
    art = artifact(spec, 3, 48, block_size=8, chunk=16, max_seq_len=96)
    work = short_prompts(10, seed=23)
    params = staggered(len(work))
    want = run_alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    over.decide_late = late  # (late: the abort comes before the next step is decided)
    aborted: list[str] = []
    last: list[Any] = [None]  # the flight in the air after the step before

    def between(batcher: Batcher, ids: dict[int, str], step: int) -> None:
        flight = batcher._flight
        before, last[0] = last[0], flight
        if aborted or flight is None:
            return
        if when == "prefill in the air":
            chunk = flight if flight.prefill else None
        else:  # the chunk landed (its first token is out); the decode after it is on the device
            chunk = before if before is not None and before.prefill and not flight.prefill \
                else None
        if chunk is None:
            return
        request_id = chunk.plan.request_id
        if request_id in batcher.scheduler.requests:
            assert batcher.abort(request_id)
            aborted.append(request_id)

    finals = closed_loop(over, work, params, 3, between)
    assert_only_aborted_differs(finals, want, aborted)
    stats = over.stats()
    assert stats.lane_blocks == 0 and stats.staged_blocks == 0


@pytest.mark.parametrize("fault", ["nan", "error", "transient"])
def test_a_fault_in_a_chunk_admitted_ahead_ends_only_its_request(fault: str) -> None:
    """A prefill chunk on the device thread that returns NaN or raises fails its request alone
    (finish_reason error, its blocks back); a transient fault is retried. The other lanes, whose
    decode ran after it, and later requests get the tokens they get alone."""
    from atombatch.errors import TransientDeviceError

    spec = SPECS["llama"]
    art = artifact(spec, 3, 48, block_size=8, chunk=16, max_seq_len=96)
    work = short_prompts(9, seed=29)
    params = staggered(len(work))
    want = run_alone(art, work, params)
    runtime = FaultyPrefill.random(art, SEED)
    runtime.at = 6  # the first three fill the batch synchronously; later ones are admitted ahead
    runtime.error = {"nan": None, "error": RuntimeError("device hung"),
                     "transient": TransientDeviceError("link reset")}[fault]
    over = Batcher(runtime, overlap=True)
    finals = closed_loop(over, work, params, 3)
    got = tokens_of(finals)
    failed = [i for i, f in enumerate(finals) if f.finish_reason == "error"]
    if fault == "transient":
        assert got == want and not failed
    else:
        assert len(failed) == 1
        message = finals[failed[0]].error or ""
        assert ("non-finite" in message) if fault == "nan" else ("device hung" in message)
        assert [g for i, g in enumerate(got) if i not in failed] == \
            [w for i, w in enumerate(want) if i not in failed]
    stats = over.stats()
    assert stats.overlapped_prefills > 0 and stats.lane_blocks == 0


def count_ahead(batcher: Batcher) -> dict[str, int]:
    """Counts of what the scheduler did while a decode was on the device: rotations of a staged
    request into a lane, chunks planned into a lane and into the spare (staging)."""
    counts = {"rotated": 0, "lane": 0, "staged": 0}
    scheduler = batcher.scheduler
    rotate, plan_prefill = scheduler.rotate_ahead, scheduler.plan_prefill_ahead

    def rotate_ahead(*args: Any) -> bool:
        moved = rotate(*args)
        counts["rotated"] += moved
        return moved

    def plan_prefill_ahead(*args: Any) -> Any:
        plan = plan_prefill(*args)
        if plan is not None:
            counts["staged" if plan.staged else "lane"] += 1
        return plan

    scheduler.rotate_ahead = rotate_ahead  # type: ignore[method-assign]
    scheduler.plan_prefill_ahead = plan_prefill_ahead  # type: ignore[method-assign]
    return counts


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_queue_behind_a_full_batch_stages_and_rotates_inside_the_pipeline(
        family: str, core: str) -> None:
    """More requests in flight than lanes: the queue's head is staged into the spare by chunks
    the device thread runs after a decode, and takes a lane that frees while a decode is on the
    device (it joins the step after). Tokens are those of each request alone."""
    spec = SPECS[family]
    art = artifact(spec, 3, 48, block_size=8, chunk=16, max_seq_len=96)
    work = short_prompts(16, seed=3)
    params = staggered(len(work))
    want = run_alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    counts = count_ahead(over)
    assert tokens_of(closed_loop(over, work, params, 6)) == want
    stats = over.stats()
    assert counts["staged"] >= 5 and counts["rotated"] >= 5
    assert stats.overlapped_prefills >= counts["staged"]
    assert stats.lane_blocks == 0 and stats.staged_blocks == 0


def test_staging_with_prefix_hits_and_evictions_inside_the_pipeline() -> None:
    """Staging reads the prefix cache (shared stems) at a pool small enough to evict, with
    buckets (padding rows): staged chunks whose hits need copies or restores wait for the next
    step; the others fly. Tokens are those of each request alone."""
    spec = SPECS["qwen3"]
    art = ArtifactConfig(model=spec, batch_size=3, max_seq_len=96, block_size=8, num_blocks=40,
                         prefill_chunk_size=16, decoder_batch_sizes=(1, 2, 3))
    work = stem_prompts(5, stems=3, count=30, longest_tail=8)
    params = staggered(len(work), base=4)
    want = run_alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), prefix_cache=True, overlap=True)
    counts = count_ahead(over)
    assert tokens_of(closed_loop(over, work, params, 5)) == want
    stats = over.stats()
    assert counts["staged"] > 0 and counts["rotated"] > 0
    assert stats.prefix_hits > 0 and stats.evictions > 0 and stats.staged_chunks > 0
    assert stats.lane_blocks == 0 and stats.staged_blocks == 0


def test_aborting_the_staged_request_inside_the_pipeline() -> None:
    """The request being staged is aborted while its chunk is on the device, and another one
    right after it took a lane ahead: their blocks (the spare among them) go back, a new spare
    is kept, and every other request's tokens are those it gets alone."""
    spec = SPECS["llama"]
    art = artifact(spec, 3, 48, block_size=8, chunk=16, max_seq_len=96)
    work = short_prompts(16, seed=13)
    params = staggered(len(work))
    want = run_alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    counts = count_ahead(over)
    aborted: list[str] = []
    rotated = [0]

    def between(batcher: Batcher, ids: dict[int, str], step: int) -> None:
        flight = batcher._flight
        staging = batcher.scheduler.staging
        if not aborted and flight is not None and flight.prefill and flight.plan.staged and \
                staging is not None:
            assert batcher.abort(staging.request_id)
            aborted.append(staging.request_id)
        elif len(aborted) == 1 and counts["rotated"] > rotated[0] and flight is not None:
            newest = max((r for r in batcher.scheduler.by_lane if r is not None),
                         key=lambda r: r.admit_order)
            assert batcher.abort(newest.request_id)
            aborted.append(newest.request_id)
        rotated[0] = counts["rotated"]

    finals = closed_loop(over, work, params, 6, between)
    assert len(aborted) == 2
    got = tokens_of(finals)
    for i, final in enumerate(finals):
        if final.request_id in aborted:
            assert final.finish_reason == "abort"
        else:
            assert got[i] == want[i]
    stats = over.stats()
    assert stats.lane_blocks == 0 and stats.staged_blocks == 0 and stats.spare_blocks == 1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_burst_of_arrivals_is_admitted_chunk_after_chunk_inside_the_pipeline(
        family: str, core: str) -> None:
    """Lanes that end in the same step free together and the client sends that many requests
    at once: the first chunk is planned while a decode runs, each next one right after the
    chunk before it (a chain, or while that chunk runs; a ring of prefill buffers in turn), then
    the lanes' decode; every request's tokens are those it gets alone."""
    spec = SPECS[family]
    art = artifact(spec, 4, 64, block_size=8, chunk=16, max_seq_len=96)
    work = short_prompts(24, seed=41)
    # one long request decodes on while the short ones of each wave end together
    params = [greedy(60 if i == 0 else 9) for i in range(len(work))]
    want = run_alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    chained = [0]
    plan_prefill = over.scheduler.plan_prefill_ahead

    def spy(running: Any, *args: Any) -> Any:
        plan = plan_prefill(running, *args)
        chained[0] += plan is not None and running.kind == "prefill"
        return plan

    over.scheduler.plan_prefill_ahead = spy  # type: ignore[method-assign]
    assert tokens_of(closed_loop(over, work, params, 4)) == want
    stats = over.stats()
    assert chained[0] >= 6 and stats.overlapped_prefills >= chained[0]
    assert stats.lane_blocks == 0 and stats.staged_blocks == 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_greedy_request_admitted_ahead_decodes_in_the_step_right_after_its_chunk(
        family: str) -> None:
    """The decode after a chunk planned ahead is built before the chunk's token exists; a
    greedy request's row in it takes the chunk's argmax, written in by the device thread, so
    the request decodes its second token in the very next device call (a request that samples
    joins the step after). Tokens are those of each request alone, sampled ones included."""
    spec = SPECS[family]
    art = artifact(spec, 4, 64, block_size=8, chunk=16, max_seq_len=96)
    work = short_prompts(16, seed=41)
    params = [greedy(6 + (5 * i) % 13) if i % 4 != 3 else
              SamplingParams(temperature=0.8, seed=i, max_tokens=6 + (5 * i) % 13,
                             ignore_eos=True) for i in range(len(work))]
    want = run_alone(art, work, params)
    runtime = CallLog.random(art, SEED)
    runtime.log = []
    over = Batcher(runtime, overlap=True)
    assert tokens_of(closed_loop(over, work, params, 4)) == want
    log = runtime.log
    joined = [i for i, call in enumerate(log[:-1]) if call[0] == "prefill" and
              log[i + 1][0] == "decode" and log[i + 1][1].get(call[1]) == call[2]]
    late = [i for i, call in enumerate(log[:-1]) if call[0] == "prefill" and
            log[i + 1][0] == "decode" and log[i + 1][1].get(call[1]) != call[2]]
    stats = over.stats()
    assert stats.overlapped_prefills >= 8
    # most greedy admissions after the first batch join at once (the sampled ones cannot)
    assert stats.overlapped_joins >= 6 and len(joined) >= stats.overlapped_joins
    if family == "llama":  # (a hybrid decode after a sampled chunk of a full batch has no slot
        assert late      # for its padding: the host schedules it once the chunk lands)


@pytest.mark.parametrize(("policy", "chunks", "decodes"),
                         [("stall-free:1", 1, 1), ("stall-free:2", 2, 1), ("interleave:2", 1, 2)])
def test_a_wave_of_arrivals_runs_in_the_pipeline_at_the_policys_pace(
        policy: str, chunks: int, decodes: int) -> None:
    """Lanes that end together are refilled together; stall-free:k runs at most k chunks
    between two decodes, interleave:n at least n decodes between two chunks: the pipeline
    builds the decodes the policy wants while requests wait (the queue has no prefill turn
    before them) and goes on admitting after them, instead of draining to the synchronous
    engine. Tokens are those of each request alone."""
    spec = SPECS["llama"]
    art = artifact(spec, 5, 64, block_size=8, chunk=16, max_seq_len=96)
    work = short_prompts(25, seed=43)
    params = [greedy(70 if i == 0 else 8) for i in range(len(work))]  # waves of four
    want = run_alone(art, work, params)
    runtime = CallLog.random(art, SEED)
    runtime.log = []
    over = Batcher(runtime, overlap=True, policy=policy)
    assert tokens_of(closed_loop(over, work, params, 5)) == want
    kinds = "".join(call[0][0] for call in runtime.log)  # "p" and "d"
    steady = kinds[kinds.index("d"):]  # (before the first decode: no lane decodes)
    runs = [len(run) for run in steady.split("d") if run]
    assert runs and max(runs) <= chunks, runs
    gaps = [len(run) for run in steady.strip("d").split("p") if run]
    assert gaps and min(gaps) >= decodes, gaps
    later = len(work) - 5  # the first five are admitted before the pipeline runs
    assert over.stats().overlapped_prefills >= later - 2, (over.stats().overlapped_prefills, later)


@pytest.mark.parametrize("late", [False, True])
def test_deciding_late_gives_a_refill_the_step_after_the_one_on_the_device(late: bool) -> None:
    """A closed loop submits the next request once its predecessor's last token is out, while
    the step after that one is on the device. Decided at the landing, the step after it is
    built before the submit, so the lane idles two steps; with `decide_late` the next `step()`
    builds it with the refill's chunk first, so the lane idles only the step on the device
    (the refill decodes in the step after its chunk). Tokens are those of each request alone,
    with aborts between steps mixed in."""
    spec = SPECS["llama"]
    art = artifact(spec, 4, 64, block_size=8, chunk=16, max_seq_len=96)
    work = short_prompts(20, seed=47)
    params = staggered(len(work))
    want = run_alone(art, work, params)
    runtime = CallLog.random(art, SEED)
    runtime.log = []
    over = Batcher(runtime, overlap=True)
    over.decide_late = late
    assert tokens_of(closed_loop(over, work, params, 4)) == want
    log = runtime.log
    idle: list[int] = []  # per refill: decodes between the lane's last row and its chunk
    first_decode = next(i for i, call in enumerate(log) if call[0] == "decode")
    for i, call in enumerate(log):
        if call[0] != "prefill" or i < first_decode:
            continue
        lane, between = call[1], 0
        for before in reversed(log[:i]):
            if before[0] == "decode":
                if before[1].get(lane, 0) > 0:
                    break
                between += 1
        idle.append(between)
    assert len(idle) >= len(work) - 4 - 2, idle
    if late:
        assert max(idle) == 1, idle
    else:  # (a refill behind a drained pipeline goes through the synchronous step: 1)
        assert sum(steps >= 2 for steps in idle) >= len(idle) // 2, idle
    assert over.stats().lane_blocks == 0

"""A wave of arrivals decided as one chain (`PipelineRunner._chain_wave`, atombatch/engine/pipeline.py): lanes
that end together are refilled together, and while a decode is on the device the engine plans
every refill's chunk to run right after the one before it (`Flight.then`), then the decode of
the other lanes after the last of them, so the device thread runs the whole wave without
waiting for the host. Each greedy request of the chain joins that decode (`build_ahead`'s
`joins`); one that samples decodes from the step after it.

Every request's tokens are compared with the same request run alone on a fresh synchronous
engine (NumPy runtime: real decoder math, KV written for every row it is given).
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
    loop_through,
    run_alone,
    short_prompts,
    tokens_of,
)
from support.pd_models import SEED, SPECS, artifact

from atombatch import Batcher, SamplingParams
from atombatch.engine.pipeline import DeviceThread
from atombatch.runtime import NumpyRuntime

pytestmark = pytest.mark.numerics

LANES = 5


def waves(count: int, seed: int, sampled: bool = True) -> tuple[list[list[int]], list[Any]]:
    """One long request and short ones that end four at a time (each wave refilled at once);
    every fifth short one samples (it cannot join the decode after its chunk)."""
    work = short_prompts(count, seed=seed)
    params: list[Any] = []
    for i in range(count):
        if i == 0:
            params.append(greedy(70))
        elif sampled and i % 5 == 3:
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=8,
                                         ignore_eos=True))
        else:
            params.append(greedy(8))
    return work, params


def greedy_waves(seed: int, family: str = "llama"
                 ) -> tuple[list[list[int]], list[Any], list[Any], Batcher]:
    """Greedy `waves` of 21 requests (on llama unless `family` says): the work, its params,
    each request's tokens alone, and a pipelined `Batcher` to run them on."""
    art = artifact(SPECS[family], LANES, 64, block_size=8, chunk=16, max_seq_len=96)
    work, params = waves(21, seed=seed, sampled=False)
    return work, params, run_alone(art, work, params), \
        Batcher(NumpyRuntime.random(art, SEED), overlap=True)


def record_chains(batcher: Batcher) -> list[tuple[int, dict[int, int]]]:
    """Every decode the scheduler builds after a chain of two or more chunks, while the decode
    before them is on the device: (the chain's length, {lane: position} of the requests that
    join it)."""
    decided: list[tuple[int, dict[int, int]]] = []
    plan = batcher.scheduler.plan_chunk_decode

    def spy(step: Any, running: Any, prefill: Any, gather: Any, joins: Any = (),
            chained: int = 1) -> Any:
        rows = plan(step, running, prefill, gather, joins, chained)
        if rows is not None and chained >= 2:
            decided.append((chained, {request.lane: len(request.prompt)
                                      for request, row in zip(joins, rows, strict=True)
                                      if row >= 0}))
        return rows

    batcher.scheduler.plan_chunk_decode = spy  # type: ignore[method-assign]
    return decided


def count_joins_that_ran(batcher: Batcher) -> list[int]:
    """For every decode the device thread calls, how many requests of the chunks before it
    were decided to join it (filled in as the engine runs)."""
    ran: list[int] = []
    runtime = batcher.runtime
    call = runtime.decode

    def spy(inputs: Any) -> Any:
        flights = [f for f in batcher._flights or () if f.plan.inputs is inputs]
        ran.append(flights[0].joins if flights else 0)  # (none: a synchronous step)
        return call(inputs)

    runtime.decode = spy  # type: ignore[method-assign]
    return ran


def runs_of_chunks(log: list[Any]) -> list[tuple[list[Any], Any]]:
    """(chunks, the decode right after them) for every run of chunks in a `CallLog` after the
    first decode (the batch's first fill comes before it)."""
    found = []
    i = next(i for i, call in enumerate(log) if call[0] == "decode")
    while i < len(log):
        if log[i][0] != "prefill":
            i += 1
            continue
        j = i
        while j < len(log) and log[j][0] == "prefill":
            j += 1
        if j < len(log):
            found.append((log[i:j], log[j][1]))
        i = j
    return found


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_a_wave_of_refills_runs_as_one_chain_and_gets_the_tokens_alone(family: str,
                                                                       core: str) -> None:
    """Waves of four refills are decided as one chain with the lanes' decode after it, while
    the decode before them is on the device: the device runs the chunks back to back and then
    that decode, in which every greedy request of the chain has its row at its prompt's length
    (its first token its chunk's argmax, written in on the device thread; one that samples
    decodes from the step after). Tokens are those of each request alone; with chains off
    (`_max_chain` 1) the same workload chains nothing."""
    spec = SPECS[family]
    art = artifact(spec, LANES, 64, block_size=8, chunk=16, max_seq_len=96)
    work, params = waves(25, seed=43)
    want = run_alone(art, work, params)
    runtime = CallLog.random(art, SEED)
    runtime.log = []
    over = Batcher(runtime, overlap=True)
    decided = record_chains(over)
    assert tokens_of(closed_loop(over, work, params, LANES)) == want
    stats = over.stats()
    assert stats.chained_chunks >= 8, stats.chained_chunks  # (five waves of four: up to 15)
    # (a hybrid model's single decode bucket: a chain with a sampled request would need a
    # padding row, and every slot it may write is a chained lane's fresh window, so the host
    # builds that decode once the chunks have landed; the chunks still run back to back)
    assert len(decided) >= (1 if spec.is_hybrid else 4), decided
    assert sum(len(joined) == chained for chained, joined in decided) >= 1, decided
    runs = runs_of_chunks(runtime.log)
    for chained, joined in decided:  # each ran as decided: its chunks, then its decode
        assert any(len(chunks) == chained and
                   {lane for _, lane, _ in chunks} >= set(joined) and
                   all(after.get(lane) == position for lane, position in joined.items())
                   for chunks, after in runs), (chained, joined, runs)

    control = Batcher(CallLog.random(art, SEED), overlap=True)
    control._max_chain = 1
    control.runtime.log = []  # type: ignore[attr-defined]
    none = record_chains(control)
    assert tokens_of(closed_loop(control, work, params, LANES)) == want
    assert control.stats().chained_chunks == 0 and not none


@pytest.mark.parametrize("fault", ["nan", "error", "transient"])
def test_a_fault_in_a_chunk_inside_a_chain_ends_only_its_request(fault: str) -> None:
    """The second chunk of a wave's chain returns NaN or raises: its request alone fails
    (finish_reason error, blocks back) or, for a transient fault, is run again; the chunks
    after it in the chain never launch (the thread stops at a failed call) and prefill later,
    and every other request gets the tokens it gets alone."""
    from atombatch.errors import TransientDeviceError

    spec = SPECS["llama"]
    art = artifact(spec, LANES, 64, block_size=8, chunk=16, max_seq_len=96)
    work, params = waves(21, seed=47, sampled=False)
    want = run_alone(art, work, params)
    runtime = FaultyPrefill.random(art, SEED)
    runtime.at = LANES + 2  # the first wave's second chunk (the first five fill the batch)
    runtime.error = {"nan": None, "error": RuntimeError("device hung"),
                     "transient": TransientDeviceError("link reset")}[fault]
    over = Batcher(runtime, overlap=True)
    ran_joins = count_joins_that_ran(over)
    finals = closed_loop(over, work, params, LANES)
    got = tokens_of(finals)
    failed = [i for i, f in enumerate(finals) if f.finish_reason == "error"]
    if fault == "transient":
        assert got == want and not failed
    else:
        assert len(failed) == 1, failed
        message = finals[failed[0]].error or ""
        assert ("non-finite" in message) if fault == "nan" else ("device hung" in message)
        assert [g for i, g in enumerate(got) if i not in failed] == \
            [w for i, w in enumerate(want) if i not in failed]
    stats = over.stats()
    assert stats.chained_chunks >= 4 and stats.lane_blocks == 0 and stats.staged_blocks == 0
    # a join counts once its decode ran: not the failed chain's, which never launched
    assert stats.overlapped_joins == sum(ran_joins) > 0, (stats.overlapped_joins, ran_joins)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("at", ["the decode before the chain", "the chain's first chunk"])
def test_an_interrupt_landing_inside_a_chain_drops_the_rest_of_it(at: str, family: str
                                                                   ) -> None:
    """A BaseException while the engine lands the decode a chain follows (or the chain's first
    chunk): `step()` raises it, and every flight decided with what it landed (the rest of the
    chain, the decode after it) lands unreported; their requests prefill again (on a hybrid
    model, the lanes those flights wrote recompute), and every request gets the tokens it
    gets alone."""
    work, params, want, over = greedy_waves(seed=53, family=family)
    fired: list[str] = []
    land, land_prefill = over._land, over._land_prefill

    def chained(flight: Any) -> bool:
        return flight is not None and flight.prefill and flight.then is not None and \
            flight.then.prefill

    def interrupted_decode(flight: Any, outputs: Any) -> None:
        if at == "the decode before the chain" and not fired and chained(over._flight):
            fired.append(over._flight.plan.request_id)  # type: ignore[union-attr]
            raise KeyboardInterrupt
        land(flight, outputs)

    def interrupted_chunk(flight: Any, outputs: Any) -> None:
        if at == "the chain's first chunk" and not fired and chained(flight):
            fired.append(flight.plan.request_id)
            raise KeyboardInterrupt
        land_prefill(flight, outputs)

    over._land = interrupted_decode  # type: ignore[method-assign]
    over._land_prefill = interrupted_chunk  # type: ignore[method-assign]
    finals, raised = loop_through(over, work, params, LANES, KeyboardInterrupt)
    assert raised == 1 and fired
    assert tokens_of(finals) == want
    stats = over.stats()
    assert stats.lane_blocks == 0 and stats.staged_blocks == 0


def test_aborting_a_request_whose_chunk_waits_in_a_chain() -> None:
    """The request of a chain's third chunk is aborted while the chain is in the air (its chunk
    planned, maybe run): it ends with finish_reason abort, its lane and blocks go back, and the
    chain's other requests and every later one get the tokens they get alone."""
    work, params, want, over = greedy_waves(seed=59)
    aborted: list[str] = []

    def between(batcher: Batcher, ids: dict[int, str], step: int) -> None:
        flight = batcher._flight
        if aborted or flight is None or not flight.prefill or flight.then is None or \
                not flight.then.prefill or flight.then.then is None:
            return
        request_id = flight.then.then.plan.request_id  # (the chain's third chunk, or later)
        if request_id in batcher.scheduler.requests and batcher.abort(request_id):
            aborted.append(request_id)

    ran_joins = count_joins_that_ran(over)
    finals = closed_loop(over, work, params, LANES, between)
    assert_only_aborted_differs(finals, want, aborted)
    stats = over.stats()
    assert stats.chained_chunks >= 4 and stats.lane_blocks == 0 and stats.staged_blocks == 0
    # a join counts once its decode ran (the aborted request's row in it included)
    assert stats.overlapped_joins == sum(ran_joins) > 0, (stats.overlapped_joins, ran_joins)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_waves_that_stop_on_an_id_with_refills_decided_late(family: str) -> None:
    """Half of each wave stops on an id (such a lane keeps a row in the decode built before
    the stop landed) as the other half reaches its limit, and the refills are decided late,
    while that decode is on the device: every request's tokens are those it gets alone. (A
    chain refuses such a lane, as a single chunk does; that an admission to it would be wrong
    is not shown here: with the refusal removed this workload still passes.)"""
    spec = SPECS[family]
    art = artifact(spec, LANES, 64, block_size=8, chunk=16, max_seq_len=96)
    work, _ = waves(25, seed=61, sampled=False)
    probe = run_alone(art, work, [greedy(8) for _ in work])
    params = [greedy(70)] + [greedy(12, stop_token_ids=[probe[i][0][7]]) if i % 2 else
                             greedy(8) for i in range(1, len(work))]
    want = run_alone(art, work, params)
    assert sum(reason == "stop" for _, reason in want) >= 8
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    over.decide_late = True
    assert tokens_of(closed_loop(over, work, params, LANES)) == want
    stats = over.stats()
    assert stats.overlapped_prefills >= 5 and stats.lane_blocks == 0


def count_written_joins(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every join the device thread really writes in (a chunk's argmax into its row of the
    decode after it)."""
    written: list[int] = []
    after_chunk = DeviceThread._after_chunk

    def spy(chunk: Any, after: Any) -> None:
        if chunk.join_into is not None and chunk.join_row >= 0:
            written.append(1)
        after_chunk(chunk, after)

    monkeypatch.setattr(DeviceThread, "_after_chunk", staticmethod(spy))
    return written


@pytest.mark.parametrize("seed", [3, 8])
def test_overlapped_joins_counts_only_requests_that_joined(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy requests of one token are admitted ahead but never join the decode after their
    chunk: the stat equals the joins the device thread wrote in."""
    art = artifact(SPECS["gemma3"], 4, 64, block_size=8, chunk=16, max_seq_len=96)
    work = short_prompts(16, seed=41 + seed)
    rng = np.random.default_rng(seed)
    # some greedy requests of one token: admitted ahead, they never join the decode after
    params = [greedy(60) if i == 0 else greedy(int(rng.choice([1, 1, 2, 5, 7])))
              for i in range(len(work))]
    want = run_alone(art, work, params)
    written = count_written_joins(monkeypatch)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    assert tokens_of(closed_loop(over, work, params, 4)) == want
    stats = over.stats()
    assert stats.overlapped_joins == len(written), (stats.overlapped_joins, len(written))

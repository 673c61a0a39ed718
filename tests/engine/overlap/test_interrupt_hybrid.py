"""Interrupts (a BaseException out of `step()`) on a hybrid model: a step that ran on the device
and runs again.

A Gemma3 lane keeps its sliding-window layers' K/V in a shift buffer of the newest
`sliding_window` positions (the NumPy runtime's slot, as the device's), so a decode position
written a second time shifts out one the window still needs. Whatever runs again after an
interrupt (the step whose landing raised, the flight dropped after it, a synchronous step that
raised after its device call, padding rows that wrote a finishing lane's slot) must recompute
those lanes (`StepRunner._recompute_spoiled`): every request's tokens are compared with the same
request run alone on a fresh synchronous engine, llama alongside as the control.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from support.overlap import choices_loop, greedy, loop_through, run_alone, tokens_of
from support.pd_models import SEED, SPECS

from atombatch import ArtifactConfig, Batcher, SamplingParams
from atombatch.runtime import NumpyRuntime

pytestmark = pytest.mark.numerics


def _setup(spec_name: str, batch: int = 4, seed: int = 5
           ) -> tuple[ArtifactConfig, list[list[int]], list[Any]]:
    art = ArtifactConfig(model=SPECS[spec_name], batch_size=batch, max_seq_len=64, block_size=8,
                         num_blocks=batch * 8 + 2, prefill_chunk_size=16,
                         decoder_batch_sizes=(batch,))
    rng = np.random.default_rng(seed)
    work = [rng.integers(1, 256, size=int(rng.integers(9, 30))).tolist() for _ in range(10)]
    params = [greedy(min(8 + (7 * i) % 13, 64 - len(p))) for i, p in enumerate(work)]
    return art, work, params


def interrupt_once(over: Batcher, when: Any, error: type[BaseException] = KeyboardInterrupt
                   ) -> list[Any]:
    """The first decode landing for which `when(flight, running)` holds (`running`: the flight
    on the device after it) raises `error` before it lands anything. Returns the flights that
    raised (one, once it fired)."""
    land = over._land
    fired: list[Any] = []

    def interrupted(flight: Any, outputs: Any) -> None:
        if not fired and when(flight, over._flight):
            fired.append(flight)
            raise error
        land(flight, outputs)

    over._land = interrupted  # type: ignore[method-assign]
    return fired


def run_interrupted(over: Batcher, fired: list[Any], work: list[list[int]], params: list[Any],
                    first: int, want: list[Any],
                    error: type[BaseException] = KeyboardInterrupt) -> None:
    """`loop_through` on `over`, whose landings raise once (`interrupt_once`): it raised once,
    every request's tokens are those alone, and no lane keeps a block."""
    finals, raised = loop_through(over, work, params, first, error)
    assert raised == 1 and fired
    assert tokens_of(finals) == want
    assert over.stats().lane_blocks == 0


@pytest.mark.parametrize("spec_name", ["llama", "gemma3"])
@pytest.mark.parametrize(("after", "nth", "seed"), [("nothing", 1, 2),
                                                    ("a chunk and no decode", 1, 5)])
def test_an_interrupt_landing_a_decode_whose_lanes_no_dropped_decode_holds(
        spec_name: str, after: str, nth: int, seed: int, core: str) -> None:
    """Landing decode N raises with nothing on the device after it, or only a chunk (no decode
    decided after it): N's own lanes run their positions again and no dropped decode has a row
    for them; they recompute all the same."""
    art, work, params = _setup(spec_name, seed=seed)
    want = run_alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    seen: list[int] = []

    def when(flight: Any, nxt: Any) -> bool:
        if nxt is None:
            kind = "nothing"
        elif nxt.prefill and nxt.then is None and nxt not in over._dropped:
            kind = "a chunk and no decode"
        else:
            kind = ""
        positions = flight.plan.inputs.cache_position[:flight.plan.rows, 0]
        if kind == after and positions.max() >= 8:  # past the window
            seen.append(1)
        return len(seen) == nth

    fired = interrupt_once(over, when)
    run_interrupted(over, fired, work, params, 5, want)


@pytest.mark.parametrize("spec_name", ["llama", "gemma3"])
@pytest.mark.parametrize("running", ["decode", "chunk"])
@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_landing_a_decode_with_the_next_step_on_the_device(
        spec_name: str, running: str, error: type[BaseException]) -> None:
    """Landing decode N raises with the step fed from N's tokens on the device (the next
    decode, or a chunk admitted ahead): that step lands unreported, and N's lanes and its own
    run their positions again, so on a hybrid model they recompute (preempted, their KV not
    kept). (A hybrid model with the prefix cache steps synchronously: its slot checkpoints keep
    any step from running ahead.)"""
    spec = SPECS[spec_name]
    art = ArtifactConfig(model=spec, batch_size=3, max_seq_len=48, block_size=8, num_blocks=19,
                         prefill_chunk_size=16, decoder_batch_sizes=(1, 2, 3))
    rng = np.random.default_rng(29)
    # prompts of one chunk and of two (only one-chunk prompts are admitted ahead)
    work = [rng.integers(1, 256, size=int(rng.integers(9, 30))).tolist() for _ in range(8)]
    params = [greedy(min(10 + (5 * i) % 9, 48 - len(p))) for i, p in enumerate(work)]
    want = run_alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    landed: list[int] = []
    rows: list[int] = []   # the rows of the decode whose landing raised

    def when(flight: Any, nxt: Any) -> bool:
        landed.append(1)
        if nxt is not None and nxt not in over._dropped and \
                nxt.prefill == (running == "chunk") and len(landed) > 6:
            rows.append(int(flight.plan.rows))
            return True
        return False

    fired = interrupt_once(over, when, error)
    run_interrupted(over, fired, work, params, 3 + (running == "chunk"), want, error)
    if spec.is_hybrid:  # its lanes recomputed
        assert over.stats().preemptions >= rows[0] >= 1


class InterruptAfterDecode(NumpyRuntime):
    """The device ran the decode; the interrupt arrives as it returns (a synchronous step).
    Likewise the first prefill chunk that does not start a prompt, with `chunks` set."""

    at_call = 6
    calls = 0
    chunks = False

    def decode(self, inputs: Any) -> Any:
        logits = super().decode(inputs)
        self.calls += 1
        if not self.chunks and self.calls == self.at_call and \
                threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt
        return logits

    def prefill(self, inputs: Any, **kw: Any) -> Any:
        logits = super().prefill(inputs, **kw)
        start = int(np.asarray(inputs.cache_position).reshape(-1)[0])
        if self.chunks and start > 0 and self.at_call > 0:
            self.at_call = 0
            raise KeyboardInterrupt
        return logits


@pytest.mark.parametrize("spec_name", ["llama", "gemma3"])
def test_a_synchronous_chunk_interrupted_after_it_ran(spec_name: str) -> None:
    """A prompt's second chunk (positions 16 on, reading the window the first chunk wrote)
    raises as its device call returns: it runs again next step, so on a hybrid model its
    request recomputes."""
    art, work, params = _setup(spec_name)
    want = run_alone(art, work, params)
    runtime = InterruptAfterDecode.random(art, SEED)
    runtime.chunks = True
    over = Batcher(runtime, overlap=False)
    finals, raised = loop_through(over, work, params, 4, KeyboardInterrupt)
    assert raised == 1 and runtime.at_call == 0
    assert tokens_of(finals) == want


@pytest.mark.parametrize("spec_name", ["llama", "gemma3"])
def test_a_synchronous_step_interrupted_after_its_decode_ran(spec_name: str) -> None:
    """A synchronous decode step raises as its device call returns: its lanes run their
    positions again next step, so on a hybrid model they recompute."""
    art, work, params = _setup(spec_name)
    want = run_alone(art, work, params)
    runtime = InterruptAfterDecode.random(art, SEED)
    runtime.at_call = 15
    over = Batcher(runtime, overlap=False)
    finals, raised = loop_through(over, work, params, 4, KeyboardInterrupt)
    assert raised == 1
    assert tokens_of(finals) == want


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_an_interrupt_when_the_dropped_decode_pads_on_a_finishing_lane(seed: int, core: str
                                                                      ) -> None:
    """The decode built ahead gives its padding row the slot of a lane that ends by its limit
    in the step on the device; landing that step raises, so the lane did not end and runs its
    last position again, with a window the padding row wrote: it recomputes too."""
    spec = SPECS["gemma3"]
    # a bucket of 4 for 3 rows: one padding row, on the slot of the lane that finishes
    art = ArtifactConfig(model=spec, batch_size=4, max_seq_len=48, block_size=8, num_blocks=25,
                         prefill_chunk_size=16, decoder_batch_sizes=(1, 2, 4))
    rng = np.random.default_rng(seed)
    work = [rng.integers(1, 256, size=int(rng.integers(9, 30))).tolist() for _ in range(4)]
    params = [greedy(min(12 + 3 * i, 48 - len(p))) for i, p in enumerate(work)]
    want = run_alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)

    def when(flight: Any, nxt: Any) -> bool:
        if nxt is None or nxt.prefill or nxt in over._dropped:
            return False
        inputs = nxt.plan.inputs
        real = set(inputs.row_lanes[:nxt.plan.rows].tolist())
        padded = set(inputs.row_lanes[nxt.plan.rows:inputs.num_rows].tolist())
        landing = set(flight.plan.inputs.row_lanes[:flight.plan.rows].tolist())
        return bool((landing - real) & padded)  # in the step landing, padded in the next

    fired = interrupt_once(over, when)
    run_interrupted(over, fired, work, params, 4, want)


# (a chain on the device: tests/engine/overlap/test_overlap_chain.py, which makes waves of refills)
WHERE = ["decode>decode", "decode>chunk", "chunk>decode", "decode>none", "chunk>none"]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("abort_after", [False, True])
def test_interrupts_at_every_kind_of_landing_on_gemma3(where: str, abort_after: bool,
                                                       core: str) -> None:
    """An interrupt landing a decode or a chunk, with a decode, a chunk or nothing on the
    device after it, over random layouts (buckets or one, prompts of one to three chunks,
    stop ids), optionally with a request aborted before the next step: tokens as alone, no
    blocks left; each kind comes up in at least two of the seeds tried."""
    fired = sum(_interrupt_once(where, seed, abort_after) for seed in range(8))
    assert fired >= 2, (where, fired)


def _interrupt_once(where: str, seed: int, abort_after: bool) -> bool:
    spec = SPECS["gemma3"]
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(3, 6))
    buckets = tuple(sorted({1, 2, batch})) if seed % 2 else (batch,)
    art = ArtifactConfig(model=spec, batch_size=batch, max_seq_len=64, block_size=8,
                         num_blocks=batch * 8 + 2, prefill_chunk_size=16,
                         decoder_batch_sizes=buckets)
    work = [rng.integers(1, 256, size=int(rng.integers(3, 16 if seed % 3 else 40))).tolist()
            for _ in range(14)]
    probe = run_alone(art, work, [greedy(min(12, 64 - len(p))) for p in work])
    params = []
    for i, p in enumerate(work):
        limit = min(int(rng.integers(2, 20)), 64 - len(p))
        if i % 3 == 1 and len(probe[i][0]) > 4:  # stop on an id
            params.append(greedy(limit, stop_token_ids=[probe[i][0][3]]))
        else:
            params.append(greedy(limit))
    want = run_alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    land, land_prefill = over._land, over._land_prefill
    fired: list[str] = []
    seen = [0]

    def ok(landing_prefill: bool) -> bool:
        nxt = over._flight
        if fired or (nxt is not None and nxt in over._dropped):
            return False
        kind = ("chunk" if landing_prefill else "decode") + ">"
        if nxt is None:
            kind += "none"
        elif nxt.prefill and nxt.then is not None and nxt.then.prefill:
            kind += "chain"
        else:
            kind += "chunk" if nxt.prefill else "decode"
        if kind != where:
            return False
        seen[0] += 1
        return seen[0] >= 1 + seed % 3

    def interrupted(flight: Any, outputs: Any) -> None:
        if ok(False):
            fired.append(where)
            raise KeyboardInterrupt
        land(flight, outputs)

    def interrupted_chunk(flight: Any, outputs: Any) -> None:
        if ok(True):
            fired.append(where)
            raise KeyboardInterrupt
        land_prefill(flight, outputs)

    over._land = interrupted  # type: ignore[method-assign]
    over._land_prefill = interrupted_chunk  # type: ignore[method-assign]
    aborted: list[int] = []

    def abort_one(over: Batcher, ids: list[str]) -> None:  # between the raise and the next step
        live = [i for i, r in enumerate(ids) if r in over.scheduler.requests]
        if abort_after and live:
            victim = live[len(live) // 2]
            assert over.abort(ids[victim])
            aborted.append(victim)

    finals, raised = loop_through(over, work, params, batch + 1, KeyboardInterrupt, abort_one)
    if not fired:
        return False
    assert raised == 1
    for i, (final, w) in enumerate(zip(finals, want, strict=True)):
        g = (final.completion.token_ids, final.finish_reason)
        if i in aborted:
            assert g[1] == "abort" and w[0][:len(g[0])] == g[0]
        else:
            assert g == w, (i, g, w)
    stats = over.stats()
    assert stats.lane_blocks == 0 and stats.staged_blocks == 0
    return True


@pytest.mark.parametrize("nth", [2, 5, 9])
@pytest.mark.parametrize("spec_name", ["gemma3", "llama"])
def test_interrupts_with_groups_and_sampled(nth: int, spec_name: str, core: str) -> None:
    """The `nth` landing raises while n > 1 groups and seeded sampled requests come and go:
    every request ends as it does alone (its choices' finish reasons), and the greedy ones
    with the same tokens."""
    spec = SPECS[spec_name]
    art = ArtifactConfig(model=spec, batch_size=4, max_seq_len=64, block_size=8, num_blocks=34,
                         prefill_chunk_size=16, decoder_batch_sizes=(1, 2, 4))
    rng = np.random.default_rng(nth)
    work = [rng.integers(1, 256, size=int(rng.integers(9, 30))).tolist() for _ in range(14)]
    params: list[Any] = []
    for i in range(len(work)):
        if i % 5 == 2:
            params.append(SamplingParams(temperature=0.9, seed=i, n=2, max_tokens=6,
                                         ignore_eos=True))
        elif i % 5 == 4:
            params.append(SamplingParams(temperature=0.9, seed=i, max_tokens=7,
                                         ignore_eos=True))
        else:
            params.append(greedy(min(6 + (5 * i) % 11, 64 - len(work[i]))))
    want = []
    for p, sp in zip(work, params, strict=True):
        want += choices_loop(Batcher(NumpyRuntime.random(art, SEED)), [p], [sp], 1)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    landings: list[int] = []

    def when(flight: Any, nxt: Any) -> bool:
        landings.append(1)
        return len(landings) == nth

    interrupt_once(over, when)
    step = over.step
    raised = [0]

    def guarded() -> Any:
        try:
            return step()
        except KeyboardInterrupt:
            raised[0] += 1
            return []

    over.step = guarded  # type: ignore[method-assign]
    got = choices_loop(over, work, params, 5)
    assert raised[0] == 1
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert [e for _, e in g[0]] == [e for _, e in w[0]], i
        if params[i].temperature == 0.0:
            assert g == w, (i, g, w)
    stats = over.stats()
    assert stats.lane_blocks == 0 and stats.staged_blocks == 0

"""Attacks on admission inside the pipeline (`Batcher(overlap=True)`: a request admitted while a
decode is on the device, its first chunk on the device thread, the other lanes' decode after it).

Every request's tokens are compared with the same request alone on a fresh synchronous engine
(NumPy runtime: real decoder math), or with the same workload stepped synchronously."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.overlap import choices_loop, closed_loop, greedy, loop_through, run_alone, tokens_of
from support.paced import PacedDecode
from support.pd_models import SEED, SPECS

from atombatch import ArtifactConfig, Batcher, SamplingParams
from atombatch.runtime import NumpyRuntime

pytestmark = pytest.mark.numerics


def _workload(seed: int, count: int, stem_len: int, longest: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    stems = [rng.integers(1, 256, size=stem_len).tolist() for _ in range(2)]
    return [(stems[i % 2] if i % 3 else []) +
            rng.integers(1, 256, size=int(rng.integers(1, longest))).tolist()
            for i in range(count)]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), batch=st.integers(2, 4), block=st.sampled_from([4, 8]),
       chunk=st.sampled_from([8, 16]), scarce=st.booleans(), prefix=st.booleans(),
       stem=st.integers(0, 13), none_limit=st.booleans())
def test_soak_closed_loop_tokens_match_requests_alone(seed: int, batch: int, block: int,
                                                      chunk: int, scarce: bool, prefix: bool,
                                                      stem: int, none_limit: bool) -> None:
    spec = SPECS["llama"]
    max_seq = 48
    bps = max_seq // block
    num_blocks = bps + 1 + batch if scarce else batch * bps + 1
    art = ArtifactConfig(model=spec, batch_size=batch, max_seq_len=max_seq, block_size=block,
                         num_blocks=num_blocks, prefill_chunk_size=chunk,
                         decoder_batch_sizes=tuple(sorted({1, 2, batch})))
    work = _workload(seed, 10, stem, 20)
    rng = np.random.default_rng(seed + 1)
    params = []
    for i, p in enumerate(work):
        limit = None if none_limit and i % 4 == 0 else int(rng.integers(1, 12))
        if limit is not None:
            limit = min(limit, max_seq - len(p))
        params.append(SamplingParams(temperature=0.0, max_tokens=limit, ignore_eos=True))
    want = run_alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), prefix_cache=prefix, overlap=True)
    assert tokens_of(closed_loop(over, work, params, batch)) == want
    stats = over.stats()
    assert stats.lane_blocks == 0 and stats.staged_blocks == 0


def _sampled(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def _reuse_after_abort(over: Batcher, work: list[list[int]], params: list[SamplingParams],
                      concurrency: int, fresh: list[int], target: Any) -> list[Any]:
    """A closed loop over `work`; the first time `target(over)` holds after a step, the
    request whose chunk was planned ahead is aborted and `fresh` (sampled) is submitted under
    its id. Returns that id's final outputs (the abort, then the new request's)."""
    pending = list(range(len(work)))
    reused: list[str] = []
    finals: dict[str, list[Any]] = {}
    for _ in range(min(concurrency, len(work))):
        i = pending.pop(0)
        over.submit(work[i], params[i], request_id=f"r{i}")
    for _ in range(10_000):
        for out in over.step():
            if out.finished:
                finals.setdefault(out.request_id, []).append(out)
                if pending:
                    i = pending.pop(0)
                    over.submit(work[i], params[i], request_id=f"r{i}")
        over.check_invariants()
        if not reused and target(over):
            if over._held is not None:
                plan = over._held
            elif over._flight is not None and over._flight.prefill:
                plan = over._flight.plan
            else:  # decided: the chunk the device thread launches next
                plan = next(f.plan for f in over._prefill_flights if f.owner is not None)
            assert over.abort(plan.request_id)
            over.submit(fresh, _sampled(8, 99), request_id=plan.request_id)
            reused.append(plan.request_id)
        if not over.has_unfinished() and not pending:
            break
    assert reused, "no chunk was planned ahead"
    stats = over.stats()
    assert stats.lane_blocks == 0 and stats.staged_blocks == 0
    want = run_alone(over.artifact, work, params)  # the others, the aborted one's KV cached
    for i in range(len(work)):
        if f"r{i}" != reused[0]:
            [final] = finals[f"r{i}"]
            assert (final.completion.token_ids, final.finish_reason) == want[i]
    return finals[reused[0]]


@pytest.mark.parametrize("when", ["chunk in the air", "chunk decided, not launched",
                                  "chunk held for its block ops", "staged chunk in the air"])
def test_an_id_reused_after_aborting_the_admitted_request_is_a_new_request(when: str) -> None:
    """The request admitted ahead is aborted while its chunk is in the air (or held for the
    next step), and a new request is submitted under the same id before the chunk lands: the
    landing must not take the new request for the aborted one (draw its first token from the
    aborted prompt's logits, advancing its seeded generator). The new request's tokens are
    those it gets alone."""
    spec = SPECS["llama"]
    rng = np.random.default_rng(12)
    fresh = rng.integers(1, 256, size=10).tolist()
    concurrency = 0
    if when != "chunk held for its block ops":
        art = ArtifactConfig(model=spec, batch_size=2, max_seq_len=48, block_size=8,
                             num_blocks=13, prefill_chunk_size=16)
        work = [rng.integers(1, 256, size=12).tolist() for _ in range(6)]
        kw: dict[str, Any] = {}
        staged = when == "staged chunk in the air"
        concurrency = 3 if staged else 2  # one queued behind the full batch: staged

        def target(over: Batcher) -> bool:
            flight = over._flight
            if when == "chunk decided, not launched":
                # the decode on the device has a chunk after it: the new request, queued now,
                # can be admitted ahead (its own chunk) before the aborted one's lands
                return flight is not None and not flight.prefill and \
                    any(f.owner is not None for f in over._prefill_flights)
            return flight is not None and flight.prefill and flight.plan.staged == staged
    else:  # evicting for an admission saves blocks to the host: the chunk is held
        art = ArtifactConfig(model=spec, batch_size=3, max_seq_len=96, block_size=8,
                             num_blocks=20, prefill_chunk_size=16)
        # one-chunk prompts (the chunk held is the last: the first token is drawn after it)
        work = [rng.integers(1, 256, size=int(rng.integers(9, 17))).tolist() for _ in range(24)]
        kw = {"prefix_cache": True, "host_cache_bytes": 1 << 24}

        concurrency = art.batch_size

        def target(over: Batcher) -> bool:
            return over._held is not None
    want = run_alone(art, [fresh], [_sampled(8, 99)])[0]
    params = [greedy(8 + (5 * i) % 13) for i in range(len(work))]
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True, **kw)
    ends = _reuse_after_abort(over, work, params, concurrency, fresh, target)
    assert [f.finish_reason for f in ends] == ["abort", want[1]]
    assert ends[1].completion.token_ids == want[0]


class InterruptedAhead(NumpyRuntime):
    """The first prefill call on the device thread raises `error` (not an Exception)."""

    error: BaseException = KeyboardInterrupt()
    fired = 0

    def prefill(self, inputs: Any, **kw: Any) -> Any:
        import threading

        if not self.fired and threading.current_thread().name == "atombatch-device":
            self.fired += 1
            raise self.error
        return super().prefill(inputs, **kw)


@pytest.mark.parametrize("queued", [0, 1])
@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(3)])
def test_a_base_exception_from_a_chunk_ahead_leaves_step_and_the_engine_goes_on(
        error: BaseException, queued: int) -> None:
    """A BaseException from the prefill call on the device thread (a lane's chunk, or one
    staged into the spare) comes out of `step()` (as from a synchronous prefill); stepping on,
    the chunk runs again and every request gets the tokens it gets alone, with no lane or block
    left behind."""
    spec = SPECS["llama"]
    art = ArtifactConfig(model=spec, batch_size=3, max_seq_len=48, block_size=8, num_blocks=19,
                         prefill_chunk_size=16, decoder_batch_sizes=(1, 2, 3))
    rng = np.random.default_rng(3)
    work = [rng.integers(1, 256, size=int(rng.integers(5, 17))).tolist() for _ in range(8)]
    params = [greedy(4 + (3 * i) % 7) for i in range(len(work))]
    want = run_alone(art, work, params)
    runtime = InterruptedAhead.random(art, SEED)
    runtime.error = error
    over = Batcher(runtime, overlap=True)
    # one queued behind the full batch: its chunks are staged ahead
    finals, raised = loop_through(over, work, params, 3 + queued, type(error))
    assert raised == 1 and runtime.fired == 1
    assert tokens_of(finals) == want
    stats = over.stats()
    assert stats.lane_blocks == 0 and stats.overlapped_prefills > 0


class FaultyDecodeAfterChunk(NumpyRuntime):
    """The first decode call right after a prefill on the device thread (the decode of the
    other lanes, after a chunk admitted ahead) raises, or returns NaN logits in its row 0."""

    nan = False
    fired = 0
    after_chunk = False

    def prefill(self, inputs: Any, **kw: Any) -> Any:
        import threading

        self.after_chunk = threading.current_thread().name == "atombatch-device"
        return super().prefill(inputs, **kw)

    def decode(self, inputs: Any) -> Any:
        fire = self.after_chunk and not self.fired
        self.after_chunk = False
        logits = super().decode(inputs)
        if fire:
            self.fired += 1
            if not self.nan:
                raise RuntimeError("decode after the chunk broke")
            logits = np.array(logits)
            logits[0] = np.nan
        return logits


@pytest.mark.parametrize("queued", [0, 1])
@pytest.mark.parametrize("nan", [False, True])
def test_a_fault_in_the_decode_after_an_admitted_chunk_spares_the_admitted_request(
        nan: bool, queued: int, core: str) -> None:
    """The decode that follows a chunk admitted ahead fails (raises: every lane in it; NaN in
    one row: that lane): those requests end with an error, while the admitted request (not in
    that step: it joins the step after, which does not run on a failed step's tokens) and every
    later request get the tokens they get alone."""
    spec = SPECS["llama"]
    art = ArtifactConfig(model=spec, batch_size=3, max_seq_len=48, block_size=8, num_blocks=19,
                         prefill_chunk_size=16, decoder_batch_sizes=(1, 2, 3))
    rng = np.random.default_rng(21)
    work = [rng.integers(1, 256, size=int(rng.integers(5, 17))).tolist() for _ in range(9)]
    params = [greedy(5 + (4 * i) % 9) for i in range(len(work))]
    want = run_alone(art, work, params)
    runtime = FaultyDecodeAfterChunk.random(art, SEED)
    runtime.nan = nan
    over = Batcher(runtime, overlap=True)
    got = tokens_of(closed_loop(over, work, params, 3 + queued))  # queued: staged ahead
    assert runtime.fired == 1
    failed = [i for i, (_, reason) in enumerate(got) if reason == "error"]
    assert failed and (len(failed) == 1 if nan else len(failed) >= 1)
    assert [g for i, g in enumerate(got) if i not in failed] == \
        [w for i, w in enumerate(want) if i not in failed]
    stats = over.stats()
    assert stats.lane_blocks == 0 and stats.overlapped_prefills > 0


def _client_work() -> tuple[ArtifactConfig, list[list[int]], list[SamplingParams]]:
    spec = SPECS["llama"]
    art = ArtifactConfig(model=spec, batch_size=3, max_seq_len=48, block_size=8, num_blocks=19,
                         prefill_chunk_size=16, decoder_batch_sizes=(1, 2, 3))
    rng = np.random.default_rng(44)
    work = [rng.integers(1, 256, size=int(rng.integers(5, 17))).tolist() for _ in range(12)]
    params = [greedy(6 + (5 * i) % 11) if i % 4 else _sampled(7, i) for i in range(len(work))]
    return art, work, params


def _client_batcher(art: ArtifactConfig) -> Batcher:
    return Batcher(PacedDecode.random(art, SEED), overlap=True)


@pytest.mark.parametrize("offload", [True, False])
async def test_async_clients_in_closed_loops_admitted_mid_pipeline(offload: bool) -> None:
    """Three clients, each sending its next request when the last one ends (AsyncBatcher,
    stepping on a thread or on the loop): admissions happen while decodes are on the device;
    every request's tokens are those it gets alone."""
    import asyncio

    from atombatch import AsyncBatcher

    art, work, params = _client_work()
    want = run_alone(art, work, params)
    batcher = _client_batcher(art)
    got: dict[int, Any] = {}
    async with AsyncBatcher(batcher, offload=offload) as engine:
        async def client(start: int) -> None:
            for i in range(start, len(work), 3):
                completion = await engine.generate(work[i], params[i])
                got[i] = (completion.token_ids, completion.finish_reason)
        await asyncio.gather(*(client(c) for c in range(3)))
    assert [got[i] for i in range(len(work))] == want
    stats = batcher.stats()
    assert stats.overlapped_prefills > 0 and stats.lane_blocks == 0


async def test_engine_core_clients_in_closed_loops_admitted_mid_pipeline() -> None:
    """The same closed loops through the engine-core process (`CoreClient`)."""
    import asyncio
    import functools

    from atombatch.core import CoreClient

    art, work, params = _client_work()
    want = run_alone(art, work, params)
    got: dict[int, Any] = {}
    async with CoreClient(functools.partial(_client_batcher, art)) as client:
        async def one(start: int) -> None:
            for i in range(start, len(work), 3):
                tokens: list[int] = []
                reason = None
                async for out in client.stream(work[i], params[i]):
                    tokens.extend(out.new_token_ids)
                    if out.finished:
                        reason = out.finish_reason
                got[i] = (tuple(tokens), reason)
        await asyncio.gather(*(one(c) for c in range(3)))
        await asyncio.sleep(0.1)
        stats = client.stats()
    assert [got[i] for i in range(len(work))] == want
    assert stats.overlapped_prefills > 0 and stats.lane_blocks == 0


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), batch=st.integers(2, 4),
       layout=st.sampled_from([(4, 8), (8, 12), (8, 16), (16, 24), (16, 16), (16, 8)]),
       scarce=st.booleans(), prefix=st.booleans(), host=st.booleans(),
       abort_rate=st.sampled_from([0.0, 0.1, 0.3]), queued=st.integers(0, 2))
def test_soak_random_aborts_leave_the_others_and_the_partial_outputs_right(
        seed: int, batch: int, layout: tuple[int, int], scarce: bool, prefix: bool, host: bool,
        abort_rate: float, queued: int, core: str) -> None:
    """Closed loops with shared stems (prefix hits that resume at chunk boundaries inside a
    block), sampled and greedy requests, context-length ends, pools with and without room for
    every lane, and aborts at random steps (half of them of the request whose chunk is in the
    air), with 0-2 requests queued behind a full batch (staged into the spare by chunks ahead,
    rotated into freed lanes): every request that ends on its own gets its tokens alone; an
    aborted one streamed a prefix of them; no lane or block is left behind. On the compiled core
    and its py twin."""
    block, chunk = layout
    max_seq = 48
    rng = np.random.default_rng(seed)
    bps = max_seq // block
    num_blocks = bps + 1 + int(rng.integers(0, 2 * batch)) if scarce else batch * bps + 1
    art = ArtifactConfig(model=SPECS["llama"], batch_size=batch, max_seq_len=max_seq,
                         block_size=block, num_blocks=num_blocks, prefill_chunk_size=chunk,
                         decoder_batch_sizes=tuple(sorted({1, 2, batch})))
    work = [p[:40] for p in _workload(seed, 14, int(rng.integers(4, 30)), 12)]
    params = []
    for i, p in enumerate(work):
        limit = None if rng.random() < 0.2 else min(int(rng.integers(1, 12)), max_seq - len(p))
        params.append(_sampled(limit, i) if rng.random() < 0.3 else  # type: ignore[arg-type]
                      SamplingParams(temperature=0.0, max_tokens=limit, ignore_eos=True))
    want = run_alone(art, work, params)
    kw: dict[str, Any] = {"host_cache_bytes": 1 << 24} if host and prefix else {}
    over = Batcher(NumpyRuntime.random(art, SEED), prefix_cache=prefix, overlap=True, **kw)
    pending = list(range(len(work)))
    index: dict[str, int] = {}
    streamed: dict[str, list[int]] = {}
    finals: dict[str, Any] = {}
    aborted: set[str] = set()

    def submit() -> None:
        i = pending.pop(0)
        index[over.submit(work[i], params[i])] = i

    for _ in range(batch + queued):  # `queued` behind a full batch: staged into the spare
        submit()
    for _ in range(5000):
        for out in over.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = out
                if pending:
                    submit()
        over.check_invariants()
        if rng.random() < abort_rate:
            live = [r for r in index if r not in finals and r not in aborted]
            ahead = over._flight
            if ahead is not None and ahead.prefill and rng.random() < 0.5 and \
                    ahead.plan.request_id in live:
                live = [ahead.plan.request_id]
            if live:
                victim = live[int(rng.integers(len(live)))]
                if over.abort(victim):
                    aborted.add(victim)
        if not over.has_unfinished() and not pending:
            break
    for request_id, i in index.items():
        final = finals[request_id]
        if request_id in aborted and final.finish_reason == "abort":
            tokens = tuple(streamed.get(request_id, ()))
            assert tokens == want[i][0][:len(tokens)]
        else:
            assert (final.completion.token_ids, final.finish_reason) == want[i]
            assert tuple(streamed[request_id]) == want[i][0]
    stats = over.stats()
    assert stats.lane_blocks == 0 and stats.staged_blocks == 0


def test_n_and_prompt_logprobs_requests_arriving_mid_pipeline_stay_correct() -> None:
    """n > 1 requests (seeded, sampled) and prompt-logprobs requests arrive while decodes run
    as a pipeline next to plain ones admitted ahead: they must not fly, and every request's
    choices and prompt logprobs are those it gets alone."""
    spec = SPECS["llama"]
    art = ArtifactConfig(model=spec, batch_size=3, max_seq_len=48, block_size=8, num_blocks=19,
                         prefill_chunk_size=16, decoder_batch_sizes=(1, 2, 3))
    rng = np.random.default_rng(31)
    work = [rng.integers(1, 256, size=int(rng.integers(5, 17))).tolist() for _ in range(18)]
    params = []
    for i in range(len(work)):
        if i % 6 == 1:
            params.append(SamplingParams(temperature=0.9, seed=i, n=2, max_tokens=5,
                                         ignore_eos=True))
        elif i % 6 == 4:
            params.append(greedy(6, prompt_logprobs=2))
        else:
            params.append(greedy(4 + (3 * i) % 7))
    want = []
    for p, sp in zip(work, params, strict=True):
        want += choices_loop(Batcher(NumpyRuntime.random(art, SEED)), [p], [sp], 1)
    for prefix in (False, True):
        over = Batcher(NumpyRuntime.random(art, SEED), prefix_cache=prefix, overlap=True)
        assert choices_loop(over, work, params, 3) == want
        stats = over.stats()
        assert stats.overlapped_prefills > 0 and stats.lane_blocks == 0


@pytest.mark.parametrize("detokenize", [False, True])
def test_stop_strings_and_eos_on_requests_admitted_ahead(detokenize: bool) -> None:
    """A tokenizer: requests admitted ahead whose stop string is their first token's piece
    (it ends them when the chunk lands, the other lanes' decode in the air) or a later one,
    and EOS stops; the closed loop's tokens, text, finish and stop reasons are those of the
    same loop stepped synchronously."""
    from support import sampling_models as sm

    art = sm.artifact()
    tok = sm.piece_tokenizer()
    rng = np.random.default_rng(9)
    work = [rng.integers(2, sm.VOCAB, size=int(rng.integers(4, 14))).tolist() for _ in range(14)]
    probe = Batcher(NumpyRuntime.random(art, SEED))
    ref = probe.generate(work, [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
                                for _ in work])
    params = []
    for i, done in enumerate(ref):
        if i % 3 == 1:
            at = 0 if i % 2 else 4
            params.append(SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                         stop=[sm.PIECES[done.token_ids[at]]]))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=4 + i % 7))

    def run(overlap: bool) -> tuple[list[Any], Batcher]:
        batcher = Batcher(NumpyRuntime.random(art, SEED), tokenizer=tok, detokenize=detokenize,
                          overlap=overlap)
        finals = closed_loop(batcher, work, params, art.batch_size)
        return [(f.completion.token_ids, f.completion.text, f.finish_reason,
                 f.completion.stop_reason) for f in finals], batcher

    want, _ = run(False)
    assert sum(reason == "stop" for _, _, reason, _ in want) >= 3
    got, over = run(True)
    assert got == want
    assert over.stats().overlapped_prefills > 0


@pytest.mark.parametrize("queued", [0, 1])
def test_an_interrupt_landing_the_decode_before_an_admitted_chunk_drops_the_chunk(
        queued: int) -> None:
    """A BaseException while the engine lands the decode that an admitted chunk follows (the
    chunk already on the device): `step()` raises it; the chunk lands unreported, its request
    prefills it again, and every request gets the tokens it gets alone."""
    spec = SPECS["llama"]
    art = ArtifactConfig(model=spec, batch_size=3, max_seq_len=48, block_size=8, num_blocks=19,
                         prefill_chunk_size=16, decoder_batch_sizes=(1, 2, 3))
    rng = np.random.default_rng(13)
    work = [rng.integers(1, 256, size=int(rng.integers(5, 17))).tolist() for _ in range(9)]
    # greedy: the rows of the interrupted step that sample were drawn on the device thread
    # already, and their generators stay advanced when those positions run again
    params = [greedy(4 + (5 * i) % 9) for i in range(len(work))]
    want = run_alone(art, work, params)
    over = Batcher(NumpyRuntime.random(art, SEED), overlap=True)
    land = over._land
    fired: list[str] = []

    def interrupted(flight: Any, outputs: Any) -> None:
        if not fired and over._flight is not None and over._flight.prefill:
            fired.append(over._flight.plan.request_id)
            raise KeyboardInterrupt
        land(flight, outputs)

    over._land = interrupted  # type: ignore[method-assign]
    # queued behind the full batch: its chunks are staged ahead
    finals, raised = loop_through(over, work, params, 3 + queued, KeyboardInterrupt)
    assert raised == 1 and fired
    assert tokens_of(finals) == want
    assert over.stats().lane_blocks == 0

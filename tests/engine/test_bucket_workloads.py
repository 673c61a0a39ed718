"""Review of decode buckets: random workloads with buckets on the exact ledger runtime, with every
decode step's rows checked against the scheduler's ownership state at the moment the device runs
it (padding rows on FREE/SPARE blocks and on sliding slots nobody is building), plus PD, prefix
cache and fault paths with buckets on real math."""

from __future__ import annotations

import numpy as np
import pytest
import support.pd_models as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.driving import run_to_end
from support.ledger import LedgerRuntime
from support.scheduling import (
    artifact,
    check_workload,
    draw_workload,
    drive,
    expected,
)

from atombatch import ArtifactConfig, Batcher, SamplingParams
from atombatch.bench import serve as serve_bench
from atombatch.kernel import blocks as blocks_module
from atombatch.pd import InProcessSource
from atombatch.runtime import NumpyRuntime

FREE, SPARE = 0, 1


class CheckedLedger(LedgerRuntime):
    """The ledger runtime, checking each decode call's rows against the scheduler it serves."""

    scheduler = None

    def __init__(self, artifact):  # type: ignore[no-untyped-def]
        super().__init__(artifact)
        self.violations: list[str] = []

    def decode(self, inputs):  # type: ignore[no-untyped-def]
        try:
            self.check(inputs)
        except AssertionError as exc:  # the engine would turn it into a failed request
            self.violations.append(repr(exc))
            raise
        return super().decode(inputs)

    def check(self, inputs):  # type: ignore[no-untyped-def]
        sched = self.scheduler
        assert sched is not None
        art = self.artifact
        rows = inputs.input_ids.shape[0]
        decoding = [lane for lane in range(art.batch_size)
                    if sched.lanes.state(lane) == blocks_module.LANE_DECODING]
        n = len(decoding)
        assert rows == min(b for b in art.decoder_batch_sizes if b >= n), (rows, n)
        assert rows == inputs.num_rows
        row_lanes = inputs.row_lanes.tolist()
        assert row_lanes[:n] == decoding
        assert len(set(row_lanes)) == rows
        assert inputs.local_block_tables.ravel().tolist() == row_lanes
        for row in range(n, rows):
            lane = row_lanes[row]
            table = set(inputs.block_tables[row].tolist())
            assert len(table) == 1, table
            block = table.pop()
            assert sched.pool.state(block) in (FREE, SPARE), (row, block)
            assert int(inputs.cache_position[row, 0]) == 0
            if sched.slots is not None and sched.by_lane[lane] is not None:
                # a padding row may only write a slot that holds nothing yet
                assert sched.slots.fill(lane) == 0, (row, lane)


@st.composite
def bucket_sets(draw, batch_size):
    smaller = draw(st.sets(st.integers(1, batch_size - 1))) if batch_size > 1 else set()
    return (*sorted(smaller), batch_size)


shapes = st.sampled_from([
    dict(batch_size=2), dict(batch_size=4), dict(batch_size=3, block_size=16),
    dict(batch_size=4, block_size=8, num_blocks=9), dict(batch_size=4, block_size=16, num_blocks=6),
    dict(batch_size=2, block_size=16, num_blocks=5), dict(batch_size=3, hybrid=True),
    dict(batch_size=4, hybrid=True), dict(batch_size=3, hybrid=True, block_size=16, num_blocks=6),
])


@pytest.mark.usefixtures("core")  # the compiled core and its twin
@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=shapes, chunk=st.sampled_from([4, 8, 16]), data=st.data(),
       policy=st.sampled_from(["prefill-first", "decode-first", "interleave:2", "fill-first:1"]))
def test_random_workloads_with_buckets_keep_padding_safe_and_tokens_right(shape, chunk, data,
                                                                          policy):
    buckets = data.draw(bucket_sets(shape["batch_size"]), label="buckets")
    art = artifact(chunk=chunk, buckets=buckets, **shape)
    cacheable = not art.model.is_hybrid
    prefix_cache = cacheable and data.draw(st.booleans())
    host_bytes = data.draw(st.sampled_from([0, 500, 5000])) if prefix_cache else 0
    runtime = CheckedLedger(art)
    batcher = Batcher(runtime, policy=policy, prefix_cache=prefix_cache,
                      host_cache_bytes=host_bytes)
    runtime.scheduler = batcher.scheduler
    arrivals, aborts = draw_workload(data)
    finals, streamed = drive(batcher, arrivals, aborts)
    assert runtime.violations == []
    check_workload(arrivals, finals, streamed, art)
    stats = batcher.stats()
    assert set(stats.bucket_steps) <= set(buckets)
    assert sum(stats.bucket_steps.values()) == stats.decode_steps == runtime.decode_calls


# -- PD imports and prefix cache with buckets, on real decoder math --------------------------------
class PaddingWitness(NumpyRuntime):
    """The NumPy runtime, noting for every padding row whose lane it borrowed (idle, importing or
    prefilling), so a test can show which situation it really exercised."""

    scheduler = None
    padding_on: list[str]

    def decode(self, inputs):  # type: ignore[no-untyped-def]
        sched = self.scheduler
        assert sched is not None
        n = sched.lanes.num_decoding()
        for row in range(n, inputs.num_rows):
            request = sched.by_lane[int(inputs.row_lanes[row])]
            self.padding_on.append("idle" if request is None else
                                   "importing" if request.importing else "prefilling")
        return super().decode(inputs)


@pytest.mark.parametrize("mode", ["whole", "layer-stream"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_pd_imports_while_smaller_buckets_decode(family, mode):
    """Three native requests decode (bucket 4: one padding row) while a PD request imports into
    the fourth lane, its layers arriving one per poll: the padding row borrows the importing
    lane's sliding slot before its sliding layers land. Later buckets 1 and 2 run. Every request
    equals its native output at B4 without buckets."""
    spec = pd.SPECS[family]
    plain = pd.artifact(spec, 4, 5)
    bucketed = ArtifactConfig(**{**{f: getattr(plain, f) for f in plain.__struct_fields__},
                                 "decoder_batch_sizes": (1, 2, 4)})
    natives, imported = pd.prompts(3, seed=11), pd.prompts(2, seed=12)
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in Batcher(NumpyRuntime.random(plain, pd.SEED)).generate(natives,
                                                                                       long)]
    want += pd.native(spec, imported, plain)
    producer = pd.producer_for(spec)
    runtime = PaddingWitness.random(bucketed, pd.SEED)
    runtime.padding_on = []
    batcher = Batcher(runtime)
    runtime.scheduler = batcher.scheduler
    ids = []
    finals: dict[str, object] = {}
    for step in range(80):
        if step < 3:
            ids.append(batcher.submit(natives[step], long))
        if step in (12, 50):
            i = int(step == 50)
            ids.append(batcher.submit(imported[i], pd.PARAMS, kv=InProcessSource.from_producer(
                producer, f"pd-{i}", imported[i], pd.PARAMS, mode=mode)))
        for out in batcher.step():
            if out.finished:
                finals[out.request_id] = out
        batcher.check_invariants()
    finals.update(run_to_end(batcher))
    assert [finals[i].completion.token_ids for i in ids] == want
    stats = batcher.stats()
    assert stats.imports >= 2 and min(stats.bucket_steps) < 4
    if family == "gemma3" and mode == "layer-stream":
        assert "importing" in runtime.padding_on, runtime.padding_on


@pytest.mark.parametrize("buckets", [(1, 4), (1, 2, 4)])
def test_prefix_cache_and_host_cache_with_buckets_keep_outputs(buckets):
    """Prefix hits, evictions and host restores while buckets with padding rows run (three
    requests at a time on four lanes): outputs equal the cache-free B4 run without buckets."""
    spec = pd.SPECS["qwen3"]
    base = dict(model=spec, batch_size=4, max_seq_len=96, block_size=16, prefill_chunk_size=16,
                num_blocks=25)
    plain = ArtifactConfig(**base)
    bucketed = ArtifactConfig(decoder_batch_sizes=buckets, **base)
    rng = np.random.default_rng(3)
    stem = rng.integers(1, 256, size=36).tolist()
    work = [stem + rng.integers(1, 256, size=int(n)).tolist() for n in rng.integers(20, 50, 15)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in Batcher(NumpyRuntime.random(plain, 5)).generate(work, params)]
    runtime = NumpyRuntime.random(bucketed, 5)
    batcher = Batcher(runtime, prefix_cache=True, host_cache_bytes=1 << 20)
    got = []
    for i in range(0, len(work), 3):
        got += [c.token_ids for c in batcher.generate(work[i:i + 3], params)]
        batcher.check_invariants()
    assert got == want
    stats = batcher.stats()
    assert stats.prefix_hits > 0 and stats.evictions > 0 and 4 not in buckets[:-1]
    assert runtime.decode_rows > sum(n * steps for n, steps in enumerate(stats.lane_histogram))


class NanOnToken(LedgerRuntime):
    """NaN logits for every row that feeds `token` (a broken row, as a device might return)."""

    token = 55

    def decode(self, inputs):  # type: ignore[no-untyped-def]
        logits = super().decode(inputs)
        logits[inputs.input_ids[:, 0] == self.token] = np.nan
        return logits


@pytest.mark.parametrize("buckets", [(1, 2, 4), (2, 4), (3, 4)])
@pytest.mark.usefixtures("core")
def test_a_failing_row_fails_its_own_request_not_the_lane_with_that_index(buckets):
    """Lanes 1..3 decode (lane 0 idles after a short request), so row r holds lane r+1: a NaN in
    one row must fail the request of that row's lane and leave the others' tokens exact."""
    art = artifact(batch_size=4, buckets=buckets)
    batcher = Batcher(NanOnToken(art))
    good = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    nan_prompt = next([t] for t in range(1, 96) if expected([t], SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True), art)[0] == 55)
    arrivals = {0: [([9], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), "short"),
                    ([4, 5, 6], good, "ok1"), (nan_prompt, good, "nan"), ([7, 8], good, "ok2")]}
    finals, streamed = drive(batcher, arrivals)
    assert finals["nan"].finish_reason == "error" and "non-finite" in finals["nan"].error
    for prompt, params, rid in arrivals[0]:
        if rid != "nan":
            assert streamed[rid] == expected(prompt, params, art), rid


@settings(max_examples=12, deadline=None)
@given(family=st.sampled_from(["llama", "gemma3"]), data=st.data())
def test_random_pd_and_native_mix_with_buckets_and_aborts(family, data):
    """Native and PD requests (whole or layer-stream) arrive and are aborted at random steps on a
    bucketed B4; every request that finishes by length equals its native B4 output, and every
    aborted one streamed a prefix of it."""
    spec = pd.SPECS[family]
    plain = pd.artifact(spec, 4, 5)
    buckets = data.draw(bucket_sets(4), label="buckets")
    bucketed = ArtifactConfig(**{**{f: getattr(plain, f) for f in plain.__struct_fields__},
                                 "decoder_batch_sizes": buckets})
    n = data.draw(st.integers(2, 6), label="requests")
    work = pd.prompts(n, seed=data.draw(st.integers(0, 1000), label="seed"))
    want = pd.native(spec, work, plain)
    producer = pd.producer_for(spec)
    batcher = Batcher(NumpyRuntime.random(bucketed, pd.SEED))
    plan = []
    for i in range(n):
        mode = data.draw(st.sampled_from([None, "whole", "layer-stream"]), label=f"mode{i}")
        at = data.draw(st.integers(0, 20), label=f"at{i}")
        abort_at = data.draw(st.one_of(st.none(), st.integers(at, 40)), label=f"abort{i}")
        plan.append((i, mode, at, abort_at))
    ids: dict[int, str] = {}
    streamed: dict[str, list[int]] = {}
    finals: dict[str, object] = {}
    step = 0
    while step <= 40 or batcher.has_unfinished():
        for i, mode, at, abort_at in plan:
            if at == step:
                kv = None if mode is None else InProcessSource.from_producer(
                    producer, f"pd-{i}", work[i], pd.PARAMS, mode=mode)
                ids[i] = batcher.submit(work[i], pd.PARAMS, kv=kv, request_id=f"r{i}")
            if abort_at == step and i in ids:
                batcher.abort(ids[i])
        for out in batcher.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
        batcher.check_invariants()
        step += 1
        assert step < 2000
    for i, rid in ids.items():
        got = streamed.get(rid, [])
        if finals[rid].finish_reason == "abort":
            assert list(want[i][: len(got)]) == got, rid
        else:
            assert finals[rid].finish_reason == "length" and tuple(got) == want[i], rid


@pytest.mark.parametrize("text, specs", [
    ("k5/B4,k1/B1", ["k5/B4", "k1/B1"]),                        # any part order, as parse_artifact
    ("B4/k5/dbs1,2,4,ctx4096/B1/k1", ["B4/k5/dbs1,2,4", "ctx4096/B1/k1"]),
    ("B4/k5/dbs1,2,4,B1/k1", ["B4/k5/dbs1,2,4", "B1/k1"]),
])
def test_bench_serve_artifact_list_splits_specs_not_bucket_lists(text, specs):
    parsed = serve_bench._parser().parse_args(["--artifacts", text]).artifacts
    assert parsed == specs
    model = serve_bench.small_spec("qwen3-0.6b")
    assert all(not isinstance(serve_bench.parse_artifact(s, model, 4096, 128)[1], str)
               for s in parsed)

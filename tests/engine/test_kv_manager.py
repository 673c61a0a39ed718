"""The KV manager's block ownership (atombatch/engine/kv_manager.py) on the paths where it is easiest
to get wrong: staging and its spares, prefix-shared blocks under abort and preemption, sliding
windows of preempted hybrid lanes, PD imports aborted or failing midway, host-cache saves and
restores into the same block, padding targets of an oversubscribed pool.

Every test checks the DESIGN §3 invariants after every step (through `drive`/`run_to_end`) and,
where tokens come out, compares them with the cache-free ledger reference. The last four were
bugs a review found (each reproduction failed before its fix).
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from support.driving import run_to_end
from support.ledger import LedgerRuntime, ledger_spec, reference

from atombatch import ArtifactConfig, AsyncBatcher, Batcher, ModelSpec, RequestError, SamplingParams
from atombatch.engine.scheduler import RequestState
from atombatch.pd import InProcessSource, Producer
from atombatch.runtime import NumpyRuntime

S = RequestState


def art(batch_size=2, max_seq_len=64, block_size=64, num_blocks=None, chunk=8, hybrid=False):
    bps = max_seq_len // block_size
    return ArtifactConfig(model=ledger_spec(hybrid=hybrid), batch_size=batch_size,
                          max_seq_len=max_seq_len, block_size=block_size,
                          num_blocks=num_blocks or batch_size * bps + 1, prefill_chunk_size=chunk)


def params(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def step_checked(batcher, finals, streamed):
    for out in batcher.step():
        assert out.request_id not in finals, f"{out.request_id} output after its final output"
        streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            finals[out.request_id] = out
    batcher.check_invariants()


def finish_all(batcher, finals, streamed, limit=5000):
    for _ in range(limit):
        if not batcher.has_unfinished():
            return
        step_checked(batcher, finals, streamed)
    raise AssertionError("no progress")


def window(a):
    return a.model.sliding_window if a.model.is_hybrid else 0


# -- staging + prefix cache: abort at each stage --------------------------------------------------
@pytest.mark.parametrize("layout", [dict(num_blocks=4), dict(block_size=16)])
@pytest.mark.parametrize("abort_in", [S.STAGING, S.STAGED])
def test_abort_of_a_staged_request_whose_spare_came_from_the_prefix_cache(layout, abort_in):
    """A staged request resumes inside a cached block (device copy into the spare); aborting it
    while staging or staged gives the spare back as a padding target, unpins the shared blocks,
    and neither the running lanes nor a later request with the same prefix see its KV."""
    a = art(batch_size=2, chunk=4, **layout)
    # fill-first:3 runs one staged chunk per three decode steps: the request stays STAGING a while
    batcher = Batcher(LedgerRuntime(a), prefix_cache=True, policy="fill-first:3")
    system = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    finals, streamed = {}, {}
    warm = batcher.submit(system + [1], params(2))
    finish_all(batcher, finals, streamed)
    busy = [batcher.submit([40 + i, 41, 42], params(40)) for i in range(2)]
    for _ in range(30):
        if batcher.stats().decoding_lanes == 2:
            break
        step_checked(batcher, finals, streamed)
    staged_prompt = system[:14] + [2, 3, 4, 5, 6, 7, 8, 9, 10]
    victim = batcher.submit(staged_prompt, params(5))
    request = batcher.scheduler.requests[victim]
    for _ in range(30):
        if request.state is abort_in:
            break
        step_checked(batcher, finals, streamed)
    assert request.state is abort_in and request.lane == -1
    assert batcher.stats().prefix_hits >= 1
    assert batcher.abort(victim) and not batcher.abort(victim)
    batcher.check_invariants()
    pool = batcher.scheduler.pool
    assert pool.num_spare == 1 and pool.num_staged == 0
    later = batcher.submit(staged_prompt, params(5))
    finish_all(batcher, finals, streamed)
    assert finals[victim].finish_reason == "abort"
    want = reference(staged_prompt, 5, 97)
    assert streamed.get(victim, []) == want[: len(streamed.get(victim, []))]
    assert list(finals[later].completion.token_ids) == want
    for rid, i in zip(busy, range(2), strict=True):
        assert list(finals[rid].completion.token_ids) == reference([40 + i, 41, 42], 40, 97)
    assert finals[warm].finish_reason == "length"
    assert pool.num_lane == pool.num_staged == 0 and pool.num_evictable == pool.num_cached


def test_abort_of_a_waiting_and_a_decoding_sharer_keeps_the_other_sharer_right():
    """Two lanes share pinned prefix blocks; aborting one unpins once, the other keeps reading."""
    a = art(batch_size=3, block_size=8, chunk=8)
    batcher = Batcher(LedgerRuntime(a), prefix_cache=True)
    system = list(range(10, 34))
    finals, streamed = {}, {}
    batcher.submit(system + [1], params(1))
    finish_all(batcher, finals, streamed)
    one, two = system + [2, 3], system + [4, 5, 6]
    r1, r2 = batcher.submit(one, params(20)), batcher.submit(two, params(20))
    queued = batcher.submit(system + [7], params(3))
    for _ in range(30):
        if batcher.scheduler.requests[r2].state is S.DECODING:
            break
        step_checked(batcher, finals, streamed)
    assert batcher.scheduler.requests[r1].shared == 3
    pool = batcher.scheduler.pool
    shared = batcher.scheduler.lanes.blocks(batcher.scheduler.requests[r1].lane)[:3]
    assert all(pool.refcount(block) >= 2 for block in shared)
    assert batcher.abort(r1)
    batcher.check_invariants()
    assert all(pool.refcount(block) >= 1 for block in shared)
    finish_all(batcher, finals, streamed)
    assert list(finals[r2].completion.token_ids) == reference(two, 20, 97)
    assert list(finals[queued].completion.token_ids) == reference(system + [7], 3, 97)
    assert pool.num_evictable == pool.num_cached


# -- preemption of lanes that share prefix blocks --------------------------------------------------
@pytest.mark.parametrize("policy", ["prefill-first", "interleave:2"])
def test_preempting_lanes_that_share_prefix_blocks_keeps_tokens_and_leaks_nothing(policy):
    a = art(batch_size=2, max_seq_len=64, block_size=8, num_blocks=10, chunk=8)
    assert a.oversubscribed
    batcher = Batcher(LedgerRuntime(a), prefix_cache=True, policy=policy)
    system = list(range(20, 44))
    finals, streamed = {}, {}
    prompts = [system + [i, i + 1] for i in range(1, 5)]
    ids = [batcher.submit(p, params(30)) for p in prompts]
    finish_all(batcher, finals, streamed)
    stats = batcher.stats()
    assert stats.preemptions > 0 and stats.prefix_hits > 0
    for rid, prompt in zip(ids, prompts, strict=True):
        assert streamed[rid] == reference(prompt, 30, 97)
    pool = batcher.scheduler.pool
    assert pool.num_lane == pool.num_staged == 0 and pool.num_evictable == pool.num_cached
    assert sum(finals[r].completion.preemptions for r in ids) == stats.preemptions


# -- oversubscribed hybrid: preemption of half-built sliding windows --------------------------------
@pytest.mark.parametrize("policy", ["prefill-first", "interleave:1", "fill-first:1"])
def test_oversubscribed_hybrid_preemption_keeps_sliding_windows_intact(policy):
    a = art(batch_size=3, max_seq_len=64, block_size=8, num_blocks=10, chunk=4, hybrid=True)
    assert a.oversubscribed
    batcher = Batcher(LedgerRuntime(a), policy=policy)
    rng = np.random.default_rng(3)
    work = [(rng.integers(1, 96, size=int(rng.integers(10, 30))).tolist(), int(rng.integers(20, 34)))
            for _ in range(6)]
    ids = [batcher.submit(p, params(n)) for p, n in work]
    finals, streamed = {}, {}
    finish_all(batcher, finals, streamed)
    assert batcher.stats().preemptions > 0
    for rid, (prompt, n) in zip(ids, work, strict=True):
        assert streamed[rid] == reference(prompt, n, 97, window(a)), rid


# -- PD: abort mid-import, import errors ----------------------------------------------------------
TINY = ModelSpec(name="rev-llama", family="llama", vocab_size=256, hidden_size=32,
                 intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8)


def tiny_art(batch_size, num_blocks, block_size=64):
    return ArtifactConfig(model=TINY, batch_size=batch_size, max_seq_len=64,
                          block_size=block_size, num_blocks=num_blocks, prefill_chunk_size=16)


@pytest.mark.parametrize("staged", [False, True])
def test_pd_request_aborted_mid_import_returns_its_blocks(staged):
    a = tiny_art(2, 3)
    producer = Producer(NumpyRuntime.random(tiny_art(1, 2), seed=7))
    batcher = Batcher(NumpyRuntime.random(a, seed=7))
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    busy = [batcher.submit([1 + i, 2, 3], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            for i in range(2 if staged else 0)]
    finals, streamed = {}, {}
    for _ in range(30):
        if not staged or batcher.stats().decoding_lanes == 2:
            break
        step_checked(batcher, finals, streamed)
    prompt = list(range(5, 25))
    rid = batcher.submit(prompt, p, kv=InProcessSource.from_producer(producer, "x", prompt, p,
                                                                     mode="layer-stream"))
    request = batcher.scheduler.requests[rid]
    for _ in range(100):
        step_checked(batcher, finals, streamed)
        if request.pd is not None and request.pd.done_layers >= 1:
            break
    assert request.importing and request.pd.done_layers >= 1
    assert request.state is (S.STAGING if staged else S.PREFILLING)
    assert batcher.abort(rid)
    batcher.check_invariants()
    assert rid not in batcher._kv  # the source was closed with the final output
    finish_all(batcher, finals, streamed)
    assert finals[rid].finish_reason == "abort"
    stats = batcher.stats()
    assert stats.lane_blocks == stats.staged_blocks == 0 and stats.occupied_lanes == 0
    assert stats.free_blocks + stats.spare_blocks == a.num_blocks
    for r in busy:
        assert finals[r].finish_reason == "length"


class FailingImport(NumpyRuntime):
    def write_layer_kv(self, layer, k, v, blocks, slot):
        if layer == 1:
            raise RuntimeError("DMA fault")
        return super().write_layer_kv(layer, k, v, blocks, slot)


@pytest.mark.parametrize("block_size", [64, 16])
def test_error_during_import_fails_only_that_request_and_frees_partly_written_blocks(block_size):
    a = tiny_art(2, 2 * (64 // block_size) + 1, block_size)
    producer = Producer(NumpyRuntime.random(tiny_art(1, 2), seed=7))
    native = Batcher(NumpyRuntime.random(a, seed=7))
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    others = [[3, 4, 5], list(range(30, 50))]
    want = [c.token_ids for c in native.generate(others, p)]
    batcher = Batcher(FailingImport.random(a, seed=7), prefix_cache=True)
    prompt = list(range(5, 25))
    bad = batcher.submit(prompt, p, kv=InProcessSource.from_producer(producer, "x", prompt, p,
                                                                     mode="whole"))
    good = [batcher.submit(q, p) for q in others]
    finals = run_to_end(batcher)
    assert finals[bad].finish_reason == "error" and "DMA fault" in finals[bad].error
    assert [finals[g].completion.token_ids for g in good] == want
    # nothing the failed import half-wrote was kept for prefix reuse
    again = batcher.generate([prompt], p)[0]
    assert again.finish_reason == "length"
    assert again.token_ids == native.generate([prompt], p)[0].token_ids


# -- exactly one final output per request under random aborts at odd moments -----------------------
@pytest.mark.parametrize("seed", range(6))
def test_every_request_ends_exactly_once_under_random_aborts(seed):
    rnd = random.Random(seed)
    layouts = [dict(batch_size=2), dict(batch_size=3, block_size=16),
               dict(batch_size=2, block_size=8, num_blocks=17, chunk=4)]
    a = art(**layouts[seed % 3])
    batcher = Batcher(LedgerRuntime(a), prefix_cache=bool(seed % 2),
                      policy=rnd.choice(["prefill-first", "decode-first", "fill-first:2"]))
    stem = [rnd.randint(1, 3) for _ in range(30)]
    submitted, finals, streamed = {}, {}, {}
    for _ in range(3000):
        if len(submitted) < 14 and rnd.random() < 0.3:
            n = rnd.randint(1, 30)
            prompt = (stem[: rnd.randint(0, n)] + [rnd.randint(1, 96) for _ in range(n)])[:n]
            rid = batcher.submit(prompt, params(rnd.randint(1, 64 - n)))
            submitted[rid] = (prompt, batcher.scheduler.requests[rid].params.max_tokens)
        live = list(batcher.scheduler.requests)
        if live and rnd.random() < 0.08:
            batcher.abort(rnd.choice(live))
        if rnd.random() < 0.03 and finals:  # aborting a finished request is a no-op
            assert not batcher.abort(rnd.choice(list(finals)))
        step_checked(batcher, finals, streamed)
        if len(submitted) == 14 and not batcher.has_unfinished():
            break
    assert set(finals) == set(submitted)
    for rid, (prompt, n) in submitted.items():
        want = reference(prompt, n, 97)
        got = streamed.get(rid, [])
        assert list(finals[rid].completion.token_ids) == got
        if finals[rid].finish_reason == "abort":
            assert got == want[: len(got)]
        else:
            assert finals[rid].finish_reason == "length" and got == want
    pool = batcher.scheduler.pool
    assert pool.num_lane == pool.num_staged == 0 and batcher.scheduler.lanes.num_busy == 0


# -- host cache: save and restore ordering within one step ----------------------------------------
def test_host_cache_saves_before_restoring_into_the_same_block():
    """Evicting a cached block and restoring another prefix into it in the same step must save
    the old contents first (saves, then restores, then copies)."""
    a = art(batch_size=1, max_seq_len=64, block_size=8, num_blocks=9, chunk=8)
    rt = LedgerRuntime(a)
    batcher = Batcher(rt, prefix_cache=True, host_cache_bytes=1 << 20)
    order = []
    for name in ("read_block", "write_block", "copy_block"):
        original = getattr(rt, name)

        def wrapped(*args, _name=name, _original=original):
            order.append((_name, args[0]))
            return _original(*args)

        setattr(rt, name, wrapped)
    steps: list[list[tuple[str, int]]] = []
    original_step = batcher.step

    def step():
        order.clear()
        outputs = original_step()
        steps.append(list(order))
        return outputs

    batcher.step = step
    first, second = list(range(1, 34)), list(range(40, 73))
    for prompt in (first, second, first, second, first):
        assert list(batcher.generate([prompt], params(2))[0].token_ids) == reference(prompt, 2, 97)
        batcher.check_invariants()
    assert batcher.stats().host_restores > 0 and batcher.stats().evictions > 0
    both = 0
    for ops in steps:
        for i, (name, block) in enumerate(ops):
            if name == "write_block" and ("read_block", block) in ops:
                both += 1
                assert ops.index(("read_block", block)) < i  # saved before overwritten
    assert both > 0


# -- AsyncBatcher edges ----------------------------------------------------------------------------
async def test_async_abort_after_finish_is_a_noop_and_the_id_can_be_reused():
    batcher = Batcher(LedgerRuntime(art(batch_size=2)))
    async with AsyncBatcher(batcher, offload=False) as ab:
        rid = ab.submit([1, 2, 3], params(3), request_id="x")
        outs = [o async for o in ab.outputs(rid)]
        assert [o.finished for o in outs] == [False, False, True]
        ab.abort("x")  # finished: nothing happens
        again = ab.submit([1, 2, 3], params(3), request_id="x")
        outs2 = [o async for o in ab.outputs(again)]
        assert outs2[-1].finish_reason == "length"
        assert [t for o in outs2 for t in o.new_token_ids] == reference([1, 2, 3], 3, 97)
        # abort queued right behind the submit: exactly one final output, reason abort
        rid3 = ab.submit([4, 5], params(30))
        ab.abort(rid3)
        outs3 = [o async for o in ab.outputs(rid3)]
        assert len(outs3) == 1 and outs3[0].finish_reason == "abort"
    with pytest.raises(RequestError, match="not running"):
        ab.submit([1])
    stats = batcher.stats()
    assert stats.occupied_lanes == 0 and stats.queue_length == 0
    batcher.check_invariants()


async def test_async_close_without_drain_aborts_in_flight_streams_once():
    batcher = Batcher(LedgerRuntime(art(batch_size=1, num_blocks=2)))
    ab = AsyncBatcher(batcher, offload=False)
    await ab.start()
    ids = [ab.submit([i + 1], params(50)) for i in range(3)]
    streams = [ab.outputs(rid) for rid in ids]
    await asyncio.sleep(0)
    await ab.close(drain=False)
    for stream in streams:
        outs = [o async for o in stream]
        assert sum(o.finished for o in outs) == 1 and outs[-1].finish_reason == "abort"
    assert not batcher.has_unfinished()
    batcher.check_invariants()



def test_oversubscribed_pool_never_stages_so_a_preempted_lane_has_a_padding_target():
    art = ArtifactConfig(model=ledger_spec(), batch_size=3, max_seq_len=32, block_size=4,
                         num_blocks=18, prefill_chunk_size=4)  # oversubscribed: 18 < 25
    batcher = Batcher(LedgerRuntime(art))
    arrivals = {1: (7, 21), 2: (19, 10), 6: (3, 28), 9: (27, 4)}
    ids = {}
    finals = {}
    for step in range(400):
        if step in arrivals:
            n, m = arrivals[step]
            params = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
            ids[batcher.submit([3] * n, params)] = (n, m)
        for out in batcher.step():
            if out.finished:
                finals[out.request_id] = out
        batcher.check_invariants()
        if step > 10 and not batcher.has_unfinished():
            break
    assert set(finals) == set(ids)
    for rid, (n, m) in ids.items():
        assert finals[rid].completion.token_ids == tuple(reference([3] * n, m, 97))
    assert batcher.stats().staged_chunks == 0


def test_staging_never_takes_blocks_running_lanes_will_need():
    art = ArtifactConfig(model=ledger_spec(), batch_size=2, max_seq_len=64, block_size=16,
                         num_blocks=9, prefill_chunk_size=16)  # exactly lanes x 4 + 1
    batcher = Batcher(LedgerRuntime(art))
    long_run = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    batcher.submit([1, 2], long_run)
    batcher.submit([3, 4], long_run)
    batcher.submit(list(range(1, 60)), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    finals = run_to_end(batcher)
    assert batcher.stats().preemptions == 0
    assert all(out.finish_reason == "length" for out in finals.values())


def test_host_restore_of_a_digest_still_on_the_device_shares_the_device_block():
    """A child block can outlive its evicted parent on the device; a lookup that continues into
    the host must use the device copy, not restore a duplicate digest."""
    art = ArtifactConfig(model=ledger_spec(), batch_size=1, max_seq_len=64, block_size=8,
                         num_blocks=9, prefill_chunk_size=16)

    class FailLate(LedgerRuntime):
        def prefill(self, inputs):
            if 70 in inputs.input_ids and inputs.cache_position[0, 0] >= 32:
                raise RuntimeError("device fault")
            return super().prefill(inputs)

    batcher = Batcher(FailLate(art), prefix_cache=True, host_cache_bytes=1 << 20)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt = list(range(1, 21))  # blocks: 1-8, 9-16, 17-20 (partial)
    want = tuple(reference(prompt, 1, 97))
    assert batcher.generate([prompt], one)[0].token_ids == want
    batcher.generate([[50] * 60], one)            # evicts everything to the host
    assert batcher.generate([prompt], one)[0].token_ids == want  # restored from the host
    failed = batcher.generate([[70] * 41], one)   # frees blocks, evicting the parent only
    assert failed[0].finish_reason == "error"
    batcher.check_invariants()
    again = batcher.submit(prompt, one)
    finals = run_to_end(batcher)                  # invariants after every step
    assert finals[again].completion.token_ids == want
    assert batcher.stats().host_restores > 0


def test_a_failed_copy_fails_the_request_it_was_for_and_nothing_else():
    art = ArtifactConfig(model=ledger_spec(), batch_size=2, max_seq_len=64, block_size=16,
                         num_blocks=9, prefill_chunk_size=8)

    class FlakyCopy(LedgerRuntime):
        fail = 0

        def copy_block(self, src, dst):
            if self.fail:
                self.fail -= 1
                raise RuntimeError("copy failed")
            super().copy_block(src, dst)

    rt = FlakyCopy(art)
    batcher = Batcher(rt, prefix_cache=True)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    base = list(range(1, 41))
    batcher.generate([[*base, 7]], params)
    prompts = [[*base[:36], 9, 9, 9], [*base[:27], 3, 3, 3]]  # the second copies a pinned block
    ids = [batcher.submit(p, params) for p in prompts]
    rt.fail = 1
    finals = run_to_end(batcher)
    assert finals[ids[0]].completion.token_ids == tuple(reference(prompts[0], 6, 97))
    assert finals[ids[1]].finish_reason == "error" and "copy failed" in finals[ids[1]].error
    assert batcher.generate([prompts[1]], params)[0].token_ids == \
        tuple(reference(prompts[1], 6, 97))

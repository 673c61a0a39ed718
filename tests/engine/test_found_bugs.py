"""Regressions for bugs a review found (each reproduction failed before its fix)."""

from __future__ import annotations

from driving import run_to_end
from ledger import LedgerRuntime, ledger_spec, reference

from atombatch import ArtifactConfig, Batcher, SamplingParams


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

"""Prefix and host caching for Gemma3's hybrid layers: sliding-slot checkpoints.

A hit on a hybrid model restores the global layers' blocks and every sliding layer's window, from
a host checkpoint of a lane's slot at a chunk boundary (atombatch/engine/checkpoints.py). The tokens must
equal transformers' (a full forward per token, no cache) in multi-turn conversations whose shared
prefix is many windows long, in eager, paged, bucketed and oversubscribed layouts, through the
host cache after evictions, and through the emulated rebel; hits must be longer than the window.
A workload of mixed hits, misses, aborts and preemptions on the ledger runtime checks the
ownership and memory accounting of checkpoints after every step.
"""

from __future__ import annotations

import numpy as np
import pytest
from fakerebel.compiler import compile_dir
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from support.driving import run_to_end
from support.hf_models import SLIDING_WINDOW, build_model, hf_logits, save_checkpoint
from support.ledger import LedgerRuntime, ledger_spec, reference
from support.numerics import greedy_reference

from atombatch import ArtifactConfig, Batcher, ModelSpec, SamplingParams
from atombatch.engine.checkpoints import DROPPED, HELD
from atombatch.runtime import NumpyRuntime, RebelRuntime

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run

NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
MAX_SEQ = 256
HOST = 1 << 22


class Conversations:
    """Two (or more) chats sharing a 48-token system prompt; turn k+1 is turn k's prompt, its
    transformers output and new user text. References are transformers' greedy tokens."""

    def __init__(self, model, count=2, turns=3, seed=3):
        self.model = model
        rng = np.random.default_rng(seed)
        system = rng.integers(3, 512, size=48).tolist()
        self.turns: list[list[tuple[list[int], list[int]]]] = []   # per chat: (prompt, output)
        for _ in range(count):
            chat, prompt = [], system + rng.integers(3, 512, size=13).tolist()
            for _ in range(turns):
                output = self.greedy(prompt)
                chat.append((prompt, output))
                prompt = prompt + output + rng.integers(3, 512, size=11).tolist()
            self.turns.append(chat)

    def greedy(self, prompt):
        """transformers' greedy tokens, with where a near tie could go either way on another
        float32 evaluation (support/numerics.py GreedyTokens)."""
        return greedy_reference(self.model, prompt, NEW, lambda m, s: hf_logits(m, s)[-1])


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = save_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3"))
    chats = Conversations(build_model("gemma3"))
    return path, ModelSpec.from_pretrained(path), chats


def numpy_runtime(path, spec, batch_size, block_size=MAX_SEQ, num_blocks=None, chunk=16,
                  buckets=(), max_seq_len=MAX_SEQ):
    bps = max_seq_len // block_size
    art = ArtifactConfig(model=spec, batch_size=batch_size, max_seq_len=max_seq_len,
                         block_size=block_size, num_blocks=num_blocks or batch_size * bps + 1,
                         prefill_chunk_size=chunk, decoder_batch_sizes=buckets)
    return NumpyRuntime.from_pretrained(path, artifact=art)


def recording(batcher):
    """The `tokens` of every prefix hit the engine reports (its `prefix.hit` events)."""
    hits: list[int] = []
    flush = batcher._flush_events

    def keep():
        hits.extend(f["tokens"] for name, f in batcher.scheduler.events if name == "prefix.hit")
        flush()

    batcher._flush_events = keep
    return hits


def run_chats(batcher, chats, q, floor=True):
    """Every chat's turns, the chats of a turn submitted together; asserts transformers' tokens
    and (`floor`) that turn k+1 resumes at least at the last chunk boundary of turn k's cached
    sequence. Without `floor` (a pool that evicts) the parent of a device block may be on the
    host only, and a lookup does not continue from the host back to the device."""
    hits = recording(batcher)
    for turn in range(len(chats.turns[0])):
        before = batcher.stats().prefix_hit_tokens
        prompts = [chat[turn][0] for chat in chats.turns]
        got = [list(c.token_ids) for c in batcher.generate(prompts, GREEDY)]
        assert got == [chat[turn][1] for chat in chats.turns], turn
        batcher.check_invariants()
        if turn and floor:
            # the previous turn's sequence holds prompt + output - 1 positions of KV
            floor = sum((len(chat[turn - 1][0]) + NEW - 1) // q * q for chat in chats.turns)
            assert batcher.stats().prefix_hit_tokens - before >= floor
    assert max(hits) > 3 * SLIDING_WINDOW   # several windows long
    return hits


LAYOUTS = {
    "eager-B2-chunk16": dict(batch_size=2),
    "eager-B4-chunk32-dbs1,2,4": dict(batch_size=4, chunk=32, buckets=(1, 2, 4)),
    "paged-B2-bs16-chunk8": dict(batch_size=2, block_size=16, chunk=8),
    "paged-B3-bs32-chunk16-dbs1,3": dict(batch_size=3, block_size=32, buckets=(1, 3)),
    # 9 blocks of 16 for two lanes of 8 (the turns need 5-7 each): growth evicts cached blocks
    # to the host, and preempts
    "oversubscribed-B2-ctx128-bs16-k9": dict(batch_size=2, block_size=16, num_blocks=9,
                                             max_seq_len=128),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_multi_turn_chats_equal_transformers_with_long_hits(gemma, layout):
    path, spec, chats = gemma
    options = LAYOUTS[layout]
    batcher = Batcher(numpy_runtime(path, spec, **options), prefix_cache=True,
                      host_cache_bytes=HOST)
    run_chats(batcher, chats, options.get("chunk", 16), floor="oversubscribed" not in layout)
    stats = batcher.stats()
    assert stats.slot_restores >= 4 and stats.slot_saves >= 4
    if "oversubscribed" in layout:
        assert stats.evictions > 0 and stats.host_restores > 0


def test_repeating_every_turn_hits_from_the_host_after_evictions(gemma):
    """Each chat's turns alone, then all of them again in reverse: the blocks of the first pass
    were evicted to the host by then, and come back with their checkpoints."""
    path, spec, chats = gemma
    batcher = Batcher(numpy_runtime(path, spec, 2, block_size=16, num_blocks=9, max_seq_len=128),
                      prefix_cache=True, host_cache_bytes=HOST)
    sequence = [pair for chat in chats.turns for pair in chat]
    for prompt, output in sequence + sequence[::-1]:
        [done] = batcher.generate([prompt], GREEDY)
        assert list(done.token_ids) == output
        batcher.check_invariants()
    stats = batcher.stats()
    assert stats.evictions > 0 and stats.host_restores > 0 and stats.slot_restores >= 6
    assert batcher.host_cache.hits > 0


def test_a_shared_system_prompt_is_checkpointed_at_its_junction(gemma):
    """Chats that start together miss; the next chat's lookup matches the 48-token system
    prompt's blocks but finds no checkpoint at 48 (the first chats saved at 64 and 80), so it
    saves one at that junction, where the chat after it resumes."""
    path, spec, chats = gemma
    batcher = Batcher(numpy_runtime(path, spec, 2), prefix_cache=True, host_cache_bytes=HOST)
    hits = recording(batcher)
    rng = np.random.default_rng(9)
    system = chats.turns[0][0][0][:48]
    first = [system + rng.integers(3, 512, size=n).tolist() for n in (30, 35)]
    assert [list(c.token_ids) for c in batcher.generate(first, GREEDY)] == \
        [chats.greedy(p) for p in first]
    assert hits == []
    for prompt in [system + rng.integers(3, 512, size=n).tolist() for n in (19, 25)]:
        [done] = batcher.generate([prompt], GREEDY)
        assert list(done.token_ids) == chats.greedy(prompt)
    assert hits == [48]   # the first later chat saved the junction, the second resumed there


def test_a_wrong_restored_slot_changes_the_tokens(gemma, monkeypatch):
    """The check can fail: restoring zeros instead of the checkpoint (what resuming the global
    layers alone amounts to) gives other tokens than transformers."""
    path, spec, chats = gemma
    rt = numpy_runtime(path, spec, 2)
    batcher = Batcher(rt, prefix_cache=True, host_cache_bytes=HOST)
    prompt, output = chats.turns[0][0]
    assert list(batcher.generate([prompt], GREEDY)[0].token_ids) == output
    monkeypatch.setattr(rt, "write_slot", lambda slot, data: NumpyRuntime.write_slot(
        rt, slot, np.zeros_like(data)))
    second, want = chats.turns[0][1]
    got = list(batcher.generate([second], GREEDY)[0].token_ids)
    assert batcher.stats().slot_restores == 1
    assert got != want


def test_no_checkpoint_budget_left_means_misses_not_wrong_tokens(gemma):
    """A host budget of exactly one checkpoint: lanes hold it while they run, so most boundaries
    go unsaved; the tokens stay right and what is held never exceeds the budget."""
    path, spec, chats = gemma
    rt = numpy_runtime(path, spec, 2)
    batcher = Batcher(rt, prefix_cache=True, host_cache_bytes=rt.slot_bytes)
    for chat in chats.turns:
        for prompt, output in chat:
            assert list(batcher.generate([prompt], GREEDY)[0].token_ids) == output
            assert batcher.host_cache.used_bytes <= rt.slot_bytes
    assert batcher.scheduler.kv.checkpoints.store.skipped > 0


# -- the emulated device ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", [dict(kvcache_num_blocks=3),
                                    dict(kvcache_block_size=32, kvcache_num_blocks=17)],
                         ids=["eager", "flash"])
def test_through_the_emulated_rebel_kv_methods(fake_rebel, tmp_path, gemma, layout):
    path, _, chats = gemma
    d = compile_dir(tmp_path / "c", path, batch_size=2, max_seq_len=MAX_SEQ,
                    prefill_chunk_size=16, **layout)
    rt = RebelRuntime.from_optimum(d)
    batcher = Batcher(rt, prefix_cache=True, host_cache_bytes=HOST)
    run_chats(batcher, chats, 16)
    assert batcher.stats().slot_restores >= 4
    assert fake_rebel.KV_CALLS["_fetch_kv_cache"] > 0
    assert fake_rebel.KV_CALLS["_update_kv_cache"] > 0


def test_rebel_slot_round_trip_is_exact(fake_rebel, tmp_path, gemma):
    path, _, chats = gemma
    d = compile_dir(tmp_path / "c", path, batch_size=2, max_seq_len=MAX_SEQ,
                    prefill_chunk_size=16, kvcache_num_blocks=3)
    rt = RebelRuntime.from_optimum(d)
    Batcher(rt).generate([chats.turns[0][0][0]], GREEDY)   # lane 0's slot holds a window
    saved = rt.read_slot(0)
    assert saved.shape == rt.slot_shape and saved.nbytes == rt.slot_bytes and saved.any()
    rt.write_slot(1, saved)
    assert np.array_equal(rt.read_slot(1), saved)


# -- ownership and memory under a random workload (ledger runtime) -----------------------------------
def ledger_batcher(host_bytes, batch_size=2, num_blocks=7):
    spec = ledger_spec(hybrid=True, window=5)
    art = ArtifactConfig(model=spec, batch_size=batch_size, max_seq_len=64, block_size=8,
                         num_blocks=num_blocks, prefill_chunk_size=4)
    return Batcher(LedgerRuntime(art), prefix_cache=True, host_cache_bytes=host_bytes)


def check_checkpoints(batcher, live: bool):
    """Byte accounting, holders and states of every checkpoint."""
    kv = batcher.scheduler.kv
    store, host = kv.checkpoints.store, batcher.host_cache
    blocks = sum(int(e.data.nbytes) for e in host._lru.values())
    assert host.used_bytes == blocks + store.used_bytes <= host.capacity_bytes
    # cached blocks, host copies, and evicted blocks whose host save has not run yet
    entries = list(kv.prefix._entries.values()) + list(host._lru.values()) + kv._saves
    holders: dict[int, int] = {}
    for entry in entries:
        for checkpoint in entry.checkpoints or ():
            if checkpoint.state != DROPPED:
                holders[id(checkpoint)] = holders.get(id(checkpoint), 0) + 1
    for checkpoint in store._by_digest.values():
        assert checkpoint.state != DROPPED
        assert checkpoint.entries == holders.get(id(checkpoint), 0)
        assert checkpoint.entries + checkpoint.lanes > 0
        if not live:
            # saved, or its save op waits for the next plan (it runs before any device call)
            assert checkpoint.lanes == 0
            assert checkpoint.state == HELD or \
                any(c is checkpoint for _, c in kv.checkpoints.saves)
    if not live:
        assert not kv.checkpoints.lanes and not kv.checkpoints.restores


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data(), host_checkpoints=st.sampled_from([1, 3, 40]),
       pool=st.sampled_from([(2, 9), (2, 17), (3, 9), (3, 12)]))
def test_random_hits_misses_aborts_and_preemptions(data, host_checkpoints, pool):
    window, vocab = 5, 97
    batch_size, num_blocks = pool   # 8 blocks per sequence: 9 and 12 oversubscribe (preempt)
    batcher = ledger_batcher(host_checkpoints * 2 * 5 * 8 + 8 * 64, batch_size=batch_size,
                             num_blocks=num_blocks)
    stems = [data.draw(st.lists(st.integers(1, 96), min_size=1, max_size=30)) for _ in range(3)]
    history: list[list[int]] = []
    expected: dict[str, tuple[list[int], int]] = {}
    finals = {}
    aborts: dict[int, list[str]] = {}

    def collect(outputs):
        for out in outputs:
            if out.finished:
                finals[out.request_id] = out
                if out.finish_reason == "length":  # a later turn may extend it
                    history.append(expected[out.request_id][0] + list(out.completion.token_ids))

    for step in range(data.draw(st.integers(20, 80))):
        if data.draw(st.booleans()):
            kind = data.draw(st.sampled_from(["stem", "extend", "fresh"]))
            if kind == "extend" and history:
                base = data.draw(st.sampled_from(history))
            elif kind == "stem":
                base = data.draw(st.sampled_from(stems))
            else:
                base = []
            prompt = (base + data.draw(st.lists(st.integers(1, 96), min_size=1, max_size=12)))[:40]
            limit = data.draw(st.integers(1, 14))
            rid = batcher.submit(prompt, SamplingParams(temperature=0.0, max_tokens=limit,
                                                        ignore_eos=True))
            expected[rid] = (prompt, limit)
            if data.draw(st.integers(0, 4)) == 0:
                aborts.setdefault(step + data.draw(st.integers(0, 6)), []).append(rid)
        for rid in aborts.pop(step, []):
            batcher.abort(rid)
        collect(batcher.step())
        batcher.check_invariants()
        check_checkpoints(batcher, live=True)
    while batcher.has_unfinished():
        collect(batcher.step())
        batcher.check_invariants()
    check_checkpoints(batcher, live=False)
    for rid, (prompt, limit) in expected.items():
        out = finals[rid]
        tokens = list(out.completion.token_ids)
        assert tokens == reference(prompt, limit, vocab, window)[:len(tokens)]
        if out.finish_reason == "length":
            assert len(tokens) == limit
        else:
            assert out.finish_reason == "abort"
    stats = batcher.stats()
    assert stats.finished.get("error", 0) == 0
    for name in ("slot_restores", "preemptions", "host_restores", "evictions"):
        event(f"{name} > 0: {getattr(stats, name) > 0}")
    event(f"checkpoints dropped > 0: {batcher.scheduler.kv.checkpoints.store.dropped > 0}")


def test_n_choices_share_the_prompt_checkpoint(gemma):
    """n > 1 with the prefix cache: choices 1.. wait for choice 0's first token and start from
    its cached prompt, whose window a checkpoint restores; each choice samples what it samples
    on its own (a run of each seed alone, without any cache)."""
    path, spec, chats = gemma
    prompt = chats.turns[0][1][0]   # 80 tokens: 5 windows
    params = SamplingParams(n=3, temperature=0.9, top_k=40, max_tokens=NEW, seed=11,
                            ignore_eos=True)
    # 16-token blocks: choice 0's full prompt blocks are published while it decodes
    batcher = Batcher(numpy_runtime(path, spec, 4, block_size=16), prefix_cache=True,
                      host_cache_bytes=HOST)
    shared = [list(c.token_ids) for c in batcher.generate([prompt], params)]
    assert batcher.stats().slot_restores == 2   # choices 1 and 2, from choice 0's checkpoint
    for index, tokens in enumerate(shared):
        alone = Batcher(numpy_runtime(path, spec, 1)).generate(
            [prompt], SamplingParams(temperature=0.9, top_k=40, max_tokens=NEW,
                                     seed=11 + index, ignore_eos=True))
        assert list(alone[0].token_ids) == tokens, index


# -- the checkpoint store and its rules, one at a time ---------------------------------------------
def test_memory_pressure_drops_host_blocks_then_idle_checkpoints_never_held_ones():
    from atombatch.engine.checkpoints import CheckpointStore
    from atombatch.kernel.prefix import Entry, HostCache

    host = HostCache(capacity_bytes=100, block_size=4)
    store = CheckpointStore(host, nbytes=40)
    block = Entry(digest=b"b" * 16, parent=b"", tokens=np.arange(4), full=True)
    host.put(block, np.zeros(5, dtype=np.int64))          # 40 bytes of host block
    held = store.create(b"h" * 16, 4)
    store.hold_lane(held)                                 # a running lane's: never dropped
    assert host.used_bytes == 80
    idle = store.create(b"i" * 16, 8)                     # the host block makes room for it
    assert len(host) == 0 and host.used_bytes == 80
    entry = Entry(digest=b"e" * 16, parent=b"", tokens=np.arange(4), full=True)
    store.hold_lane(idle)
    store.attach(idle, entry)
    store.release_lane(idle)                              # held by a cached block only: idle
    third = store.create(b"t" * 16, 12)                   # drops the idle one, not the held one
    assert third is not None and idle.state == DROPPED and held.state != DROPPED
    assert store.find(idle.digest) is None and host.used_bytes == 80
    store.hold_lane(third)
    assert store.create(b"x" * 16, 16) is None and store.skipped == 1   # all held by lanes
    store.entry_gone(entry)                               # a dropped checkpoint is skipped
    store.release_lane(third)
    assert third.state == DROPPED and host.used_bytes == 40   # no holder left: freed


def test_a_checkpoint_travels_with_its_block_to_the_host_and_leaves_with_it():
    from atombatch.engine.checkpoints import CheckpointStore
    from atombatch.kernel.prefix import Entry, HostCache

    host = HostCache(capacity_bytes=200, block_size=4)
    store = CheckpointStore(host, nbytes=50)
    checkpoint = store.create(b"c" * 16, 4)
    store.hold_lane(checkpoint)
    device = Entry(digest=b"d" * 16, parent=b"", tokens=np.arange(4), full=True, block=3)
    store.attach(checkpoint, device)
    store.release_lane(checkpoint)
    host.put(device, np.zeros(10, dtype=np.int64))        # evicted: the checkpoint goes along
    (copy,) = host._lru.values()
    assert copy.checkpoints == [checkpoint] and device.checkpoints is None
    assert checkpoint.entries == 1 and checkpoint.state != DROPPED
    host.drop_lru()                                       # the host copy is dropped: so is it
    assert checkpoint.state == DROPPED and host.used_bytes == 0


def test_a_pending_restore_leaves_with_its_request():
    """A lane released while its restore has not run (preempted in the step that planned it)
    drops the restore and registers nothing: its slot never held that window."""
    batcher = ledger_batcher(1 << 16, num_blocks=17)
    prompt = list(range(1, 30))
    batcher.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    scheduler = batcher.scheduler
    kv = scheduler.kv
    rid = batcher.submit(prompt + [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4,
                                                            ignore_eos=True))
    scheduler._admit(0.0)                                 # attach: the hit plans a restore
    request = scheduler.requests[rid]
    assert [op[2] for op in kv.checkpoints.restores] == [rid] and request.prefill_pos > 0
    (_, hit, _), = kv.checkpoints.restores
    lanes = hit.lanes
    scheduler.preempt(request)
    assert kv.checkpoints.restores == [] and kv.checkpoints.dropped_restores == 1
    assert rid not in [r.request_id for r in kv.checkpoints.lanes.values()]
    assert hit.lanes == lanes - 1        # the lane let go of it, and registered nothing
    scheduler.check_invariants()
    got = list(run_to_end(batcher)[rid].completion.token_ids)   # re-admitted: restored for real
    assert got == reference(prompt + [5, 6, 7], 4, 97, 5)
    check_checkpoints(batcher, live=False)



def test_bfloat16_device_caches_give_the_tokens_of_no_cache(fake_rebel, tmp_path, gemma):
    """A bfloat16 directory: a checkpoint moves the slot's bf16 bits and the resumed prefill runs
    the same chunks, so every turn's tokens equal those of a run without any cache (on its own
    emulated device) exactly."""
    path, _, chats = gemma

    def directory(name):
        return compile_dir(tmp_path / name, path, batch_size=2, max_seq_len=MAX_SEQ,
                           prefill_chunk_size=16, kvcache_num_blocks=3, dtype="bfloat16")

    cached = Batcher(RebelRuntime.from_optimum(directory("cached")), prefix_cache=True,
                     host_cache_bytes=HOST)
    plain = Batcher(RebelRuntime.from_optimum(directory("plain")))
    for chat in chats.turns:
        for prompt, _ in chat:
            want = plain.generate([prompt], GREEDY)[0].token_ids
            assert cached.generate([prompt], GREEDY)[0].token_ids == want
    assert cached.stats().slot_restores >= 4
    assert cached.runtime.read_slot(0).dtype == cached.runtime._host_dtype


def test_plan_reports_the_checkpoint_size_and_stats_the_bytes_held(gemma):
    from atombatch.artifact import plan

    gemma_1b = ArtifactConfig(model=ModelSpec.preset("gemma3-1b"), batch_size=4,
                              max_seq_len=8192, block_size=8192, num_blocks=5)
    result = plan.fit(gemma_1b)
    assert result.checkpoint_bytes == plan.checkpoint_bytes(gemma_1b) == 22 * 2 * 512 * 256 * 2
    assert "11,534,336 bytes per sliding-slot checkpoint" in plan.describe(result)
    assert result.projected_bytes == result.other_bytes + result.kv_bytes   # not on the device
    qwen = ArtifactConfig(model=ModelSpec.preset("qwen3-0.6b"), batch_size=4, max_seq_len=8192,
                          block_size=8192, num_blocks=5)
    assert plan.fit(qwen).checkpoint_bytes == 0 and "checkpoint" not in plan.describe(
        plan.fit(qwen))
    path, spec, chats = gemma
    rt = numpy_runtime(path, spec, 2)
    batcher = Batcher(rt, prefix_cache=True, host_cache_bytes=HOST)
    batcher.generate([chats.turns[0][0][0]], GREEDY)
    stats = batcher.stats()
    assert stats.checkpoint_bytes == len(batcher.scheduler.kv.checkpoints.store) * rt.slot_bytes
    assert stats.checkpoint_bytes > 0 and stats.slot_saves >= 1

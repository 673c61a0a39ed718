"""The routing policies as pure classes: digests, affinity, the imbalance bound, forgetting."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atombatch import ArtifactConfig, Batcher, ModelSpec, SamplingParams
from atombatch.cluster import (
    LoadOnlyPolicy,
    OtherRouters,
    PrefixAffinityPolicy,
    ReplicaLoad,
    make_policy,
    route_digests,
)
from atombatch.cluster.summary import CacheSummarizer, CacheSummary
from atombatch.errors import CapacityError, ConfigError
from atombatch.kernel import prefix
from atombatch.runtime.sim import SimRuntime


def loads(*values: int, lanes: int = 4) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i}", lanes=lanes, in_flight=v) for i, v in enumerate(values)]


def test_route_digests_are_the_prefix_caches_chained_digests() -> None:
    prompt = list(range(3, 3 + 100))
    digests = route_digests(prompt, route_block=16)
    assert len(digests) == 6                      # 100 // 16 full blocks, the tail is not digested
    parent = prefix.ROOT
    for j, digest in enumerate(digests):
        parent = prefix.chain_digest(parent, np.asarray(prompt[j * 16:(j + 1) * 16]), True)
        assert digest == parent
    # a digest covers everything before it: one changed early token changes every later digest
    other = route_digests([4] + prompt[1:], route_block=16)
    assert all(a != b for a, b in zip(digests, other, strict=True))
    # shared leading blocks share digests, then diverge
    forked = route_digests(prompt[:40] + [7] * 60, route_block=16)
    assert forked[:2] == digests[:2] and forked[2] != digests[2]
    assert route_digests(prompt, route_block=16, max_blocks=2) == digests[:2]
    assert route_digests(prompt[:15], route_block=16) == ()
    with pytest.raises(ConfigError, match="route_block=0"):
        route_digests(prompt, route_block=0)


def test_affinity_follows_the_longest_leading_match() -> None:
    policy = PrefixAffinityPolicy(max_imbalance=8)
    system = list(range(10, 74))                  # 64 shared tokens = 4 blocks of 16
    a = route_digests(system + [1] * 32, 16)
    b = route_digests(system + [2] * 32, 16)
    policy.routed(a, "r1")
    policy.routed(b[:4], "r2")                    # r2 only saw the shared system prompt
    assert policy.match_blocks(a, "r1") == 6
    assert policy.match_blocks(a, "r2") == 4
    # both hold the system prompt; r1 holds more of this conversation
    assert policy.rank(a, loads(0, 2, 0))[0] == "r1"
    # a new conversation on the same system prompt: r1 and r2 tie on 4 blocks, lower load wins
    c = route_digests(system + [3] * 32, 16)
    assert policy.rank(c, loads(0, 3, 1))[0] == "r2"
    assert policy.stats.affinity == 2


def test_imbalance_bound_spills_to_the_least_loaded() -> None:
    policy = PrefixAffinityPolicy(max_imbalance=2)
    digests = route_digests(list(range(64)), 16)
    policy.routed(digests, "r0")
    assert policy.rank(digests, loads(2, 0, 1))[0] == "r0"       # 2 <= 0 + 2
    ranking = policy.rank(digests, loads(3, 0, 1))                # 3 > 0 + 2: spill
    assert ranking == ["r1", "r2", "r0"]
    assert policy.stats.spilled == 1


def test_reports_and_own_count_take_the_larger() -> None:
    stale = ReplicaLoad("r0", lanes=4, occupied=1, queue=0, in_flight=3)
    assert stale.load == 3 and stale.free_lanes == 1
    other_router = ReplicaLoad("r0", lanes=4, occupied=4, queue=2, in_flight=1)
    assert other_router.load == 6 and other_router.free_lanes == 0


def test_a_hot_prefix_never_starves_a_replica() -> None:
    """Every request shares one prefix and none finishes: affinity fills r0 only up to the bound,
    then the others take turns, so the spread stays within max_imbalance + 1."""
    policy = PrefixAffinityPolicy(max_imbalance=3)
    digests = route_digests(list(range(128)), 16)
    in_flight = {"r0": 0, "r1": 0, "r2": 0}
    for _ in range(60):
        replicas = [ReplicaLoad(r, lanes=4, in_flight=n) for r, n in in_flight.items()]
        in_flight[policy.choose(digests, replicas)] += 1
        assert max(in_flight.values()) - min(in_flight.values()) <= 3 + 1
    assert min(in_flight.values()) >= 60 // 3 - 3


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=6), st.integers(0, 6),
       st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), max_size=12),
       st.integers(0, 3))
def test_choice_is_always_within_the_bound(load_values: list[int], bound: int,
                                           history: list[tuple[int, int]], group: int) -> None:
    policy = PrefixAffinityPolicy(max_imbalance=bound)
    groups = [route_digests([g] * 48, 16) for g in range(4)]
    for replica, g in history:
        policy.routed(groups[g], f"r{replica}")
    replicas = loads(*load_values)
    ranking = policy.rank(groups[group], replicas)
    assert sorted(ranking) == sorted(r.replica for r in replicas)
    chosen = next(r for r in replicas if r.replica == ranking[0])
    assert chosen.load <= min(load_values) + bound


def test_new_prefix_groups_spread_and_repeat_deterministically() -> None:
    policy = PrefixAffinityPolicy()
    replicas = loads(0, 0, 0, 0)
    firsts = {policy.rank(route_digests([g] * 32, 16), replicas)[0] for g in range(40)}
    assert len(firsts) == 4                       # equal loads: groups spread over all replicas
    again = PrefixAffinityPolicy()
    assert all(policy.rank(route_digests([g] * 32, 16), replicas)[0] ==
               again.rank(route_digests([g] * 32, 16), replicas)[0] for g in range(40))


def test_forget_and_capacity() -> None:
    policy = PrefixAffinityPolicy(capacity=5)
    d = route_digests(list(range(64)), 16)
    policy.routed(d, "r0")
    policy.routed(d, "r1")
    policy.forget("r0")
    assert policy.match_blocks(d, "r0") == 0 and policy.match_blocks(d, "r1") == 4
    policy.forget("r1")
    assert len(policy) == 0
    for g in range(3):
        policy.routed(route_digests([g] * 64, 16), "r0")
    assert len(policy) == 5                        # least recently used digests forgotten
    assert policy.match_blocks(route_digests([2] * 64, 16), "r0") == 4
    assert policy.match_blocks(route_digests([0] * 64, 16), "r0") == 0


def test_load_only_baselines() -> None:
    replicas = loads(5, 1, 3)
    assert LoadOnlyPolicy("least-loaded").choose((), replicas) == "r1"
    rr = LoadOnlyPolicy("round-robin")
    assert [rr.choose((), replicas) for _ in range(4)] == ["r0", "r1", "r2", "r0"]
    pow2 = LoadOnlyPolicy("pow2", seed=3)
    for _ in range(20):
        ranking = pow2.rank((), replicas)
        first, second = (next(r for r in replicas if r.replica == x) for x in ranking[:2])
        assert first.load <= second.load
        assert ranking[0] != "r0"                  # the busiest never wins a pair
    assert isinstance(make_policy("prefix"), PrefixAffinityPolicy)
    with pytest.raises(ConfigError, match="'random'"):
        make_policy("random")
    with pytest.raises(CapacityError, match="no replicas"):
        PrefixAffinityPolicy().rank((), [])
    with pytest.raises(ConfigError, match="max_imbalance=-1"):
        PrefixAffinityPolicy(max_imbalance=-1)


def test_a_free_lane_elsewhere_beats_queueing_on_the_prefix_holder() -> None:
    policy = PrefixAffinityPolicy(max_imbalance=8)
    digests = route_digests(list(range(64)), 16)
    policy.routed(digests, "r0")
    full = [ReplicaLoad("r0", lanes=2, in_flight=2), ReplicaLoad("r1", lanes=2, in_flight=1)]
    assert policy.rank(digests, full)[0] == "r1"      # r0 has no free lane, r1 has one
    everyone_full = [ReplicaLoad("r0", lanes=2, in_flight=3),
                     ReplicaLoad("r1", lanes=2, in_flight=2)]
    assert policy.rank(digests, everyone_full)[0] == "r0"   # then affinity, within the bound
    no_cache = [ReplicaLoad("r0", lanes=2, in_flight=1, prefix_cache=False),
                ReplicaLoad("r1", lanes=2, in_flight=0, prefix_cache=False)]
    assert policy.rank(digests, no_cache)[0] == "r1"  # nothing cached anywhere: least loaded


# -- what the replicas' caches report --------------------------------------------------------------
def sim_batcher(num_blocks: int = 12, block_size: int = 32, host_cache_bytes: int = 0) -> Batcher:
    art = ArtifactConfig(model=ModelSpec.preset("qwen3-0.6b"), batch_size=2, max_seq_len=256,
                         block_size=block_size, num_blocks=num_blocks, prefill_chunk_size=32)
    return Batcher(SimRuntime(art), prefix_cache=True, host_cache_bytes=host_cache_bytes)


def serve_one(batcher: Batcher, prompt: list[int]) -> None:
    batcher.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))


def summarize(batcher: Batcher, summarizer: CacheSummarizer) -> CacheSummary:
    return summarizer.summary(batcher.scheduler.prefix, batcher.scheduler.host)


def test_summary_holds_what_the_cache_holds_and_drops_what_it_evicts() -> None:
    batcher = sim_batcher()
    summarizer = CacheSummarizer(route_block=16, max_blocks=8)
    a = [3 + (i * 7) % 500 for i in range(100)]            # 6 route blocks of 16 (+4 tokens)
    serve_one(batcher, a)
    summary = summarize(batcher, summarizer)
    digests = route_digests(a, 16)
    assert summary.run(digests) == 6 and summary.count == 6 and not summary.truncated
    # a different prompt sharing the first 40 tokens holds 2 route blocks of it
    assert summary.run(route_digests(a[:40] + [9] * 60, 16)) == 2
    assert summary.run(route_digests([4] * 100, 16)) == 0
    # memoized by block digest: nothing new cached, nothing hashed
    hashed = summarizer.hashed_tokens
    assert summarize(batcher, summarizer) == summary and summarizer.hashed_tokens == hashed
    # other prompts fill the cache (12 blocks of 32): a's blocks are evicted, and so is its report
    for g in range(4):
        serve_one(batcher, [600 + g] * 100)
    evicted = summarize(batcher, summarizer)
    assert batcher.stats().evictions > 0
    assert evicted.run(digests) < 6
    assert batcher.scheduler.prefix.lookup(a).tokens < 96
    assert evicted.run(route_digests([603] * 100, 16)) == 6


def test_summary_includes_the_host_cache_and_respects_its_bounds() -> None:
    batcher = sim_batcher(host_cache_bytes=1 << 30)
    a = [5 + i % 400 for i in range(100)]
    serve_one(batcher, a)
    for g in range(4):
        serve_one(batcher, [600 + g] * 100)
    summarizer = CacheSummarizer(route_block=16, max_blocks=8)
    # evicted from the device into the host cache: still a hit there, still reported
    assert summarize(batcher, summarizer).run(route_digests(a, 16)) == 6
    shallow = CacheSummarizer(route_block=16, max_blocks=2)
    assert summarize(batcher, shallow).run(route_digests(a, 16)) == 2
    # leading blocks first: capped at the 5 chains' first cache blocks (2 route blocks each)
    capped = CacheSummarizer(route_block=16, max_blocks=8, capacity=10)
    summary = summarize(batcher, capped)
    assert summary.count == 10 and summary.truncated
    assert all(summary.run(route_digests(p, 16)) == 2 for p in [a] + [[600 + g] * 100
                                                                     for g in range(4)])
    with pytest.raises(ConfigError, match="bits=100"):
        CacheSummarizer(bits=100)


def test_an_evicted_prefix_stops_attracting_requests() -> None:
    policy = PrefixAffinityPolicy(max_imbalance=8, pending_s=2.0)
    group = route_digests(list(range(10, 106)), 16)          # 6 route blocks
    replicas = loads(0, 0, 0)
    first = policy.choose(group, replicas, now=0.0)
    # sent there, not yet reported: the router's own record keeps the group together
    assert policy.rank(group, replicas, now=1.0)[0] == first
    held = CacheSummary.build(group, route_block=16)
    empty = CacheSummary.build((), route_block=16)
    for r in replicas:
        policy.report(r.replica, held if r.replica == first else empty)
    assert policy.rank(group, replicas, now=10.0)[0] == first      # its cache says it holds it
    assert policy.stats.reported == 1
    # the replica evicted the prefix (or restarted empty); another one cached it meanwhile
    other = next(r.replica for r in replicas if r.replica != first)
    policy.report(first, empty)
    policy.report(other, held)
    assert policy.rank(group, replicas, now=10.0)[0] == other
    # nobody holds it any more: back to the rendezvous choice among equals, not the old holder
    policy.report(other, empty)
    fresh = PrefixAffinityPolicy()
    assert policy.rank(group, replicas, now=10.0)[0] == fresh.rank(group, replicas)[0]
    assert policy.match_blocks(group, first, now=10.0) == 0
    # a report of part of the chain plus recent sends of the rest: the run continues
    policy.report(first, CacheSummary.build(group[:2], route_block=16))
    policy.routed(group, first, now=20.0)
    assert policy.match_blocks(group, first, now=21.0) == 6
    assert policy.match_blocks(group, first, now=23.0) == 2   # past pending_s: only the report
    policy.completed(group, first, now=30.0)                  # the request ended: fresh again
    assert policy.match_blocks(group, first, now=31.0) == 6


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12),
                          st.dictionaries(st.integers(0, 5), st.integers(1, 6), max_size=4)),
                min_size=1, max_size=5),
       st.integers(0, 5), st.integers(0, 5), st.integers(1, 6), st.integers(1, 4))
def test_routing_over_reported_summaries(replica_specs: list[tuple[int, dict[int, int]]],
                                         bound: int, group: int, depth: int,
                                         lanes: int) -> None:
    """Each replica reports the groups it caches and how deep; the request is `depth` route
    blocks of `group`. The choice respects the bound, and among eligible replicas the one whose
    report holds the longest run wins (the exact runs are the oracle)."""
    chains = {g: route_digests([g + 3] * (16 * 6), 16) for g in range(6)}
    policy = PrefixAffinityPolicy(max_imbalance=bound)
    replicas = []
    exact = {}
    for i, (load, cached) in enumerate(replica_specs):
        name = f"r{i}"
        replicas.append(ReplicaLoad(name, lanes=lanes, in_flight=load))
        policy.report(name, CacheSummary.build(
            (d for g, n in cached.items() for d in chains[g][:n]), route_block=16))
        exact[name] = min(cached.get(group, 0), depth)
    request = chains[group][:depth]
    ranking = policy.rank(request, replicas, now=100.0)
    assert sorted(ranking) == sorted(exact)
    chosen = next(r for r in replicas if r.replica == ranking[0])
    floor = min(r.load for r in replicas)
    assert chosen.load <= floor + bound
    lane_free = any(r.free_lanes > 0 for r in replicas)
    eligible = [r for r in replicas if r.load <= floor + bound and
                (r.free_lanes > 0 or not lane_free) and exact[r.replica] >= 1]
    if eligible:
        assert exact[chosen.replica] == max(exact[r.replica] for r in eligible)
    else:
        assert chosen.load == floor
    for r in replicas:
        assert policy.match_blocks(request, r.replica, now=100.0) == exact[r.replica]


def test_stale_reports_of_the_routers_own_requests_do_not_count_twice() -> None:
    others = OtherRouters()
    for n in range(1, 5):
        others.sent("r0", n)                      # this router sends 4 requests to r0
    # a report made while they ran arrives after they all ended: not other routers' work
    assert others.estimate("r0", 1, reported=4, mine=0) == 0
    assert others.estimate("r0", 1, reported=4, mine=0) == 0   # the same report, judged once
    # another router's 3 requests: the report shows more than this router ever had there
    others.sent("r0", 1)
    assert others.estimate("r0", 2, reported=4, mine=1) == 3
    assert others.estimate("r0", 2, reported=4, mine=0) == 3   # until the next report
    assert others.estimate("r0", 3, reported=0, mine=0) == 0   # they ended
    assert others.estimate("r1", None, reported=2, mine=0) == 2  # a replica never seen
    others.forget("r1")
    assert others.estimate("r1", None, reported=0, mine=0) == 0

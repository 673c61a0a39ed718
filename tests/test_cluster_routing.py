"""The routing policies as pure classes: digests, affinity, the imbalance bound, forgetting."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atombatch import prefix
from atombatch.cluster import (
    LoadOnlyPolicy,
    PrefixAffinityPolicy,
    ReplicaLoad,
    make_policy,
    route_digests,
)
from atombatch.errors import CapacityError, ConfigError


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

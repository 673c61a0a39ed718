"""Scheduler + engine behaviour on the exact ledger runtime: rotation, growth, preemption,
cancellation, error isolation, policies, and the ownership invariants after every step."""

from __future__ import annotations

import logging
import math

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.ledger import LedgerRuntime, reference
from support.scheduling import (
    artifact,
    check_workload,
    draw_workload,
    drive,
    expected,
)

from atombatch import (
    Batcher,
    CapacityError,
    ConfigError,
    RequestError,
    SamplingParams,
)
from atombatch.engine.scheduler import TRANSITIONS, Policy, Request, RequestState
from atombatch.errors import StateError


# -- the state table --------------------------------------------------------------------------------
def test_every_state_has_a_transition_entry_and_illegal_moves_raise():
    assert set(TRANSITIONS) == set(RequestState)
    request = Request("r", np.array([1]), SamplingParams(temperature=0.0), 0.0, np.random.default_rng(0))
    with pytest.raises(StateError, match="illegal transition waiting -> decoding"):
        request.set_state(RequestState.DECODING)
    request.set_state(RequestState.FINISHED)
    with pytest.raises(StateError, match="finished -> waiting"):
        request.set_state(RequestState.WAITING)


def test_policy_parse_and_rejects_unknown():
    assert Policy.parse("interleave:3") == Policy(kind="interleave", decode_steps=3)
    assert Policy.parse("decode-first").label == "decode-first"
    with pytest.raises(ConfigError, match="policy kind=.fastest. is not one of prefill-first"):
        Policy.parse("fastest")


# -- correctness of generated tokens under every layout ---------------------------------------------
LAYOUTS = {
    "B1/k1 single-block": dict(batch_size=1, num_blocks=1),
    "B1/k3 eager": dict(batch_size=1, num_blocks=3),
    "B4/k5 eager": dict(batch_size=4),
    "B4 partitioned": dict(batch_size=4, block_size=16),
    "B4 oversubscribed": dict(batch_size=4, block_size=16, num_blocks=6),
    "B3 hybrid": dict(batch_size=3, hybrid=True),
    "B2 hybrid partitioned": dict(batch_size=2, hybrid=True, block_size=16, num_blocks=6),
    "B4/k5 eager dbs1,2,4": dict(batch_size=4, buckets=(1, 2, 4)),
    "B4 oversubscribed dbs1,3,4": dict(batch_size=4, block_size=16, num_blocks=6, buckets=(1, 3, 4)),
    "B3 hybrid dbs1,3": dict(batch_size=3, hybrid=True, buckets=(1, 3)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("policy", ["prefill-first", "decode-first", "interleave:3", "fill-first:2"])
def test_all_layouts_and_policies_generate_the_reference_tokens(core, layout, policy):
    art = artifact(**LAYOUTS[layout])
    batcher = Batcher(LedgerRuntime(art), policy=policy)
    rng = np.random.default_rng(7)
    arrivals: dict[int, list] = {}
    for i in range(10):
        prompt = rng.integers(1, 90, size=int(rng.integers(1, 30))).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 64 - len(prompt))),
                                ignore_eos=True)
        arrivals.setdefault(int(rng.integers(0, 40)), []).append((prompt, params, f"r{i}"))
    finals, streamed = drive(batcher, arrivals)
    for batch in arrivals.values():
        for prompt, params, rid in batch:
            want = expected(prompt, params, art)
            assert list(finals[rid].completion.token_ids) == want, rid
            assert streamed[rid] == want
            assert finals[rid].finish_reason == "length"


def test_rotation_stages_into_the_spare_and_takes_over_the_finished_lane(core):
    art = artifact(batch_size=2, num_blocks=3)
    batcher = Batcher(LedgerRuntime(art))
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    arrivals = {0: [([1, 2, 3], short, "a"), ([4, 5], long, "b"), ([6, 7, 8, 9], long, "c")]}
    finals, _ = drive(batcher, arrivals)
    stats = batcher.stats()
    assert stats.rotations == 1 and stats.staged_chunks == 1
    # "c" produced its first token while both lanes decoded, before "a" finished
    assert finals["c"].completion.timings.first_token < finals["a"].completion.timings.finished
    for prompt, params, rid in arrivals[0]:
        assert list(finals[rid].completion.token_ids) == expected(prompt, params, art)


def test_lane_released_by_abort_is_reused_by_the_next_request_in_the_next_step(core):
    art = artifact(batch_size=2, num_blocks=3)
    batcher = Batcher(LedgerRuntime(art), policy="prefill-first")
    p = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    a, b_, c = batcher.submit([1, 2], p), batcher.submit([3, 4], p), batcher.submit([5], p)
    while batcher.scheduler.requests[b_].state is not RequestState.DECODING:
        batcher.step()
    lane_of_a = batcher.scheduler.requests[a].lane
    assert batcher.abort(a) and not batcher.abort(a)
    outs = batcher.step()
    assert [o.finish_reason for o in outs if o.request_id == a] == ["abort"]
    assert batcher.scheduler.requests[c].lane == lane_of_a
    assert batcher.scheduler.requests[c].state is RequestState.DECODING  # its prefill ran in that step
    batcher.check_invariants()


def test_abort_queued_prefilling_staged_and_decoding_in_one_step(core):
    art = artifact(batch_size=2, num_blocks=3, max_seq_len=128, block_size=128, chunk=8)
    batcher = Batcher(LedgerRuntime(art), policy="prefill-first")
    p = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ids = [batcher.submit(list(range(1, 40)), p) for _ in range(5)]
    states = {}
    for _ in range(200):
        batcher.step()
        states = {rid: batcher.scheduler.requests[rid].state for rid in ids}
        if RequestState.STAGING in states.values() and RequestState.DECODING in states.values():
            break
    assert RequestState.WAITING in states.values()
    victims = [rid for rid in ids if states[rid] in (RequestState.WAITING, RequestState.STAGING,
                                                     RequestState.DECODING)][:4]
    for rid in victims:
        assert batcher.abort(rid)
    batcher.check_invariants()
    outs = batcher.step()
    assert {o.request_id for o in outs if o.finish_reason == "abort"} == set(victims)
    finals, _ = drive(batcher, {})
    batcher.check_invariants()
    pool = batcher.scheduler.pool
    assert pool.num_free + pool.num_spare == art.num_blocks
    for rid in set(ids) - set(victims):
        assert finals[rid].completion.token_ids == tuple(expected(list(range(1, 40)), p, art))


def test_oversubscribed_pool_preempts_and_recomputes_without_changing_tokens(core):
    art = artifact(batch_size=4, block_size=8, num_blocks=9, max_seq_len=64)
    batcher = Batcher(LedgerRuntime(art))
    p = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [list(range(1 + i, 20 + i)) for i in range(4)]
    finals, _ = drive(batcher, {0: [(pr, p, f"r{i}") for i, pr in enumerate(prompts)]})
    assert batcher.stats().preemptions > 0
    for i, prompt in enumerate(prompts):
        assert finals[f"r{i}"].completion.token_ids == tuple(expected(prompt, p, art))
    assert sum(finals[f"r{i}"].completion.preemptions for i in range(4)) == \
        batcher.stats().preemptions


def test_stop_tokens_and_eos(core):
    art = artifact(eos=(reference([1, 2, 3], 3, 97)[2],))
    batcher = Batcher(LedgerRuntime(art))
    eos = art.model.eos_token_ids[0]
    through = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    stopping = SamplingParams(temperature=0.0, max_tokens=8)
    finals, _ = drive(batcher, {0: [([1, 2, 3], stopping, "stop"), ([1, 2, 3], through, "go")]})
    assert finals["stop"].finish_reason == "stop"
    assert finals["stop"].completion.token_ids[-1] == eos and \
        len(finals["stop"].completion.token_ids) == 3
    assert finals["go"].finish_reason == "length" and len(finals["go"].completion.token_ids) == 8
    first = reference([1, 2, 3], 1, 97)[0]
    batcher = Batcher(LedgerRuntime(art))
    finals, _ = drive(batcher, {0: [([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                                stop_token_ids=(first,)), "s")]})
    assert finals["s"].completion.token_ids == (first,) and finals["s"].finish_reason == "stop"


# -- bad input and failures ---------------------------------------------------------------------
@pytest.mark.parametrize(("prompt", "params", "match"), [
    ([], SamplingParams(temperature=0.0), "prompt is empty"),
    ([1, 97], SamplingParams(temperature=0.0),
     "token id 97 at prompt index 1 is outside the vocabulary 0..96"),
    ([1, -1], SamplingParams(temperature=0.0), "token id -1 at prompt index 1"),
    ([1] * 60, SamplingParams(temperature=0.0, max_tokens=5),
     "60 tokens \\+ max_tokens=5 = 65 exceeds max_seq_len=64"),
    ([1], SamplingParams(temperature=0.0, stop_token_ids=(500,)), "stop_token_ids names token id 500"),
    ([[1, 2]], SamplingParams(temperature=0.0), "flat sequence"),
])
def test_invalid_requests_are_rejected_at_submit_and_nothing_is_queued(prompt, params, match):
    batcher = Batcher(LedgerRuntime(artifact()))
    with pytest.raises(RequestError, match=match):
        batcher.submit(prompt, params)
    assert not batcher.has_unfinished()


@pytest.mark.parametrize(("fields", "match"), [
    ({"max_tokens": 0}, "max_tokens=0 must be >= 1"),
    ({"temperature": -1.0}, "temperature=-1.0"),
    ({"top_p": 0.0}, "top_p=0.0 must be a finite number in"),
    ({"top_k": -2}, "top_k=-2 must be >= -1"),
    ({"seed": -3}, "seed=-3 must be >= 0"),
])
def test_out_of_range_sampling_params_are_rejected_when_built(fields, match):
    with pytest.raises(RequestError, match=match):
        SamplingParams(**fields)


def test_queue_bound_and_duplicate_ids():
    batcher = Batcher(LedgerRuntime(artifact(batch_size=1, num_blocks=2)), max_waiting=2)
    batcher.submit([1], request_id="x")
    with pytest.raises(RequestError, match="request_id='x' is already in flight"):
        batcher.submit([1], request_id="x")
    batcher.submit([2])
    with pytest.raises(CapacityError, match="max_waiting=2"):
        batcher.submit([3])


def test_prefix_cache_with_hybrid_needs_a_host_budget():
    with pytest.raises(ConfigError, match="keeps sliding-slot checkpoints in the host cache"):
        Batcher(LedgerRuntime(artifact(hybrid=True)), prefix_cache=True)


class Poisoned(LedgerRuntime):
    """Raises on any call that carries token 66, returns NaN logits for lanes that feed 55."""

    def prefill(self, inputs):
        if 66 in inputs.input_ids:
            raise RuntimeError("device fault on token 66")
        return super().prefill(inputs)

    def decode(self, inputs):
        logits = super().decode(inputs)
        logits[inputs.input_ids[:, 0] == 55] = math.nan
        return logits


def test_runtime_failures_fail_only_their_request(core):
    art = artifact(batch_size=3, num_blocks=4)
    batcher = Batcher(Poisoned(art))
    good = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # a prompt whose first generated token is 55 makes the next decode step return NaN for it
    nan_prompt = next([t] for t in range(1, 96) if reference([t], 1, 97)[0] == 55)
    arrivals = {0: [([1, 2, 66, 3], good, "fault"), ([4, 5, 6], good, "ok1"),
                    (nan_prompt, good, "nan")], 2: [([7, 8], good, "ok2")]}
    finals, _ = drive(batcher, arrivals)
    assert finals["fault"].finish_reason == "error"
    assert "device fault on token 66" in finals["fault"].error
    assert finals["nan"].finish_reason == "error" and "non-finite" in finals["nan"].error
    for prompt, params, rid in [a for batch in arrivals.values() for a in batch]:
        if rid.startswith("ok"):
            assert finals[rid].completion.token_ids == tuple(expected(prompt, params, art))
    assert batcher.stats().finished == {"error": 2, "length": 2}


class Speckled(LedgerRuntime):
    """One bad logit in a row that is otherwise fine, by the token a lane feeds (`kinds`): "nan"
    or "inf" away from the row's best, or "-inf" at half the row (a device's "cannot be
    drawn"), never at its best."""

    def __init__(self, art, kinds):
        super().__init__(art)
        self.kinds = kinds

    def decode(self, inputs):
        logits = super().decode(inputs)
        fed = inputs.input_ids[:, 0]
        for row in range(logits.shape[0]):
            kind = self.kinds.get(int(fed[row]))
            best = int(np.argmax(logits[row]))
            other = (best + 1 + int(fed[row])) % logits.shape[1]
            if kind == "nan":
                logits[row, other] = math.nan
            elif kind == "inf":
                logits[row, other] = math.inf
            elif kind == "-inf":
                logits[row, np.arange(logits.shape[1]) % 2 != best % 2] = -math.inf
        return logits


def test_one_nan_or_inf_logit_fails_its_request_and_minus_inf_does_not(core):
    art = artifact(batch_size=4, num_blocks=5)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = {}  # first generated token -> a one-token prompt that makes it
    for t in range(1, 96):
        first.setdefault(reference([t], 1, 97)[0], t)
    (nan, _), (inf, _), (minus, _) = list(first.items())[:3]
    kinds = {nan: "nan", inf: "inf", minus: "-inf"}
    arrivals = {0: [([first[nan]], params, "nan"), ([first[inf]], params, "inf"),
                    ([first[minus]], params, "-inf"), ([4, 5, 6], params, "ok")]}
    finals, _ = drive(Batcher(Speckled(art, kinds)), arrivals)
    for rid in ("nan", "inf"):  # the step's argmax lands on the bad logit: the row is found
        assert finals[rid].finish_reason == "error" and "non-finite" in finals[rid].error
    for prompt, _, rid in arrivals[0][2:]:  # the best token is the same with -inf elsewhere
        want = tuple(expected(prompt, params, art))
        assert not {nan, inf} & set(want[:-1])  # (the premise: it never feeds a broken row)
        assert finals[rid].finish_reason == "length" and finals[rid].completion.token_ids == want


def test_structlog_events_carry_request_lane_and_blocks(core, caplog):
    batcher = Batcher(LedgerRuntime(artifact(batch_size=1, num_blocks=2)))
    with caplog.at_level(logging.DEBUG, logger="atombatch"):
        batcher.generate([[1, 2], [3]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    events = [msgspec.json.decode(r.getMessage()) for r in caplog.records]
    names = [e["event"] for e in events]
    assert names.count("request.admitted") == 2 and names.count("request.finished") == 2
    released = [e for e in events if e["event"] == "lane.released"]
    assert released and all("lane" in e and "blocks" in e for e in released)
    levels = {e["event"]: e["level"] for e in events}
    assert levels["request.admitted"] == levels["lane.released"] == "debug"  # per lane: quiet
    assert levels["request.finished"] == "info"


shapes = st.sampled_from([
    dict(batch_size=1, num_blocks=1), dict(batch_size=1, num_blocks=2), dict(batch_size=2),
    dict(batch_size=4), dict(batch_size=3, block_size=16), dict(batch_size=4, block_size=8,
                                                               num_blocks=9),
    dict(batch_size=2, block_size=16, num_blocks=5), dict(batch_size=3, hybrid=True),
    dict(batch_size=2, hybrid=True, block_size=16, num_blocks=5),
])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=shapes, chunk=st.sampled_from([4, 8, 16]), data=st.data(),
       policy=st.sampled_from(["prefill-first", "decode-first", "interleave:2", "fill-first:1"]))
def test_random_workloads_keep_invariants_and_tokens(core, shape, chunk, data, policy):
    art = artifact(chunk=chunk, **shape)
    cacheable = not art.single_block and not art.model.is_hybrid
    prefix_cache = cacheable and data.draw(st.booleans())
    host_bytes = data.draw(st.sampled_from([0, 500, 5000])) if prefix_cache else 0
    batcher = Batcher(LedgerRuntime(art), policy=policy, prefix_cache=prefix_cache,
                      host_cache_bytes=host_bytes)
    arrivals, aborts = draw_workload(data)
    finals, streamed = drive(batcher, arrivals, aborts)
    check_workload(arrivals, finals, streamed, art)
    pool = batcher.scheduler.pool
    assert pool.num_free + pool.num_spare + pool.num_cached == art.num_blocks
    assert pool.num_evictable == pool.num_cached
    assert batcher.scheduler.lanes.num_busy == 0

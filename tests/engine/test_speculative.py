"""Speculative decoding through the prefill graph (atombatch/engine/speculative.py) on real
decoder math (the NumPy runtime on tiny random Llama / Qwen3 checkpoints).

Tiny random models rarely continue a pattern, so n-gram drafts mostly miss; besides the real
proposer, an oracle drafter (`support/speculative.py`) proposes the next tokens of a run without
speculation with chosen positions corrupted, so drafts are accepted in full, in part and not at
all. Every greedy output must equal the run without speculation token for token: a stale key or
value of a rejected position read by a later one, a lane advanced wrongly, or a chunk built at
the wrong positions would change the logits and, over 40+ tokens, the tokens.
"""

from __future__ import annotations

import asyncio
import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.engines import numpy_batcher
from support.hf_models import save_checkpoint
from support.scheduling import artifact as ledger_artifact
from support.scheduling import check_workload, draw_workload, drive
from support.speculative import (
    LedgerDrafts,
    OracleDrafts,
    chi_square_limit,
    ledger_every_position,
    repeating_prompts,
    sampled_experiment,
)

from atombatch import ArtifactConfig, Batcher, ConfigError, ModelSpec, SamplingParams
from atombatch.api.speculative import SpeculativeConfig, parse_speculative_config
from atombatch.core import CoreClient
from atombatch.engine import speculative as engine_speculative
from atombatch.runtime import NumpyRuntime
from atombatch.sampling import ngram

pytestmark = pytest.mark.numerics

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
                         auto_off=False)


@pytest.fixture(scope="module", params=("llama", "qwen3"))
def model(request, tmp_path_factory):
    path = save_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, ModelSpec.from_pretrained(path)


def artifact(spec, batch_size=1, chunk=16, num_blocks=None):
    return ArtifactConfig(model=spec, batch_size=batch_size, max_seq_len=128, block_size=16,
                          prefill_chunk_size=chunk,
                          num_blocks=num_blocks or batch_size * 8 + 1)


def runtime(path, art):
    return NumpyRuntime.from_pretrained(path, art)


def run(batcher, prompts, params, check=False):
    """Every request's tokens and finish reason, stepping by hand (invariants after each step
    when `check`)."""
    ids = [batcher.submit(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    reasons: dict[str, str | None] = {}
    while batcher.has_unfinished():
        for out in batcher.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if check:
            batcher.check_invariants()
    return [(tokens[i], reasons[i]) for i in ids]


# -- the proposer ----------------------------------------------------------------------------
def brute_force(tokens, k, lo, hi, window):
    seq = list(tokens[max(len(tokens) - window, 0):])
    for n in range(min(hi, len(seq) - 1), lo - 1, -1):
        suffix = seq[len(seq) - n:]
        for i in range(len(seq) - n - 1, -1, -1):
            if seq[i:i + n] == suffix:
                return seq[i + n:i + n + k]
    return []


def test_ngram_proposer_matches_a_brute_force_scan():
    rng = np.random.default_rng(5)
    for _ in range(400):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40)))
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        k, window = int(rng.integers(1, 6)), int(rng.integers(2, 50))
        got = ngram.propose(tokens, k, lo, hi, window).tolist()
        assert got == brute_force(tokens.tolist(), k, lo, hi, window)


def test_ngram_proposer_longest_match_most_recent_occurrence():
    tokens = np.array([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3])
    assert ngram.propose(tokens, 3, 1, 3, 100).tolist() == [5, 7, 1]
    assert ngram.propose(np.array([1, 2, 3, 4]), 3, 1, 3, 100).tolist() == []
    # the window bounds the search: the only earlier 3 lies outside it
    assert ngram.propose(np.array([3, 8, 0, 0, 0, 0, 3]), 2, 1, 1, 7).tolist() == [8, 0]
    assert ngram.propose(np.array([3, 8, 0, 0, 0, 0, 3]), 2, 1, 1, 5).tolist() == []


# -- greedy exactness -----------------------------------------------------------------------
def test_greedy_identical_with_the_ngram_proposer(model):
    _, path, spec = model
    art = artifact(spec)
    prompts = repeating_prompts(np.random.default_rng(0))
    reference = run(Batcher(runtime(path, art)), prompts, GREEDY)
    batcher = Batcher(runtime(path, art), speculative=SPEC)
    assert run(batcher, prompts, GREEDY) == reference
    stats = batcher.stats()
    assert stats.spec_decode_num_drafts > 0  # drafts were verified (mostly rejected here)
    assert stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_drafts


@pytest.mark.parametrize("chunk", [8, 16])
def test_greedy_identical_with_accepted_and_rejected_drafts(model, monkeypatch, chunk):
    _, path, spec = model
    art = artifact(spec, chunk=chunk)
    prompts = repeating_prompts(np.random.default_rng(1))
    reference = run(Batcher(runtime(path, art)), prompts, GREEDY)
    oracle = OracleDrafts(prompts, [t for t, _ in reference], miss_rate=0.25, seed=chunk)
    monkeypatch.setattr(ngram, "propose", oracle.propose)
    config = SpeculativeConfig(num_speculative_tokens=min(5, chunk - 1), auto_off=False)
    batcher = Batcher(runtime(path, art), speculative=config)
    assert run(batcher, prompts, GREEDY) == reference
    stats = batcher.stats()
    accepted, drafted = stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_draft_tokens
    assert 0 < accepted < drafted            # some drafts accepted, some rejected
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert sum(per_pos) == accepted and list(per_pos) == sorted(per_pos, reverse=True)
    # fewer device calls than tokens: each verify call yielded its accepted drafts + 1
    generated = sum(len(t) for t, _ in reference)
    assert stats.generated_tokens == generated
    assert stats.steps < sum(len(p) // chunk + 1 for p in prompts) + generated
    assert sum(stats.iteration_tokens) == stats.steps  # each device call binned once


def test_stop_id_and_max_tokens_inside_an_accepted_run(model, monkeypatch):
    _, path, spec = model
    art = artifact(spec)
    prompts = repeating_prompts(np.random.default_rng(2))
    long_ref = run(Batcher(runtime(path, art)), prompts, GREEDY)
    oracle = OracleDrafts(prompts, [t for t, _ in long_ref], miss_rate=0.0, seed=0)
    monkeypatch.setattr(ngram, "propose", oracle.propose)
    config = SpeculativeConfig(num_speculative_tokens=6, auto_off=False)
    for prompt, (tokens, _) in zip(prompts, long_ref, strict=True):
        stop = tokens[13]
        first = tokens.index(stop)
        for params in (SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop]),
                       SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)):
            expected = run(Batcher(runtime(path, art)), [prompt], params)
            batcher = Batcher(runtime(path, art), speculative=config)
            got = run(batcher, [prompt], params)
            assert got == expected
            if params.stop_token_ids:  # the stop id (or EOS before it) ended it early
                assert got[0][1] == "stop" and len(got[0][0]) <= first + 1
            else:
                assert got[0] == (tokens[:11], "length")
            assert batcher.stats().spec_decode_num_accepted_tokens > 0


def test_stop_string_inside_an_accepted_run(model, monkeypatch):
    """A stop string completed by a token inside an accepted run ends the request there: the
    same tokens, text and finish reason as without speculation, nothing past it emitted."""
    from support.templates import _tokenizer

    _, path, spec = model
    art = artifact(spec)
    tok = _tokenizer()
    prompts = repeating_prompts(np.random.default_rng(13))[:2]
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    long_ref = Batcher(runtime(path, art), tokenizer=tok).generate(prompts, free)
    monkeypatch.setattr(ngram, "propose", OracleDrafts(
        prompts, [list(c.token_ids) for c in long_ref], miss_rate=0.0, seed=13).propose)
    checked = 0
    for prompt, done in zip(prompts, long_ref, strict=True):
        text = done.text
        if len(text) < 12:
            continue
        stop = text[len(text) // 2:len(text) // 2 + 3]
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
        [want] = Batcher(runtime(path, art), tokenizer=tok).generate([prompt], params)
        batcher = Batcher(runtime(path, art), tokenizer=tok, speculative=SpeculativeConfig(
            num_speculative_tokens=6, auto_off=False))
        [got] = batcher.generate([prompt], params)
        assert (list(got.token_ids), got.text, got.finish_reason) == \
            (list(want.token_ids), want.text, want.finish_reason)
        assert want.finish_reason == "stop" and len(want.token_ids) < 40
        assert batcher.stats().spec_decode_num_accepted_tokens > 0
        checked += 1
    assert checked


def test_invariants_with_prefix_and_host_cache(model, monkeypatch):
    _, path, spec = model
    art = artifact(spec, batch_size=2, num_blocks=14)
    rng = np.random.default_rng(3)
    base = repeating_prompts(rng)
    prompts = base + [base[0][:20] + p[:9] for p in base] + base
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = run(Batcher(runtime(path, art)), prompts, params)
    oracle = OracleDrafts(prompts, [t for t, _ in reference], miss_rate=0.3, seed=3)
    monkeypatch.setattr(ngram, "propose", oracle.propose)
    batcher = Batcher(runtime(path, art), speculative=SPEC, prefix_cache=True,
                      host_cache_bytes=1 << 20)
    assert run(batcher, prompts, params, check=True) == reference
    stats = batcher.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.prefix_hits > 0


@pytest.mark.parametrize("seed", [11, 12])
def test_random_workloads_with_aborts_and_a_tight_pool(model, monkeypatch, seed):
    """Random prompts (repeating and not), output limits and arrival times on B2 with a pool
    tight enough to preempt, the prefix and host caches on, and aborts: invariants after every
    step; every request that was not aborted gets the tokens it gets alone without speculation."""
    _, path, spec = model
    rng = np.random.default_rng(seed)
    art = artifact(spec, batch_size=2, num_blocks=9)
    base = repeating_prompts(rng)
    prompts = [base[int(rng.integers(len(base)))][:int(rng.integers(8, 30))] for _ in range(10)]
    limits = [int(rng.integers(1, 80)) for _ in prompts]
    alone = Batcher(runtime(path, art))
    reference = [list(alone.generate([p], SamplingParams(max_tokens=m, temperature=0.0,
                                                         ignore_eos=True))[0].token_ids)
                 for p, m in zip(prompts, limits, strict=True)]
    monkeypatch.setattr(ngram, "propose", OracleDrafts(prompts, reference, miss_rate=0.3,
                                                       seed=seed).propose)
    batcher = Batcher(runtime(path, art), speculative=SPEC, prefix_cache=True,
                      host_cache_bytes=1 << 20)
    ids: list[str] = []
    tokens: dict[str, list[int]] = {}
    aborted: set[str] = set()
    pending = list(range(len(prompts)))
    while pending or batcher.has_unfinished():
        if pending and rng.random() < 0.4:
            i = pending.pop(0)
            rid = batcher.submit(prompts[i], SamplingParams(max_tokens=limits[i],
                                                            temperature=0.0, ignore_eos=True))
            ids.append(rid)
            tokens[rid] = []
        live = [r for r in ids if r not in aborted and len(tokens[r]) < 80]
        if live and rng.random() < 0.01:
            victim = live[int(rng.integers(len(live)))]
            batcher.abort(victim)
            aborted.add(victim)
        for out in batcher.step():
            tokens[out.request_id].extend(out.new_token_ids)
        batcher.check_invariants()
    for i, rid in enumerate(ids):
        if rid not in aborted:
            assert tokens[rid] == reference[i], i
    stats = batcher.stats()
    assert stats.spec_decode_num_drafts > 0
    assert stats.occupied_lanes == 0 and stats.lane_blocks == 0
    assert stats.preemptions > 0  # the pool was tight: lanes recomputed around verify calls


ledger_shapes = st.sampled_from([
    dict(batch_size=1, num_blocks=1), dict(batch_size=1, num_blocks=2), dict(batch_size=2),
    dict(batch_size=4), dict(batch_size=3, block_size=16),
    dict(batch_size=4, block_size=8, num_blocks=9), dict(batch_size=2, block_size=16, num_blocks=5),
])


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=ledger_shapes, chunk=st.sampled_from([4, 8, 16]), data=st.data(),
       policy=st.sampled_from(["prefill-first", "decode-first", "interleave:2", "fill-first:1"]))
def test_the_ledger_fuzzer_with_speculation_on(shape, chunk, data, policy, monkeypatch):
    """The scheduler's random workloads (support/scheduling.py) on the exact ledger runtime,
    whose every token depends on every key it reads through the tables, with speculation on:
    drafts from the ledger's own rule, partly corrupted; invariants after every step, finished
    requests exactly the reference tokens, aborted ones a prefix of them."""
    art = ledger_artifact(chunk=chunk, **shape)
    prefix_cache = not art.single_block and data.draw(st.booleans())
    host_bytes = data.draw(st.sampled_from([0, 500, 5000])) if prefix_cache else 0
    drafts = LedgerDrafts(art.model.vocab_size, data.draw(st.sampled_from([0.0, 0.3, 1.0])),
                          seed=data.draw(st.integers(0, 1000)))
    monkeypatch.setattr(ngram, "propose", drafts.propose)
    config = SpeculativeConfig(num_speculative_tokens=data.draw(st.integers(1, chunk - 1)),
                               auto_off=data.draw(st.booleans()))
    batcher = Batcher(ledger_every_position()(art), policy=policy, prefix_cache=prefix_cache,
                      host_cache_bytes=host_bytes, speculative=config)
    arrivals, aborts = draw_workload(data)
    finals, streamed = drive(batcher, arrivals, aborts)
    check_workload(arrivals, finals, streamed, art)
    assert batcher.scheduler.lanes.num_busy == 0
    pool = batcher.scheduler.pool
    assert pool.num_free + pool.num_spare + pool.num_cached == art.num_blocks


# -- auto-off ---------------------------------------------------------------------------------
def test_drafts_that_always_miss_turn_speculation_off(model, monkeypatch):
    _, path, spec = model
    art = artifact(spec)
    prompts = repeating_prompts(np.random.default_rng(4))[:1]
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    reference = run(Batcher(runtime(path, art)), prompts, params)
    oracle = OracleDrafts(prompts, [t for t, _ in reference], miss_rate=1.0, seed=4)
    monkeypatch.setattr(ngram, "propose", oracle.propose)
    batcher = Batcher(runtime(path, art), speculative=SpeculativeConfig(num_speculative_tokens=4))
    assert run(batcher, prompts, params) == reference
    drafts = batcher.stats().spec_decode_num_drafts
    assert batcher.stats().spec_decode_num_accepted_tokens == 0
    # one probe, then one per PROBE_EVERY eligible steps (a step decoding plainly)
    assert 1 <= drafts <= 1 + 100 // engine_speculative.PROBE_EVERY
    # with auto-off disabled the same drafts are verified at every step
    always = Batcher(runtime(path, art), speculative=SPEC)
    assert run(always, prompts, params) == reference
    assert always.stats().spec_decode_num_drafts > 3 * drafts


# -- refusals ---------------------------------------------------------------------------------
class LastLogitsOnly(NumpyRuntime):
    every_position_logits = False  # a graph compiled with logits_to_keep=1


def test_refusals(model, tmp_path):
    _, path, spec = model
    art = artifact(spec)
    with pytest.raises(ConfigError, match="logits_to_keep=0"):
        Batcher(LastLogitsOnly.from_pretrained(path, art), speculative=SPEC)
    with pytest.raises(ConfigError, match="overlap"):
        Batcher(runtime(path, art), speculative=SPEC, overlap=True)
    with pytest.raises(ConfigError, match="prefill_chunk_size"):
        Batcher(runtime(path, artifact(spec, chunk=4)),
                speculative=SpeculativeConfig(num_speculative_tokens=4))
    gemma = save_checkpoint("gemma3", tmp_path)
    gemma_art = artifact(ModelSpec.from_pretrained(gemma))
    with pytest.raises(ConfigError, match="hybrid"):
        Batcher(runtime(gemma, gemma_art), speculative=SPEC)


def test_server_flag_builds_the_engine_options():
    from atombatch.serve.cli import engine_options, parser

    args = parser().parse_args(["--speculative-config",
                                '{"method": "ngram", "num_speculative_tokens": 3}'])
    options = engine_options(args, prefix_cache=False)
    assert options.speculative == SpeculativeConfig(num_speculative_tokens=3)
    assert options.overlap is False  # speculation runs on synchronous steps
    assert engine_options(parser().parse_args([]), prefix_cache=False).speculative is None
    args = parser().parse_args(["-sc", '{"method": "ngram", "num_speculative_tokens": 99}'])
    with pytest.raises(ConfigError, match="num_speculative_tokens=99"):
        engine_options(args, prefix_cache=False)


def test_speculative_config_parses_vllm_json():
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert (config.num_speculative_tokens, config.prompt_lookup_max,
            config.prompt_lookup_min) == (5, 4, 4)
    config = parse_speculative_config('{"model": "[ngram]", "num_speculative_tokens": 2}')
    assert (config.method, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 5, 5)
    for text, field in [('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
                        ('{"method": "ngram"}', "num_speculative_tokens"),
                        ('{"method": "ngram", "num_speculative_tokens": 0}',
                         "num_speculative_tokens"),
                        ('{"method": "ngram", "num_speculative_tokens": 2, "foo": 1}', "foo"),
                        ('{"method": "ngram", "num_speculative_tokens": 2, '
                         '"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
                        ('{"model": "some/draft", "num_speculative_tokens": 2}', "model"),
                        ('[1]', "JSON object"), ('{', "not JSON"),
                        ('{"method": "ngram", "num_speculative_tokens": "3"}',
                         "num_speculative_tokens")]:
        with pytest.raises(ConfigError, match=field):
            parse_speculative_config(text)


# -- sampled: the same distribution ----------------------------------------------------------
def test_sampled_tokens_follow_the_same_distribution(tmp_path, monkeypatch):
    """Two runs of N seeded requests each, with and without speculation: the joint counts of
    the first three tokens (of four: the verify call at the second token has room for two
    drafts; top_k=3: at most 27 outcomes) pass a two-sample chi-square test at 1e-4. The drafts
    are the greedy continuation, so they are accepted about half the time and the rejection
    rule's every branch runs (accept, reject and redraw, bonus)."""
    path = save_checkpoint("llama", tmp_path)
    art = artifact(ModelSpec.from_pretrained(path))
    prompt = np.random.default_rng(6).integers(3, 512, size=12).tolist()
    n = 1500
    stat, df, stats = sampled_experiment(lambda: runtime(path, art), prompt, n, monkeypatch)
    assert n <= stats.spec_decode_num_drafts <= 2 * n
    assert 0.2 * n < stats.spec_decode_num_accepted_tokens < 1.8 * n
    assert stats.spec_decode_num_accepted_tokens_per_pos[1] > 0  # the bonus branch ran
    assert df >= 3
    assert stat < chi_square_limit(df), (stat, df)


# -- through the engine core process -----------------------------------------------------------
async def test_core_process_gives_the_same_greedy_tokens():
    """The options cross into the core process (`CoreClient`); each request, sent alone so it
    decodes a lone lane, gets the tokens it gets in-process without speculation, and the
    counters ride back on the wire."""
    prompts = [[t % 256 for t in p] for p in repeating_prompts(np.random.default_rng(8))]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    want = [list(c.token_ids) for c in numpy_batcher().generate(prompts, params)]
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, auto_off=False)
    async with CoreClient(functools.partial(numpy_batcher, speculative=config)) as client:
        got = []
        for prompt in prompts:
            tokens: list[int] = []
            async for out in client.stream(prompt, params):
                tokens.extend(out.new_token_ids)
            got.append(tokens)
        assert got == want
        for _ in range(50):  # the stats ride on the core's next messages
            if client.stats().spec_decode_num_drafts:
                break
            await asyncio.sleep(0.05)
        stats = client.stats()
        assert stats.spec_decode_num_drafts > 0
        assert len(stats.spec_decode_num_accepted_tokens_per_pos) == 3


# -- metrics and failures -----------------------------------------------------------------------
def test_vllm_spec_decode_metrics(model, monkeypatch):
    from prometheus_client import CollectorRegistry, generate_latest

    from atombatch.serve.vllm_metrics import VllmEngineFamilies

    _, path, spec = model
    art = artifact(spec)
    prompts = repeating_prompts(np.random.default_rng(9))[:1]
    reference = run(Batcher(runtime(path, art)), prompts, GREEDY)
    monkeypatch.setattr(ngram, "propose", OracleDrafts(prompts, [t for t, _ in reference],
                                                       miss_rate=0.3, seed=9).propose)
    batcher = Batcher(runtime(path, art), speculative=SPEC)

    def scrape() -> dict[str, float]:
        registry = CollectorRegistry()
        registry.register(VllmEngineFamilies(batcher.stats, art, "m"))
        values = {}
        for line in generate_latest(registry).decode().splitlines():
            if line.startswith("vllm:spec_decode"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    before = scrape()  # every series from the start, at 0 (as vLLM registers them)
    assert len(before) == 3 + SPEC.num_speculative_tokens and not any(before.values())
    run(batcher, prompts, GREEDY)
    after, stats = scrape(), batcher.stats()
    labels = '{engine="0",model_name="m"}'
    assert after[f"vllm:spec_decode_num_drafts_total{labels}"] == stats.spec_decode_num_drafts > 0
    assert after[f"vllm:spec_decode_num_accepted_tokens_total{labels}"] == \
        stats.spec_decode_num_accepted_tokens > 0
    per_pos = [after[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",'
                     f'model_name="m",position="{i}"}}'] for i in range(4)]
    assert per_pos == list(stats.spec_decode_num_accepted_tokens_per_pos)
    plain = Batcher(runtime(path, art))
    registry = CollectorRegistry()
    registry.register(VllmEngineFamilies(plain.stats, art, "m"))
    assert b"spec_decode" not in generate_latest(registry)  # not configured: not exported


class FailingVerify(NumpyRuntime):
    """A device whose every-position prefill fails past position 0 (a verify call)."""

    def prefill(self, inputs, every_position=False):
        if every_position and int(inputs.cache_position[0, 0]) > 0:
            raise RuntimeError("injected verify fault")
        return super().prefill(inputs, every_position=every_position)


def test_a_failed_verify_fails_its_request_and_the_others_go_on(model):
    _, path, spec = model
    art = artifact(spec, batch_size=2, num_blocks=17)
    prompts = repeating_prompts(np.random.default_rng(10))
    reference = run(Batcher(runtime(path, art)), prompts, GREEDY)
    batcher = Batcher(FailingVerify.from_pretrained(path, art), speculative=SPEC)
    got = run(batcher, prompts, GREEDY, check=True)
    errors = [i for i, (_, reason) in enumerate(got) if reason == "error"]
    assert errors  # a lone lane's verify ran and failed its request
    for i, (tokens, reason) in enumerate(got):
        if reason != "error":
            assert (tokens, reason) == reference[i]
        else:
            assert tokens == reference[i][0][:len(tokens)]
    stats = batcher.stats()
    assert stats.lane_blocks == 0 and stats.occupied_lanes == 0  # every block back



class OwnedWrites:
    """A runtime whose prefill calls are checked against the engine's pool as they are made:
    every real position a chunk writes (its first through `query_position`) must fall in a
    block one request owns alone (LANE, or STAGED in the spare), never in a CACHED block other
    requests may read."""

    def __init__(self, inner):
        self.inner = inner
        self.artifact = inner.artifact
        self.every_position_logits = True
        self.batcher = None
        self.checked = 0

    def prefill(self, inputs, **kw):
        pool = self.batcher.scheduler.kv.pool
        bs = self.artifact.block_size
        start = int(np.asarray(inputs.cache_position).reshape(-1)[0])
        table = np.asarray(inputs.block_tables).reshape(-1)
        for p in range(start, start + int(inputs.query_position) + 1):
            block = int(table[p // bs])
            assert pool.state(block) in (engine_speculative.core.LANE,
                                         engine_speculative.core.STAGED), \
                f"a chunk from {start} writes position {p} into shared block {block}"
            self.checked += 1
        return self.inner.prefill(inputs, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_verify_never_rewrites_a_cached_block(model, monkeypatch):
    """Blocks smaller than the chunk: a verify from the chunk boundary rewrites the positions
    between that boundary and the last token. None of them is in a block served from the prefix
    cache (which other requests read): a hit resumes at a chunk boundary, so the cached blocks
    end at or before the verify's start. Every prefill call's writes are checked as made."""
    _, path, spec = model
    art = ArtifactConfig(model=spec, batch_size=1, max_seq_len=128, block_size=16,
                         prefill_chunk_size=64, num_blocks=20)
    rng = np.random.default_rng(8)
    shared = rng.integers(3, 512, size=64).tolist()   # one chunk: four cached blocks
    prompts = [shared + rng.integers(3, 512, size=6).tolist() for _ in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = run(Batcher(runtime(path, art)), prompts, params)
    oracle = OracleDrafts(prompts, [t for t, _ in reference], miss_rate=0.0, seed=1)
    monkeypatch.setattr(ngram, "propose", oracle.propose)
    wrapped = OwnedWrites(runtime(path, art))
    batcher = Batcher(wrapped, prefix_cache=True, speculative=SpeculativeConfig(
        num_speculative_tokens=3, auto_off=False))
    wrapped.batcher = batcher
    # the first alone (its prompt blocks are cached when it ends), then the others hit them
    assert run(batcher, prompts[:1], params) + run(batcher, prompts[1:], params) == reference
    stats = batcher.stats()
    assert stats.prefix_hits > 0 and wrapped.checked > 0 and stats.spec_decode_num_drafts > 0

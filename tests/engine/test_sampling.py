"""Sampling options against references: a direct NumPy computation per option, transformers'
logits processors for the sampled distribution, lanes with different options in one B4 step,
stop strings through the detokenizer, n > 1 sharing the prompt's prefill."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.numerics import f32_logprob_atol
from support.sampling_models import (
    EOS,
    PIECES,
    VOCAB,
    artifact,
    piece_tokenizer,
    spec,
)
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from atombatch import ArtifactConfig, Batcher, RequestError, SamplingParams
from atombatch.runtime import NumpyRuntime
from atombatch.sampling.detokenizer import Detokenizer
from atombatch.sampling.sampler import RequestSampler, sample, sample_rows

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run


class Recording:
    """A NumpyRuntime whose decode logits are kept (rows by lane) for checking the sampler."""

    def __init__(self, runtime: NumpyRuntime) -> None:
        self.runtime = runtime
        self.artifact = runtime.artifact
        self.decodes: list[tuple[np.ndarray, np.ndarray]] = []  # (input_ids, logits)
        self.prefills: list[np.ndarray] = []

    def prefill(self, inputs: Any) -> np.ndarray:
        out = self.runtime.prefill(inputs)
        self.prefills.append(np.array(out))
        return out

    def decode(self, inputs: Any) -> np.ndarray:
        out = self.runtime.decode(inputs)
        self.decodes.append((np.array(inputs.input_ids).reshape(-1), np.array(out)))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runtime, name)


def state(params: SamplingParams, prompt: tuple[int, ...] = (), seed: int = 0,
          eos: tuple[int, ...] = (EOS,), bad: tuple[tuple[int, ...], ...] = ()) -> RequestSampler:
    return RequestSampler(params, np.asarray(prompt, dtype=np.int64), VOCAB, eos,
                          np.random.default_rng(seed), bad)


def logits_rows(rows: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, VOCAB)) * 3).astype(np.float32)


def np_penalized(row: np.ndarray, prompt: list[int], output: list[int],
                 params: SamplingParams) -> np.ndarray:
    """vLLM's penalties written out directly: repetition over prompt+output, then frequency and
    presence over the output."""
    x = row.astype(np.float64).copy()
    seen = set(prompt) | set(output)
    for t in seen:
        r = params.repetition_penalty
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return x


def hf_distribution(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """transformers' warpers in vLLM's order: temperature, min_p, top_k, top_p."""
    scores = torch.tensor(row, dtype=torch.float32)[None, :]
    ids = torch.zeros((1, 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(params.temperature)(ids, scores)
    if params.min_p > 0:
        scores = MinPLogitsWarper(params.min_p)(ids, scores)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(ids, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(ids, scores)
    return torch.softmax(scores, dim=-1)[0].double().numpy()


# -- SamplingParams ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("fields", "match"), [
    ({"max_tokens": 5.5}, "max_tokens=5.5 must be an integer"),
    ({"top_k": 2.5}, "top_k=2.5 must be an integer"),
    ({"temperature": "0.5"}, "temperature='0.5' must be a number"),
    ({"temperature": None}, "temperature=None must be a number"),
    ({"top_p": None}, "top_p=None must be a number"),
    ({"n": None}, "n=None must be an integer"),
    ({"max_tokens": "8"}, "max_tokens='8' must be an integer"),
    ({"seed": True}, "seed=True must be an integer"),
    ({"temperature": float("nan")}, "temperature=nan must be a finite number"),
    ({"temperature": float("inf")}, "temperature=inf must be a finite number"),
    ({"n": 0}, "n=0 must be >= 1"),
    ({"min_tokens": 17}, "min_tokens=17 must be <= max_tokens=16"),
    ({"presence_penalty": 2.5}, r"presence_penalty=2.5 must be a finite number in \[-2.0, 2.0\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty=0.0 must be a finite number > 0.0"),
    ({"min_p": 1.5}, "min_p=1.5"),
    ({"logprobs": 21}, "logprobs=21 must be <= 20"),
    ({"stop": [""]}, "stop entry '' must be a non-empty string"),
    ({"stop": 3}, "stop=3 must be a string or a list of strings"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids entry 1.5 must be a token id"),
    ({"allowed_token_ids": []}, "allowed_token_ids=.. must name at least one token id"),
    ({"logit_bias": {1: 101}}, r"logit_bias\[1\]=101 must be a number in \[-100, 100\]"),
    ({"logit_bias": {"x": 1}}, "logit_bias key 'x' must be a token id"),
    ({"ignore_eos": 1}, "ignore_eos=1 must be a bool"),
])
def test_sampling_params_are_validated_at_construction(fields: dict, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        SamplingParams(**fields)


def test_sampling_params_defaults_and_normalization_follow_vllm() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.n) == \
        (1.0, 1.0, 0, 0.0, 16, 1)
    assert SamplingParams(top_k=-1).top_k == -1
    p = SamplingParams(stop="END", stop_token_ids=[3], logit_bias={"5": 2}, temperature=1)
    assert p.stop == ("END",) and p.stop_token_ids == (3,) and p.logit_bias == {5: 2.0}
    assert isinstance(p.temperature, float)
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize("temperature", [1e-320, 1e-310, 1e-6])
def test_subnormal_temperature_is_greedy_not_nan(temperature: float) -> None:
    rows = logits_rows(3)
    states = [state(SamplingParams(temperature=temperature)) for _ in range(3)]
    result = sample_rows(rows, states, [[], [], []])
    assert list(result.tokens) == list(rows.argmax(axis=1))
    art = artifact()
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    greedy = Batcher(NumpyRuntime.random(art, seed=0)).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    tiny = Batcher(NumpyRuntime.random(art, seed=0)).generate(
        prompts, SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True))
    assert [c.token_ids for c in tiny] == [c.token_ids for c in greedy]
    assert all(c.finish_reason == "length" for c in tiny)


def test_small_temperatures_above_the_greedy_threshold_stay_finite() -> None:
    rows = logits_rows(4, seed=1)
    states = [state(SamplingParams(temperature=2e-5, logprobs=3), seed=i) for i in range(4)]
    result = sample_rows(rows, states, [[]] * 4, mode="processed")
    assert list(result.tokens) == list(rows.argmax(axis=1))  # the distribution is one-hot
    assert all(lp is not None and lp.logprob == 0.0 for lp in result.logprobs)


# -- one option at a time against NumPy -------------------------------------------------------------
def test_penalties_match_a_direct_computation() -> None:
    rows = logits_rows(3, seed=2)
    prompt = [3, 5, 5, 9]
    output = [11, 3, 11, 40, 11]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.7),
              SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5),
              SamplingParams(temperature=0.0, repetition_penalty=0.6, frequency_penalty=-0.4,
                             presence_penalty=2.0, logprobs=VOCAB // 5)]
    states = [state(p, tuple(prompt)) for p in params]
    # counts are kept incrementally: feed the output one token per "step"
    for n in range(1, len(output)):
        for s in states:
            s.observe(output[:n])
    result = sample_rows(rows, states, [output] * 3, mode="processed")
    for i, p in enumerate(params):
        want = np_penalized(rows[i], prompt, output, p)
        assert result.tokens[i] == int(np.argmax(want))
    lp = result.logprobs[2]
    want = np_penalized(rows[2], prompt, output, params[2])
    want = want - np.log(np.exp(want - want.max()).sum()) - want.max()
    top = [t.token_id for t in lp.top]
    assert top == list(np.argsort(-want, kind="stable")[:len(top)])
    np.testing.assert_allclose([t.logprob for t in lp.top], want[top], rtol=0,
                               atol=f32_logprob_atol(rows[2]))


def test_repetition_penalty_matches_transformers() -> None:
    rows = logits_rows(1, seed=3)
    prompt, output = [1, 2, 50], [60, 2]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.9, logprobs=20)
    s = state(params, tuple(prompt))
    result = sample_rows(rows, [s], [output], mode="processed")
    ids = torch.tensor([prompt + output])
    ref = RepetitionPenaltyLogitsProcessor(1.9)(ids, torch.tensor(rows))[0].double().numpy()
    ref_lp = ref - ref.max() - np.log(np.exp(ref - ref.max()).sum())
    got = {t.token_id: t.logprob for t in result.logprobs[0].top}
    for token, logprob in got.items():
        assert logprob == pytest.approx(ref_lp[token], abs=f32_logprob_atol(ref))
    assert result.tokens[0] == int(np.argmax(ref))


def test_masks_bias_and_min_tokens() -> None:
    rows = logits_rows(5, seed=4)
    top = rows.argmax(axis=1)
    allowed = (3, 17, 40)
    params = [
        SamplingParams(temperature=0.0, allowed_token_ids=allowed),
        SamplingParams(temperature=0.0, logit_bias={20: 100.0}),
        SamplingParams(temperature=0.0, logit_bias={int(top[2]): -100.0}),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(int(top[3]),)),
        SamplingParams(temperature=0.0, min_tokens=3),
    ]
    rows[4, EOS] = 50.0  # EOS is the argmax of row 4
    states = [state(p) for p in params]
    states.append(state(SamplingParams(temperature=0.0, min_tokens=2)))
    result = sample_rows(np.vstack([rows, rows[4:5]]), states, [[]] * 5 + [[1, 2]])
    assert result.tokens[0] == allowed[int(np.argmax(rows[0, list(allowed)]))]
    assert result.tokens[1] == 20
    second = np.argsort(-rows[2])[1]
    assert result.tokens[2] == second
    assert result.tokens[3] != top[3] and result.tokens[3] == np.argsort(-rows[3])[1]
    assert result.tokens[4] != EOS
    assert result.tokens[5] == EOS  # min_tokens reached: EOS is allowed again


def test_bad_words_ban_the_last_token_after_their_prefix() -> None:
    rows = np.zeros((3, VOCAB), dtype=np.float32)
    rows[:, 30] = 10.0
    rows[:, 31] = 9.0
    bad = ((5, 30), (31,))  # "30 after 5" and "31 anywhere"
    states = [state(SamplingParams(temperature=0.0), bad=bad) for _ in range(3)]
    result = sample_rows(rows, states, [[1, 2], [1, 5], [5, 1]])
    assert result.tokens[0] == 30           # prefix not just generated: 30 stays allowed
    assert result.tokens[1] not in (30, 31)  # after 5: 30 banned, 31 always banned
    assert result.tokens[2] == 30


def test_every_token_masked_is_reported() -> None:
    rows = logits_rows(1)
    s = state(SamplingParams(temperature=0.0, allowed_token_ids=(EOS,), min_tokens=1))
    assert sample_rows(rows, [s], [[]]).masked_rows == [0]


def test_raw_logprobs_are_the_model_distribution() -> None:
    rows = logits_rows(2, seed=5)
    states = [state(SamplingParams(temperature=0.8, top_k=3, logprobs=5, seed=1), seed=1),
              state(SamplingParams(temperature=0.0, presence_penalty=1.0, logprobs=0))]
    result = sample_rows(rows, states, [[], [4]])
    ref = torch.log_softmax(torch.tensor(rows, dtype=torch.float64), dim=-1).numpy()
    for i, lp in enumerate(result.logprobs):
        assert lp is not None and lp.token_id == result.tokens[i]
        assert lp.logprob == pytest.approx(ref[i, lp.token_id], abs=f32_logprob_atol(rows[i]))
        assert lp.rank == int((ref[i] > ref[i, lp.token_id]).sum()) + 1
        order = np.argsort(-ref[i], kind="stable")
        assert [t.token_id for t in lp.top] == list(order[:len(lp.top)])
        assert [t.rank for t in lp.top] == list(range(1, len(lp.top) + 1))
    assert len(result.logprobs[0].top) == 5 and result.logprobs[1].top == ()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=1.5, top_k=6, top_p=0.8, min_p=0.05),
], ids=["temperature", "top_k", "top_p", "min_p", "all"])
def test_sampled_distribution_matches_transformers_warpers(params: SamplingParams) -> None:
    vocab = 12
    row = (np.random.default_rng(6).standard_normal(vocab) * 1.5).astype(np.float32)
    want = hf_distribution(row, params)
    # The processed logprobs are the distribution drawn from: exactly the reference.
    s = RequestSampler(params.__class__(**{**_fields(params), "logprobs": vocab}),
                       np.zeros(0, np.int64), vocab, (), np.random.default_rng(0))
    lp = sample_rows(row[None, :], [s], [[]], mode="processed").logprobs[0]
    assert lp is not None
    got = np.zeros(vocab)
    for t in lp.top:
        got[t.token_id] = np.exp(t.logprob)
    np.testing.assert_allclose(got[want > 0], want[want > 0], rtol=f32_logprob_atol(row), atol=0)
    # Draws, all rows in one vectorized call: support and frequencies of the reference.
    draws = 6000
    states = [RequestSampler(params, np.zeros(0, np.int64), vocab, (), np.random.default_rng(i))
              for i in range(draws)]
    tokens = sample_rows(np.repeat(row[None, :], draws, axis=0), states, [[]] * draws).tokens
    freq = np.bincount(tokens, minlength=vocab) / draws
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(want))
    sigma = np.sqrt(want * (1 - want) / draws)
    assert np.all(np.abs(freq - want) <= 5 * sigma + 1e-3)


@pytest.mark.parametrize(("top_k", "top_p", "scale"), [
    (50, 1.0, 3.0),      # top-k decided by the candidates
    (1000, 1.0, 3.0),    # k beyond the candidates: full sort
    (0, 0.9, 6.0),       # peaked: the candidates hold the mass
    (0, 0.95, 0.3),      # flat: the candidates do not, full sort
    (300, 0.5, 1.0),
])
def test_large_vocab_filters_match_transformers(top_k: int, top_p: float, scale: float) -> None:
    from atombatch.sampling.sampler import CANDIDATES, _filtered

    vocab = 4 * CANDIDATES + 7
    rows = (np.random.default_rng(9).standard_normal((3, vocab)) * scale).astype(np.float32)
    params = SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p)
    states = [RequestSampler(params, np.zeros(0, np.int64), vocab, (), np.random.default_rng(0))
              for _ in range(3)]
    z = _filtered(rows, rows.max(axis=1), states)
    for i in range(3):
        want = hf_distribution(rows[i], params)
        assert np.array_equal(np.isfinite(z[i]), want > 0)
        got = np.exp(z[i].astype(np.float64))
        np.testing.assert_allclose(got / got.sum(), want, rtol=f32_logprob_atol(rows[i]), atol=0)


def _fields(params: SamplingParams) -> dict[str, Any]:
    return {f: getattr(params, f) for f in params.__struct_fields__}


def test_seeded_sampling_does_not_depend_on_the_batch() -> None:
    rows = logits_rows(4, seed=7)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    alone = sample_rows(rows[2:3], [state(params, seed=11)], [[]]).tokens[0]
    mixed = [state(SamplingParams(temperature=0.5), seed=3), state(SamplingParams(temperature=0.0)),
             state(params, seed=11), state(SamplingParams(temperature=2.0, top_k=5), seed=4)]
    assert sample_rows(rows, mixed, [[]] * 4).tokens[2] == alone


def test_single_row_sample_keeps_its_contract() -> None:
    row = logits_rows(1, seed=8)[0]
    assert sample(row, SamplingParams(temperature=0.0), np.random.default_rng(0)) == row.argmax()
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    p = SamplingParams(temperature=1.0, top_k=3)
    assert sample(row, p, rng_a) == sample(row, p, rng_b)
    assert sample(row, p, rng_a) in set(np.argsort(-row)[:3])


# -- the engine: B4 lanes with different options in one step ----------------------------------------
def test_b4_lanes_with_different_options_in_one_step() -> None:
    rec = Recording(NumpyRuntime.random(artifact(), seed=1))
    batcher = Batcher(rec, logprobs_mode="raw")  # type: ignore[arg-type]
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.7,
                       frequency_penalty=0.3, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=1, logprobs=3, max_tokens=10, ignore_eos=True,
                       seed=5),
        SamplingParams(temperature=1.2, top_p=0.7, min_p=0.05, seed=9, max_tokens=10,
                       ignore_eos=True, logit_bias={2: 5.0}),
        SamplingParams(temperature=0.0, min_tokens=10, max_tokens=10),
    ]
    ids = [batcher.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done: dict[str, Any] = {}
    while batcher.has_unfinished():
        for out in batcher.step():
            if out.completion is not None:
                done[out.request_id] = out.completion
        batcher.check_invariants()
    mixed_steps = [logits for _, logits in rec.decodes]
    assert mixed_steps, "no decode step ran"
    completions = [done[i] for i in ids]
    assert all(len(c.token_ids) == 10 for c in completions)
    # The lanes decoded together: every step covered all four (lane = submit order here).
    steps = len(mixed_steps)
    for step in range(steps):
        logits = mixed_steps[step]
        pos = step + 1  # decode step k samples each lane's token k+1 (token 0 came from prefill)
        # lane 0: greedy with penalties over prompt + output so far
        out0 = list(completions[0].token_ids[:pos])
        want = np_penalized(logits[0], prompts[0], out0, params[0])
        assert completions[0].token_ids[pos] == int(np.argmax(want))
        # lane 1: top_k=1 is the argmax; raw logprobs are log_softmax of the model's row
        assert completions[1].token_ids[pos] == int(np.argmax(logits[1]))
        lp = completions[1].logprobs[pos]
        ref = torch.log_softmax(torch.tensor(logits[1], dtype=torch.float64), dim=-1).numpy()
        assert lp.logprob == pytest.approx(ref[lp.token_id], abs=f32_logprob_atol(logits[1]))
        assert [t.token_id for t in lp.top] == list(np.argsort(-ref, kind="stable")[:3])
        # lane 2: the token is inside the reference support of top_p/min_p on biased logits
        biased = logits[2].astype(np.float64).copy()
        biased[2] += 5.0
        support = hf_distribution(biased.astype(np.float32), params[2]) > 0
        assert support[completions[2].token_ids[pos]]
        # lane 3: greedy with EOS masked until min_tokens
        row = logits[3].astype(np.float64).copy()
        row[EOS] = -np.inf
        assert completions[3].token_ids[pos] == int(np.argmax(row))
    assert completions[1].logprobs is not None and len(completions[1].logprobs) == 10
    # Seeded lanes sample the same when they run alone.
    alone = Batcher(NumpyRuntime.random(artifact(), seed=1)).generate([prompts[2]], [params[2]])
    assert alone[0].token_ids == completions[2].token_ids


def test_greedy_requests_keep_the_fast_path_next_to_sampled_ones() -> None:
    art = artifact()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = Batcher(NumpyRuntime.random(art, seed=2)).generate(prompts, greedy)
    mixed = Batcher(NumpyRuntime.random(art, seed=2)).generate(
        prompts, [greedy, SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
                  greedy, SamplingParams(temperature=0.0, frequency_penalty=2.0, max_tokens=8,
                                         ignore_eos=True)])
    assert mixed[0].token_ids == alone[0].token_ids and mixed[2].token_ids == alone[2].token_ids
    assert mixed[3].token_ids != alone[3].token_ids or len(set(alone[3].token_ids)) == 8


def test_max_tokens_none_runs_to_the_context_end() -> None:
    art = artifact()
    [done] = Batcher(NumpyRuntime.random(art, seed=0)).generate(
        [[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(done.token_ids) == art.max_seq_len - 3 and done.finish_reason == "length"


def test_engine_rejects_ids_outside_the_vocabulary_and_unsupported_options() -> None:
    batcher = Batcher(NumpyRuntime.random(artifact(), seed=0))
    for params, match in [
        (SamplingParams(allowed_token_ids=(VOCAB,)), "allowed_token_ids names token id 97"),
        (SamplingParams(logit_bias={VOCAB + 3: 1.0}), "logit_bias names token id 100"),
        (SamplingParams(stop=["x"]), "stop=.'x'. needs a tokenizer"),
        (SamplingParams(bad_words=["x"]), "bad_words=.'x'. needs a tokenizer"),
        (SamplingParams(prompt_logprobs=-1), r"prompt_logprobs=-1 asks for the whole vocabulary "
                                             r"\(97 ids\); at most 20"),
    ]:
        with pytest.raises(RequestError, match=match):
            batcher.submit([1, 2], params)
    assert not batcher.has_unfinished()


def test_detokenizer_holds_back_a_stop_string_split_across_tokens() -> None:
    tok = piece_tokenizer()
    ids = [PIECES.index(p) for p in ["p1", "p2", "p3", "p4", "p5"]]  # "p1p2p3p4p5"
    params = SamplingParams(stop=["2p3p"], max_tokens=10)
    detok = Detokenizer(tok, [], params)
    streamed = [detok.add([t], n + 1) for n, t in enumerate(ids[:4])]
    assert detok.stopped == "2p3p"
    assert "".join(streamed) == "p1p" == detok.text
    assert not any("2p3p"[:k] in "".join(streamed)[-k:] for k in range(2, 5))
    with_stop = Detokenizer(tok, [], SamplingParams(stop=["2p3p"], include_stop_str_in_output=True))
    text = "".join(with_stop.add([t], n + 1) for n, t in enumerate(ids))
    assert text == "p1p2p3p" and with_stop.stopped == "2p3p"
    # a prefix of a stop string that does not complete is released
    detok = Detokenizer(tok, [], SamplingParams(stop=["p2x"]))
    parts = [detok.add([t], n + 1) for n, t in enumerate(ids)] + [detok.flush()]
    assert "".join(parts) == "p1p2p3p4p5" and detok.stopped is None
    # before min_tokens a stop string does not count
    detok = Detokenizer(tok, [], SamplingParams(stop=["p1"], min_tokens=2))
    assert detok.add([ids[0]], 1) == "p1" and detok.stopped is None
    assert detok.add([ids[1]], 2) == "p2" and detok.stopped is None


def test_engine_stops_on_a_stop_string_and_streams_none_of_it() -> None:
    tok = piece_tokenizer()
    art = artifact()
    prompt = [3, 4, 5]
    base = Batcher(NumpyRuntime.random(art, seed=3), tokenizer=tok).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert base.text is not None and base.text == tok.decode(list(base.token_ids))
    # a stop string spanning tokens 3 and 4 of the greedy continuation
    pieces = [tok.decode([t]) for t in base.token_ids]
    start = sum(len(p) for p in pieces[:3]) - 1
    stop = base.text[start:start + 3]
    cut = base.text.find(stop)
    batcher = Batcher(NumpyRuntime.random(art, seed=3), tokenizer=tok)
    rid = batcher.submit(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                stop=[stop, "never-there"]))
    streamed = []
    final = None
    while batcher.has_unfinished():
        for out in batcher.step():
            assert out.request_id == rid
            streamed.append(out.text or "")
            if out.finished:
                final = out
    assert final is not None and final.finish_reason == "stop"
    completion = final.completion
    assert completion.text == base.text[:cut] == "".join(streamed)
    assert completion.stop_reason == stop
    # generation ended at the token that completed the stop string
    upto = len(tok.decode(list(completion.token_ids)))
    assert upto >= cut + len(stop) > len(tok.decode(list(completion.token_ids[:-1])))
    batcher.check_invariants()


def test_bad_words_through_the_engine() -> None:
    tok = piece_tokenizer()
    art = artifact()
    base = Batcher(NumpyRuntime.random(art, seed=4), tokenizer=tok).generate(
        [[9, 8]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    banned = PIECES[base.token_ids[1]]
    again = Batcher(NumpyRuntime.random(art, seed=4), tokenizer=tok).generate(
        [[9, 8]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                 bad_words=[banned]))[0]
    assert again.token_ids[0] == base.token_ids[0]
    assert base.token_ids[1] not in again.token_ids


def test_stop_token_ids_report_the_stop_reason() -> None:
    art = artifact()
    base = Batcher(NumpyRuntime.random(art, seed=5)).generate(
        [[1, 2]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    stop = base.token_ids[2]
    done = Batcher(NumpyRuntime.random(art, seed=5)).generate(
        [[1, 2]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                 stop_token_ids=(stop,), logprobs=0))[0]
    assert done.finish_reason == "stop" and done.stop_reason == stop
    assert done.token_ids == base.token_ids[:3 if stop not in base.token_ids[:2] else
                                            base.token_ids.index(stop) + 1]


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_id_is_not_text_in_the_engine(include: bool) -> None:
    """A request the engine detokenizes (it has a stop string) that ends on a stop id: the id is
    the last of its tokens and, as vLLM has it, not text unless `include_stop_str_in_output`
    (special tokens shown, so its piece would otherwise be written)."""
    tok = piece_tokenizer()
    art = artifact()
    base = Batcher(NumpyRuntime.random(art, seed=5)).generate(
        [[1, 2]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    stop = base.token_ids[2]
    done = Batcher(NumpyRuntime.random(art, seed=5), tokenizer=tok).generate(
        [[1, 2]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                 stop_token_ids=(stop,), stop=["never-there"],
                                 skip_special_tokens=False,
                                 include_stop_str_in_output=include))[0]
    assert done.finish_reason == "stop" and done.stop_reason == stop
    ids = list(done.token_ids)
    assert ids[-1] == stop
    assert done.text == tok.decode(ids if include else ids[:-1], skip_special_tokens=False)


# -- n > 1 ----------------------------------------------------------------------------------------------
def test_n_choices_share_the_prompt_prefill() -> None:
    art = artifact(block_size=8, chunk=8)
    prompt = list(range(1, 30))
    batcher = Batcher(NumpyRuntime.random(art, seed=6), prefix_cache=True)
    params = SamplingParams(temperature=1.0, seed=21, n=3, max_tokens=6, ignore_eos=True,
                            logprobs=1)
    rid = batcher.submit(prompt, params, request_id="multi")
    outs: list[Any] = []
    while batcher.has_unfinished():
        outs.extend(batcher.step())
        batcher.check_invariants()
    assert rid == "multi" and {o.request_id for o in outs} == {"multi"}
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    completions = {o.index: o.completion for o in outs if o.completion is not None}
    assert sorted(completions) == [0, 1, 2]
    stats = batcher.stats()
    # choices 1 and 2 started from choice 0's published prompt blocks (24 of 29 tokens)
    assert stats.prefix_hits == 2 and stats.prefix_hit_tokens == 2 * 24
    # each choice samples as a single request with seed + index
    for index, completion in completions.items():
        single = Batcher(NumpyRuntime.random(art, seed=6)).generate(
            [prompt], SamplingParams(temperature=1.0, seed=21 + index, max_tokens=6,
                                     ignore_eos=True))[0]
        assert completion.token_ids == single.token_ids
        assert completion.index == index and completion.request_id == "multi"
        assert completion.logprobs is not None and len(completion.logprobs) == 6
    streamed = {i: [t for o in outs if o.index == i for t in o.new_token_ids] for i in range(3)}
    assert all(tuple(streamed[i]) == completions[i].token_ids for i in range(3))
    assert not batcher._groups and not batcher._extras and not batcher._samplers


def test_n_choices_without_a_prefix_cache_and_generate_grouping() -> None:
    art = artifact()
    batcher = Batcher(NumpyRuntime.random(art, seed=7))
    greedy = SamplingParams(temperature=0.0, n=2, max_tokens=5, ignore_eos=True)
    single = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    done = batcher.generate([[1, 2, 3], [4, 5]], [greedy, single])
    assert [(c.index, len(c.token_ids)) for c in done] == [(0, 5), (1, 5), (0, 4)]
    assert done[0].token_ids == done[1].token_ids  # greedy choices agree
    batcher.check_invariants()


def test_aborting_an_n_request_ends_every_choice() -> None:
    batcher = Batcher(NumpyRuntime.random(artifact(), seed=8), prefix_cache=True)
    rid = batcher.submit(list(range(1, 20)), SamplingParams(temperature=1.0, n=4, max_tokens=20,
                                                            ignore_eos=True))
    batcher.step()  # choice 0's prefill; the others wait for it
    assert batcher.stats().queue_length == 3
    assert batcher.abort(rid)
    outs = batcher.step()
    while batcher.has_unfinished():
        outs.extend(batcher.step())
    finals = [o for o in outs if o.finish_reason is not None]
    assert sorted(o.index for o in finals) == [0, 1, 2, 3]
    assert all(o.finish_reason == "abort" for o in finals)
    assert [o.finished for o in outs].count(True) == 1
    batcher.check_invariants()
    assert batcher.stats().occupied_lanes == 0
    # nothing kept for finished requests (per-request sampler, detokenizer and group records)
    assert not batcher._groups and not batcher._extras and not batcher._samplers


def test_preemption_keeps_seeded_sampling_penalties_and_logprobs() -> None:
    tight = ArtifactConfig(model=spec(), batch_size=4, max_seq_len=64, block_size=8, num_blocks=9,
                           prefill_chunk_size=8)
    roomy = ArtifactConfig(model=spec(), batch_size=1, max_seq_len=64, block_size=8,
                           num_blocks=9, prefill_chunk_size=8)
    prompts = [list(range(1 + i, 20 + i)) for i in range(4)]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=40 + i, max_tokens=40,
                             ignore_eos=True, frequency_penalty=0.5, repetition_penalty=1.2,
                             logprobs=1) for i in range(4)]
    batcher = Batcher(NumpyRuntime.random(tight, seed=11))
    done = batcher.generate(prompts, params)
    assert batcher.stats().preemptions > 0
    for prompt, p, completion in zip(prompts, params, done, strict=True):
        [alone] = Batcher(NumpyRuntime.random(roomy, seed=11)).generate([prompt], p)
        assert completion.token_ids == alone.token_ids
        assert completion.logprobs is not None and len(completion.logprobs) == 40
        assert [lp.token_id for lp in completion.logprobs] == list(completion.token_ids)
    batcher.check_invariants()


def test_special_tokens_in_text_follow_skip_special_tokens() -> None:
    tok = piece_tokenizer()
    ids = [PIECES.index("p1"), 1, PIECES.index("p2")]  # 1 is the special "<eos>"
    skip = Detokenizer(tok, [], SamplingParams())
    keep = Detokenizer(tok, [], SamplingParams(skip_special_tokens=False))
    assert "".join(skip.add([t], n + 1) for n, t in enumerate(ids)) == "p1p2"
    assert "".join(keep.add([t], n + 1) for n, t in enumerate(ids)) == "p1<eos>p2"


_OPTIONS = st.fixed_dictionaries({}, optional={
    "temperature": st.sampled_from([0.0, 1e-300, 0.3, 1.0, 2.5]),
    "top_k": st.sampled_from([-1, 0, 1, 3, 50]),
    "top_p": st.sampled_from([0.2, 0.9, 1.0]),
    "min_p": st.sampled_from([0.0, 0.1, 0.5]),
    "presence_penalty": st.sampled_from([0.0, -1.0, 1.5]),
    "frequency_penalty": st.sampled_from([0.0, 0.7]),
    "repetition_penalty": st.sampled_from([1.0, 0.5, 1.8]),
    "logit_bias": st.sampled_from([None, {3: 5.0, 9: -100.0}]),
    "allowed_token_ids": st.sampled_from([None, (2, 3, 9, 40, EOS)]),
    "min_tokens": st.sampled_from([0, 2]),
    "logprobs": st.sampled_from([None, 0, 4]),
    "seed": st.integers(0, 2**64 - 1),
})


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(_OPTIONS, st.lists(st.integers(0, VOCAB - 1), max_size=6),
                               st.integers(0, 2**32)), min_size=1, max_size=6),
       mode=st.sampled_from(["raw", "processed"]), data_seed=st.integers(0, 1000))
def test_each_row_samples_as_if_alone(rows: list, mode: str, data_seed: int) -> None:
    """Vectorization never mixes rows: a batch gives each row what a call of its own gives."""
    logits = logits_rows(len(rows), seed=data_seed)
    params = [SamplingParams(max_tokens=16, **options) for options, _, _ in rows]
    outputs = [output for _, output, _ in rows]
    states = [state(p, (1, 2), seed=s) for p, (_, _, s) in zip(params, rows, strict=True)]
    batch = sample_rows(logits, states, outputs, mode=mode)  # type: ignore[arg-type]
    for i, (p, (_, output, s)) in enumerate(zip(params, rows, strict=True)):
        alone = sample_rows(logits[i:i + 1], [state(p, (1, 2), seed=s)], [output],
                            mode=mode)  # type: ignore[arg-type]
        assert (i in batch.masked_rows) == (0 in alone.masked_rows)
        if i in batch.masked_rows:
            continue
        assert batch.tokens[i] == alone.tokens[0]
        assert batch.logprobs[i] == alone.logprobs[0]
        if p.allowed_token_ids is not None:
            assert batch.tokens[i] in p.allowed_token_ids
        if len(output) < p.min_tokens:
            assert batch.tokens[i] != EOS


AB_PIECES = ["<unk>"] + ["".join(p) for n in (1, 2, 3) for p in itertools.product("ab", repeat=n)]


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(st.integers(1, len(AB_PIECES) - 1), min_size=1, max_size=12),
       stops=st.lists(st.text("ab", min_size=1, max_size=5), min_size=1, max_size=3),
       include=st.booleans())
def test_stop_strings_against_a_naive_search(pieces: list[int], stops: list[str],
                                             include: bool) -> None:
    """Streamed text = the text up to the first stop string to end (by str.find), nothing of
    it streamed early; overlapping and self-similar stop strings included."""
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(AB_PIECES)}, unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    text = "".join(AB_PIECES[t] for t in pieces)
    ends = [(text.find(s) + len(s), k, s) for k, s in enumerate(stops) if s in text]
    detok = Detokenizer(tok, [], SamplingParams(stop=stops, include_stop_str_in_output=include))
    streamed = ""
    for n, token in enumerate(pieces):
        streamed += detok.add([token], n + 1)
        if detok.stopped is not None:
            break
        # what is out never reaches into a stop string's first occurrence
        assert all(len(streamed) <= end - len(s) for end, _, s in ends)
    if not ends:
        assert detok.stopped is None and streamed + detok.flush() == text
        return
    end, _, stop = min(ends)
    assert detok.stopped is not None
    assert len(detok.stopped) and text.find(detok.stopped) + len(detok.stopped) == end
    cut = end if include else end - len(detok.stopped)
    assert streamed == text[:cut] == detok.text


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.integers(1, len(AB_PIECES) - 1), min_size=1, max_size=16),
       cuts=st.lists(st.integers(1, 4), min_size=16, max_size=16),
       stops=st.lists(st.text("ab", min_size=1, max_size=5), min_size=1, max_size=3),
       include=st.booleans(), min_tokens=st.integers(0, 6))
def test_long_pieces_stop_where_character_steps_stop(pieces: list[int], cuts: list[int],
                                                     stops: list[str], include: bool,
                                                     min_tokens: int) -> None:
    """Issue 18 item 8: text searched in C (`str.find`, automata rebuilt from the tail: the path
    of a long token) streams, holds back and stops exactly as the character automata do, for the
    same tokens arriving in the same groups, min_tokens included."""
    from unittest import mock

    from tokenizers import Tokenizer, decoders, models

    import atombatch.sampling.detokenizer as detok_module

    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(AB_PIECES)}, unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens)

    def run(char_steps: int) -> tuple[list[str], str | None, str]:
        with mock.patch.object(detok_module, "_CHAR_STEPS", char_steps):
            detok = Detokenizer(tok, [], params)
            streamed, at, k = [], 0, 0
            while at < len(pieces) and detok.stopped is None:
                group = pieces[at:at + cuts[k]]
                at, k = at + len(group), k + 1
                streamed.append(detok.add(group, at))
            if detok.stopped is None:
                streamed.append(detok.flush())
            return streamed, detok.stopped, detok.text

    assert run(0) == run(10**9)


def test_plain_greedy_steps_never_enter_the_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    import atombatch.engine.step as engine_module  # the step samples

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a plain greedy request went through sample_rows")

    monkeypatch.setattr(engine_module, "sample_rows", refuse)
    batcher = Batcher(NumpyRuntime.random(artifact(), seed=0))
    done = batcher.generate([[1, 2], [3, 4, 5], [6]],
                            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert all(c.finish_reason == "length" for c in done)
    [failed] = batcher.generate([[1, 2]], SamplingParams(temperature=0.5, max_tokens=3))
    assert failed.finish_reason == "error" and "sample_rows" in (failed.error or "")


@pytest.mark.parametrize("top_k,top_p,min_p,temperature,scale", [
    (50, 1.0, 0.0, 0.8, 1.0),     # top-k alone
    (1, 1.0, 0.0, 1.0, 1.0),      # top-k 1: the argmax
    (256, 1.0, 0.0, 1.3, 2.0),    # k = the candidates
    (0, 0.9, 0.0, 0.7, 8.0),      # top-p on a peaked row: decided by the candidates
    (40, 0.95, 0.0, 0.8, 1.0),    # both
    (0, 0.8, 0.05, 0.9, 6.0),     # top-p with min_p
    (0, 0.99, 0.0, 1.0, 0.5),     # flat: the candidates do not hold p, the full path draws
])
def test_candidate_draw_is_the_full_paths_distribution(top_k: int, top_p: float, min_p: float,
                                                       temperature: float, scale: float) -> None:
    """A large vocabulary's top-k / top-p rows draw from their candidates alone
    (`_draw_candidates`); for the same uniform numbers they pick what the full path picks
    (`_filtered` then `_draw`: the same kept ids, the same inverse CDF in id order), up to
    float rounding at a boundary between two ids."""
    from atombatch.sampling.sampler import CANDIDATES, DRAW_BLOCK, _draw, _draw_candidates, _filtered

    vocab = CANDIDATES * DRAW_BLOCK + 4321          # enough blocks for the candidate bound
    rows = 3
    x = (np.random.default_rng(11).standard_normal((rows, vocab)) * scale).astype(np.float32)
    x[1, 7] = x[1].max() + 3.0                      # one clear favourite
    x[2, ::3] = -np.inf                             # masked ids (a grammar, allowed ids)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    states = [RequestSampler(params, np.zeros(0, np.int64), vocab, (), np.random.default_rng(0))
              for _ in range(rows)]
    top = x.max(axis=1)
    z = _filtered(x, top, states)
    draws = 401
    agree = total = 0
    took = np.zeros(rows, dtype=bool)
    for u in (np.arange(draws) + 0.5) / draws:
        uniform = np.full(rows, u)
        candidate = np.full(rows, -1, dtype=np.int64)
        drawn = _draw_candidates(x, top, np.arange(rows), states, uniform, candidate)
        took |= drawn
        full = _draw(z.copy(), uniform)
        for i in np.flatnonzero(drawn):
            assert np.isfinite(z[i, candidate[i]])  # never an id the full path masked
            agree += int(candidate[i] == full[i])
            total += 1
    if scale >= 1.0 or top_k:   # the candidates decided these rows
        assert took.all()
    if total:
        assert agree >= 0.995 * total

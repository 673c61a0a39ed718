"""Structured output in the engine: a grammar mask per constrained row (atombatch/sampling/grammar.py).

The model is a random-weight Llama whose vocabulary a byte-level BPE fills (tests/support/
structured.py): its unconstrained text is garbage, so output that matches a schema, a regex, a
choice or a grammar can only come from a correct mask. Where constrained and unconstrained runs
are compared token for token, the mask is the only difference.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import jsonschema
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.driving import run_to_end
from support.structured import ART, SPEC, batcher, byte_tokenizer

from atombatch import Batcher, RequestError, SamplingParams, StructuredOutput
from atombatch.pd import InProcessSource, Producer
from atombatch.runtime import NumpyRuntime
from atombatch.sampling.grammar import Grammars, apply_masks
from atombatch.sampling.sampler import RequestSampler, sample_rows

pytestmark = pytest.mark.numerics   # greedy tokens of real math (run again under a second BLAS)

PROMPT = [1, 40, 41, 42, 43]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}
LARK = 'start: "(" item ("," item)* ")"\nitem: /[a-c]{1,2}/ | "nil"'


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return byte_tokenizer()


def text_of(tok: Any, ids: tuple[int, ...]) -> str:
    return str(tok.decode([t for t in ids if t != SPEC.eos_token_ids[0]]))


CONSTRAINTS = {
    "json_schema": (StructuredOutput.json_schema(PERSON),
                    lambda s: jsonschema.validate(json.loads(s), PERSON) is None),
    "json_object": (StructuredOutput.json_object(), lambda s: isinstance(json.loads(s), dict)),
    "regex": (StructuredOutput.regex(r"[0-9]{3}-[a-z]{2,4}"),
              lambda s: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", s) is not None),
    "choice": (StructuredOutput.choice(["yes", "no", "maybe so"]),
               lambda s: s in ("yes", "no", "maybe so")),
    "grammar": (StructuredOutput.grammar(LARK),
                lambda s: re.fullmatch(r"\((?:[a-c]{1,2}|nil)(?:,(?:[a-c]{1,2}|nil))*\)", s)
                is not None),
    "gbnf": (StructuredOutput.grammar('root ::= "x" [0-9]+ "y"'),
             lambda s: re.fullmatch(r"x[0-9]+y", s) is not None),
}


def _valid(check: Any, text: str) -> bool:
    try:
        return bool(check(text))
    except (ValueError, jsonschema.ValidationError):
        return False


# any JSON object, sampled from random logits, rarely closes within max_tokens: greedy only
@pytest.mark.parametrize(("kind", "temperature"),
                         [(k, t) for k in CONSTRAINTS for t in (0.0, 1.0)
                          if (k, t) != ("json_object", 1.0)])
def test_constrained_text_matches_and_ends_with_eos(kind: str, temperature: float,
                                                     tokenizer: Any) -> None:
    structured, check = CONSTRAINTS[kind]
    b = batcher()
    params = SamplingParams(max_tokens=120, temperature=temperature, seed=5, n=3,
                            structured=structured)
    done = b.generate([PROMPT], params)
    assert len(done) == 3
    for c in done:
        assert c.finish_reason == "stop", (c.error, c.text)
        assert c.token_ids[-1] == SPEC.eos_token_ids[0]  # the grammar ended, then EOS only
        assert _valid(check, c.text), c.text
        assert c.text == text_of(tokenizer, c.token_ids)
    # the same requests without the constraint: garbage (so the check above can fail)
    free = b.generate([PROMPT], msgspec.structs.replace(params, structured=None))
    assert not any(_valid(check, c.text) for c in free)


def test_sampled_choices_differ_and_greedy_choices_agree() -> None:
    b = batcher()
    choice = StructuredOutput.regex(r"[a-z]{8}")
    sampled = b.generate([PROMPT], SamplingParams(max_tokens=20, temperature=1.0, seed=1, n=4,
                                                  structured=choice))
    assert len({c.text for c in sampled}) > 1      # each choice its own matcher and draws
    greedy = b.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0.0, n=3,
                                                 structured=choice))
    assert len({c.token_ids for c in greedy}) == 1
    alone = b.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0.0,
                                                structured=choice))
    assert greedy[0].token_ids == alone[0].token_ids


def test_constrained_greedy_is_the_masked_argmax_of_full_recompute(tokenizer: Any) -> None:
    """Each greedy token is the argmax of the full-recompute logits over the ids the grammar
    allows after the tokens before it (an independent matcher, stepped by hand)."""
    b = batcher()
    structured = StructuredOutput.json_schema(PERSON)
    done = b.generate([PROMPT], SamplingParams(max_tokens=60, temperature=0.0,
                                               structured=structured))[0]
    grammars = Grammars(tokenizer, SPEC.vocab_size, SPEC.eos_token_ids)
    matcher = grammars.matcher_now(structured)
    seq = list(PROMPT)
    for token in done.token_ids:
        logits = _recompute(seq)
        allowed = _bitmask(matcher, SPEC.vocab_size)
        masked = np.where(allowed, logits, -np.inf)
        assert token == int(np.argmax(masked))
        assert matcher.consume_token(token)
        seq.append(token)


def _recompute(seq: list[int]) -> np.ndarray:
    """Last-position logits of `seq` from a fresh engine (no cache shared with the run)."""
    rt = NumpyRuntime.random(ART, seed=3)
    b = Batcher(rt)
    rid = b.submit(seq, SamplingParams(max_tokens=1, temperature=0.0, logprobs=0))
    seen: dict[str, Any] = {}
    orig = rt.prefill

    def capture(inputs: Any, **kw: Any) -> Any:
        out = orig(inputs, **kw)
        seen["logits"] = np.array(out, dtype=np.float64).reshape(-1)
        return out
    rt.prefill = capture  # type: ignore[method-assign]
    run_to_end(b)
    assert rid
    return seen["logits"]


def _bitmask(matcher: Any, vocab: int) -> np.ndarray:
    """llguidance's own mask of one matcher (`compute_bitmask`, no executor, no engine code)."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                         bitorder="little")
    return bits[:vocab].astype(bool)


def _accepted(matcher: Any, vocab: int) -> np.ndarray:
    """The ids the matcher itself consumes next, tried one id at a time on copies."""
    return np.array([matcher.deep_copy().consume_token(t) for t in range(vocab)])


@pytest.mark.parametrize("kind", ["json_schema", "regex", "grammar", "choice"])
def test_mask_equals_the_matchers_own_acceptance_token_by_token(kind: str,
                                                                 tokenizer: Any) -> None:
    structured, _ = CONSTRAINTS[kind]
    grammars = Grammars(tokenizer, SPEC.vocab_size, SPEC.eos_token_ids)
    rng = np.random.default_rng(0)
    for _ in range(3):
        grammar = _request_grammar(grammars, structured)
        output: list[int] = []
        for _step in range(40):
            x = rng.standard_normal((2, SPEC.vocab_size)).astype(np.float32)
            apply_masks(x, [1], [grammar])
            allowed = np.isfinite(x[1])
            assert np.isfinite(x[0]).all()            # the unconstrained row is untouched
            assert np.array_equal(allowed, _bitmask(grammar.matcher, SPEC.vocab_size))
            # every id the mask allows, the matcher consumes; the ids it consumes that the mask
            # leaves out spell a strict prefix of the bytes the grammar forces next (llguidance
            # keeps forced text to its canonical tokens)
            accepted = _accepted(grammar.matcher, SPEC.vocab_size)
            assert not (allowed & ~accepted).any()
            forced = grammar.matcher.compute_ff_bytes()
            for t in np.flatnonzero(accepted & ~allowed).tolist():
                spelled = tokenizer.decode([t]).encode()
                assert len(spelled) < len(forced) and forced.startswith(spelled), (t, forced)
            token = int(rng.choice(np.flatnonzero(allowed)))
            output.append(token)
            assert grammar.advance(output) is None
            if token in SPEC.eos_token_ids:
                break


def _request_grammar(grammars: Grammars, structured: StructuredOutput) -> Any:
    from atombatch.sampling.grammar import RequestGrammar
    return RequestGrammar(grammars.matcher_now(structured), structured, grammars)


def test_mixed_steps_leave_unconstrained_rows_as_they_were() -> None:
    plain = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=12, temperature=0.9, seed=11, ignore_eos=True)]
    prompts = [[1, 7, 8, 9], [1, 9, 8]]
    alone = batcher().generate(prompts, plain)
    structured = SamplingParams(max_tokens=40, temperature=0.0,
                                structured=StructuredOutput.json_schema(PERSON))
    mixed = batcher().generate(prompts + [PROMPT, PROMPT], plain + [structured, structured])
    assert [c.token_ids for c in mixed[:2]] == [c.token_ids for c in alone]
    assert mixed[2].token_ids == mixed[3].token_ids
    jsonschema.validate(json.loads(mixed[2].text or ""), PERSON)


def test_preemption_keeps_each_matcher_in_step() -> None:
    """Oversubscribed blocks: requests are preempted and recomputed; their constrained greedy
    output equals a run of each alone."""
    art = msgspec.structs.replace(ART, num_blocks=6)  # bps 4 + 2: oversubscribed
    tok = byte_tokenizer()
    regex = StructuredOutput.regex(r"[a-z ]{150,}")
    params = SamplingParams(max_tokens=180, temperature=0.0, structured=regex)
    prompts = [[1, 30 + i, 31, 32] for i in range(4)]
    b = Batcher(NumpyRuntime.random(art, seed=3), tokenizer=tok)
    got = b.generate(prompts, params)
    assert b.stats().preemptions > 0
    for prompt, c in zip(prompts, got, strict=True):
        alone = Batcher(NumpyRuntime.random(ART, seed=3), tokenizer=tok).generate([prompt],
                                                                                 params)[0]
        assert c.token_ids == alone.token_ids
        assert re.fullmatch(r"[a-z ]{150,}", c.text or ""), c.text


def test_buckets_prefix_cache_stop_strings_and_logprobs(tokenizer: Any) -> None:
    art = msgspec.structs.replace(ART, decoder_batch_sizes=(1, 2, 4))
    structured = StructuredOutput.regex(r"(ab|cd)+e")
    params = SamplingParams(max_tokens=30, temperature=0.7, seed=4, logprobs=3,
                            structured=structured)
    b = Batcher(NumpyRuntime.random(art, seed=3), tokenizer=tokenizer, prefix_cache=True)
    first = b.generate([PROMPT * 8, PROMPT * 8], [params, params])
    again = b.generate([PROMPT * 8], params)
    assert b.stats().prefix_hits > 0
    assert again[0].token_ids == first[0].token_ids
    for c in first:
        assert re.fullmatch(r"(ab|cd)+e", c.text or ""), c.text
        assert c.logprobs is not None
        for entry in c.logprobs:  # raw logprobs come after the mask (as in vLLM)
            assert np.isfinite(entry.logprob)
            finite = [t.logprob for t in entry.top if np.isfinite(t.logprob)]
            assert np.exp(finite).sum() <= 1.0 + 1e-5
    stopped = b.generate([PROMPT * 8], msgspec.structs.replace(params, stop=("cd",)))[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "cd"
    assert "cd" not in (stopped.text or "")


def test_bad_constraints_and_missing_tokenizer_are_request_errors() -> None:
    b = batcher()
    with pytest.raises(RequestError, match="not valid JSON") as info:
        b.submit(PROMPT, SamplingParams(structured=StructuredOutput.json_schema("{oops",
                                                                                param="guided_json")))
    assert info.value.param == "guided_json"
    with pytest.raises(RequestError, match="needs a tokenizer"):
        Batcher(NumpyRuntime.random(ART, seed=3)).submit(
            PROMPT, SamplingParams(structured=StructuredOutput.regex("a")))
    with pytest.raises(RequestError, match="takes no value"):
        StructuredOutput(kind="json_object", value="{}")
    with pytest.raises(RequestError, match="at most"):
        StructuredOutput.choice(["x"] * 2000)
    # compiled on the grammar thread: the request fails alone, the others finish
    bad = b.submit(PROMPT, SamplingParams(structured=StructuredOutput.regex("(ab")))
    unsat = b.submit(PROMPT, SamplingParams(structured=StructuredOutput.grammar("start: foo")))
    good = b.submit(PROMPT, SamplingParams(max_tokens=5, temperature=0.0))
    finals = run_to_end(b)
    assert finals[bad].finish_reason == "error" and "does not compile" in finals[bad].error
    assert finals[unsat].finish_reason == "error" and 'unknown name: "foo"' in \
        finals[unsat].error
    assert finals[good].finish_reason == "length"
    b.check_invariants()
    assert b.stats().free_blocks + b.stats().spare_blocks == ART.num_blocks


def test_a_choice_no_token_can_spell_is_refused() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    # a sentencepiece-style vocabulary without byte fallback: only "a", "b" and the space
    tok = Tokenizer(models.BPE({"<|eos|>": 0, "<|bos|>": 1, "a": 2, "b": 3, "\u2581": 4}, []))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    grammars = Grammars(tok, SPEC.vocab_size, SPEC.eos_token_ids)
    with pytest.raises(RequestError, match="no token of the model's vocabulary") as info:
        grammars.matcher_now(StructuredOutput.choice(["zz"], param="guided_choice"))
    assert info.value.param == "guided_choice"
    grammars.matcher_now(StructuredOutput.choice(["ab"]))  # spellable: compiles


def test_abort_while_compiling_and_requests_wait_for_their_grammar() -> None:
    b = batcher()
    structured = StructuredOutput.json_schema(PERSON)
    rid = b.submit(PROMPT, SamplingParams(max_tokens=40, temperature=0.0, structured=structured))
    request = b.scheduler.requests[rid]
    assert request.compiling and not request.ready   # queued while its matcher builds
    b.abort(rid)
    finals = run_to_end(b)
    assert finals[rid].finish_reason == "abort"
    b.check_invariants()


def test_pd_decoder_refuses_a_producer_first_token_outside_the_grammar(tokenizer: Any) -> None:
    producer = Producer(NumpyRuntime.random(ART, seed=3))
    first = producer.produce("probe", PROMPT).header.first_token
    assert first is not None
    text = tokenizer.decode([first])
    b = batcher()
    fits = StructuredOutput.regex(re.escape(text) + "[a-z]{4}")
    other = "q" if not text.startswith("q") else "w"
    breaks = StructuredOutput.choice([other * 3])
    ids = {}
    for name, structured in (("fits", fits), ("breaks", breaks)):
        params = SamplingParams(max_tokens=20, temperature=0.0, structured=structured)
        ids[name] = b.submit(PROMPT, params, kv=InProcessSource.from_producer(
            producer, name, PROMPT, params))
    finals = run_to_end(b)
    ok = finals[ids["fits"]].completion
    assert ok is not None and ok.finish_reason == "stop"
    assert re.fullmatch(re.escape(text) + "[a-z]{4}", ok.text or "")
    refused = finals[ids["breaks"]]
    assert refused.finish_reason == "error"
    assert f"token {first} at output position 0 does not match" in (refused.error or "")


# -- hypothesis: random JSON schemas -------------------------------------------------------------
_LEAF = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 200)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 5)),
    st.builds(lambda vals: {"enum": vals},
              st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=3,
                       unique=True)),
)


def _object(children: Any) -> Any:
    props = st.dictionaries(st.text("abcdef", min_size=1, max_size=3), children, min_size=1,
                            max_size=3)
    return props.map(lambda p: {"type": "object", "properties": p, "required": sorted(p),
                                "additionalProperties": False})


SCHEMAS = st.recursive(
    _LEAF, lambda children: st.one_of(
        _object(children),
        st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n},
                  children, st.integers(0, 2))),
    max_leaves=5)


@pytest.fixture(scope="module")
def shared_batcher() -> Batcher:
    return batcher()


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=SCHEMAS, temperature=st.sampled_from([0.0, 0.8]), seed=st.integers(0, 2**16))
def test_hypothesis_schemas_produce_valid_json(schema: dict[str, Any], temperature: float,
                                               seed: int, shared_batcher: Batcher) -> None:
    params = SamplingParams(max_tokens=200, temperature=temperature, seed=seed,
                            structured=StructuredOutput.json_schema(schema))
    c = shared_batcher.generate([PROMPT], params)[0]
    assert c.finish_reason == "stop", (c.error, c.text, schema)
    jsonschema.validate(json.loads(c.text or ""), schema)


def test_sample_rows_masks_only_constrained_rows(tokenizer: Any) -> None:
    grammars = Grammars(tokenizer, SPEC.vocab_size, SPEC.eos_token_ids)
    structured = StructuredOutput.choice(["yes", "no"])
    params = SamplingParams(temperature=0.0, structured=structured)
    plain = SamplingParams(temperature=0.0, top_k=3)
    states = [RequestSampler(p, np.asarray(PROMPT), SPEC.vocab_size, SPEC.eos_token_ids,
                             np.random.default_rng(0)) for p in (plain, params, plain)]
    states[1].grammar = _request_grammar(grammars, structured)
    logits = np.random.default_rng(1).standard_normal((3, SPEC.vocab_size)).astype(np.float32)
    result = sample_rows(logits, states, [(), (), ()])
    assert result.tokens[0] == np.argmax(logits[0]) and result.tokens[2] == np.argmax(logits[2])
    allowed = _bitmask(grammars.matcher_now(structured), SPEC.vocab_size)
    assert result.tokens[1] == np.argmax(np.where(allowed, logits[1], -np.inf))


def test_masks_are_computed_during_the_device_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps start their constrained rows' masks before the device call (the mask
    thread), and sampling uses them; the tokens equal those of masks filled after the call."""
    structured = StructuredOutput.json_schema(PERSON)
    params = [SamplingParams(max_tokens=60, temperature=0.8, seed=s, structured=structured)
              for s in range(3)] + [SamplingParams(max_tokens=20, temperature=0.0)]
    prompts = [PROMPT, PROMPT[:3], PROMPT[1:], PROMPT]
    b = batcher()
    overlapped = b.generate(prompts, params)
    grammars = b.grammars()
    assert grammars.prefetch_hits >= max(len(c.token_ids) for c in overlapped[:3]) - 1
    monkeypatch.setattr(Grammars, "prefetch", lambda self, grammars: None)
    after = batcher().generate(prompts, params)
    assert [c.token_ids for c in after] == [c.token_ids for c in overlapped]
    for c in overlapped[:3]:
        jsonschema.validate(json.loads(c.text or ""), PERSON)


def test_a_repeated_constraint_compiles_once(monkeypatch: pytest.MonkeyPatch) -> None:
    b = batcher()
    structured = StructuredOutput.json_schema(PERSON)
    params = SamplingParams(max_tokens=60, temperature=0.0, structured=structured)
    first = b.generate([PROMPT], params)[0]
    built: list[StructuredOutput] = []
    build = Grammars._build

    def counting(self: Grammars, spec: StructuredOutput) -> Any:
        built.append(spec)
        return build(self, spec)
    monkeypatch.setattr(Grammars, "_build", counting)
    again = b.generate([PROMPT, PROMPT], params)
    assert built == []                          # copies of the compiled matcher
    assert [c.token_ids for c in again] == [first.token_ids] * 2
    b.generate([PROMPT], msgspec.structs.replace(
        params, structured=StructuredOutput.json_schema({**PERSON, "required": ["ok"]})))
    assert len(built) == 1                      # another schema compiles


def test_after_leaves_a_preamble_free_then_constrains(tokenizer: Any) -> None:
    """`after` (a reasoning block's end): the tokens up to its first occurrence are the model's
    own, the rest matches the constraint."""
    b = batcher()
    free = b.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0,
                                               ignore_eos=True))[0].token_ids
    end = next(i for i in range(2, len(free)) if (free[i - 1], free[i]) not in
               set(itertools.pairwise(free[:i])))  # a pair not seen before it
    marker = (free[end - 1], free[end])
    structured = StructuredOutput.regex(r"[0-9]{3}-[a-z]{2,4}", after=marker)
    c = b.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0.0,
                                            structured=structured))[0]
    assert c.token_ids[:end + 1] == free[:end + 1]
    rest = text_of(tokenizer, c.token_ids[end + 1:])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", rest), rest
    assert c.finish_reason == "stop"
    with pytest.raises(RequestError, match="after="):
        StructuredOutput.regex("a", after=tuple(range(65)))


def test_a_matcher_in_llguidance_error_fails_its_row_alone(tokenizer: Any) -> None:
    grammars = Grammars(tokenizer, SPEC.vocab_size, SPEC.eos_token_ids)
    structured = StructuredOutput.choice(["yes"], param="guided_choice")
    grammar = _request_grammar(grammars, structured)
    assert not grammar.matcher.consume_token(tokenizer.token_to_id("z"))  # llguidance's error
    params = SamplingParams(temperature=0.0, structured=structured)
    states = [RequestSampler(p, np.asarray(PROMPT), SPEC.vocab_size, SPEC.eos_token_ids,
                             np.random.default_rng(0))
              for p in (SamplingParams(temperature=0.0, top_k=2), params)]
    states[1].grammar = grammar
    logits = np.random.default_rng(2).standard_normal((2, SPEC.vocab_size)).astype(np.float32)
    result = sample_rows(logits, states, [(), ()])
    assert list(result.failed) == [1]
    assert "guided_choice constraint (choice) failed" in result.failed[1]
    assert result.tokens[0] == np.argmax(logits[0])


def test_bench_structured_runs_small() -> None:
    from atombatch.bench import structured as bench
    records = bench.run([2, 4], vocab=3000, steps=12, threads=1)
    assert [r.batch for r in records] == [2, 4]
    for r in records:
        assert r.constrained_sampled_ms > 0 and r.fill_ms > 0 and r.apply_ms > 0
        assert 0 < r.allowed_fraction < 1
    assert "constr." in bench.format_table(records)

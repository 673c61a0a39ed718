"""Reviewer regression tests for tricky paths of the block core, the NumPy runtime, config and serve.

Every test here passes on the current code; they pin behaviour that a refactor could silently
break:
  - the compiled core and its twin agree on PrefillInputs inputs that take the non-fast paths
    (strided / non-int64 tokens, int64 or list block rows, padded last chunk) and on error paths;
  - failed calls leave the compiled pool unchanged (an out-of-range owner is refused up front);
  - chunk sizes that do not divide the block size (and vice versa), with prefix/host caches,
    oversubscription, preemption and every policy, give the cache-free reference tokens (ledger);
  - Gemma3 greedy output equals transformers' at prompts exactly at / around the sliding window,
    with chunk == window, and up to the max_seq_len boundary;
  - the HTTP server answers over-long / negative / missing fields with OpenAI error bodies.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from ledger import LedgerRuntime, ledger_spec, reference

from atombatch import ArtifactConfig, Batcher, ConfigError, SamplingParams
from atombatch import _blocks as C
from atombatch import _blocks_py as P
from atombatch.errors import StateError

IMPLS = (C, P)


# -- compiled core vs twin -------------------------------------------------------------------------
def _prefill_state(inputs):
    return (inputs.input_ids.tolist(), inputs.cache_position.tolist(),
            inputs.block_tables.tolist(), inputs.local_block_tables.tolist(),
            int(inputs.query_position))


PREFILL_CASES = [
    # tokens, start, blocks, num_blocks, slot
    (np.arange(50, dtype=np.int64), 48, np.array([3, 4, 5], np.int32), 2, 1),     # fast paths
    (np.arange(100, dtype=np.int64)[::2], 8, np.array([9, 1, 5, 7], np.int32)[::2], 2, 0),  # strided
    (np.arange(20, dtype=np.int32), 16, np.array([1, 2, 3], np.int64), 3, 0),     # slow paths
    (list(range(5)), 0, [7], 1, 2),                                               # lists, 1 block
    ((1, 2, 3, 4, 5, 6, 7, 8, 9), 8, (32767, 0), 2, 32767),                       # int16 edges
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"start{c[1]}")
def test_prefill_inputs_twin_parity_on_slow_and_padded_paths(case):
    tokens, start, blocks, num_blocks, slot = case
    results = []
    for impl in IMPLS:
        inputs = impl.PrefillInputs(8, 3)
        # pre-fill with garbage: build must overwrite every entry (padding included)
        inputs.input_ids[...] = 99
        inputs.block_tables[...] = 99
        real = inputs.build(tokens, start, blocks, num_blocks, slot)
        results.append((real, _prefill_state(inputs)))
    assert results[0] == results[1]
    real, (ids, positions, table, _, query) = results[0]
    assert real == min(8, len(tokens) - start) and query == real - 1
    assert ids[0][real:] == [0] * (8 - real)                  # padded tokens are 0
    assert positions[0] == list(range(start, start + 8))      # padded positions continue
    assert table[num_blocks:] == [table[num_blocks - 1]] * (3 - num_blocks)


PREFILL_ERRORS = [
    (list(range(4)), 4, [1], 1, 0),            # start past the prompt
    (list(range(4)), 0, [1], 0, 0),            # no block
    (list(range(4)), 0, [1], 4, 0),            # more blocks than the row
    (list(range(4)), 0, [1], 2, 0),            # more blocks than given
    (list(range(4)), 0, [1, -1], 2, 0),        # negative block
    (list(range(4)), 0, np.array([1, 32768], np.int32), 2, 0),  # int16 overflow (fast path)
    (list(range(4)), 0, [1, 32768], 2, 0),     # int16 overflow (slow path)
    (list(range(4)), 0, [1], 1, 32768),        # sliding slot overflow
]


@pytest.mark.parametrize("case", PREFILL_ERRORS)
def test_prefill_inputs_errors_match_and_leave_buffers_untouched(case):
    messages = []
    for impl in IMPLS:
        inputs = impl.PrefillInputs(4, 3)
        inputs.build(list(range(10, 14)), 0, [2, 2, 2], 3, 0)
        before = _prefill_state(inputs)
        with pytest.raises(StateError) as info:
            inputs.build(*case)
        assert _prefill_state(inputs) == before
        messages.append(str(info.value))
    assert messages[0] == messages[1]


def test_decode_inputs_padding_and_tail_rows_match_twin():
    tables = []
    for impl in IMPLS:
        lanes = impl.LaneTable(4, 3, 4)
        a, b, c = lanes.assign(), lanes.assign(), lanes.assign()
        lanes.push_block(a, 5)
        lanes.start_decode(a, 3, 11)          # last position of its only block
        lanes.push_block(b, 6)
        lanes.push_block(b, 7)
        lanes.start_decode(b, 4, 12)          # first position of its second block
        lanes.push_block(c, 8)                # still prefilling: padded like an idle lane
        inputs = impl.DecodeInputs(4, 3)
        assert inputs.build(lanes, 9) == 2
        tables.append((inputs.input_ids.tolist(), inputs.cache_position.tolist(),
                       inputs.block_tables.tolist(), inputs.local_block_tables.tolist()))
        # one position too far for the blocks held: refused, buffers unchanged
        lanes.advance(a, 13)
        snapshot = inputs.block_tables.copy()
        with pytest.raises(StateError, match="too few for position 4"):
            inputs.build(lanes, 9)
        assert (inputs.block_tables == snapshot).all()
    assert tables[0] == tables[1]
    ids, positions, rows, local = tables[0]
    assert ids == [[11], [12], [0], [0]] and positions == [[3], [4], [0], [0]]
    assert rows == [[5, 5, 5], [6, 7, 7], [9, 9, 9], [9, 9, 9]]
    assert local == [[0], [1], [2], [3]]


def test_compiled_pool_refuses_an_owner_outside_int32_without_changing_state():
    pool = C.BlockPool(3)
    with pytest.raises(OverflowError):
        pool.allocate(C.STAGED, 2**31)
    spare = pool.reserve_spare()
    with pytest.raises(OverflowError):
        pool.stage(spare, 2**40)
    pool.check()
    assert pool.counts() == (2, 1, 0, 0, 0) and pool.state(spare) == C.SPARE


@pytest.mark.parametrize("impl", IMPLS, ids=lambda m: m.IMPLEMENTATION)
def test_sliding_slots_saturate_at_the_window(impl):
    slots = impl.SlidingSlots(2, 4)
    assert [slots.advance(0, n) for n in (3, 0, 1, 1, 2**40)] == [3, 3, 4, 4, 4]
    slots.reset(0)
    assert slots.fill(0) == 0 and slots.fill(1) == 0


# -- chunk / block combinations through the whole engine (exact ledger runtime) --------------------
def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _ledger_case(seed):
    rng = random.Random(seed)
    msl = rng.choice([24, 32, 48])
    bs = rng.choice([d for d in _divisors(msl) if d >= 2])
    chunk = rng.choice(_divisors(msl))
    batch = rng.randint(1, 3)
    hybrid = rng.random() < 0.25
    window = rng.randint(1, 12)
    spec = ledger_spec(hybrid=hybrid, window=window)
    bps = msl // bs
    choices = [batch * bps + 1]
    if bs < msl and bps + 1 <= batch * bps:
        choices.append(rng.randint(bps + 1, batch * bps))  # oversubscribed: preemption
    if batch == 1 and not hybrid:
        choices.append(bps)                                 # single-block mode
    art = ArtifactConfig(model=spec, batch_size=batch, max_seq_len=msl, block_size=bs,
                         num_blocks=rng.choice(choices), prefill_chunk_size=chunk)
    prefix = not hybrid and not art.single_block and rng.random() < 0.6
    host = bs * 8 * rng.randint(1, 4) if prefix and rng.random() < 0.5 else 0
    policy = rng.choice(["prefill-first", "decode-first", "interleave:2", "fill-first:1"])
    return rng, art, spec, window if hybrid else 0, prefix, host, policy


@pytest.mark.parametrize("seed", range(40))
def test_any_chunk_block_combination_gives_reference_tokens(seed):
    rng, art, spec, window, prefix, host, policy = _ledger_case(seed)
    batcher = Batcher(LedgerRuntime(art), prefix_cache=prefix, host_cache_bytes=host,
                      policy=policy)
    msl = art.max_seq_len
    base = [rng.randint(1, 3) for _ in range(msl)]   # small alphabet: long shared prefixes
    work = []
    for _ in range(rng.randint(2, 7)):
        length = rng.randint(1, msl - 1)
        keep = rng.randint(0, length)
        work.append((base[:keep] + [rng.randint(1, 3) for _ in range(length - keep)],
                     rng.randint(1, msl - length)))
    finals, ids = {}, {}
    while work or batcher.has_unfinished():
        if work and (rng.random() < 0.5 or not batcher.has_unfinished()):
            prompt, max_tokens = work.pop(0)
            ids[batcher.submit(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                      ignore_eos=True))] = (prompt, max_tokens)
        for out in batcher.step():
            if out.finished:
                finals[out.request_id] = out
        batcher.check_invariants()
    for request_id, (prompt, max_tokens) in ids.items():
        out = finals[request_id]
        assert out.finish_reason == "length", out.error
        assert list(out.completion.token_ids) == reference(prompt, max_tokens, spec.vocab_size,
                                                           window)


def test_config_accepts_chunks_that_do_not_divide_the_block_and_rejects_non_divisors():
    spec = ledger_spec()
    ArtifactConfig(model=spec, batch_size=2, max_seq_len=96, block_size=48, num_blocks=5,
                   prefill_chunk_size=32)
    ArtifactConfig(model=spec, batch_size=2, max_seq_len=96, block_size=32, num_blocks=7,
                   prefill_chunk_size=48)
    with pytest.raises(ConfigError, match="prefill_chunk_size=40"):
        ArtifactConfig(model=spec, batch_size=2, max_seq_len=96, block_size=48, num_blocks=5,
                       prefill_chunk_size=40)
    with pytest.raises(ConfigError, match="int16"):
        ArtifactConfig(model=spec, batch_size=1, max_seq_len=32768 * 2, block_size=2,
                       num_blocks=32768, prefill_chunk_size=16)


# -- Gemma3 parity with transformers at the sliding-window and context boundaries ------------------
@pytest.fixture(scope="module")
def gemma3_case(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_models import SLIDING_WINDOW, build_model, hf_logits, save_checkpoint

    from atombatch import ModelSpec

    path = save_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3-review"))
    model = build_model("gemma3")
    msl = 48
    rng = np.random.default_rng(5)
    cases = []
    for length in (1, SLIDING_WINDOW - 1, SLIDING_WINDOW, SLIDING_WINDOW + 1, 2 * SLIDING_WINDOW,
                   msl - 1):
        prompt = rng.integers(3, 512, size=length).tolist()
        seq = list(prompt)
        for _ in range(msl - length):   # generate up to the last position of the context
            seq.append(int(np.argmax(hf_logits(model, seq)[-1])))
        cases.append((prompt, seq[length:]))
    return path, ModelSpec.from_pretrained(path), msl, cases


@pytest.mark.parametrize("layout", [dict(chunk=16, block_size=48, num_blocks=3),
                                    dict(chunk=16, block_size=16, num_blocks=4),
                                    dict(chunk=48, block_size=16, num_blocks=7)],
                         ids=["chunk==window", "oversubscribed", "chunk>window"])
def test_gemma3_matches_transformers_at_window_and_context_edges(gemma3_case, layout):
    from atombatch.runtime import NumpyRuntime

    path, spec, msl, cases = gemma3_case
    art = ArtifactConfig(model=spec, batch_size=2, max_seq_len=msl,
                         block_size=layout["block_size"], num_blocks=layout["num_blocks"],
                         prefill_chunk_size=layout["chunk"])
    batcher = Batcher(NumpyRuntime.from_pretrained(path, artifact=art))
    done = [batcher.submit(prompt, SamplingParams(temperature=0.0, max_tokens=len(want), ignore_eos=True))
            for prompt, want in cases]
    finals = {}
    while batcher.has_unfinished():
        for out in batcher.step():
            if out.finished:
                finals[out.request_id] = out
        batcher.check_invariants()
    for request_id, (_, want) in zip(done, cases, strict=True):
        assert list(finals[request_id].completion.token_ids) == want


# -- HTTP edge cases --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http_server():
    import httpx
    from support.serving import ART, NAME, WEIGHT_SEED, ServerThread

    from atombatch.runtime.numpy_runtime import NumpyRuntime
    from atombatch.serve import create_app

    app = create_app(Batcher(NumpyRuntime.random(ART, seed=WEIGHT_SEED)), NAME)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize(("body", "status", "param", "code"), [
    ({"prompt": [5, 6], "max_tokens": 2**64 - 1}, 400, "prompt", "invalid_value"),
    ({"prompt": [5, 6], "max_tokens": 2**70}, 400, "prompt", "invalid_value"),
    ({"prompt": [5, 6], "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ({"prompt": [5, 6], "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"max_tokens": 2}, 400, "prompt", "missing_required_parameter"),
    ({"prompt": [], "max_tokens": 2}, 400, "prompt", "invalid_value"),
    ({"prompt": "", "max_tokens": 2}, 400, "prompt", "invalid_value"),
    ({"prompt": [2**63], "max_tokens": 2}, 400, "prompt", "invalid_value"),
    ({"prompt": "<99999999999999999999999>", "max_tokens": 2}, 400, "prompt", "invalid_value"),
    ({"prompt": [5], "max_tokens": 2, "top_k": -2}, 400, "top_k", "invalid_value"),
    ({"prompt": [5], "max_tokens": 2, "stop_token_ids": [-1]}, 400, "stop_token_ids",
     "invalid_value"),
    ({"prompt": [5] * 128, "max_tokens": 1}, 400, "prompt", "invalid_value"),
    ({"messages": []}, 400, "messages", "invalid_value"),
    ({"messages": [{"role": "user", "content": "<5>" * 128}]}, 400, "messages",
     "invalid_value"),
])
def test_http_rejections_carry_openai_error_bodies(http_server, body, status, param, code):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = http_server.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == code and error["message"]


def test_http_context_boundary_and_huge_seed_are_served(http_server):
    response = http_server.post("/v1/completions", json={"prompt": [5] * 127, "max_tokens": 1,
                                                         "seed": 2**64 - 1, "temperature": 0})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage == {"prompt_tokens": 127, "completion_tokens": 1, "total_tokens": 128}
    response = http_server.post("/v1/completions", content=b'{"prompt": [5], "temperature": 1e999}',
                                headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"

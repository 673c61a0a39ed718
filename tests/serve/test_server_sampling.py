"""Sampling fields over HTTP: n choices, logprobs in OpenAI's shapes, stop strings streamed through
the engine's detokenizer, and the F2 temperature regression (subnormal temperatures)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from support.numerics import f32_atol, f32_logprob_atol, reduction_length
from support.serving import ART, NAME, SPEC, WEIGHT_SEED, ServerThread, expected

from atombatch import Batcher
from atombatch.runtime.numpy_runtime import NumpyRuntime
from atombatch.serve import create_app

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    app = create_app(Batcher(NumpyRuntime.random(ART, seed=WEIGHT_SEED), prefix_cache=True), NAME)
    with ServerThread(app) as s:
        yield s


@pytest.fixture
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


LOGPROB_ATOL = 0.0   # set by reference_logprobs for the logits it computed


def reference_logprobs(tokens: list[int]) -> np.ndarray:
    """log-softmax of the full-recompute logits at every position of `tokens`."""
    logits = NumpyRuntime.random(ART, seed=WEIGHT_SEED).reference_logits(tokens).astype(np.float64)
    global LOGPROB_ATOL
    # The server's logits come from chunked prefill and decode steps, the reference's from one
    # recompute: both float32, so they differ by reordering through the model (the logit and the
    # log-sum-exp each move by that much), plus the server's float32 log-softmax.
    LOGPROB_ATOL = 2 * f32_atol(logits, reduction=reduction_length(SPEC, ART.max_seq_len),
                                depth=SPEC.num_layers + 1) + f32_logprob_atol(logits)
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def sse(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("temperature", [1e-320, 1e-310])
def test_subnormal_temperature_is_served_greedily(server: ServerThread, temperature: float) -> None:
    prompt = [5, 6, 7]
    want = expected([prompt], 6)[0]
    for stream in (False, True):
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"prompt": prompt, "max_tokens": 6, "temperature": temperature,
                             "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            chunks = sse(r.text.splitlines())
            assert all("error" not in c for c in chunks)
            ids = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
        else:
            ids = r.json()["choices"][0]["token_ids"]
        assert ids == want


def test_n_choices_in_one_response(server: ServerThread, client: openai.OpenAI) -> None:
    prompt = list(range(3, 60))
    want = expected([prompt], 5)[0]
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.model_extra["token_ids"] == want for c in out.choices)
    assert out.usage is not None and out.usage.completion_tokens == 15
    assert out.usage.prompt_tokens == len(prompt)
    # seeded sampled choices: streamed per index, equal to the whole response with the same seed
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 4, "n": 2}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    finishes = {}
    for chunk in sse(r.text.splitlines()):
        for choice in chunk["choices"]:
            streamed[choice["index"]].extend(choice["token_ids"])
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert streamed == {c["index"]: c["token_ids"] for c in whole["choices"]}
    assert finishes == {0: "length", 1: "length"}


def test_completion_logprobs_match_the_model(server: ServerThread) -> None:
    prompt = [9, 10, 11, 12]
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 3})
    choice = r.json()["choices"][0]
    ids = choice["token_ids"]
    lp = choice["logprobs"]
    ref = reference_logprobs(prompt + ids)
    assert lp["tokens"] == [f"<{t}>" for t in ids]
    assert lp["text_offset"] == [sum(len(f"<{t}>") for t in ids[:i]) for i in range(len(ids))]
    for i, token in enumerate(ids):
        row = ref[len(prompt) - 1 + i]
        assert lp["token_logprobs"][i] == pytest.approx(row[token], abs=LOGPROB_ATOL)
        top = np.argsort(-row)[:3]
        assert list(lp["top_logprobs"][i]) == [f"<{t}>" for t in top]


def test_chat_logprobs_with_the_openai_client(server: ServerThread,
                                               client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=NAME, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
        messages=[{"role": "user", "content": "<20><21><22>"}])
    choice = out.choices[0]
    ids = choice.model_extra["token_ids"]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    ref = reference_logprobs([20, 21, 22] + ids)
    for i, entry in enumerate(choice.logprobs.content):
        assert entry.token == f"<{ids[i]}>" and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(ref[2 + i, ids[i]], abs=LOGPROB_ATOL)
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == f"<{ids[i]}>"
    stream = client.chat.completions.create(
        model=NAME, max_tokens=4, temperature=0, logprobs=True, stream=True,
        messages=[{"role": "user", "content": "<20><21><22>"}])
    streamed = [e.logprob for chunk in stream for c in chunk.choices
                if c.logprobs is not None and c.logprobs.content for e in c.logprobs.content]
    assert streamed == [e.logprob for e in choice.logprobs.content]
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "<5>"}], "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_sampling_extensions_are_mapped(server: ServerThread) -> None:
    prompt = [30, 31, 32]
    want = expected([prompt], 4)[0]
    banned = want[0]
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "logit_bias": {str(banned): -100}})
    assert r.json()["choices"][0]["token_ids"][0] != banned
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "allowed_token_ids": [40, 41]})
    assert set(r.json()["choices"][0]["token_ids"]) <= {40, 41}
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "min_tokens": 4,
        "stop_token_ids": [want[1]]})
    choice = r.json()["choices"][0]
    assert len(choice["token_ids"]) == 4 and want[1] not in choice["token_ids"]
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "stop_token_ids": [want[1]]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == want[1]


def test_stop_strings_stream_through_the_engine_detokenizer(tmp_path: Any) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(SPEC.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    prompt = [10, 11, 12]
    want = expected([prompt], 10)[0]
    # the continuation's text as it reads after the prompt (WordLevel joins words with spaces)
    full = tok.decode(prompt + want)[len(tok.decode(prompt)):]
    assert full.startswith(" w")
    # a stop string from the end of token 2's word into token 3's word
    second = full.index(f"w{want[2]}", len(tok.decode(prompt + want[:2])) - len(tok.decode(prompt)))
    stop = full[second + len(f"w{want[2]}") - 1: second + len(f"w{want[2]}") + 3]
    cut = full.index(stop)
    batcher = Batcher(NumpyRuntime.random(ART, seed=WEIGHT_SEED))
    with ServerThread(create_app(batcher, NAME, tok)) as s, \
            openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0) as client:
        assert batcher.tokenizer is tok
        parts = []
        finish = stop_reason = None
        for chunk in client.completions.create(model=NAME, prompt="w10 w11 w12", max_tokens=10,
                                               temperature=0, stop=[stop], stream=True):
            for c in chunk.choices:
                parts.append(c.text)
                assert stop not in "".join(parts)
                finish = c.finish_reason or finish
                stop_reason = c.model_extra.get("stop_reason") or stop_reason
        assert "".join(parts) == full[:cut]
        assert finish == "stop" and stop_reason == stop
        out = client.completions.create(model=NAME, prompt="w10 w11 w12", max_tokens=10,
                                        temperature=0, stop=stop,
                                        extra_body={"include_stop_str_in_output": True})
        assert out.choices[0].text == full[:cut + len(stop)]

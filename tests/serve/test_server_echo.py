"""`echo` on /v1/completions: loglikelihood scoring as lm-evaluation-harness asks a vLLM server.

lm-eval's `local-completions` sends a batch of token-id prompts (context + continuation) with
`echo: true, logprobs: 1, temperature: 0, max_tokens: 1` (or 0) and sums
`token_logprobs[ctxlen:-1]`, calling the continuation greedy when each of its tokens' logprob is
the top one of `top_logprobs`. The values are checked against transformers' log-softmax of its
full-sequence logits on a tiny random Llama checkpoint (one forward pass, no cache), the streamed
form against the whole one, and the refusal on a prefill graph that keeps only the last
position's logits (the emulated rebel SDK with `logits_to_keep=1`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fakerebel.compiler import compile_dir
from support.hf_models import build_model, hf_logits, save_checkpoint
from support.numerics import f32_logprob_atol
from support.served import ServerThread

from atombatch import ArtifactConfig, Batcher, ModelSpec
from atombatch.runtime import NumpyRuntime, RebelRuntime
from atombatch.serve import create_app

pytestmark = pytest.mark.numerics

NAME = "echo-test"
RNG = np.random.default_rng(5)
CONTEXTS = [RNG.integers(3, 512, size=n).tolist() for n in (19, 6)]
CONTINUATIONS = [RNG.integers(3, 512, size=n).tolist() for n in (4, 1)]


def artifact(spec: ModelSpec) -> ArtifactConfig:
    return ArtifactConfig(model=spec, batch_size=4, max_seq_len=128, block_size=16,
                          prefill_chunk_size=8, num_blocks=4 * 8 + 1)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Any, Path]]:
    path = save_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    spec = ModelSpec.from_pretrained(path)
    runtime = NumpyRuntime.from_pretrained(path, artifact=artifact(spec))
    with ServerThread(create_app(Batcher(runtime, max_waiting=16), NAME)) as server:
        yield server, build_model("llama"), path


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def lm_eval_parse(choice: dict[str, Any], ctxlen: int) -> tuple[float, bool]:
    """What lm-eval's LocalCompletionsAPI.parse_logprobs computes from one choice."""
    values = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    greedy = all(value == max(top.values()) for value, top in zip(values, tops, strict=True))
    return sum(values), greedy


def check_prompt_part(logprobs: dict[str, Any], prompt: list[int], ref: np.ndarray,
                      k: int = 1) -> None:
    """Every prompt position against transformers: the token's logprob, the top-1 candidate."""
    atol = f32_logprob_atol(ref)
    n = len(prompt)
    assert logprobs["tokens"][:n] == [f"<{t}>" for t in prompt]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"][:n] == [sum(len(f"<{t}>") for t in prompt[:i])
                                           for i in range(n)]
    for i in range(1, n):
        row = ref[i - 1]  # the logits at i - 1 predict prompt token i
        assert abs(logprobs["token_logprobs"][i] - row[prompt[i]]) < atol + 2e-4, i
        top = logprobs["top_logprobs"][i]
        assert f"<{prompt[i]}>" in top and top[f"<{prompt[i]}>"] == logprobs["token_logprobs"][i]
        best = int(np.argmax(row))
        if np.sort(row)[-1] - np.sort(row)[-2] > 1e-3:
            assert f"<{best}>" in top and abs(top[f"<{best}>"] - row[best]) < atol + 2e-4
        assert k <= len(top) <= k + 1  # the top k, and the prompt token if not among them


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_request(llama: Any, max_tokens: int) -> None:
    server, model, _ = llama
    prompts = [c + x for c, x in zip(CONTEXTS, CONTINUATIONS, strict=True)]
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": NAME, "prompt": prompts, "temperature": 0, "max_tokens": max_tokens,
        "logprobs": 1, "seed": 1234, "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for choice, prompt, context in zip(choices, prompts, CONTEXTS, strict=True):
        ref = log_softmax(hf_logits(model, prompt))
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + max_tokens
        check_prompt_part(lp, prompt, ref)
        prompt_text = "".join(f"<{t}>" for t in prompt)
        assert choice["text"].startswith(prompt_text)
        if max_tokens == 0:
            assert choice["text"] == prompt_text and choice["token_ids"] == []
            assert choice["finish_reason"] == "length"
            continue
        # the generated token is the greedy one, its logprob that of the last position
        generated = int(np.argmax(ref[-1]))
        assert choice["token_ids"] == [generated]
        assert choice["text"] == prompt_text + f"<{generated}>"
        assert abs(lp["token_logprobs"][-1] - ref[-1, generated]) < f32_logprob_atol(ref) + 2e-4
        # lm-eval's arithmetic on it: the continuation's loglikelihood and greediness
        ctxlen = len(context)
        total, greedy = lm_eval_parse(choice, ctxlen)
        cont = list(range(ctxlen, len(prompt)))
        want = sum(ref[p - 1, prompt[p]] for p in cont)
        assert abs(total - want) < len(cont) * (f32_logprob_atol(ref) + 2e-4)
        want_greedy = all(int(np.argmax(ref[p - 1])) == prompt[p] for p in cont)
        assert greedy == want_greedy
    usage = body["usage"]
    assert usage["prompt_tokens"] == sum(map(len, prompts))
    assert usage["completion_tokens"] == 2 * max_tokens


def test_streamed_echo_equals_the_whole_response(llama: Any) -> None:
    server, model, _ = llama
    prompt = CONTEXTS[0]
    request = {"prompt": prompt, "temperature": 0, "max_tokens": 3, "logprobs": 2, "echo": True,
               "ignore_eos": True}
    whole = httpx.post(f"{server.url}/v1/completions", timeout=120, json=request).json()
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={**request, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [c for e in events for c in e["choices"]]
    assert choices[0]["text"].startswith("".join(f"<{t}>" for t in prompt))
    assert "".join(c["text"] for c in choices) == whole["choices"][0]["text"]
    streamed = {key: [v for c in choices for v in c["logprobs"][key]]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert streamed == whole["choices"][0]["logprobs"]
    check_prompt_part(streamed, prompt, log_softmax(hf_logits(model, prompt)), 2)
    assert choices[-1]["finish_reason"] == "length"


def test_echo_without_logprobs_and_refusals(llama: Any) -> None:
    server, model, _ = llama
    prompt = CONTEXTS[1]
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": prompt, "temperature": 0, "max_tokens": 2, "echo": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None
    assert choice["text"] == "".join(f"<{t}>" for t in prompt + choice["token_ids"])
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "echo" in r.json()["error"]["message"]
    # the client's own prompt_logprobs next to echo keep their own k
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 3, "prompt_logprobs": 0})
    choice = r.json()["choices"][0]
    assert all(len(e) == 1 for e in choice["prompt_logprobs"][1:])
    assert all(len(t) >= 3 for t in choice["logprobs"]["top_logprobs"][1:])


def test_text_prompt_is_echoed_as_sent(tmp_path: Path) -> None:
    from support.templates import QWEN3
    from support.templates import save_checkpoint as save_tokenizer

    from atombatch.serve.tokens import HFCodec

    hf = save_tokenizer(tmp_path, QWEN3, None, "<|im_end|>")
    spec = ModelSpec(name=NAME, family="qwen3", vocab_size=512, hidden_size=64,
                     intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, eos_token_ids=(2,), dtype="float32")
    art = ArtifactConfig(model=spec, batch_size=2, max_seq_len=128, block_size=128,
                         num_blocks=3, prefill_chunk_size=16)
    text = "the weather in Seoul is humid today"
    ids = hf(text, add_special_tokens=False)["input_ids"]
    ref = log_softmax(NumpyRuntime.random(art, seed=3).reference_logits(ids))
    app = create_app(Batcher(NumpyRuntime.random(art, seed=3)), NAME, HFCodec.from_dir(tmp_path))
    with ServerThread(app) as server:
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == text
    lp = choice["logprobs"]
    assert lp["tokens"] == [hf.decode([t]) for t in ids]
    assert "".join(lp["tokens"]) == text
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]]) < f32_logprob_atol(ref) + 2e-4
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                                 "total_tokens": len(ids)}


def test_a_graph_that_keeps_only_the_last_logits_refuses_echo_logprobs(
        fake_rebel: Any, llama: Any, tmp_path: Path) -> None:
    _, _, path = llama
    directory = compile_dir(tmp_path / "compiled", path, batch_size=2, max_seq_len=128,
                            prefill_chunk_size=16, kvcache_num_blocks=3, logits_to_keep=1)
    app = create_app(Batcher(RebelRuntime.from_optimum(directory)), NAME)
    with ServerThread(app) as server:
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": CONTEXTS[1], "max_tokens": 1, "echo": True, "logprobs": 1})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "echo"
        assert "logits_to_keep=1" in error["message"] and "echo=true" in error["message"]
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": CONTEXTS[1], "max_tokens": 1, "echo": True, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].startswith("".join(f"<{t}>" for t in CONTEXTS[1]))


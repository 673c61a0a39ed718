"""vLLM's operational surface: /tokenize, /detokenize, /version, /tokenizer_info, --api-key, the
`vllm serve` flag spellings, and fields that would change the result being refused, not dropped.

Token ids are checked against the tokenizer itself (transformers' `AutoTokenizer` on a
checkpoint written by transformers) and the shapes against vLLM's (`count`, `max_model_len`,
`tokens`, `token_strs`; `prompt`; `version`; the tokenizer config with `tokenizer_class`).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.served import ServerThread
from support.templates import QWEN3, save_checkpoint

from atombatch import ArtifactConfig, Batcher, ConfigError, ModelSpec, __version__
from atombatch.runtime.numpy_runtime import NumpyRuntime
from atombatch.serve import create_app
from atombatch.serve.auth import BearerAuth
from atombatch.serve.cli import parser
from atombatch.serve.tokens import HFCodec
from atombatch.serve.unhonoured import UNHONOURED

NAME = "surface-test"
KEY = "sk-test-0123456789"
SPEC = ModelSpec(name=NAME, family="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, eos_token_ids=(2,),
                 dtype="float32")
ART = ArtifactConfig(model=SPEC, batch_size=2, max_seq_len=256, block_size=256, num_blocks=3,
                     prefill_chunk_size=64)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Any]]:
    path = tmp_path_factory.mktemp("tok")
    hf = save_checkpoint(path, QWEN3, None, "<|im_end|>")
    app = create_app(Batcher(NumpyRuntime.random(ART, seed=1)), NAME, HFCodec.from_dir(path),
                     api_keys=[KEY, "second-key"])
    with ServerThread(app) as server:
        yield server, hf


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_tokenize_and_detokenize_as_vllm(served: tuple[ServerThread, Any]) -> None:
    server, hf = served
    text = "the weather in Seoul is humid"
    r = httpx.post(f"{server.url}/tokenize", json={"model": NAME, "prompt": text,
                                                   "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = hf(text)["input_ids"]
    assert body == {"count": len(ids), "max_model_len": ART.max_seq_len, "tokens": ids,
                    "token_strs": hf.convert_ids_to_tokens(ids)}
    messages = [{"role": "user", "content": "Weather in Seoul?"}]
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages})
    want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want = want if isinstance(want, list) else want["input_ids"]
    assert r.json()["tokens"] == list(want) and r.json()["token_strs"] is None
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": hf.decode(ids)}
    # refusals name the field
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": [5, SPEC.vocab_size]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[1]"
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "x", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "weather " * 300})
    assert r.status_code == 400 and "max_model_len=256" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/tokenize", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_version_and_tokenizer_info(served: tuple[ServerThread, Any]) -> None:
    server, hf = served
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["tokenizer_class"] and info["eos_token"] == "<|im_end|>"
    assert info["chat_template"] == QWEN3
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)


def test_api_key_guards_v1_only(served: tuple[ServerThread, Any]) -> None:
    server, _ = served
    body = {"prompt": [5, 6], "max_tokens": 2}
    for headers in ({}, auth("wrong"), {"Authorization": KEY}, auth(KEY + "x"), auth(" " + KEY)):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    for key in (KEY, "second-key"):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth(key))
        assert r.status_code == 200, r.text
    for path in ("/health", "/metrics", "/version", "/tokenizer_info"):
        assert httpx.get(f"{server.url}{path}").status_code == 200, path
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as sdk:
        assert sdk.models.list().data[0].id == NAME
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0) as sdk, \
            pytest.raises(openai.AuthenticationError):
        sdk.models.list()


def test_bad_keys_are_config_errors() -> None:
    for keys in ([], [""], [" padded "], ["x" * 5000]):
        with pytest.raises(ConfigError, match="--api-key"):
            BearerAuth(lambda *a: None, keys)  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "value"), [
    ("return_tokens_as_token_ids", True),
    ("logits_processors", ["my.module:Processor"]),
    ("vllm_xargs", {"k": 1}),
    ("reasoning_effort", "high"),
    ("prompt_embeds", "AAAA"),
    ("top_logprobs", 3),
])
def test_fields_that_change_results_are_refused_not_dropped(
        served: tuple[ServerThread, Any], field: str, value: Any) -> None:
    server, _ = served
    r = httpx.post(f"{server.url}/v1/completions", headers=auth(),
                   json={"prompt": [5, 6], "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == "unsupported_value"
    assert UNHONOURED[field][1] in error["message"]


def test_a_text_prompt_gets_the_tokenizers_special_tokens_as_in_vllm() -> None:
    """A Llama-style tokenizer adds BOS to a text prompt (vLLM's `add_special_tokens=True`
    default for completions): the engine sees [BOS] + the text's ids, the usage counts them,
    /tokenize agrees, `add_special_tokens: false` leaves them out, and the chat template's
    output (which writes its own specials) refuses the field."""
    from support.structured import BOS, byte_tokenizer
    from tokenizers import processors

    tok = byte_tokenizer()
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A",
                                                       special_tokens=[(BOS, bos)])
    art = ArtifactConfig(model=SPEC, batch_size=2, max_seq_len=256, block_size=256,
                         num_blocks=3, prefill_chunk_size=64)
    app = create_app(Batcher(NumpyRuntime.random(art, seed=1)), NAME, HFCodec(tok))
    text = "the weather in Seoul is humid"
    plain = tok.encode(text, add_special_tokens=False).ids
    assert tok.encode(text).ids == [bos, *plain]
    with ServerThread(app) as server:
        def complete(**extra: Any) -> dict[str, Any]:
            r = httpx.post(f"{server.url}/v1/completions", json={
                "prompt": text, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra})
            assert r.status_code == 200, r.text
            return r.json()

        def ids_of(prompt: list[int]) -> list[int]:
            r = httpx.post(f"{server.url}/v1/completions", json={
                "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
            return r.json()["choices"][0]["token_ids"]

        default = complete()
        assert default["usage"]["prompt_tokens"] == len(plain) + 1
        assert default["choices"][0]["token_ids"] == ids_of([bos, *plain])
        r = httpx.post(f"{server.url}/tokenize", json={"prompt": text})
        assert r.json()["tokens"] == [bos, *plain]
        without = complete(add_special_tokens=False)
        assert without["usage"]["prompt_tokens"] == len(plain)
        assert without["choices"][0]["token_ids"] == ids_of(plain)
        r = httpx.post(f"{server.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "add_special_tokens": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"


def test_harmless_values_and_unknown_fields_still_pass(served: tuple[ServerThread, Any]) -> None:
    server, _ = served
    r = httpx.post(f"{server.url}/v1/completions", headers=auth(), json={
        "prompt": [5, 6], "max_tokens": 2, "return_tokens_as_token_ids": False,
        "spaces_between_special_tokens": True, "add_special_tokens": False, "store": True,
        "metadata": {"a": "b"}, "priority": 0})
    assert r.status_code == 200, r.text
    ignored = r.headers["x-ignored-fields"]
    assert "store" in ignored and "return_tokens_as_token_ids" in ignored
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=auth(), json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def parse(*argv: str) -> argparse.Namespace:
    return parser().parse_args(list(argv))


def test_vllm_flag_spellings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                             capsys: Any) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    a = parse(str(tmp_path), "--max-model-len", "2048", "--max-num-seqs", "8",
              "--served-model-name", "koni", "--enable-prefix-caching", "--api-key", KEY)
    b = parse("--model", str(tmp_path), "--max-seq-len", "2048", "--batch-size", "8",
              "--served-model-name", "koni", "--prefix-cache", "--api-key", KEY)
    for name in ("model", "max_seq_len", "batch_size", "served_model_name", "prefix_cache",
                 "api_key", "device"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.model == str(tmp_path) and a.served_model_name == "koni" and a.device == "0"
    assert parse("--runtime", "rebel", "--tensor-parallel-size", "4").device == "0,1,2,3"
    assert parse("--runtime", "rebel", "-tp", "2", "--device", "2,3").device == "2,3"
    assert parse("--tensor-parallel-size", "1").device == "0"
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert parse().api_key == ["from-env"]
    assert parse("--api-key", "flag").api_key == ["flag"]
    for argv, words in [
        (("--tensor-parallel-size", "2"), "tensor parallel needs --runtime rebel"),
        (("--runtime", "rebel", "-tp", "2", "--device", "0"), "different device counts"),
        (("m1", "--model", "m2"), "give one"),
        (("--served-model-name", "a", "b"), "serves one name"),
        (("--enable-auto-tool-choice",), "needs --tool-call-parser"),
        (("--tool-call-parser", "mistral"), "invalid choice"),
    ]:
        with pytest.raises(SystemExit) as info:
            parse(*argv)
        assert info.value.code == 2
        assert words in capsys.readouterr().err, argv
    assert parse("--enable-tokenizer-info-endpoint").enable_tokenizer_info_endpoint
    assert parse("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                 "--reasoning-parser", "qwen3").tool_call_parser == "hermes"


def test_the_command_line_in_vllm_spelling_scores_prompts_in_the_core_process() -> None:
    """`python -m atombatch.serve` as `vllm serve` is spelled (engine core in its own process):
    the key guards /v1, the names and shapes are the flags', and an lm-eval loglikelihood
    request returns the prompt's logprobs, equal to a full recompute of the same weights."""
    import numpy as np
    from support.numerics import f32_logprob_atol
    from support.served import served

    from atombatch.serve.cli import DEFAULT_SPEC

    with served("--max-model-len", "256", "--max-num-seqs", "2", "--served-model-name", "tiny",
                "--api-key", KEY) as (url, _):
        assert httpx.get(f"{url}/v1/models").status_code == 401
        card = httpx.get(f"{url}/v1/models", headers=auth()).json()["data"][0]
        assert card["id"] == "tiny" and card["max_model_len"] == 256
        assert card["atombatch"]["batch_size"] == 2
        assert card["atombatch"]["engine_core"]["mode"] == "process"
        prompt = [7, 300, 12, 901, 44, 5]
        r = httpx.post(f"{url}/v1/completions", headers=auth(), timeout=60, json={
            "model": "tiny", "prompt": [prompt], "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0})
        assert r.status_code == 200, r.text
        logprobs = r.json()["choices"][0]["logprobs"]
    art = ArtifactConfig(model=DEFAULT_SPEC, batch_size=2, max_seq_len=256, block_size=256,
                         num_blocks=3, prefill_chunk_size=128)
    logits = NumpyRuntime.random(art, seed=0).reference_logits(prompt).astype(np.float64)
    ref = logits - logits.max(axis=1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(axis=1, keepdims=True))
    assert logprobs["token_logprobs"][0] is None and len(logprobs["tokens"]) == len(prompt) + 1
    for i in range(1, len(prompt)):
        assert abs(logprobs["token_logprobs"][i] - ref[i - 1, prompt[i]]) < \
            f32_logprob_atol(logits) + 2e-4


def test_an_empty_model_is_the_served_model_as_in_vllm(served: tuple[ServerThread, Any]) -> None:
    """Review: vLLM takes `"model": ""` as the base model (`_is_model_supported`: an empty name
    is supported) and answers with the served name; atombatch answered 404 model_not_found."""
    server, _ = served
    r = httpx.post(f"{server.url}/v1/completions", headers=auth(),
                   json={"model": "", "prompt": [5, 6], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == NAME
    r = httpx.post(f"{server.url}/tokenize", json={"model": "", "prompt": "x"})
    assert r.status_code == 200, r.text

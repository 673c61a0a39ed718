"""One request, one answer, whichever engine core serves it (issue 39): the same requests against
`python -m atombatch.serve` with `--engine-core inline`, `--engine-core process` (the default)
and `--api-server-count 2` give the same text, token ids, finish reasons, stop reasons and
logprobs. The cases are the ones whose text is made from the request's own params (special
tokens shown or not, `spaces_between_special_tokens`, stop strings, logprob token strings), and
the ones whose shape is easy to get wrong in one path only (n > 1, a tool call cut by
`max_tokens`, structured output, echo). Each case also checks its answer against the tokenizer
itself, so three modes wrong in the same way fail too.

The model is the suite's random Qwen3 with its byte-level BPE (tests/support/structured.py:
ids 0..2 are the special `<|pad|>`, `<|bos|>`, `<|eos|>`); requests are seeded or greedy.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.served import served
from support.structured import checkpoint_dir

MODES = {"inline": ("--engine-core", "inline"), "process": ("--engine-core", "process"),
         "fronts": ("--api-server-count", "2")}
# A short template (the suite's model has 512 positions): roles, the tools' names, the prompt.
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n"
            "{% endif %}{% if add_generation_prompt %}assistant:{% endif %}")
SPECIALS = {0: "<|pad|>", 1: "<|bos|>", 2: "<|eos|>"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {  # a call the random model can finish
    "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["KST", "UTC"]}}, "required": ["zone"],
        "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "yes or no?"}]
# Text of byte tokens and the specials: a sampled output that shows special tokens among text
BYTES = list(range(70, 90))
SHOWN = {"allowed_token_ids": [0, 1, 2, *BYTES], "logit_bias": {"0": 2.0, "1": 2.0},
         "temperature": 1.0, "seed": 11, "max_tokens": 24, "min_tokens": 20}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = checkpoint_dir(tmp_path_factory.mktemp("protocol-modes"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model / "tokenizer.json"))


@pytest.fixture(scope="module")
def urls(model: Path) -> Iterator[dict[str, str]]:
    """The three servers, up at once (each case asks all three)."""
    with contextlib.ExitStack() as stack:
        found = {}
        for mode, flags in MODES.items():
            url, _ = stack.enter_context(served(
                "--model", str(model), "--max-model-len", "512", "--batch-size", "4",
                "--served-model-name", "tiny", *flags))
            found[mode] = url
        yield found


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def streamed(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = httpx.post(f"{url}{path}", json={**body, "stream": True}, timeout=120)
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert r.text.rstrip().endswith("data: [DONE]")
    return events


def answer(response: dict[str, Any]) -> dict[str, Any]:
    """What must be equal across modes: the choices (ordered by index) and the usage; ids and
    times differ."""
    choices = sorted(response["choices"], key=lambda c: c["index"])
    for choice in choices:
        for call in (choice.get("message") or {}).get("tool_calls") or []:
            call.pop("id")  # random per call
    return {"choices": choices, "usage": response["usage"],
            "prompt_logprobs": response.get("prompt_logprobs")}


def joined(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """A stream's choices put back together: text (or content / reasoning / tool-call
    arguments), token ids, the finish and stop reasons, the logprobs' tokens."""
    out: dict[int, dict[str, Any]] = {}
    for event in events:
        for choice in event["choices"]:
            c = out.setdefault(choice["index"], {"text": "", "token_ids": [], "calls": {},
                                                 "finish_reason": None, "stop_reason": None,
                                                 "logprobs": []})
            delta = choice.get("delta") or {}
            c["text"] += choice.get("text") or delta.get("content") or ""
            c["token_ids"] += choice.get("token_ids") or []
            for call in delta.get("tool_calls") or []:
                entry = c["calls"].setdefault(call["index"], {"name": None, "arguments": ""})
                function = call.get("function") or {}
                entry["name"] = entry["name"] or function.get("name")
                entry["arguments"] += function.get("arguments") or ""
            logprobs = choice.get("logprobs")
            if logprobs:
                c["logprobs"] += logprobs.get("content") or logprobs.get("tokens") or []
            if choice.get("finish_reason") is not None:
                c["finish_reason"] = choice["finish_reason"]
                c["stop_reason"] = choice.get("stop_reason")
    return out


def same_everywhere(urls: dict[str, str], path: str, body: dict[str, Any],
                    stream: bool = False) -> Any:
    """The request's answer in every mode; asserts they are equal and returns it."""
    if stream:
        got = {mode: joined(streamed(url, path, body)) for mode, url in urls.items()}
    else:
        got = {mode: answer(post(url, path, body)) for mode, url in urls.items()}
    first = got["inline"]
    for mode, value in got.items():
        assert value == first, f"{mode} differs from inline for {body}"
    return first


# -- text from the request's own params ----------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("skip", "spaces"), [(True, True), (False, True), (False, False)])
def test_special_tokens_shown_or_skipped_as_the_request_asks(
        urls: dict[str, str], tokenizer: Any, skip: bool, spaces: bool, stream: bool) -> None:
    body = {"prompt": "yes no", **SHOWN, "skip_special_tokens": skip,
            "spaces_between_special_tokens": spaces}
    got = same_everywhere(urls, "/v1/completions", body, stream)
    choice = got[0] if stream else got["choices"][0]
    ids = choice["token_ids"]
    assert any(t in SPECIALS for t in ids[:-1]), ids  # the case shows special tokens at all
    shown = ids[:-1] if choice["finish_reason"] == "stop" else ids  # the stop id: never text
    assert choice["text"] == tokenizer.decode(shown, skip_special_tokens=skip)
    assert ("<|pad|>" in choice["text"] or "<|bos|>" in choice["text"]) is not skip


def test_the_stop_id_is_not_text_unless_include_stop_str_in_output(
        urls: dict[str, str], tokenizer: Any) -> None:
    """vLLM leaves the id that ended a request (EOS, a stop id) out of the text, also when
    special tokens are shown; `include_stop_str_in_output` keeps it."""
    base = {"prompt": "yes no", "allowed_token_ids": [0, *BYTES], "temperature": 1.0,
            "seed": 3, "max_tokens": 30, "stop_token_ids": [0], "skip_special_tokens": False}
    for include in (False, True):
        got = same_everywhere(urls, "/v1/completions",
                              {**base, "include_stop_str_in_output": include})
        [choice] = got["choices"]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == 0, choice
        ids = choice["token_ids"]
        assert ids[-1] == 0
        kept = ids if include else ids[:-1]
        assert choice["text"] == tokenizer.decode(kept, skip_special_tokens=False)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(urls: dict[str, str], tokenizer: Any, include: bool,
                      stream: bool) -> None:
    free = post(urls["inline"], "/v1/completions",
                {"prompt": "yes no", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                 "allowed_token_ids": BYTES})["choices"][0]["text"]
    stop = free[12:14]
    at = free.index(stop)
    body = {"prompt": "yes no", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "allowed_token_ids": BYTES, "stop": [stop, "never written"],
            "include_stop_str_in_output": include}
    got = same_everywhere(urls, "/v1/completions", body, stream)
    choice = got[0] if stream else got["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == free[:at + len(stop) if include else at]


def test_completion_logprobs_and_their_token_strings(urls: dict[str, str], tokenizer: Any
                                                      ) -> None:
    body = {"prompt": "yes no", **SHOWN, "logprobs": 3, "skip_special_tokens": False}
    got = same_everywhere(urls, "/v1/completions", body)
    logprobs = got["choices"][0]["logprobs"]
    ids = got["choices"][0]["token_ids"]
    assert logprobs["tokens"] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert all(len(top) <= 3 for top in logprobs["top_logprobs"])
    assert same_everywhere(urls, "/v1/completions", body, stream=True)[0]["logprobs"] == \
        logprobs["tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_with_top_logprobs(urls: dict[str, str], stream: bool) -> None:
    body = {"messages": MESSAGES, **SHOWN, "logprobs": True, "top_logprobs": 4}
    got = same_everywhere(urls, "/v1/chat/completions", body, stream)
    content = got[0]["logprobs"] if stream else got["choices"][0]["logprobs"]["content"]
    assert content and all(len(entry["top_logprobs"]) == 4 for entry in content)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_choices(urls: dict[str, str], stream: bool) -> None:
    body = {"prompt": "yes no", **SHOWN, "n": 3, "skip_special_tokens": False, "logprobs": 1}
    got = same_everywhere(urls, "/v1/completions", body, stream)
    assert len(got if stream else got["choices"]) == 3


# -- the shapes of chat answers -------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_tool_call_cut_by_max_tokens_reports_length(urls: dict[str, str], choice: str,
                                                      stream: bool) -> None:
    tool_choice: Any = {"type": "function", "function": {"name": "get_weather"}} \
        if choice == "named" else "required"
    body = {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": tool_choice,
            "max_tokens": 16, "temperature": 0}
    got = same_everywhere(urls, "/v1/chat/completions", body, stream)
    if stream:
        assert got[0]["finish_reason"] == "length"
        [call] = got[0]["calls"].values()
        assert call["name"] == "get_weather"
        with pytest.raises(json.JSONDecodeError):
            json.loads(call["arguments"])
        return
    [answer_] = got["choices"]
    assert answer_["finish_reason"] == "length"
    message = answer_["message"]
    if choice == "named":  # the call as far as written (vLLM's)
        [call] = message["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        with pytest.raises(json.JSONDecodeError):
            json.loads(call["function"]["arguments"])
    else:  # the array does not validate: no call, empty content (vLLM's)
        assert not message.get("tool_calls") and message["content"] == ""
    if choice == "required":  # (the random model pads a whole array with whitespace)
        return
    # a whole named call: "stop" (OpenAI's and vLLM's; tests/serve/test_tool_parsers.py has
    # "tool_calls" for the others)
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = same_everywhere(urls, "/v1/chat/completions", {
        **body, "tools": [TIME], "tool_choice": named, "max_tokens": 120})
    assert whole["choices"][0]["finish_reason"] == "stop"
    [call] = whole["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["zone"] in ("KST", "UTC")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_structured_output(urls: dict[str, str], stream: bool) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    body = {"messages": MESSAGES, "max_tokens": 60, "temperature": 1.0, "seed": 5,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "answer", "schema": schema}}}
    got = same_everywhere(urls, "/v1/chat/completions", body, stream)
    text = got[0]["text"] if stream else got["choices"][0]["message"]["content"]
    assert isinstance(json.loads(text)["ok"], bool)


@pytest.mark.parametrize("max_tokens", [0, 2])
def test_echo(urls: dict[str, str], max_tokens: int) -> None:
    body = {"prompt": "yes no yes", "echo": True, "logprobs": 1, "max_tokens": max_tokens,
            "temperature": 0}
    got = same_everywhere(urls, "/v1/completions", body)
    choice = got["choices"][0]
    assert choice["text"].startswith("yes no yes")
    assert choice["logprobs"]["tokens"][0] is not None


def test_ping_answers_as_health(urls: dict[str, str]) -> None:
    for url in urls.values():
        health = httpx.get(f"{url}/health")
        for method in ("GET", "POST"):
            ping = httpx.request(method, f"{url}/ping")
            assert (ping.status_code, ping.json()) == (health.status_code, health.json()) == \
                (200, {"status": "ok"})


# -- each request is validated once --------------------------------------------------------------
@pytest.mark.parametrize("mode", ["inline", "process"])
def test_each_request_is_validated_once(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`api/validation.py` runs once per prompt, in the front: a batch's prompts before any is
    queued, a single prompt at submit; neither the inline engine's loop nor the engine core
    checks again (the core's own `validate` fails here, so a second check would fail the
    request). A bad prompt is still refused, by the front."""
    import functools

    from support.engines import numpy_batcher, trusting_batcher
    from support.served import ServerThread

    from atombatch.api import validation
    from atombatch.core.client import CoreClient
    from atombatch.serve import create_app

    calls: list[int] = []
    real = validation.validate_request

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr("atombatch.engine.batcher.validate_request", counted)
    monkeypatch.setattr("atombatch.core.client.validate_request", counted)
    engine: Any = numpy_batcher() if mode == "inline" else \
        CoreClient(functools.partial(trusting_batcher))
    with ServerThread(create_app(engine, "core-test")) as server:
        for prompt, count in (([5, 6, 7], 1), ([[5, 6], [7, 8, 9]], 2)):
            calls.clear()
            got = post(server.url, "/v1/completions",
                       {"prompt": prompt, "max_tokens": 3, "temperature": 0})
            assert [c["finish_reason"] for c in got["choices"]] == ["length"] * count
            assert len(calls) == count, (prompt, len(calls))
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5, 9999]})
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]

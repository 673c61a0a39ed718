"""What OpenAI and vLLM clients send, against the real server: unknown fields, nulls, schema
errors, vLLM's continuous usage, batched prompts, `/v1/models/{id}`, roles, and the features the
server refuses by name. Expected token ids come from a separate greedy `Batcher` on the same
weights (see test_server.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from support.serving import (
    ART,
    NAME,
    SPEC,
    WEIGHT_SEED,
    ServerThread,
    assert_blocks_released,
    expected,
    ids_of,
    make_server,
    metrics,
    wait_idle,
)

from atombatch import Batcher
from atombatch.runtime.numpy_runtime import NumpyRuntime
from atombatch.serve import create_app

IDS = [9, 8, 7, 6]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with make_server(max_waiting=64) as s:
        yield s


def post(server: ServerThread, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def sse(response: httpx.Response) -> list[dict[str, Any]]:
    events = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    assert response.text.rstrip().endswith("data: [DONE]")
    return events


# -- unknown fields --------------------------------------------------------------------------------
def test_unknown_fields_are_ignored_logged_once_and_listed(server: ServerThread,
                                                           caplog: Any) -> None:
    want = expected([IDS], 5)[0]
    body = {"prompt": IDS, "max_tokens": 5, "temperature": 0, "colour": "red",
            "stream_options": {"include_usage": True, "shiny": 1}}
    with caplog.at_level(logging.WARNING, logger="atombatch.serve"):
        for _ in range(3):
            r = post(server, "/v1/completions", body)
            assert r.status_code == 200, r.text
            assert r.headers["x-ignored-fields"] == "colour, stream_options.shiny"
            assert r.json()["choices"][0]["token_ids"] == want
        chat = post(server, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "<9><8><7><6>", "mood": "calm"},
                         {"role": "user", "content": "<5>", "mood": "tense"}],
            "max_tokens": 3, "temperature": 0, "stream": True})
        assert chat.status_code == 200
        assert chat.headers["x-ignored-fields"] == "messages[0].mood, messages[1].mood"
        assert ids_of("".join(e["choices"][0]["delta"].get("content") or ""
                              for e in sse(chat))) == expected([IDS + [5]], 3)[0]
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "atombatch.serve"]
    warned = [e for e in events if e["event"] == "request.unknown_field_ignored"]
    # colour, stream_options.shiny, messages[].mood: once each
    assert [(e["path"], e["field"]) for e in warned] == [
        ("/v1/completions", "colour"), ("/v1/completions", "stream_options.shiny"),
        ("/v1/chat/completions", "messages[].mood")], warned
    clean = post(server, "/v1/completions", {"prompt": IDS, "max_tokens": 2})
    assert "x-ignored-fields" not in clean.headers


def test_ignored_fields_are_bounded(server: ServerThread) -> None:
    from atombatch.serve.app import MAX_LISTED_FIELDS

    extra = {f"x{i:04d}": i for i in range(2000)}
    r = post(server, "/v1/completions", {"prompt": IDS, "max_tokens": 2, **extra})
    assert r.status_code == 200
    listed = r.headers["x-ignored-fields"].split(", ")
    assert listed[:MAX_LISTED_FIELDS] == [f"x{i:04d}" for i in range(MAX_LISTED_FIELDS)]
    assert listed[-1] == f"... ({2000 - MAX_LISTED_FIELDS} more)"


def test_strict_protocol_rejects_unknown_fields() -> None:
    app = create_app(Batcher(NumpyRuntime.random(ART, seed=WEIGHT_SEED), overlap=True), NAME,
                     strict_protocol=True)
    with ServerThread(app) as s:
        r = post(s, "/v1/completions", {"prompt": IDS, "max_tokens": 2, "colour": "red"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "colour"
        assert r.json()["error"]["code"] == "unknown_parameter"
        r = post(s, "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "<5>", "mood": 1}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].mood"
        card = httpx.get(f"{s.url}/v1/models").json()["data"][0]
        assert card["atombatch"]["strict_protocol"] is True


# -- nulls -----------------------------------------------------------------------------------------
NULLABLE = ["temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "seed", "stop",
            "stream", "stream_options", "user", "top_k", "stop_token_ids", "ignore_eos"]


def test_explicit_nulls_mean_the_default(server: ServerThread) -> None:
    # Completions: max_tokens null -> 16 (OpenAI's default); temperature null -> 1.0 (sampled).
    body = {"prompt": IDS, "max_tokens": None, "ignore_eos": True, "logprobs": None,
            "echo": None, "suffix": None, "best_of": None, "model": None,
            **{k: None for k in NULLABLE if k != "ignore_eos"}}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16
    # Greedy with every other optional field null gives the greedy tokens.
    want = expected([IDS], 6)[0]
    r = post(server, "/v1/completions", {**{k: None for k in NULLABLE}, "prompt": IDS,
                                         "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    # Chat: the fields the OpenAI chat API lets be null, tools and response_format included.
    chat = {"messages": [{"role": "system", "content": None},
                         {"role": "user", "content": "<9><8><7><6>", "name": None}],
            "temperature": 0, "max_tokens": None, "max_completion_tokens": 6, "logprobs": None,
            "tools": None, "tool_choice": None, "response_format": None,
            "parallel_tool_calls": None, "documents": None, "chat_template_kwargs": None,
            **{k: None for k in NULLABLE if k != "temperature"}}
    r = post(server, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert ids_of(r.json()["choices"][0]["message"]["content"]) == want
    # null is not a value for a required field
    r = post(server, "/v1/completions", {"prompt": None, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_schema_errors_are_400_for_the_openai_client(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt=IDS, max_tokens="four")  # type: ignore
    assert info.value.body["param"] == "max_tokens"
    assert info.value.body["code"] == "invalid_type"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=[{"role": "wizard", "content": "x"}])
    assert info.value.body["param"] == "messages[0].role"
    assert "wizard" in info.value.body["message"]


def test_every_4xx_reason_is_logged(server: ServerThread, caplog: Any) -> None:
    with caplog.at_level(logging.INFO, logger="atombatch.serve"):
        post(server, "/v1/completions", {"prompt": IDS, "max_tokens": 4, "temperature": -1})
        post(server, "/v1/completions", {"prompt": IDS, "max_tokens": 4, "model": "other"})
        httpx.get(f"{server.url}/v1/nowhere")
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "atombatch.serve"]
    rejected = [e for e in events if e["event"] == "request.rejected"]
    assert any((e["status"], e["code"], e["param"]) == (400, "invalid_value", "temperature")
               and "temperature=-1" in e["message"] for e in rejected), rejected
    assert any((e["status"], e["code"], e["param"]) == (404, "model_not_found", "model")
               and "'other'" in e["message"] for e in rejected)
    assert any((e["method"], e["path"], e["status"]) == ("GET", "/v1/nowhere", 404)
               for e in rejected)


# -- usage -----------------------------------------------------------------------------------------
def test_continuous_usage_stats_on_every_chunk(server: ServerThread) -> None:
    want = expected([IDS], 7)[0]
    options = {"include_usage": True, "continuous_usage_stats": True}
    r = post(server, "/v1/completions", {"prompt": IDS, "max_tokens": 7, "temperature": 0,
                                         "stream": True, "stream_options": options})
    events = sse(r)
    seen = 0
    for event in events[:-1]:
        seen += len(event["choices"][0]["token_ids"])
        assert event["usage"] == {"prompt_tokens": len(IDS), "completion_tokens": seen,
                                  "total_tokens": len(IDS) + seen}
    assert seen == len(want)
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == len(want)

    r = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "<9><8><7><6>"}], "max_tokens": 7,
        "temperature": 0, "stream": True, "stream_options": options})
    events = sse(r)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[0]["usage"]["completion_tokens"] == 0
    assert [e["usage"]["completion_tokens"] for e in events[1:-1]] == \
        list(range(1, len(want) + 1))
    # Without include_usage, continuous_usage_stats adds nothing (vLLM's rule).
    r = post(server, "/v1/completions", {"prompt": IDS, "max_tokens": 3, "stream": True,
                                         "stream_options": {"continuous_usage_stats": True}})
    assert all(e["usage"] is None for e in sse(r))


# -- batched prompts -------------------------------------------------------------------------------
def test_batched_prompts_answer_one_choice_per_prompt(server: ServerThread) -> None:
    prompts = [[5, 6, 7], [40] * 9, [3], list(range(10, 30))]
    want = expected(prompts, 8)
    r = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in choices] == want
    assert r.json()["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert r.json()["usage"]["completion_tokens"] == sum(map(len, want))
    # The same batch as strings (token-id text), streamed.
    texts = ["".join(f"<{t}>" for t in p) for p in prompts]
    r = post(server, "/v1/completions", {"prompt": texts, "max_tokens": 8, "temperature": 0,
                                         "stream": True, "stream_options": {"include_usage": True}})
    got: dict[int, list[int]] = {}
    finishes: dict[int, str] = {}
    events = sse(r)
    for event in events[:-1]:
        (choice,) = event["choices"]
        got.setdefault(choice["index"], []).extend(choice["token_ids"])
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert [got[i] for i in range(4)] == want
    assert sorted(finishes) == [0, 1, 2, 3]
    assert events[-1]["usage"]["completion_tokens"] == sum(map(len, want))
    # One bad prompt in the batch refuses the whole batch, naming it.
    r = post(server, "/v1/completions", {"prompt": [[5], [SPEC.vocab_size]], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"
    assert_blocks_released(wait_idle(server.url))


async def test_a_batch_the_queue_cannot_take_is_withdrawn_whole() -> None:
    with make_server(ART, max_waiting=1) as s:
        before = metrics(s.url)
        async with httpx.AsyncClient(timeout=60) as client:
            r = await client.post(f"{s.url}/v1/completions",
                                  json={"prompt": [[5, 6]] * 3, "max_tokens": 30})
            assert r.status_code == 429, r.text
            r = await client.post(f"{s.url}/v1/completions",
                                  json={"prompt": [[5, 6]] * 9, "max_tokens": 30})
            assert r.status_code == 400 and r.json()["error"]["code"] == "batch_too_large"
        after = wait_idle(s.url)
        assert_blocks_released(after)
        generated = after["atombatch_engine_generated_tokens_total"] - \
            before["atombatch_engine_generated_tokens_total"]
        assert generated < 30  # the queued prompt was aborted, not run to its end
        await asyncio.sleep(0)


# -- models ----------------------------------------------------------------------------------------
def test_models_by_id(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.retrieve(NAME)
    assert model.id == NAME and model.model_extra["max_model_len"] == ART.max_seq_len
    assert model.model_extra["atombatch"]["chat_template"].startswith("none")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    r = httpx.get(f"{server.url}/v1/models/org/other-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# -- what the server cannot honour -----------------------------------------------------------------
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [TOOL]}, "tool_choice"),          # auto needs --tool-call-parser
    ({"tools": [TOOL], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),  # needs a tokenizer
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"functions": [TOOL["function"]]}, "functions"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
])
def test_unservable_features_are_refused_by_name(server: ServerThread, extra: dict[str, Any],
                                                 param: str) -> None:
    body = {"messages": [{"role": "user", "content": "<5>"}], "max_tokens": 2, **extra}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("extra", [
    {"tools": [TOOL], "tool_choice": "none"},
    {"response_format": {"type": "text"}},
    {"tool_choice": "none"},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "<9><8>"},
                                               {"type": "text", "text": "<7><6>"}]}]},
])
def test_servable_forms_are_accepted(server: ServerThread, extra: dict[str, Any]) -> None:
    body = {"messages": [{"role": "user", "content": "<9><8><7><6>"}], "max_tokens": 4,
            "temperature": 0, **extra}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert ids_of(r.json()["choices"][0]["message"]["content"]) == expected([IDS], 4)[0]


# -- vLLM fields that change results ---------------------------------------------------------------
def test_truncate_prompt_tokens_keeps_the_last_tokens(server: ServerThread) -> None:
    prompt = list(range(10, 30))
    want = expected([prompt[-5:]], 6)[0]
    assert want != expected([prompt], 6)[0]  # the truncation must be visible in the tokens
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                         "truncate_prompt_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    assert r.json()["usage"]["prompt_tokens"] == 5
    r = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "".join(f"<{t}>" for t in prompt)}],
        "max_tokens": 6, "temperature": 0, "truncate_prompt_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2,
                                         "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(prompt)
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2,
                                         "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_beam_search_is_refused_and_length_penalty_accepted(server: ServerThread) -> None:
    r = post(server, "/v1/completions", {"prompt": IDS, "max_tokens": 2,
                                         "use_beam_search": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"
    r = post(server, "/v1/completions", {"prompt": IDS, "max_tokens": 4, "temperature": 0,
                                         "length_penalty": 0.5, "use_beam_search": False})
    assert r.status_code == 200 and "X-Ignored-Fields" not in r.headers
    assert r.json()["choices"][0]["token_ids"] == expected([IDS], 4)[0]


def test_the_batch_limit_counts_every_choice(server: ServerThread) -> None:
    limit = ART.batch_size + 64
    prompts = [[5, 6]] * (limit // 2 + 1)
    r = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 1, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "batch_too_large"
    assert_blocks_released(wait_idle(server.url))

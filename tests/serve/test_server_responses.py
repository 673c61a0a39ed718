"""The Responses API (`/v1/responses`) through the official openai SDK, with the engine inline and
in its own core process.

Two models stand behind the server:
- the random-weight Llama with a byte-level BPE of tests/support/structured.py: its text is
  noise, so only the `text.format` constraint makes it JSON, and only the tools' constraint
  (`tool_choice` required) makes it call a tool;
- the scripted Qwen3 of tests/support/scripted.py (hermes tool parser, qwen3 reasoning parser):
  it thinks, then calls get_weather; after a prompt holding a tool result it thinks and answers.
  What is tested is what the server makes of that text (items, events, chaining).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from support import structured as model
from support.scripted import save_tokenizer, scripted_batcher
from support.served import ServerThread
from support.templates import QWEN3

from atombatch.core.client import CoreClient
from atombatch.serve.app import create_app
from atombatch.serve.responses import MAX_INPUT_ITEMS, ResponseStore

NAME = "responses-test"
QUESTION = "What is the weather in Seoul?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "enum": ["Seoul", "Busan"]}},
                          "required": ["city"], "additionalProperties": False}}
THINKING = "\nI should call get_weather.\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Seoul"}}\n</tool_call>'
SCRIPT = f"<think>{THINKING}</think>\n\n{CALL}"
ANSWER = "It is sunny in Seoul."
REPLY = f"<think>\nThe tool answered.\n</think>{ANSWER}"
TAGS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>"]


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=150)


def engine(mode: str, factory: functools.partial[Any]) -> Any:
    """The engine of a server: built here (inline), or by its own core process from `factory`."""
    return factory() if mode == "inline" else CoreClient(factory)


@pytest.fixture(scope="module", params=["inline", "process"])
def noise(request: Any) -> Iterator[ServerThread]:
    """The random model (with a tool parser, so tools' `auto` is served)."""
    app = create_app(engine(request.param, functools.partial(model.batcher)), NAME,
                     model.byte_tokenizer(), tool_parser="hermes")
    with ServerThread(app) as server:
        yield server


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen-responses")
    save_tokenizer(path, QWEN3, "<|im_end|>", TAGS)
    return path


@pytest.fixture(scope="module", params=["inline", "process"])
def scripted(request: Any, qwen_dir: Path) -> Iterator[ServerThread]:
    from atombatch.serve.tokens import HFCodec

    factory = functools.partial(scripted_batcher, str(qwen_dir), SCRIPT,
                                (("<tool_response>", REPLY),))
    app = create_app(engine(request.param, factory), NAME, HFCodec.from_dir(qwen_dir),
                     tool_parser="hermes", reasoning_parser="qwen3")
    with ServerThread(app) as server:
        yield server


def sdk(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def chat_prompt_tokens(server: ServerThread, messages: list[dict[str, Any]],
                       **fields: Any) -> int:
    """Prompt tokens of the same conversation sent to chat completions (the same template)."""
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": NAME, "messages": messages, "max_tokens": 1, **fields})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


def items(response: Any) -> list[dict[str, Any]]:
    """Output items without their generated ids (a stream's and a whole response's compare)."""
    return [{k: v for k, v in item.model_dump(exclude_none=True).items()
             if k not in ("id", "call_id")}
            for item in response.output]


# -- text ------------------------------------------------------------------------------------------
def test_create_streamed_and_not_give_the_same_response(noise: ServerThread) -> None:
    with sdk(noise) as client:
        request: dict[str, Any] = dict(model=NAME, input="Who are you?", max_output_tokens=12,
                                       temperature=0, instructions="Answer briefly.")
        whole = client.responses.create(**request)
        assert whole.object == "response" and whole.id.startswith("resp_")
        assert whole.output_text and whole.usage is not None
        assert whole.usage.input_tokens == chat_prompt_tokens(noise, [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Who are you?"}])
        assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
        assert whole.usage.input_tokens_details.cached_tokens == 0
        events = list(client.responses.create(**request, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    last = events[-1].response  # type: ignore[union-attr]
    assert items(last) == items(whole)
    assert last.status == whole.status and last.usage == whole.usage


def test_max_output_tokens_cut_is_incomplete(noise: ServerThread) -> None:
    with sdk(noise) as client:
        request: dict[str, Any] = dict(model=NAME, input="Count.", max_output_tokens=4,
                                       temperature=0, extra_body={"ignore_eos": True})
        cut = client.responses.create(**request)
        events = list(client.responses.create(**request, stream=True))
    assert cut.status == "incomplete"
    assert cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage is not None and cut.usage.output_tokens == 4
    assert cut.max_output_tokens == 4
    assert [item.status for item in cut.output] == ["incomplete"]  # type: ignore[union-attr]
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"  # type: ignore


# -- structured output and tools on the random model --------------------------------------------
def test_text_format_json_schema_makes_the_random_model_valid(noise: ServerThread) -> None:
    schema = Person.model_json_schema()
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    with sdk(noise) as client:
        for seed in range(2):
            out = client.responses.create(model=NAME, input="Who are you?", temperature=1.0,
                                          max_output_tokens=80, text={"format": fmt},
                                          extra_body={"seed": seed})
            assert out.status == "completed", out
            jsonschema.validate(json.loads(out.output_text), schema)
        parsed = client.responses.parse(model=NAME, input="Who are you?", text_format=Person,
                                        max_output_tokens=80, temperature=0)
        assert isinstance(parsed.output_parsed, Person)
        with client.responses.stream(model=NAME, input="Who are you?", text_format=Person,
                                     max_output_tokens=80, temperature=0) as stream:
            streamed = stream.get_final_response()
        assert streamed.output_parsed == parsed.output_parsed
        free = client.responses.create(model=NAME, input="Who are you?", temperature=0,
                                       max_output_tokens=80)
    with pytest.raises(pydantic.ValidationError):  # without the format: not a Person
        Person.model_validate_json(free.output_text)


def test_required_tool_choice_calls_a_tool_and_the_result_goes_back(
        noise: ServerThread) -> None:
    with sdk(noise) as client:
        first = client.responses.create(model=NAME, input=QUESTION, tools=[WEATHER],
                                        tool_choice="required", max_output_tokens=60,
                                        temperature=0)  # type: ignore[arg-type]
        [call] = [item for item in first.output if item.type == "function_call"]
        assert call.name == "get_weather" and call.call_id
        assert json.loads(call.arguments)["city"] in ("Seoul", "Busan")
        named = client.responses.create(model=NAME, input=QUESTION, tools=[WEATHER],
                                        tool_choice={"type": "function", "name": "get_weather"},
                                        max_output_tokens=60, temperature=1.0)
        assert [item.type for item in named.output] == ["function_call"]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
        final = client.responses.create(
            model=NAME, input=[{"role": "user", "content": QUESTION},
                               call.model_dump(exclude_none=True), result],  # type: ignore
            tools=[WEATHER], tool_choice="none", max_output_tokens=5, temperature=0)
    assert [item.type for item in final.output] == ["message"]
    assert final.usage is not None
    assert final.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]


# -- previous_response_id and the store --------------------------------------------------------
def test_previous_response_id_continues_the_conversation(noise: ServerThread) -> None:
    with sdk(noise) as client:
        first = client.responses.create(model=NAME, input="Who are you?", max_output_tokens=6,
                                        temperature=0, instructions="Answer briefly.",
                                        extra_body={"ignore_eos": True})
        second = client.responses.create(model=NAME, input="And then?", max_output_tokens=6,
                                         temperature=0, previous_response_id=first.id,
                                         extra_body={"ignore_eos": True})
        again = client.responses.retrieve(first.id)
    assert second.previous_response_id == first.id
    assert second.usage is not None
    # the instructions do not carry over; the first turn's input and output do
    assert second.usage.input_tokens == chat_prompt_tokens(noise, [
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}])
    assert again.id == first.id and again.output_text == first.output_text


def test_an_unknown_unstored_or_evicted_id_is_a_400_naming_it(noise: ServerThread) -> None:
    def chained(previous: str) -> httpx.Response:
        return httpx.post(f"{noise.url}/v1/responses", timeout=60, json={
            "model": NAME, "input": "hi", "max_output_tokens": 2,
            "previous_response_id": previous})

    r = chained("resp_nowhere")
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "previous_response_id" and "resp_nowhere" in error["message"]
    unstored = httpx.post(f"{noise.url}/v1/responses", timeout=60, json={
        "model": NAME, "input": "hi", "max_output_tokens": 2, "store": False}).json()
    assert chained(unstored["id"]).status_code == 400
    assert httpx.get(f"{noise.url}/v1/responses/{unstored['id']}").status_code == 404
    store: ResponseStore = noise.app.state.responses.store
    kept = store.max_count
    store.max_count = 2
    try:
        ids = [httpx.post(f"{noise.url}/v1/responses", timeout=60, json={
            "model": NAME, "input": "hi", "max_output_tokens": 2}).json()["id"]
            for _ in range(3)]
        assert len(store) == 2
        assert chained(ids[0]).status_code == 400  # evicted, least recently used first
        assert chained(ids[2]).status_code == 200
    finally:
        store.max_count = kept


def test_the_store_is_bounded_by_bytes() -> None:
    from atombatch.serve.responses import ResponseObject

    def response(i: int) -> ResponseObject:
        return ResponseObject(
            id=f"resp_{i}", created_at=0, model=NAME, output=[], status="completed", usage=None,
            instructions=None, metadata=None, parallel_tool_calls=True, temperature=1.0,
            tool_choice="auto", tools=[], top_p=1.0, max_output_tokens=1, max_tool_calls=None,
            previous_response_id=None, reasoning=None, text=None, truncation="disabled",
            user=None)

    store = ResponseStore(max_count=100, max_bytes=4000)
    for i in range(10):
        assert store.put(response(i), [{"role": "user", "content": "x" * 500}])
    assert store.bytes <= 4000 and 0 < len(store) < 10
    assert store.get("resp_9") is not None and store.get("resp_0") is None
    assert not store.put(response(99), [{"role": "user", "content": "x" * 5000}])


# -- reasoning and tools on the scripted model --------------------------------------------------
def test_reasoning_and_a_function_call_round_trip(scripted: ServerThread, qwen_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen_dir)
    with sdk(scripted) as client:
        first = client.responses.create(model=NAME, input=QUESTION, tools=[WEATHER],
                                        temperature=0)  # type: ignore[arg-type]
        assert [item.type for item in first.output] == ["reasoning", "function_call"]
        reasoning, call = first.output
        assert reasoning.content[0].text == THINKING  # type: ignore[union-attr,index]
        assert call.name == "get_weather"  # type: ignore[union-attr]
        assert json.loads(call.arguments) == {"city": "Seoul"}  # type: ignore[union-attr]
        ids = list(hf(SCRIPT, add_special_tokens=False)["input_ids"])
        start, end = ids.index(hf.convert_tokens_to_ids("<think>")), \
            ids.index(hf.convert_tokens_to_ids("</think>"))
        assert first.usage is not None
        assert first.usage.output_tokens_details.reasoning_tokens == end - start - 1
        result = {"type": "function_call_output", "call_id": call.call_id,  # type: ignore
                  "output": "sunny, 24C"}
        # the whole conversation as items, or the previous response and the result
        replayed = client.responses.create(
            model=NAME, tools=[WEATHER], temperature=0,  # type: ignore[arg-type]
            input=[{"role": "user", "content": QUESTION},
                   *[item.model_dump(exclude_none=True) for item in first.output], result])
        chained = client.responses.create(model=NAME, tools=[WEATHER], temperature=0,
                                          input=[result],  # type: ignore[list-item]
                                          previous_response_id=first.id)
    for final in (replayed, chained):
        assert final.output_text == ANSWER
        assert [item.type for item in final.output] == ["reasoning", "message"]
    assert replayed.usage is not None and chained.usage is not None
    assert replayed.usage.input_tokens == chained.usage.input_tokens == chat_prompt_tokens(
        scripted, [{"role": "user", "content": QUESTION},
                   {"role": "assistant", "content": None, "reasoning_content": THINKING,
                    "tool_calls": [{"id": call.call_id, "type": "function",  # type: ignore
                                    "function": {"name": "get_weather",
                                                 "arguments": call.arguments}}]},  # type: ignore
                   {"role": "tool", "tool_call_id": call.call_id,  # type: ignore[union-attr]
                    "content": "sunny, 24C"}],
        tools=[{"type": "function", "function": {
            k: v for k, v in WEATHER.items() if k != "type"}}])


def test_streamed_reasoning_and_call_events(scripted: ServerThread) -> None:
    with sdk(scripted) as client:
        whole = client.responses.create(model=NAME, input=QUESTION, tools=[WEATHER],
                                        temperature=0)  # type: ignore[arg-type]
        with client.responses.stream(model=NAME, input=QUESTION, tools=[WEATHER],
                                     temperature=0) as stream:  # type: ignore[arg-type]
            events = list(stream)
            final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert kinds.count("response.output_item.added") == 2
    assert kinds.count("response.output_item.done") == 2
    assert kinds.index("response.function_call_arguments.done") < kinds.index(
        "response.completed")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    assert reasoning == THINKING and json.loads(arguments) == {"city": "Seoul"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert items(final) == items(whole)


def test_openai_agents_runs_a_function_tool_agent(scripted: ServerThread) -> None:
    """openai-agents' default model (the Responses API) runs an agent: the model calls the
    tool, the agent runs it and sends its result back, the model answers."""
    import agents

    agents.set_tracing_disabled(True)
    called: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        called.append(city)
        return "sunny, 24C"

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=f"{scripted.url}/v1", api_key="none",
                                      max_retries=0) as client:
            agent = agents.Agent(
                name="weather", instructions="Use the tools.", tools=[get_weather],
                model=agents.OpenAIResponsesModel(model=NAME, openai_client=client))
            return await agents.Runner.run(agent, QUESTION)

    result = asyncio.run(run())
    assert called == ["Seoul"]
    assert result.final_output == ANSWER


def test_the_command_line_gives_the_same_response_in_every_engine_core_mode(
        tmp_path: Path) -> None:
    """`python -m atombatch.serve --model DIR` with the engine inline, in its own core process
    (the default) and behind two fronts: the same constrained response; the same request again
    (whole and streamed) reports the prompt tokens the prefix cache (on by default) saved in
    `input_tokens_details.cached_tokens` and answers the same; chained to it, the next one's
    prompt holds it (one front: the store is the front's)."""
    from support.served import served

    directory = model.checkpoint_dir(tmp_path / "ckpt")
    schema = Person.model_json_schema()
    texts, cached = [], []
    chunk = 16
    for flags in (("--engine-core", "inline"), (), ("--api-server-count", "2")):
        with served("--model", str(directory), "--max-seq-len", "256", "--batch-size", "2",
                    "--block-size", "16", "--prefill-chunk-size", str(chunk),
                    "--served-model-name", NAME, *flags) as (url, _), \
                openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
            request: dict[str, Any] = dict(
                model=NAME, input="Who are you?", max_output_tokens=80, temperature=0,
                text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
            first = client.responses.create(**request)
            jsonschema.validate(json.loads(first.output_text), schema)
            texts.append(first.output_text)
            again = client.responses.create(**request)
            events = list(client.responses.create(**request, stream=True))
            streamed = next(e for e in events if e.type == "response.completed").response
            assert first.usage is not None and again.usage is not None
            assert streamed.usage is not None
            assert first.usage.input_tokens_details.cached_tokens == 0
            # a hit resumes at the last chunk boundary before the prompt's last token
            prompt = first.usage.input_tokens
            assert again.usage.input_tokens_details.cached_tokens == \
                (prompt - 1) // chunk * chunk > 0
            assert streamed.usage == again.usage
            assert again.output_text == streamed.output_text == first.output_text
            cached.append(again.usage.input_tokens_details.cached_tokens)
            if flags == ():
                second = client.responses.create(model=NAME, input="And then?",
                                                 max_output_tokens=3, temperature=0,
                                                 previous_response_id=first.id)
                assert second.usage is not None and first.usage is not None
                assert second.usage.input_tokens > \
                    first.usage.input_tokens + first.usage.output_tokens
                card = httpx.get(f"{url}/v1/models").json()["data"][0]
                assert card["atombatch"]["engine_core"]["mode"] == "process"
    assert texts[0] == texts[1] == texts[2] and cached[0] == cached[1] == cached[2]


# -- refusals --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fields", "param"), [
    ({"input": [{"role": "user", "content": "hi"}] * (MAX_INPUT_ITEMS + 1)}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ({"tools": [dict(WEATHER, name="bad name")]}, "tools[0].name"),
    ({"tools": [WEATHER] * 129}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}},
     "text.format"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "sometimes"}, "truncation"),
    ({"input": "x" * 200_000}, "input"),
])
def test_bad_requests_are_400s_naming_the_field(noise: ServerThread, fields: dict[str, Any],
                                                param: str) -> None:
    body = {"model": NAME, "input": "hi", "max_output_tokens": 4, **fields}
    r = httpx.post(f"{noise.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert httpx.get(f"{noise.url}/health", timeout=5).status_code == 200


def test_any_input_tools_and_format_answer_200_or_a_400_naming_a_field(
        noise: ServerThread) -> None:
    """Hypothesis sends arbitrary JSON as input items, tools, tool_choice and text: never a
    5xx, and every refusal names the field at fault."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) |
        st.dictionaries(st.sampled_from(["type", "role", "content", "text", "call_id", "name",
                                         "arguments", "output", "summary", "x"]), inner,
                        max_size=4),
        max_leaves=10)
    part = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text",
                                                           "input_image", "reasoning_text"]),
                                  "text": st.text(max_size=8) | json_values})
    item = st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "x"]),
                               "content": st.text(max_size=8) | st.lists(part, max_size=2)}),
        st.fixed_dictionaries({"type": st.just("function_call"),
                               "call_id": st.sampled_from(["c1", "c2"]) | json_values,
                               "name": st.just("get_weather") | json_values,
                               "arguments": st.just('{"city": "Seoul"}') | json_values}),
        st.fixed_dictionaries({"type": st.just("function_call_output"),
                               "call_id": st.sampled_from(["c1", "c2"]) | json_values,
                               "output": st.text(max_size=8) | st.lists(part, max_size=2)}),
        st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.just([]),
                               "content": st.lists(part, max_size=2) | json_values}),
        json_values)
    tool = st.sampled_from([WEATHER, {"type": "function", "name": "f"},
                            {"type": "web_search"}]) | json_values
    choice = st.sampled_from(["none", "auto", "required", {"type": "function",
                                                           "name": "get_weather"}]) | json_values
    text = st.sampled_from([None, {"format": {"type": "json_object"}},
                            {"format": {"type": "json_schema", "name": "p",
                                        "schema": Person.model_json_schema()}}]) | json_values

    @settings(max_examples=60, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(items=st.lists(item, min_size=1, max_size=4) | json_values,
           tools=st.none() | st.lists(tool, max_size=2), tool_choice=choice, text=text)
    def send(items: Any, tools: Any, tool_choice: Any, text: Any) -> None:
        body = {"model": NAME, "input": items, "max_output_tokens": 4, "tools": tools,
                "tool_choice": tool_choice, "text": text}
        r = httpx.post(f"{noise.url}/v1/responses", json=body, timeout=60)
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert r.json()["error"]["param"], r.text

    send()


def test_unknown_ids_on_get_and_cancel(noise: ServerThread) -> None:
    r = httpx.get(f"{noise.url}/v1/responses/resp_nowhere")
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
    assert httpx.post(f"{noise.url}/v1/responses/resp_nowhere/cancel").status_code == 404
    kept = httpx.post(f"{noise.url}/v1/responses", timeout=60, json={
        "model": NAME, "input": "hi", "max_output_tokens": 2}).json()
    r = httpx.post(f"{noise.url}/v1/responses/{kept['id']}/cancel")
    assert r.status_code == 400 and "synchronous" in r.json()["error"]["message"]

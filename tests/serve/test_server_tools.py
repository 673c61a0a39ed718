"""Tool calls and reasoning through the server, driven by the official openai SDK.

The tokenizer is a byte-level BPE made here with Qwen3's tool and think tags as added (not
special) tokens, as Qwen3 ships them, and the chat template is the Qwen3-style one of
tests/serve/test_chat_template.py (it renders `tools`, assistant `tool_calls` and `tool` results).

Two models stand behind the server:
- a scripted one (`ScriptedRuntime`): after any prompt it writes a given text, then EOS. What
  is tested is what the server makes of that text (parsing, deltas, finish reasons), so the
  model only has to say it;
- the tiny random Qwen3 on the NumPy runtime with real math, for `tool_choice` required and
  named: its own greedy output is noise, so only the JSON-schema constraint built from the tools
  can turn it into a valid call.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.scripted import ScriptedRuntime, artifact, save_tokenizer, spec_for
from support.served import ServerThread
from support.templates import LLAMA3, QWEN3

from atombatch import Batcher
from atombatch.runtime.numpy_runtime import NumpyRuntime
from atombatch.serve import create_app
from atombatch.serve.tokens import HFCodec

NAME = "tools-test"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "enum": ["Seoul", "Busan"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object",
                   "properties": {"zone": {"type": "string", "enum": ["KST", "UTC"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
QUESTION = [{"role": "user", "content": "What is the weather in Seoul?"}]
HERMES_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Seoul"}}\n'
               "</tool_call>")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("qwen-tokenizer")
    hf = save_tokenizer(path, QWEN3, "<|im_end|>",
                        ["<tool_call>", "</tool_call>", "<think>", "</think>"])
    return path, hf


def scripted_server(path: Path, hf: Any, text: str, eos: str = "<|im_end|>",
                    **options: Any) -> ServerThread:
    runtime = ScriptedRuntime.random(artifact(spec_for(hf, eos)), seed=0)
    runtime.script = list(hf(text, add_special_tokens=False)["input_ids"])
    assert hf.decode(runtime.script) == text
    return ServerThread(create_app(Batcher(runtime), NAME, HFCodec.from_dir(path), **options))


def client(server: ServerThread, **kw: Any) -> openai.OpenAI:
    """An SDK client (use it in a `with`: it owns a connection pool)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, **kw)


@pytest.fixture(autouse=True)
def _close_clients(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    made: list[openai.OpenAI] = []
    real = openai.OpenAI

    def tracked(*args: Any, **kw: Any) -> openai.OpenAI:
        made.append(real(*args, **kw))
        return made[-1]

    monkeypatch.setattr(openai, "OpenAI", tracked)
    yield
    for sdk in made:
        sdk.close()


def rendered(hf: Any, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kw)
    return list(out if isinstance(out, list) else out["input_ids"])


@pytest.fixture(scope="module")
def hermes(qwen: tuple[Path, Any]) -> Iterator[ServerThread]:
    path, hf = qwen
    text = "Let me look that up.\n" + HERMES_CALL
    with scripted_server(path, hf, text, tool_parser="hermes") as server:
        yield server


def test_auto_call_is_parsed_into_tool_calls(qwen: tuple[Path, Any],
                                             hermes: ServerThread) -> None:
    _, hf = qwen
    answer = client(hermes).chat.completions.create(
        model=NAME, messages=QUESTION, tools=TOOLS, temperature=0)  # type: ignore[arg-type]
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look that up."
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Seoul"}
    # the tools reached the model through its chat template, as transformers renders them
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == len(rendered(hf, QUESTION, tools=TOOLS))
    assert answer.usage.prompt_tokens > len(rendered(hf, QUESTION)) + 20


def test_streamed_call_arrives_as_openai_tool_call_deltas(hermes: ServerThread) -> None:
    sdk = client(hermes)
    chunks = list(sdk.chat.completions.create(
        model=NAME, messages=QUESTION, tools=TOOLS, temperature=0,  # type: ignore[arg-type]
        stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert calls and calls[0].id and calls[0].type == "function"
    assert calls[0].function.name == "get_weather"
    assert all(t.index == 0 and t.id is None and t.function.name is None for t in calls[1:])
    arguments = "".join(t.function.arguments or "" for t in calls)
    assert json.loads(arguments) == {"city": "Seoul"}
    assert "".join(d.content or "" for d in deltas) == "Let me look that up."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # the SDK's own stream helper assembles the same message
    with sdk.chat.completions.stream(model=NAME, messages=QUESTION,  # type: ignore[arg-type]
                                     tools=TOOLS, temperature=0) as stream:
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Seoul"}


def test_tool_results_round_trip_through_the_template(qwen: tuple[Path, Any],
                                                      hermes: ServerThread) -> None:
    _, hf = qwen
    sdk = client(hermes)
    first = sdk.chat.completions.create(model=NAME, messages=QUESTION,  # type: ignore[arg-type]
                                        tools=TOOLS, temperature=0)
    call = (first.choices[0].message.tool_calls or [])[0]
    history = [*QUESTION,
               {"role": "assistant", "content": first.choices[0].message.content,
                "tool_calls": [{"id": call.id, "type": "function",
                                "function": {"name": call.function.name,
                                             "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "31 C, humid"}]
    again = sdk.chat.completions.create(model=NAME, messages=history,  # type: ignore[arg-type]
                                        tools=TOOLS, temperature=0)
    assert again.usage is not None
    want = rendered(hf, history, tools=TOOLS)
    assert again.usage.prompt_tokens == len(want)
    # the server's rendering is exactly transformers' (vLLM's /tokenize with messages)
    r = httpx.post(f"{hermes.url}/tokenize", json={"messages": history, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == want
    assert "<tool_response>\n31 C, humid\n</tool_response>" in hf.decode(want)


def test_plain_answers_and_refusals(qwen: tuple[Path, Any]) -> None:
    path, hf = qwen
    with scripted_server(path, hf, "It is humid in Seoul.", tool_parser="hermes") as server:
        answer = client(server).chat.completions.create(
            model=NAME, messages=QUESTION, tools=TOOLS)  # type: ignore[arg-type]
        assert answer.choices[0].finish_reason == "stop"
        assert answer.choices[0].message.content == "It is humid in Seoul."
        assert answer.choices[0].message.tool_calls is None
        too_many = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(129)]
        r = httpx.post(f"{server.url}/v1/chat/completions",
                       json={"messages": QUESTION, "tools": too_many})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "MAX_TOOLS=128" in r.json()["error"]["message"]
    with scripted_server(path, hf, HERMES_CALL) as server:  # no --tool-call-parser
        with pytest.raises(openai.BadRequestError) as info:
            client(server).chat.completions.create(model=NAME, messages=QUESTION,
                                                   tools=TOOLS)  # type: ignore[arg-type]
        assert info.value.body["param"] == "tool_choice"  # type: ignore[index]
        assert "--tool-call-parser" in info.value.body["message"]  # type: ignore[index]
        # tool_choice none only shows the tools to the template: the text stays text
        answer = client(server).chat.completions.create(
            model=NAME, messages=QUESTION, tools=TOOLS, tool_choice="none")  # type: ignore
        assert answer.choices[0].message.content == HERMES_CALL
        assert answer.choices[0].finish_reason == "stop"


def test_llama3_json_parser(tmp_path: Path) -> None:
    hf = save_tokenizer(tmp_path, LLAMA3, "<|eot_id|>", ["<|python_tag|>"])
    text = '{"name": "get_time", "parameters": {"zone": "KST"}}'
    with scripted_server(tmp_path, hf, text, eos="<|eot_id|>",
                         tool_parser="llama3_json") as server:
        answer = client(server).chat.completions.create(
            model=NAME, messages=QUESTION, tools=TOOLS)  # type: ignore[arg-type]
    [call] = answer.choices[0].message.tool_calls or []
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments) == {"zone": "KST"}
    assert answer.choices[0].message.content is None
    assert answer.choices[0].finish_reason == "tool_calls"


def test_reasoning_parser_splits_thinking_streamed_and_not(qwen: tuple[Path, Any]) -> None:
    path, hf = qwen
    text = "<think>\nThe user wants the weather tool.\n</think>\n\n" + HERMES_CALL
    with scripted_server(path, hf, text, tool_parser="hermes",
                         reasoning_parser="qwen3") as server:
        sdk = client(server)
        answer = sdk.chat.completions.create(model=NAME, messages=QUESTION,  # type: ignore
                                             tools=TOOLS)
        message = answer.choices[0].message
        assert message.model_extra is not None
        assert message.model_extra["reasoning_content"] == "\nThe user wants the weather tool.\n"
        assert message.content is None
        assert [c.function.name for c in message.tool_calls or []] == ["get_weather"]
        chunks = list(sdk.chat.completions.create(model=NAME, messages=QUESTION,  # type: ignore
                                                  tools=TOOLS, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        thinking = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        assert thinking == "\nThe user wants the weather tool.\n"
        assert not "".join(d.content or "" for d in deltas)
        calls = [t for d in deltas for t in d.tool_calls or []]
        assert json.loads("".join(t.function.arguments or "" for t in calls)) == \
            {"city": "Seoul"}
        # without tools the content is the answer after the thinking
        plain = sdk.chat.completions.create(model=NAME, messages=QUESTION)
        assert plain.choices[0].message.content == "\n\n" + HERMES_CALL


# -- required and named: the constraint makes a random model call the tools ---------------------
@pytest.fixture(scope="module")
def random_qwen(qwen: tuple[Path, Any]) -> Iterator[ServerThread]:
    path, hf = qwen
    runtime = NumpyRuntime.random(artifact(spec_for(hf, "<|im_end|>")), seed=5)
    app = create_app(Batcher(runtime), NAME, HFCodec.from_dir(path))
    with ServerThread(app) as server:
        yield server


def valid_call(name: str, arguments: str) -> bool:
    values = json.loads(arguments)
    if name == "get_weather":
        return set(values) == {"city"} and values["city"] in ("Seoul", "Busan")
    return name == "get_time" and set(values) == {"zone"} and values["zone"] in ("KST", "UTC")


def test_without_a_constraint_the_random_model_writes_no_call(random_qwen: ServerThread) -> None:
    answer = client(random_qwen).chat.completions.create(
        model=NAME, messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=40,
        temperature=0)  # type: ignore[arg-type]
    text = answer.choices[0].message.content or ""
    try:
        calls = json.loads(text)
    except ValueError:
        calls = None
    assert not isinstance(calls, list)


@pytest.mark.parametrize("stream", [False, True])
def test_required_makes_every_output_a_valid_call(random_qwen: ServerThread,
                                                  stream: bool) -> None:
    sdk = client(random_qwen)
    for seed in range(3):
        request: dict[str, Any] = dict(model=NAME, messages=QUESTION, tools=TOOLS,
                                       tool_choice="required", max_tokens=120, seed=seed,
                                       temperature=1.0)
        if stream:
            with sdk.chat.completions.stream(**request) as events:
                answer = events.get_final_completion()
        else:
            answer = sdk.chat.completions.create(**request)
        choice = answer.choices[0]
        calls = choice.message.tool_calls or []
        assert calls, choice
        assert all(valid_call(c.function.name, c.function.arguments) for c in calls), calls
        assert choice.finish_reason == "tool_calls"


def test_named_choice_calls_that_function(random_qwen: ServerThread) -> None:
    sdk = client(random_qwen)
    answer = sdk.chat.completions.create(
        model=NAME, messages=QUESTION, tools=TOOLS, max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})  # type: ignore
    [call] = answer.choices[0].message.tool_calls or []
    assert call.function.name == "get_time" and valid_call("get_time", call.function.arguments)
    r = httpx.post(f"{random_qwen.url}/v1/chat/completions", json={
        "messages": QUESTION, "tools": TOOLS, "tool_choice": "required",
        "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_the_documented_tool_call_request_is_served(hermes: ServerThread) -> None:
    import re

    docs = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    tools = docs[docs.index("## Tool calls"):]
    match = re.search(r"--tool-call-parser hermes.*?-d '(\{.*?\})'\n", tools, flags=re.S)
    assert match, "docs/server.md's tool-call section shows no curl request"
    r = httpx.post(f"{hermes.url}/v1/chat/completions", json=json.loads(match.group(1)),
                   timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_the_constraint_applies_after_the_reasoning(qwen: tuple[Path, Any]) -> None:
    """The scripted model thinks, then calls; the mask lets it through only if the constraint
    starts after `</think>` (the model's preferred token is masked otherwise). With the think
    block closed in the prompt (`enable_thinking: false`), the constraint covers everything."""
    path, hf = qwen
    thinking = "\nI should call get_weather.\n"
    call = '[{"name":"get_weather","parameters":{"city":"Seoul"}}]'
    text = f"<think>{thinking}</think>{call}"
    request: dict[str, Any] = dict(model=NAME, messages=QUESTION, tools=TOOLS,
                                   tool_choice="required", max_tokens=60)
    with scripted_server(path, hf, text, reasoning_parser="qwen3") as server:
        sdk = client(server)
        message = sdk.chat.completions.create(**request).choices[0].message
        assert (message.model_extra or {})["reasoning_content"] == thinking
        assert [(c.function.name, json.loads(c.function.arguments))
                for c in message.tool_calls or []] == [("get_weather", {"city": "Seoul"})]
        with sdk.chat.completions.stream(**request) as events:
            final = events.get_final_completion()
        [streamed] = final.choices[0].message.tool_calls or []
        assert json.loads(streamed.function.arguments) == {"city": "Seoul"}
        closed = sdk.chat.completions.create(
            **request, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert "I should" not in str(closed.choices[0].message)
    with scripted_server(path, hf, text) as server:  # no reasoning parser: the whole output
        answer = client(server).chat.completions.create(**request)
        assert "I should" not in str(answer.choices[0].message)


def test_reasoning_end_ids_look_at_the_prompt(qwen: tuple[Path, Any]) -> None:
    from atombatch.serve.reasoning import reasoning_end_ids

    path, hf = qwen
    codec = HFCodec.from_dir(path)
    assert codec is not None
    end = tuple(hf("</think>", add_special_tokens=False)["input_ids"])
    thinking = rendered(hf, QUESTION)
    closed = rendered(hf, QUESTION, enable_thinking=False)
    assert reasoning_end_ids(codec.tokenizer, thinking) == end
    assert reasoning_end_ids(codec.tokenizer, closed) == ()
    assert reasoning_end_ids(None, thinking) == ()


def test_the_command_line_serves_tools_with_the_core_process(tmp_path: Path) -> None:
    """`python -m atombatch.serve CKPT --tool-call-parser hermes --reasoning-parser qwen3`: a
    transformers-written Qwen3 checkpoint with the tokenizer beside it, the engine in its own
    process; a required choice comes back as valid calls (thinking off: the random model would
    never close a think block, and the constraint waits for its end)."""
    from support.hf_models import save_checkpoint as save_model
    from support.served import served

    save_model("qwen3", tmp_path)
    save_tokenizer(tmp_path, QWEN3, "<|im_end|>",
                   ["<tool_call>", "</tool_call>", "<think>", "</think>"])
    with served(str(tmp_path), "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                "--max-model-len", "512", "--served-model-name", NAME) as (url, _), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as sdk:
        request: dict[str, Any] = dict(
            model=NAME, messages=QUESTION, tools=[WEATHER], tool_choice="required",
            max_tokens=60, temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        chunks = [c.choices[0] for c in sdk.chat.completions.create(**request, stream=True)
                  if c.choices]
        deltas = [t for c in chunks for t in c.delta.tool_calls or []]
        calls = [(t.function.name, "".join(d.function.arguments or "" for d in deltas
                                           if d.index == t.index))
                 for t in deltas if t.id is not None and t.function is not None]
        assert calls and all(valid_call(name, arguments) for name, arguments in calls)
        finish = chunks[-1].finish_reason
        # the random model pads the array with whitespace and may reach max_tokens before its
        # "]": then "length", and the whole message drops the unclosed array's calls (vLLM's)
        answer = sdk.chat.completions.create(**request).choices[0]
        assert answer.finish_reason == finish
        if finish == "length":
            assert answer.message.tool_calls is None and answer.message.content == ""
        else:
            assert finish == "tool_calls"
            assert [(c.function.name, c.function.arguments)
                    for c in answer.message.tool_calls or []] == calls
        card = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert card["atombatch"]["engine_core"]["mode"] == "process"


def test_sdk_parse_with_pydantic_function_tools(random_qwen: ServerThread) -> None:
    """`chat.completions.parse(tools=[openai.pydantic_function_tool(Model)])`: the SDK sends
    strict function tools and validates the arguments into the pydantic model."""
    from enum import StrEnum

    import pydantic

    class City(StrEnum):
        seoul = "Seoul"
        busan = "Busan"

    class GetWeather(pydantic.BaseModel):
        """Current weather in a city."""

        city: City

    sdk = client(random_qwen)
    answer = sdk.chat.completions.parse(
        model=NAME, messages=QUESTION, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required", max_tokens=80, temperature=0)  # type: ignore[arg-type]
    calls = answer.choices[0].message.tool_calls or []
    assert calls  # a required choice may make several calls (parallel_tool_calls)
    for call in calls:
        assert call.function.name == "GetWeather"
        assert isinstance(call.function.parsed_arguments, GetWeather)
        assert call.function.parsed_arguments.city in (City.seoul, City.busan)


def test_any_tools_and_tool_choice_answer_200_or_a_400_naming_a_field(
        hermes: ServerThread) -> None:
    """Hypothesis sends arbitrary JSON as `tools`, `tool_choice` and `parallel_tool_calls`:
    never a 5xx, and every refusal names the field at fault."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) |
        st.dictionaries(st.sampled_from(["type", "function", "name", "parameters",
                                         "description", "strict", "x"]), inner, max_size=4),
        max_leaves=10)
    function = st.fixed_dictionaries(
        {"name": st.sampled_from(["get_weather", "f", "bad name", ""]) | json_values},
        optional={"parameters": st.sampled_from([WEATHER["function"]["parameters"], {},
                                                 True]) | json_values,
                  "description": json_values})
    tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "other"]),
                                  "function": function}) | json_values
    choice = st.sampled_from(["none", "auto", "required", "any",
                              {"type": "function", "function": {"name": "get_weather"}},
                              {"type": "function", "function": {"name": "nope"}}]) | json_values

    @settings(max_examples=60, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(tools=st.lists(tool, max_size=3) | json_values, tool_choice=choice,
           parallel=st.none() | st.booleans() | json_values)
    def send(tools: Any, tool_choice: Any, parallel: Any) -> None:
        body = {"messages": QUESTION, "max_tokens": 30, "tools": tools,
                "tool_choice": tool_choice, "parallel_tool_calls": parallel}
        r = httpx.post(f"{hermes.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert r.json()["error"]["param"], r.text

    send()

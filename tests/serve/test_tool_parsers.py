"""Tool-call and reasoning parsers on hand-written model outputs.

Every output is parsed whole, one character at a time, and split in two at every character
boundary: the deltas must add up to the same message each time (a stream says what the whole
response says). The expected messages are written out by hand from the formats (Qwen3/Hermes
`<tool_call>` blocks, Llama 3.1 JSON, the `required` array, a named call, Qwen3 `<think>`),
and hypothesis writes calls with any JSON arguments and cuts them anywhere.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atombatch.errors import RequestError
from atombatch.serve import tools
from atombatch.serve.chat_output import ChatOutput, chat_finish_reason, message_of
from atombatch.serve.reasoning import Qwen3ReasoningParser
from atombatch.serve.tools import (
    HermesParser,
    JsonCallsParser,
    NamedCallParser,
    ToolCallError,
    ToolPlan,
    assemble,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}


def splits(text: str) -> list[list[str]]:
    ways = [[text], list(text)]
    ways += [[text[:i], text[i:]] for i in range(1, len(text))]
    return ways


def parsed(make: Any, text: str) -> tuple[str, list[tuple[str, str]]]:
    """The message every split of `text` gives (asserted equal), as (content, [(name, args)])."""
    results = set()
    for parts in splits(text):
        parser = make()
        whole = assemble([parser.feed(p) for p in parts] + [parser.finish()])
        ids = [c.id for c in whole.calls]
        assert len(set(ids)) == len(ids) and all(i and i.startswith("call_") for i in ids)
        assert [c.index for c in whole.calls] == list(range(len(whole.calls)))
        results.add((whole.content, tuple((c.name, c.arguments) for c in whole.calls)))
    assert len(results) == 1, results
    content, calls = results.pop()
    return content, list(calls)


HERMES_CASES = [
    # Qwen3's own shape: newlines around the JSON inside the tags
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Seoul"}}\n</tool_call>',
     "", [("get_weather", '{"city": "Seoul"}')]),
    # text first, two calls, braces and the closing tag inside strings, escapes, nesting
    ('I will check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "S\\"e}oul</tool_call>", "days": [1, {"a": [2]}]}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "I will check both.",
     [("get_weather", '{"city": "S\\"e}oul</tool_call>", "days": [1, {"a": [2]}]}'),
      ("get_time", "{}")]),
    # arguments before the name; arguments as a JSON string; "parameters" spelling
    ('<tool_call>{"arguments": {"zone": "KST"}, "name": "get_time"}</tool_call>',
     "", [("get_time", '{"zone": "KST"}')]),
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Busan\\"}"}</tool_call>',
     "", [("get_weather", '{"city": "Busan"}')]),
    ('<tool_call>{"name": "get_time", "parameters": {"zone": "UTC"}}</tool_call>',
     "", [("get_time", '{"zone": "UTC"}')]),
    # not a call: left as the model wrote it
    ("hello <tool and <tool_call>{bad json</tool_call> bye  \n",
     "hello <tool and <tool_call>{bad json</tool_call> bye  \n", []),
    ("a < b and 3 <4, then <", "a < b and 3 <4, then <", []),
    ("plain answer\n", "plain answer\n", []),
    # cut off by max_tokens inside the arguments: the call keeps what was written
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Se',
     "", [("get_weather", '{"city": "Se')]),
    # text after the calls is content too; whitespace around calls is not
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\nDone.',
     "Done.", [("get_time", "{}")]),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    assert parsed(HermesParser, text) == (content, calls)


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Seoul"}}',
     "", [("get_weather", '{"city": "Seoul"}')]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Seoul"}}; '
     '{"name": "get_time", "parameters": {"zone": "KST"}}',
     "", [("get_weather", '{"city": "Seoul"}'), ("get_time", '{"zone": "KST"}')]),
    ("  The weather is humid.", "  The weather is humid.", []),
    ('{"name": 3}', '{"name": 3}', []),
    ('\n{"name": "get_time", "arguments": {"zone": "}"}}\nthat was it',
     "that was it", [("get_time", '{"zone": "}"}')]),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama3_json(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    assert parsed(JsonCallsParser, text) == (content, calls)


def test_required_array_and_named_call() -> None:
    text = ('[{"name": "get_weather", "parameters": {"city": "Seoul"}}, '
            '{"name": "get_time", "parameters": {}}]')
    assert parsed(lambda: JsonCallsParser(array=True), text) == \
        ("", [("get_weather", '{"city": "Seoul"}'), ("get_time", "{}")])
    assert parsed(lambda: NamedCallParser("get_time"), '{"zone": "KST"}') == \
        ("", [("get_time", '{"zone": "KST"}')])
    # an empty output is still one call (with empty arguments) for a named choice
    parser = NamedCallParser("get_time")
    assert [(c.name, c.arguments) for c in assemble([parser.finish()]).calls] == \
        [("get_time", "")]


def test_the_call_bounds_are_errors_naming_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    block = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    parser = HermesParser()
    with pytest.raises(ToolCallError, match=f"MAX_TOOL_CALLS={tools.MAX_TOOL_CALLS}"):
        parser.feed(block * (tools.MAX_TOOL_CALLS + 1))
    monkeypatch.setattr(tools, "MAX_TOOL_CALL_CHARS", 100)
    parser = HermesParser()
    with pytest.raises(ToolCallError, match="MAX_TOOL_CALL_CHARS=100"):
        parser.feed('<tool_call>{"name": "get_time", "arguments": {"zone": "' + "x" * 200)
    with pytest.raises(ToolCallError, match="MAX_TOOL_CALL_CHARS=100"):
        NamedCallParser("f").feed("x" * 101)
    # a long whitespace run is not held past its bound
    monkeypatch.setattr(tools, "MAX_HELD_WHITESPACE", 8)
    parser = HermesParser()
    assert parser.feed("a" + " " * 9).content == "a" + " " * 9


REASONING_CASES = [
    ("<think>\nThe user wants weather.\n</think>\n\nIt is humid.",
     "\nThe user wants weather.\n", "\n\nIt is humid."),
    ("  <think>a</thin</think>b", "a</thin", "b"),
    ("No thinking here.", None, "No thinking here."),
    ("<thinking is not the tag", None, "<thinking is not the tag"),
    ("<think>cut off before the end", "cut off before the end", None),
]


@pytest.mark.parametrize(("text", "reasoning", "content"), REASONING_CASES)
def test_qwen3_reasoning(text: str, reasoning: str | None, content: str | None) -> None:
    for parts in splits(text):
        output = ChatOutput(None, "qwen3")
        got_reasoning, got_content = "", ""
        for part in parts:
            piece = output.feed(part)
            got_reasoning += piece.reasoning
            got_content += piece.content
        piece = output.finish()
        got_reasoning += piece.reasoning
        got_content += piece.content
        assert (got_reasoning if output.saw_reasoning else None) == reasoning
        assert (got_content or None) == content
    message = message_of(ChatOutput(None, "qwen3"), text)
    assert message.reasoning_content == reasoning and message.content == content
    parser = Qwen3ReasoningParser()
    assert "".join(parser.feed(text)) + "".join(parser.finish()) == \
        (reasoning or "") + (content or "")


def test_reasoning_then_tool_calls_in_one_message() -> None:
    plan = ToolPlan.from_request([WEATHER], "auto", None, "hermes")
    text = ('<think>\nI need the weather tool.\n</think>\n\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Seoul"}}\n</tool_call>')
    message = message_of(ChatOutput(plan, "qwen3"), text)
    assert message.reasoning_content == "\nI need the weather tool.\n"
    assert message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", {"city": "Seoul"})]


def test_tool_plans() -> None:
    auto = ToolPlan.from_request([WEATHER, TIME], None, None, "hermes")
    assert auto.mode == "auto" and auto.constraint() is None
    with pytest.raises(RequestError, match="--tool-call-parser") as info:
        ToolPlan.from_request([WEATHER], "auto", None, None)
    assert info.value.param == "tool_choice"
    none = ToolPlan.from_request([WEATHER], "none", None, None)
    assert none.tools is not None and none.parser_for_output() is None
    named = ToolPlan.from_request([WEATHER, TIME], {"type": "function",
                                                    "function": {"name": "get_time"}}, None, None)
    schema = json.loads(named.constraint().value)
    assert schema == TIME["function"]["parameters"]
    required = ToolPlan.from_request([WEATHER, TIME], "required", False, None)
    schema = json.loads(required.constraint().value)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]] == \
        [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == \
        WEATHER["function"]["parameters"]


def test_required_schema_keeps_each_tools_definitions() -> None:
    """`$defs` of a tool's parameters (pydantic writes them) move to the array schema's root,
    renamed when two tools define one name differently; references follow."""
    def tool(name: str, enum: list[str]) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}},
            "$defs": {"Place": {"type": "string", "enum": enum}}}}}

    plan = ToolPlan.from_request([tool("a", ["x"]), tool("b", ["y"]), tool("c", ["x"])],
                                 "required", None, None)
    schema = json.loads(plan.constraint().value)
    assert schema["$defs"] == {"Place": {"type": "string", "enum": ["x"]},
                               "b.Place": {"type": "string", "enum": ["y"]}}
    refs = [v["properties"]["parameters"]["properties"]["where"]["$ref"]
            for v in schema["items"]["anyOf"]]
    assert refs == ["#/$defs/Place", "#/$defs/b.Place", "#/$defs/Place"]


@pytest.mark.parametrize(("tools_", "choice", "param", "limit"), [
    ([WEATHER] * 2, "auto", "tools[1].function.name", None),
    ([{"type": "function", "function": {"name": "bad name!"}}], "auto",
     "tools[0].function.name", tools.MAX_TOOL_NAME_CHARS),
    ([{"type": "retrieval"}], "auto", "tools[0]", None),
    ([], "auto", "tools", None),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", None),
    ([WEATHER], "sometimes", "tool_choice", None),
    (None, "required", "tool_choice", None),
    ([{"type": "function", "function": {"name": f"t{i}"}} for i in range(tools.MAX_TOOLS + 1)],
     "auto", "tools", tools.MAX_TOOLS),
    ([{"type": "function", "function": {"name": "big", "parameters": {
        "type": "object", "description": "x" * tools.MAX_TOOLS_CHARS}}}], "auto", "tools",
     tools.MAX_TOOLS_CHARS),
])
def test_bad_tools_name_the_field_and_the_limit(tools_: Any, choice: Any, param: str,
                                                limit: int | None) -> None:
    with pytest.raises(RequestError) as info:
        ToolPlan.from_request(tools_, choice, None, "hermes")
    assert info.value.param == param
    assert info.value.limit == limit
    if limit is not None:
        assert str(limit) in str(info.value)


# -- properties: any JSON arguments, any split ----------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) |
    st.floats(allow_nan=False, allow_infinity=False, width=32) |
    st.text(alphabet=st.characters(codec="utf-8"), max_size=12),
    lambda inner: st.lists(inner, max_size=4) |
    st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
ARGUMENTS = st.dictionaries(st.text(max_size=8), JSON, max_size=5)
NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,20}", fullmatch=True)
TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="<{["), max_size=20)


def parse_in_pieces(parser: Any, text: str, cuts: list[int]) -> tuple[str, list[Any]]:
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces, start = [], 0
    for cut in bounds:
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    whole = assemble([parser.feed(p) for p in pieces] + [parser.finish()])
    return whole.content, [(c.name, json.loads(c.arguments)) for c in whole.calls]


@settings(max_examples=150, deadline=None)
@given(calls=st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3), before=TEXT,
       ensure_ascii=st.booleans(), cuts=st.lists(st.integers(0, 2000), max_size=6))
def test_hermes_reads_back_any_arguments(calls: list[tuple[str, Any]], before: str,
                                         ensure_ascii: bool, cuts: list[int]) -> None:
    blocks = "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a},
                                                    ensure_ascii=ensure_ascii) + "\n</tool_call>"
                       for n, a in calls)
    content, got = parse_in_pieces(HermesParser(), before + blocks, cuts)
    assert got == calls
    assert content == before.rstrip()  # whitespace before a call is not content


@settings(max_examples=150, deadline=None)
@given(calls=st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 2000), max_size=6), tag=st.booleans())
def test_llama3_json_and_required_read_back_any_arguments(calls: list[tuple[str, Any]],
                                                          cuts: list[int], tag: bool) -> None:
    objects = [json.dumps({"name": n, "parameters": a}) for n, a in calls]
    text = ("<|python_tag|>" if tag else "") + "; ".join(objects)
    assert parse_in_pieces(JsonCallsParser(), text, cuts) == ("", calls)
    array = "[" + ",".join(json.dumps({"name": n, "parameters": a}, separators=(",", ":"))
                           for n, a in calls) + "]"
    assert parse_in_pieces(JsonCallsParser(array=True), array, cuts) == ("", calls)


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Seoul"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    for parallel, names in ((None, ["get_weather", "get_time"]), (False, ["get_weather"])):
        plan = ToolPlan.from_request([WEATHER, TIME], "auto", parallel, "hermes")
        message = message_of(ChatOutput(plan, None), text)
        assert [c.function.name for c in message.tool_calls or []] == names
        output = ChatOutput(plan, None)
        streamed = [c.index for ch in text for c in output.feed(ch).calls]
        assert sorted(set(streamed)) == list(range(len(names)))


NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}
WHOLE_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Seoul"}}</tool_call>'
CUT_CALLS = {  # (tool_choice, reasoning parser, text cut by max_tokens)
    "auto": ("auto", None, 'Let me look.<tool_call>{"name": "get_weather", '
                           '"arguments": {"city": "Se'),
    "auto parallel": ("auto", None, WHOLE_CALL + '\n<tool_call>{"name": "get_ti'),
    "auto after reasoning": ("auto", "qwen3", '<think>sunny?</think>\n<tool_call>{"name": '),
    "required": ("required", None, '[{"name": "get_weather", "parameters": {"city": "Seo'),
    "required parallel": ("required", None, '[{"name": "get_time", "parameters": {}}, '
                                            '{"name": "get_weather", "parame'),
    "named": (NAMED_TIME, None, '{"zone": "Asia/Se'),
}


@pytest.mark.parametrize("case", CUT_CALLS)
def test_a_call_cut_by_max_tokens_reports_length_with_vllms_message(case: str) -> None:
    """vLLM: `finish_reason` "length" whatever was parsed; its parsers fail on the cut JSON, so
    `auto` answers the text as content and no call, `required` no call and empty content, and
    a named choice keeps its one call with the arguments as far as written."""
    choice, reasoning, text = CUT_CALLS[case]
    plan = ToolPlan.from_request([WEATHER, TIME], choice, None, "hermes")
    output = ChatOutput(plan, reasoning)
    message = message_of(output, text, "length")
    assert chat_finish_reason("length", output) == "length"
    if plan.mode == "named":
        [call] = message.tool_calls or []
        assert (call.function.name, call.function.arguments) == ("get_time", text)
    elif plan.mode == "required":
        assert message.tool_calls is None and message.content == ""
    else:
        assert message.tool_calls is None
        assert message.content == text.split("</think>")[-1]  # (as written, its newline too)
        assert message.reasoning_content == ("sunny?" if reasoning else None)
    # the same text ending on its own keeps what was parsed ("stop" is not rewritten here)
    streamed = ChatOutput(plan, reasoning)
    made = [c for ch in text for c in streamed.feed(ch).calls] + streamed.finish().calls
    assert bool(made) == streamed.made_calls
    assert chat_finish_reason("length", streamed) == "length"


def test_finish_reasons_of_whole_calls_as_vllm_resolves_them() -> None:
    """A whole call that stopped on its own: "tool_calls", but "stop" for a named choice
    (OpenAI's and vLLM's); no call: the engine's reason unchanged."""
    cases = [("auto", WHOLE_CALL, "tool_calls"), ("auto", "just text", "stop"),
             ("required", '[{"name": "get_time", "parameters": {}}]', "tool_calls"),
             (NAMED_TIME, '{"zone": "UTC"}', "stop")]
    for choice, text, expected in cases:
        output = ChatOutput(ToolPlan.from_request([WEATHER, TIME], choice, None, "hermes"), None)
        message = message_of(output, text, "stop")
        assert chat_finish_reason("stop", output) == expected, (choice, text)
        assert chat_finish_reason("abort", output) == "abort"
        if expected != "stop" or choice != "auto":
            assert message.tool_calls
    whole = ChatOutput(ToolPlan.from_request([WEATHER], "auto", None, "hermes"), None)
    # a whole call that happens to end at max_tokens is still cut by the budget: "length"
    message = message_of(whole, WHOLE_CALL, "length")
    assert message.tool_calls and chat_finish_reason("length", whole) == "length"

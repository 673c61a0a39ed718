"""Structured output through the HTTP server with the official openai SDK: `response_format`,
vLLM's `structured_outputs` and `guided_*`, on chat and completions, streamed and not, with the
engine inline and in its own core process.

The model is a random-weight Llama with a byte-level BPE made in the suite
(tests/support/structured.py): only a correct constraint makes its output parse.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from support import structured as model
from support.served import ServerThread

from atombatch.core.client import CoreClient
from atombatch.serve.app import create_app

pytestmark = pytest.mark.numerics

NAME = "structured-test"
MESSAGES = [{"role": "user", "content": "Who are you?"}]


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=150)
    admin: bool


@pytest.fixture(scope="module", params=["inline", "process"])
def server(request: Any) -> Iterator[ServerThread]:
    # process: the engine core process builds its own Batcher and tokenizer from the factory
    engine: Any = model.batcher() if request.param == "inline" else \
        CoreClient(functools.partial(model.batcher))
    with ServerThread(create_app(engine, NAME, model.byte_tokenizer(),
                                 max_structured_chars=4096)) as s:
        yield s


@pytest.fixture
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sdk_parse_with_a_pydantic_model(client: openai.OpenAI, temperature: float) -> None:
    out = client.chat.completions.parse(model=NAME, messages=MESSAGES, response_format=Person,
                                        max_tokens=80, temperature=temperature, seed=3, n=2)
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        person = choice.message.parsed
        assert isinstance(person, Person), choice.message.content
        assert 0 <= person.age <= 150 and len(person.name) <= 8


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=5)
    zip: int = pydantic.Field(ge=0, le=99)


class Kind(enum.Enum):
    person = "person"
    robot = "robot"


class Record(pydantic.BaseModel):
    """$defs and $ref, an enum, a list of objects and an optional field (anyOf with null)."""

    kind: Kind
    home: Address
    others: list[Address] = pydantic.Field(max_length=2)
    note: str | None = pydantic.Field(max_length=4)


def test_sdk_parse_with_nested_models(client: openai.OpenAI) -> None:
    out = client.chat.completions.parse(model=NAME, messages=MESSAGES, response_format=Record,
                                        max_tokens=200, temperature=1.0, seed=1, n=2)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Record), choice.message.content


def test_unconstrained_output_is_not_json(client: openai.OpenAI) -> None:
    """The same request without response_format: the random model's text does not parse (so
    the test above can fail)."""
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=80,
                                         temperature=0.0)
    with pytest.raises(pydantic.ValidationError):
        Person.model_validate_json(out.choices[0].message.content or "")


def test_response_format_json_object_and_json_schema_stream(client: openai.OpenAI) -> None:
    schema = Person.model_json_schema()
    stream = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=80, temperature=0.0, stream=True,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": schema, "strict": True}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=None,
                                         temperature=0.0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)
    text_format = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5,
                                                 temperature=0.0,
                                                 response_format={"type": "text"})
    assert text_format.choices[0].finish_reason == "length"


@pytest.mark.parametrize(("fields", "pattern"), [
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, r"red|green|blue"),
    ({"structured_outputs": {"regex": r"[0-9]{4}-[0-9]{2}"}}, r"[0-9]{4}-[0-9]{2}"),
    ({"structured_outputs": {"grammar": 'start: "<" /[xy]+/ ">"'}}, r"<[xy]+>"),
    ({"structured_outputs": {"json": {"type": "array", "items": {"type": "integer",
                                                                 "minimum": 0, "maximum": 9},
                                      "minItems": 2, "maxItems": 3},
                             "whitespace_pattern": " ?"}}, r"\[ ?[0-9]( ?, ?[0-9]){1,2} ?\]"),
    ({"guided_choice": ["on", "off"]}, r"on|off"),
    ({"guided_regex": r"[A-Z][a-z]{2}"}, r"[A-Z][a-z]{2}"),
    ({"guided_json": {"enum": ["a", "b"]}, "guided_decoding_backend": "xgrammar"}, r'"[ab]"'),
    ({"guided_grammar": 'root ::= "v" [0-9]'}, r"v[0-9]"),
])
def test_vllm_fields_on_completions_and_chat(client: openai.OpenAI, fields: dict[str, Any],
                                             pattern: str) -> None:
    out = client.completions.create(model=NAME, prompt="Say:", max_tokens=40, temperature=1.0,
                                    seed=7, n=2, extra_body=fields)
    for choice in out.choices:
        assert re.fullmatch(pattern, choice.text), choice.text
        assert choice.finish_reason == "stop"
    chat = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=40,
                                          temperature=0.0, extra_body=fields)
    assert re.fullmatch(pattern, chat.choices[0].message.content or "")


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"guided_regex": "(ab"}, "guided_regex", "does not compile"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs",
     "does not compile"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format", "does not compile"),
    ({"response_format": {"type": "yaml"}}, "response_format", "not supported"),
    ({"guided_regex": "a" * 5000}, "guided_regex", "max_structured_chars=4096"),
    ({"guided_regex": "a", "guided_choice": ["x"]}, "guided_choice", "one of"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "already sets one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "x"}}, "structured_outputs",
     "structural_tag is not supported"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs", "list of strings"),
])
def test_bad_constraints_are_400s_naming_the_field(server: ServerThread, body: dict[str, Any],
                                                   param: str, message: str) -> None:
    for path, base in (("completions", {"prompt": "hi"}), ("chat/completions",
                                                          {"messages": MESSAGES})):
        r = httpx.post(f"{server.url}/v1/{path}", json={"model": NAME, "max_tokens": 4,
                                                       **base, **body}, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and message in error["message"], error
    health = httpx.get(f"{server.url}/health", timeout=5)
    assert health.status_code == 200


def test_a_constraint_that_leaves_nothing_to_sample_is_a_400_not_a_500(
        server: ServerThread) -> None:
    """Issue 18: a request whose own constraints mask every token mid-generation (here the
    choice is complete, so only EOS is allowed, and min_tokens masks EOS) ended as a 500
    `engine_error`, the server's fault; it is the request's: a 400 (streamed: an error event)."""
    body = {"model": NAME, "prompt": "hi", "max_tokens": 8, "min_tokens": 6,
            "structured_outputs": {"choice": ["yes"]}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "masked" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


def test_constraints_need_a_tokenizer() -> None:
    from support.structured import ART

    from atombatch import Batcher
    from atombatch.runtime import NumpyRuntime
    with ServerThread(create_app(Batcher(NumpyRuntime.random(ART, seed=3)), NAME)) as s:
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "<5><6>", "max_tokens": 4,
                                                        "guided_choice": ["a"]}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "guided_choice"
    assert "needs a tokenizer" in r.json()["error"]["message"]


def test_the_cli_server_with_its_default_engine_core_process(tmp_path: Any) -> None:
    """`python -m atombatch.serve --model DIR` (the engine in its own core process, the default)
    on a Qwen3 checkpoint with tokenizer.json: the core builds the grammars from the tokenizer
    it loads itself."""
    from support.served import served
    directory = model.checkpoint_dir(tmp_path / "ckpt")
    with contextlib.ExitStack() as stack:
        url, _ = stack.enter_context(served("--model", str(directory), "--max-seq-len", "256",
                                            "--batch-size", "2"))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        stack.enter_context(client)
        name = client.models.list().data[0].id
        out = client.chat.completions.parse(model=name, messages=MESSAGES,
                                            response_format=Person, max_tokens=80,
                                            temperature=0.5, seed=2, n=2)
        for choice in out.choices:
            assert isinstance(choice.message.parsed, Person), choice.message.content
        free = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=80,
                                              temperature=0.5, seed=2)
        with pytest.raises(pydantic.ValidationError):
            Person.model_validate_json(free.choices[0].message.content or "")

"""Issue 38's hostile grammars against the server, with a victim stream timed alongside: no
grammar, schema or template argument makes the server exit, stalls other streams beyond
`VICTIM_GAP`, or answers 500; one that is too costly is a 400 naming the limit.

What failed on 4a5a9db (tiny Llama checkpoint, default `python -m atombatch.serve`):
- one `guided_grammar` Lark chain of ~4 500 rules (58 KB): the server died of SIGSEGV in 0.04 s
  (the front's compile check overflowed its thread's stack); a GBNF chain of ~4 000 rules too;
- GBNF chains of ~3 500 rules (56 KB), each first made known to the front with a wrong model
  name (404): converted in pure Python on the engine core's loop thread, every stream stopped
  7-20 s per grammar; nine of them and the front declared the core hung and exited;
- a JSON schema sent as a string nested 3 000 deep: RecursionError, 500;
- `/tokenize` with `chat_template_kwargs` naming `max_chars`, `messages` or `self`: 500.
"""

from __future__ import annotations

import concurrent.futures
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from support import grammar_faults
from support.grammars import LARK_GRAMMARS, REGEXES, SCHEMAS
from support.served import ServerThread, running, served
from support.victim import NAME, VICTIM_GAP, Victim

CONTEXT = 512


def lark_chain(n: int, tag: str = "") -> str:
    return "\n".join([f"start: r0{tag}", *(f"r{i}{tag}: r{i + 1}{tag}" for i in range(n)),
                      f'r{n}{tag}: "a"'])


def gbnf_chain(n: int, tag: str = "") -> str:
    return "\n".join([f"root ::= r0{tag}", *(f"r{i}{tag} ::= r{i + 1}{tag}" for i in range(n)),
                      f'r{n}{tag} ::= "a"'])


def nested_parens(depth: int) -> str:
    return "start: " + "(" * depth + '"a"' + ")" * depth


def deep_schema(depth: int) -> str:
    return '{"items":' * depth + "{}" + "}" * depth  # 30 KB at 3 000: under the size bound


@pytest.fixture(scope="module", params=["process", "fronts"])
def server(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """The tiny Qwen3 checkpoint with its byte-level tokenizer; the engine core in its own
    process, with one front or two (`--api-server-count 2`)."""
    from support.structured import checkpoint_dir

    directory = checkpoint_dir(Path(tmp_path_factory.mktemp("ckpt")))
    fronts = ("--api-server-count", "2") if request.param == "fronts" else ()
    with served(str(directory), "--served-model-name", NAME, "--max-model-len", str(CONTEXT),
                "--tool-call-parser", "hermes", "--max-waiting", "200", *fronts) as s:
        yield s


def _completion(url: str, constraint: dict[str, Any], model: str = NAME) -> httpx.Response:
    body = {"model": model, "prompt": "hi", "max_tokens": 4, "temperature": 0, **constraint}
    return httpx.post(url + "/v1/completions", json=body, timeout=300)


def _assert_alive_and_serving(url: str, pid: int) -> None:
    assert running(pid), "the server exited"
    honest = _completion(url, {"structured_outputs": {"choice": ["yes", "no"]}})
    assert honest.status_code == 200, honest.text
    assert honest.json()["choices"][0]["text"] in ("yes", "no")


ONE_SHOT = {
    "lark chain 4500 (guided_grammar)": {"guided_grammar": lark_chain(4500)},
    "lark chain 4500 (structured_outputs.grammar)":
        {"structured_outputs": {"grammar": lark_chain(4500, "x")}},
    "gbnf chain 4000": {"guided_grammar": gbnf_chain(4000)},
    "parentheses 30000 deep": {"guided_grammar": nested_parens(30_000)},
    "regex nested 2000 deep": {"guided_regex": "(" * 2000 + "a" + ")" * 2000},
}


@pytest.mark.parametrize("attack", list(ONE_SHOT))
def test_one_grammar_cannot_kill_or_stall_the_server(server: tuple[str, int],
                                                     attack: str) -> None:
    url, pid = server
    with Victim(url, tokens=200, until_exit=True) as victim:
        time.sleep(0.2)
        start = time.perf_counter()
        r = _completion(url, ONE_SHOT[attack])
        end = time.perf_counter()
    assert victim.error is None, victim.error
    assert r.status_code in (200, 400), r.text[:400]
    if r.status_code == 200:  # compiled: the grammar is honoured
        assert r.json()["choices"][0]["text"] == "a", r.text
    else:
        assert r.json()["error"]["param"] in ("guided_grammar", "structured_outputs",
                                              "guided_regex"), r.text
    gap = victim.gap_during(start, end)
    assert gap < VICTIM_GAP, f"the victim stream paused {gap:.2f} s"
    _assert_alive_and_serving(url, pid)


def test_a_storm_of_distinct_costly_grammars_neither_stalls_nor_stops_the_server(
        server: tuple[str, int]) -> None:
    """Nine distinct 56 KB GBNF chains sent at once, new to the server (their conversion runs
    in the grammar workers meanwhile); then nine more, each first made known with a wrong model
    name (the trick that put their conversion on the core's loop at 4a5a9db)."""
    url, pid = server
    fresh = [gbnf_chain(3300, f"f{i}") for i in range(9)]
    known = [gbnf_chain(3300, f"k{i}") for i in range(9)]
    for text in known:
        assert _completion(url, {"guided_grammar": text}, model="nope").status_code in (404, 429)
    for grammars in (fresh, known):
        with Victim(url, tokens=200, until_exit=True) as victim, \
                concurrent.futures.ThreadPoolExecutor(9) as pool:
            time.sleep(0.2)
            start = time.perf_counter()
            storm = [pool.submit(_completion, url, {"guided_grammar": g}) for g in grammars]
            answers = [f.result() for f in storm]
            end = time.perf_counter()
        assert victim.error is None, victim.error
        statuses = [a.status_code for a in answers]
        assert all(s in (200, 400, 429) for s in statuses), statuses  # never a 500
        assert all(a.json()["choices"][0]["text"] == "a"
                   for a in answers if a.status_code == 200)
        assert statuses.count(200) >= 1, statuses
        gap = victim.gap_during(start, end)
        assert gap < VICTIM_GAP, f"the victim stream paused {gap:.2f} s ({statuses})"
    _assert_alive_and_serving(url, pid)


@pytest.mark.parametrize("field", ["guided_json", "structured_outputs", "response_format"])
def test_a_schema_string_nested_past_the_bound_is_a_400(server: tuple[str, int],
                                                        field: str) -> None:
    url, _ = server
    schema = deep_schema(3000)
    body: dict[str, Any] = {"model": NAME, "max_tokens": 4,
                            "messages": [{"role": "user", "content": "hi"}]}
    if field == "guided_json":
        body["guided_json"] = schema
    elif field == "structured_outputs":
        body["structured_outputs"] = {"json": schema}
    else:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "deep", "schema": schema}}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == field and "at most 128" in error["message"], error


@pytest.mark.parametrize("kwargs", [{"max_chars": 1}, {"messages": []}, {"self": 1},
                                    {"tools": []}])
def test_tokenize_refuses_the_template_arguments_the_chat_route_refuses(
        server: tuple[str, int], kwargs: dict[str, Any]) -> None:
    url, _ = server
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": kwargs}
    chat = httpx.post(url + "/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=60)
    tokenize = httpx.post(url + "/tokenize", json=body, timeout=60)
    assert chat.status_code == tokenize.status_code == 400, (chat.text, tokenize.text)
    assert tokenize.json()["error"]["param"] == "chat_template_kwargs", tokenize.text


def test_tokenize_bounds_tools_as_the_chat_route_does(server: tuple[str, int]) -> None:
    url, _ = server
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}] * 2}
    tokenize = httpx.post(url + "/tokenize", json=body, timeout=60)
    assert tokenize.status_code == 400, tokenize.text
    assert "second tool named" in tokenize.json()["error"]["message"]


# -- a fault injected into the grammar library, with constrained and plain streams running -------
@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    from support.structured import batcher, byte_tokenizer

    from atombatch.serve.app import create_app

    app = create_app(batcher(), NAME, byte_tokenizer(),
                     grammar_check="support.grammar_faults:check", grammar_wall_seconds=8.0)
    with ServerThread(app) as s:
        yield s


def test_a_worker_that_dies_or_hangs_costs_its_request_only(faulty: ServerThread) -> None:
    url = faulty.url
    honest = {"structured_outputs": {"regex": "[0-9]{3}"}}
    with Victim(url, tokens=100, until_exit=True) as victim, \
            concurrent.futures.ThreadPoolExecutor(6) as pool:
        start = time.perf_counter()
        crash = pool.submit(_completion, url, {"guided_regex": f"a{grammar_faults.CRASH}"})
        hang = pool.submit(_completion, url,
                           {"structured_outputs": {"grammar": f'start: "{grammar_faults.HANG}"'}})
        honest_answers = [pool.submit(_completion, url, honest) for _ in range(3)]
        crashed, hung = crash.result(), hang.result()
        answers = [f.result() for f in honest_answers]
        end = time.perf_counter()
    assert victim.error is None, victim.error
    assert crashed.status_code == 400 and "SIGSEGV" in crashed.json()["error"]["message"]
    assert crashed.json()["error"]["param"] == "guided_regex"
    assert hung.status_code == 400 and "within the budget of 8 s" in hung.json()["error"]["message"]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert all(re.fullmatch("[0-9]{3}", a.json()["choices"][0]["text"]) for a in answers)
    assert victim.times[-1] > end and victim.gap_during(start, end) < VICTIM_GAP


# -- hypothesis against the server: generated grammars, regexes and schemas, a victim alongside ---
_AGAINST_SERVER = settings(max_examples=20, deadline=None,
                           suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                  HealthCheck.too_slow])


def _never_a_500(url: str, pid: int, victim: Victim, constraint: dict[str, Any]) -> None:
    start = time.perf_counter()
    r = _completion(url, constraint)
    end = time.perf_counter()
    assert r.status_code in (200, 400), r.text[:400]
    assert victim.error is None, victim.error
    gap = victim.gap_during(start, end)
    assert gap < VICTIM_GAP, f"the victim stream paused {gap:.2f} s"
    assert running(pid)


@pytest.fixture(scope="module")
def victim(server: tuple[str, int]) -> Iterator[Victim]:
    with Victim(server[0], tokens=200, until_exit=True) as v:
        yield v


@_AGAINST_SERVER
@given(text=LARK_GRAMMARS)
def test_generated_grammars_against_the_server(server: tuple[str, int], victim: Victim,
                                               text: str) -> None:
    _never_a_500(*server, victim, {"guided_grammar": text})


@_AGAINST_SERVER
@given(pattern=REGEXES)
def test_generated_regexes_against_the_server(server: tuple[str, int], victim: Victim,
                                              pattern: str) -> None:
    _never_a_500(*server, victim, {"structured_outputs": {"regex": pattern}})


@_AGAINST_SERVER
@given(schema=SCHEMAS)
def test_generated_schemas_against_the_server(server: tuple[str, int], victim: Victim,
                                              schema: dict[str, Any]) -> None:
    _never_a_500(*server, victim, {"guided_json": schema})

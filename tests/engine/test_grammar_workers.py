"""Issue 38: client constraints are lowered and compiled in worker processes
(atombatch/sampling/grammar_check.py), never on the engine's loop thread, and a grammar that crashes,
hangs or hogs the grammar library costs one request a `GrammarBudgetError`, not the process.

What failed on 4a5a9db: a Lark chain of ~4 500 rules (58 KB) segfaulted the server; a GBNF chain
of ~3 500 rules was converted in pure Python on the core's loop thread (every stream stopped
7-20 s); a JSON schema string nested 3 000 deep raised RecursionError (a 500).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from support import grammar_faults
from support.driving import run_to_end
from support.grammars import LARK_GRAMMARS, REGEXES, SCHEMAS
from support.served import running
from support.structured import SPEC, batcher, byte_tokenizer

from atombatch import ConfigError, RequestError, SamplingParams, StructuredOutput
from atombatch.api.structured import MAX_SCHEMA_DEPTH, json_depth
from atombatch.sampling import grammar as grammar_module
from atombatch.sampling.grammar_check import GrammarBudgetError, GrammarWorkers

PROMPT = [1, 40, 41, 42, 43]
FAULTS = "support.grammar_faults:check"


def lark_chain(n: int) -> str:
    """`start` -> r0 -> r1 -> ... -> rn -> "a": what overflowed an 8 MiB stack at n ~ 4 000."""
    return "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(n)), f'r{n}: "a"'])


def gbnf_chain(n: int) -> str:
    return "\n".join(["root ::= r0", *(f"r{i} ::= r{i + 1}" for i in range(n)), f'r{n} ::= "a"'])


@pytest.fixture(scope="module")
def workers() -> Iterator[GrammarWorkers]:
    w = GrammarWorkers(byte_tokenizer(), SPEC.vocab_size, SPEC.eos_token_ids, target=FAULTS,
                       seconds=4.0, wall_seconds=5.0)
    yield w
    w.close()


def test_a_checked_constraint_runs_as_the_unchecked_one(workers: GrammarWorkers) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    raw = StructuredOutput.json_schema(schema, param="guided_json")
    checked = workers.check(raw)
    assert checked.lowered and checked.value == raw.value and checked.param == "guided_json"
    assert workers.known(raw) == checked
    params = [SamplingParams(max_tokens=120, temperature=0.0, structured=s)
              for s in (raw, checked)]
    a, b = batcher().generate([PROMPT, PROMPT], params)
    assert a.token_ids == b.token_ids and b.finish_reason == "stop"
    assert isinstance(json.loads(b.text or "")["n"], int)


def test_a_chain_that_overflowed_the_server_compiles_in_a_worker_and_in_the_engine(
        workers: GrammarWorkers) -> None:
    structured = StructuredOutput.grammar(lark_chain(4500), param="guided_grammar")
    checked = workers.check(structured)
    b = batcher()
    out = b.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0,
                                              structured=checked))[0]
    assert out.text == "a" and out.finish_reason == "stop"
    gbnf = workers.check(StructuredOutput.grammar(gbnf_chain(3500), param="guided_grammar"))
    assert gbnf.lowered and gbnf.lowered != gbnf.value  # converted to Lark in the worker
    assert b.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0,
                                               structured=gbnf))[0].text == "a"


def test_a_native_stack_overflow_kills_the_worker_not_the_caller() -> None:
    """A real overflow (no injection): a worker with a 1 MiB stack cannot parse 1 000 chained
    rules; the request is refused naming the budget and the next check gets a new worker."""
    small = GrammarWorkers(byte_tokenizer(), SPEC.vocab_size, SPEC.eos_token_ids,
                           stack_bytes=1 << 20)
    try:
        with pytest.raises(GrammarBudgetError, match="stack of 1 MiB") as info:
            small.check(StructuredOutput.grammar(lark_chain(1000), param="guided_grammar"))
        assert info.value.param == "guided_grammar" and "SIGSEGV" in str(info.value)
        assert small.restarts == 1 and small.refused == 1
        assert small.check(StructuredOutput.regex("[0-9]+")).lowered
    finally:
        small.close()


@pytest.mark.parametrize(("marker", "budget"), [(grammar_faults.CRASH, "worker process"),
                                                (grammar_faults.HANG, "within the budget of 5 s"),
                                                (grammar_faults.HOG, "memory of 1024 MiB")])
def test_a_faulty_grammar_library_costs_one_check(workers: GrammarWorkers, marker: str,
                                                  budget: str) -> None:
    restarts = workers.restarts
    with pytest.raises(RequestError, match=budget) as info:
        workers.check(StructuredOutput.regex(f"x{marker}", param="structured_outputs"))
    assert info.value.param == "structured_outputs"
    assert workers.restarts - restarts == (0 if marker == grammar_faults.HOG else 1)
    assert workers.check(StructuredOutput.choice(["yes", "no"])).lowered  # served again
    with pytest.raises(RequestError, match="does not compile"):  # and still a real checker
        workers.check(StructuredOutput.regex("(ab"))


def test_checks_run_concurrently_from_many_threads(workers: GrammarWorkers) -> None:
    specs = [StructuredOutput.regex(f"[a-z]{{{i}}}") for i in range(1, 25)]
    results: list[Any] = [None] * len(specs)

    def run(i: int) -> None:
        results[i] = workers.check(specs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.value for r in results] == [s.value for s in specs]
    assert all(r.lowered for r in results)


def test_a_deep_schema_string_is_refused_before_any_recursive_parse() -> None:
    deep = '{"type": "array", "items": ' * 3000 + "{}" + "}" * 3000
    assert json_depth(deep) == 3001
    for param in ("guided_json", "structured_outputs", "response_format"):
        with pytest.raises(RequestError, match=f"at most {MAX_SCHEMA_DEPTH}") as info:
            StructuredOutput.json_schema(deep, param=param)
        assert info.value.param == param and info.value.limit == MAX_SCHEMA_DEPTH
    # strings do not count, and a schema at the bound still compiles
    assert json_depth('{"description": "[[[[{{{{", "type": "string"}') == 1
    nested: Any = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH // 2 - 1):
        nested = {"type": "array", "items": nested}
    structured = StructuredOutput.json_schema(nested)
    assert json_depth(structured.value) <= MAX_SCHEMA_DEPTH
    batcher().grammars().matcher_now(structured)


def test_the_engine_lowers_on_its_compile_thread_not_the_callers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    lower = grammar_module.grammar_text

    def recording(structured: StructuredOutput) -> str:
        threads.append(threading.current_thread().name)
        return lower(structured)

    monkeypatch.setattr(grammar_module, "grammar_text", recording)
    b = batcher()
    rid = b.submit(PROMPT, SamplingParams(max_tokens=4, temperature=0.0,
                                          structured=StructuredOutput.grammar(gbnf_chain(200))))
    assert threads in ([], ["atombatch-grammar"])  # never the submitting thread
    finals = run_to_end(b)
    assert threads == ["atombatch-grammar"] and finals[rid].finish_reason == "stop"


# -- hypothesis: grammars, regexes and schemas, deep, chained, ambiguous and recursive ------------
def _served_or_refused(workers: GrammarWorkers, structured: StructuredOutput) -> None:
    """The worker answers (checked, or a RequestError naming the field); what it passed
    compiles in the engine's Grammars too, from its lowered text."""
    try:
        checked = workers.check(structured)
    except RequestError as exc:
        assert exc.param == structured.param, exc
        return
    grammars = _engine_grammars()
    assert grammars.matcher_now(checked) is not None


_GRAMMARS: list[Any] = []


def _engine_grammars() -> Any:
    if not _GRAMMARS:
        _GRAMMARS.append(batcher().grammars())
    return _GRAMMARS[0]


_HYPOTHESIS = settings(max_examples=25, deadline=None,
                       suppress_health_check=[HealthCheck.function_scoped_fixture,
                                              HealthCheck.too_slow])


@_HYPOTHESIS
@given(text=LARK_GRAMMARS)
def test_generated_grammars_are_checked_or_refused(workers: GrammarWorkers, text: str) -> None:
    _served_or_refused(workers, StructuredOutput.grammar(text, param="guided_grammar"))


@_HYPOTHESIS
@given(pattern=REGEXES)
def test_generated_regexes_are_checked_or_refused(workers: GrammarWorkers, pattern: str) -> None:
    _served_or_refused(workers, StructuredOutput.regex(pattern, param="guided_regex"))


@_HYPOTHESIS
@given(schema=SCHEMAS)
def test_generated_schemas_are_checked_or_refused(workers: GrammarWorkers,
                                                  schema: dict[str, Any]) -> None:
    _served_or_refused(workers, StructuredOutput.json_schema(schema, param="guided_json"))


# -- the review's findings ------------------------------------------------------------------------
def test_the_budget_is_cpu_time_a_waiting_check_passes_a_spinning_one_does_not() -> None:
    w = GrammarWorkers(byte_tokenizer(), SPEC.vocab_size, SPEC.eos_token_ids, target=FAULTS,
                       seconds=1.0, wall_seconds=20.0)
    try:
        slow = w.check(StructuredOutput.regex(f"ab{grammar_faults.SLOW}"))  # 2 s, no CPU
        assert slow.lowered
        with pytest.raises(GrammarBudgetError, match="1 s of CPU time"):
            w.check(StructuredOutput.regex(f"ab{grammar_faults.SPIN}"))
        assert w.restarts == 1
    finally:
        w.close()


def test_a_hang_meets_the_wall_budget() -> None:
    w = GrammarWorkers(byte_tokenizer(), SPEC.vocab_size, SPEC.eos_token_ids, target=FAULTS,
                       seconds=1.0, wall_seconds=3.0)
    try:
        with pytest.raises(GrammarBudgetError, match="within the budget of 3 s"):
            w.check(StructuredOutput.regex(f"ab{grammar_faults.HANG}"))
    finally:
        w.close()


def test_one_off_constraints_cannot_push_out_the_ones_in_use(workers: GrammarWorkers,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from atombatch.sampling import grammar_check

    monkeypatch.setattr(grammar_check, "CHECKED_COUNT", 8)
    used = StructuredOutput.regex("[0-9]{2}-churn")
    workers.check(used)
    assert workers.known(used) is not None  # asked for again: protected
    for i in range(40):  # a client churning distinct one-offs
        workers.check(StructuredOutput.regex(f"[a-z]{{{i + 1}}}-churn"))
    assert workers.known(used) is not None
    assert len(workers._probation) + len(workers._protected) <= 8


def test_requests_bringing_the_same_new_constraint_share_one_check(
        workers: GrammarWorkers) -> None:
    structured = StructuredOutput.grammar(gbnf_chain(800) + "\n", param="guided_grammar")
    before = workers.checks
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(workers.check(structured)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and len({r.lowered for r in results}) == 1
    assert workers.checks - before == 1


def test_a_worker_whose_front_is_killed_exits(tmp_path: Any) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "front.py"
    script.write_text(
        "import os, sys, threading, time\n"
        "from support.structured import SPEC, byte_tokenizer\n"
        "from atombatch.sampling import grammar_check\n"
        "from atombatch.api.structured import StructuredOutput\n"
        "if __name__ == '__main__':\n"
        "    w = grammar_check.GrammarWorkers(byte_tokenizer(), SPEC.vocab_size,\n"
        f"        SPEC.eos_token_ids, target={FAULTS!r})\n"
        "    worker = w._idle.get(); worker.start(); w._idle.put(worker)\n"
        "    print(worker.process.pid, flush=True)\n"
        f"    spec = StructuredOutput.regex('a{grammar_faults.HANG}')\n"
        "    threading.Thread(target=w.check, args=(spec,), daemon=True).start()\n"
        "    time.sleep(600)\n")
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    front = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env=env)
    try:
        assert front.stdout is not None
        worker_pid = int(front.stdout.readline())
        time.sleep(1.0)  # the worker is inside the hanging check now
        os.kill(front.pid, signal.SIGKILL)
        front.wait(10)
        deadline = time.monotonic() + 20
        while running(worker_pid):
            if time.monotonic() > deadline:
                os.kill(worker_pid, signal.SIGKILL)
                raise AssertionError("the orphaned grammar worker still runs")
            time.sleep(0.2)
    finally:
        if front.poll() is None:
            front.kill()
            front.wait(10)
        if front.stdout is not None:
            front.stdout.close()


def test_close_stops_a_busy_worker_and_refuses_waiting_checks() -> None:
    w = GrammarWorkers(byte_tokenizer(), SPEC.vocab_size, SPEC.eos_token_ids, target=FAULTS,
                       seconds=1.0, wall_seconds=3.0)
    outcomes: list[str] = []

    def run(spec: StructuredOutput) -> None:
        try:
            w.check(spec)
            outcomes.append("ok")
        except ConfigError:
            outcomes.append("closed")
        except GrammarBudgetError:
            outcomes.append("budget")

    busy = threading.Thread(target=run, args=(StructuredOutput.regex(f"a{grammar_faults.HANG}"),))
    busy.start()
    import time
    time.sleep(1.0)
    waiting = threading.Thread(target=run, args=(StructuredOutput.regex("[0-9]+close"),))
    waiting.start()
    time.sleep(0.3)
    w.close()
    busy.join(10)
    waiting.join(10)
    assert sorted(outcomes) == ["budget", "closed"], outcomes
    assert w.idle_processes() == 0


def test_the_engines_cache_counts_what_it_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammar_module, "COMPILED_CACHE_CHARS", 4000)
    grammars = batcher().grammars()
    for i in range(30):  # unlowered (an embedder's): the engine lowers them itself
        schema = {"type": "object", "properties": {f"k{i}_{j}": {"type": "integer"}
                                                   for j in range(40)}}
        grammars.compile(StructuredOutput.json_schema(schema)).result()
    held = sum(size for _, size in grammars._compiled.values())
    assert grammars._compiled_chars == held <= 4000 and grammars._compiled

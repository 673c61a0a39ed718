"""What a client's grammar costs, and what a storm of them costs everyone else (issue 38).

`python -m atombatch.bench structured --storm [--clients 9] [--seconds 20] [--step-ms 10]
[--vocab 151936] [--json PATH]`

Two parts:

- **Compile time per grammar kind and size.** For each kind (JSON schema, regex, choice, Lark
  chain, GBNF chain, Lark nesting) at about 1, 8 and 56 KB, the check a front runs in a grammar
  worker (lowering, compiling against the tokenizer, the first mask: `GrammarWorkers.check`) and
  the engine's compile of the lowered text (`Grammars.matcher_now`), medians of `--repeats`
  distinct grammars (a cache hit would measure nothing); or the 400 a grammar past the budgets
  gets, named.
- **A storm.** `python -m atombatch.serve --runtime null` (the qwen3-0.6b shapes, a `--step-ms`
  device, the synthetic byte-level tokenizer of `--vocab` ids: grammar masks at full cost) in a
  child process; a victim streams a plain completion, request after request, while `--clients`
  clients send distinct worst-case grammars as fast as the server answers them, for
  `--seconds`. Reported: the victim's median and worst inter-token gap (in steps), the grammars
  answered by status, and the server's exit (it must still run).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from atombatch.api.structured import StructuredOutput

KINDS = ("json_schema", "regex", "choice", "lark_chain", "gbnf_chain", "lark_nesting")
SIZES = (1024, 8 * 1024, 56 * 1024)


class CompileRecord(msgspec.Struct, frozen=True):
    """One kind at one size: milliseconds (medians), or why it was refused."""

    kind: str
    chars: int
    check_ms: float | None            # a grammar worker's check (lower, compile, first mask)
    engine_ms: float | None           # the engine compiling the lowered text
    refused: str | None = None        # the 400's message when the budgets refuse it


class StormRecord(msgspec.Struct, frozen=True):
    clients: int
    seconds: float
    step_ms: float
    victim_tokens: int
    victim_gap_median_ms: float
    victim_gap_max_ms: float
    victim_gap_max_steps: float       # the worst gap in device steps
    statuses: dict[str, int]          # the storm's answers by HTTP status
    server_alive: bool


def make_grammar(kind: str, chars: int, tag: str) -> StructuredOutput:
    """A grammar of `kind` about `chars` characters long, distinct by `tag`."""
    if kind == "json_schema":
        props: dict[str, Any] = {}
        i = 0
        while len(msgspec.json.encode(props)) < chars - 64:
            props[f"{tag}_{i}"] = {"type": "object", "properties": {
                "a": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                "b": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}}}
            i += 1
        return StructuredOutput.json_schema({"type": "object", "properties": props},
                                            param="guided_json")
    if kind == "regex":
        words = itertools.count()
        parts: list[str] = []
        while sum(len(p) + 1 for p in parts) < chars - 16:
            parts.append(f"{tag}{next(words)}[a-z]{{1,3}}")
        return StructuredOutput.regex("(" + "|".join(parts) + ")", param="guided_regex")
    if kind == "choice":
        words = itertools.count()
        choices: list[str] = []
        while sum(len(c) for c in choices) < chars:
            choices.append(f"{tag} choice {next(words)}")
        return StructuredOutput.choice(choices[:1024], param="guided_choice")
    if kind == "lark_chain":
        n = chars // (2 * len(tag) + 14)
        return StructuredOutput.grammar("\n".join(
            [f"start: r0{tag}", *(f"r{i}{tag}: r{i + 1}{tag}" for i in range(n)),
             f'r{n}{tag}: "a"']), param="guided_grammar")
    if kind == "gbnf_chain":
        n = chars // (2 * len(tag) + 16)
        return StructuredOutput.grammar("\n".join(
            [f"root ::= r0{tag}", *(f"r{i}{tag} ::= r{i + 1}{tag}" for i in range(n)),
             f'r{n}{tag} ::= "a"']), param="guided_grammar")
    if kind == "lark_nesting":
        depth = (chars - 16 - len(tag)) // 2
        return StructuredOutput.grammar(f'start: "{tag}" ' + "(" * depth + '"a"' + ")" * depth,
                                        param="guided_grammar")
    raise ValueError(f"unknown grammar kind {kind!r}")


def body_of(structured: StructuredOutput, model: str) -> dict[str, Any]:
    """A completion request asking for `structured` the way vLLM clients spell it."""
    field: dict[str, Any]
    if structured.kind == "json_schema":
        field = {"guided_json": structured.value}
    elif structured.kind == "regex":
        field = {"guided_regex": structured.value}
    elif structured.kind == "choice":
        field = {"guided_choice": list(structured.choices)}
    else:
        field = {"guided_grammar": structured.value}
    return {"model": model, "prompt": "hi", "max_tokens": 8, "temperature": 0, **field}


def compile_times(tokenizer: Any, vocab: int, eos: int, repeats: int,
                  kinds: tuple[str, ...] = KINDS, sizes: tuple[int, ...] = SIZES,
                  progress: bool = False) -> list[CompileRecord]:
    from atombatch.errors import RequestError
    from atombatch.sampling.grammar import Grammars
    from atombatch.sampling.grammar_check import GrammarWorkers

    workers = GrammarWorkers(tokenizer, vocab, (eos,))
    engine = Grammars(tokenizer, vocab, (eos,))
    records = []
    try:
        workers.check(StructuredOutput.regex("a"))   # started, tokenizer built
        engine.matcher_now(StructuredOutput.regex("a"))
        for kind, chars in itertools.product(kinds, sizes):
            checks, compiles, refused = [], [], None
            for r in range(repeats):
                spec = make_grammar(kind, chars, f"t{r}x")
                start = time.perf_counter()
                try:
                    checked = workers.check(spec)
                except RequestError as exc:
                    refused = str(exc)[:160]
                    break
                checks.append(time.perf_counter() - start)
                start = time.perf_counter()
                engine.matcher_now(checked)
                compiles.append(time.perf_counter() - start)
            records.append(CompileRecord(
                kind=kind, chars=make_grammar(kind, chars, "t0x").chars,
                check_ms=round(1e3 * statistics.median(checks), 2) if checks else None,
                engine_ms=round(1e3 * statistics.median(compiles), 2) if compiles else None,
                refused=refused))
            if progress:
                print(f"  compiled {kind} at {chars} chars", file=sys.stderr, flush=True)
    finally:
        workers.close()
        engine.close()
    return records


STORM_KINDS = ("gbnf_chain", "lark_chain", "lark_nesting", "json_schema", "regex")


def storm(tokenizer: Any, clients: int, seconds: float, step_ms: float,
          kinds: tuple[str, ...] = STORM_KINDS, chars: int = 56 * 1024) -> StormRecord:
    """The victim's gaps while `clients` send distinct worst-case grammars (module docstring);
    `tokenizer` is the server's (`bench.structured.synthetic_tokenizer`, the qwen3-0.6b vocabulary)."""
    import httpx

    from atombatch.bench.overlap import Server

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(str(Path(tmp) / "tokenizer.json"))
        server = Server([sys.executable, "-m", "atombatch.serve", "--runtime", "null",
                         "--model", "qwen3-0.6b", "--null-step-ms", str(step_ms),
                         "--tokenizer", tmp, "--port", "0", "--max-model-len", "4096",
                         "--batch-size", "16", "--served-model-name", "storm",
                         "--log-level", "error"])
        url = f"http://{server.host}:{server.port}"
        times: list[float] = []
        statuses: dict[str, int] = {}
        stop = threading.Event()
        lock = threading.Lock()

        def victim() -> None:
            body = {"model": "storm", "prompt": "hello", "max_tokens": 3000, "ignore_eos": True,
                    "stream": True}
            with httpx.Client(timeout=120) as client:
                while not stop.is_set():
                    with client.stream("POST", url + "/v1/completions", json=body) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                times.append(time.perf_counter())

        worst = [(kind, chars) for kind in kinds]
        counter = itertools.count()

        def attacker(index: int) -> None:
            with httpx.Client(timeout=300) as client:
                while not stop.is_set():
                    n = next(counter)
                    kind, chars = worst[n % len(worst)]
                    body = body_of(make_grammar(kind, chars, f"c{index}n{n}"), "storm")
                    status = str(client.post(url + "/v1/completions", json=body).status_code)
                    with lock:
                        statuses[status] = statuses.get(status, 0) + 1

        try:
            watcher = threading.Thread(target=victim, daemon=True)
            watcher.start()
            time.sleep(1.0)
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                for index in range(clients):
                    pool.submit(attacker, index)
                time.sleep(seconds)
                stop.set()
            end = time.perf_counter()
            watcher.join(30)
            alive = server.proc.poll() is None
        finally:
            stop.set()
            server.stop()
    gaps = [b - a for a, b in itertools.pairwise(times) if b >= start and a <= end]
    worst_gap = max(gaps, default=0.0)
    return StormRecord(clients=clients, seconds=seconds, step_ms=step_ms,
                       victim_tokens=len(gaps),
                       victim_gap_median_ms=round(1e3 * statistics.median(gaps), 2) if gaps else 0.0,
                       victim_gap_max_ms=round(1e3 * worst_gap, 2),
                       victim_gap_max_steps=round(1e3 * worst_gap / step_ms, 1),
                       statuses=statuses, server_alive=alive)


def format_compile_table(records: list[CompileRecord]) -> str:
    lines = ["grammar compile time (medians; check: a grammar worker's lower + compile + first "
             "mask; engine: compiling the lowered text)",
             f"{'kind':<13} {'chars':>7} {'check ms':>9} {'engine ms':>10}  refused"]
    for r in records:
        check = f"{r.check_ms:.1f}" if r.check_ms is not None else "-"
        engine = f"{r.engine_ms:.1f}" if r.engine_ms is not None else "-"
        lines.append(f"{r.kind:<13} {r.chars:>7} {check:>9} {engine:>10}  {r.refused or ''}")
    return "\n".join(lines)


def format_storm(record: StormRecord) -> str:
    return (f"grammar storm: {record.clients} clients x {record.seconds:g} s of distinct 56 KB "
            f"worst-case grammars, {record.step_ms:g} ms device steps\n"
            f"  victim stream: {record.victim_tokens} tokens, median gap "
            f"{record.victim_gap_median_ms:.1f} ms, worst {record.victim_gap_max_ms:.1f} ms "
            f"({record.victim_gap_max_steps:.1f} steps)\n"
            f"  grammars answered: {dict(sorted(record.statuses.items()))}; server "
            f"{'still running' if record.server_alive else 'EXITED'}")

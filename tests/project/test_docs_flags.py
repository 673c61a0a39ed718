"""Every flag the docs show exists. The `python -m atombatch.serve[.ray]` command lines of fenced
blocks are parsed by the parsers the programs use (an unknown flag exits with status 2); every
`python -m atombatch...` command anywhere in code (inline, fenced, indented; every bench
subcommand) names only flags its program's parser has."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from atombatch.bench.__main__ import SUBCOMMANDS
from atombatch.serve.cli import parser as serve_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "docs" / "records").glob("*.md"))]


def commands(text: str) -> list[list[str]]:
    """The argument lists of the `python -m atombatch.serve...` commands in fenced blocks."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split(" &")[0].split("  #")[0].strip()
            line = re.sub(r"\[(--[^\]]*)\]", r"\1", line)  # "[--flag VALUE]": optional, still a flag
            if line.startswith(("python -m atombatch.serve ", "python -m atombatch.serve.ray ")):
                found.append(shlex.split(line)[2:])
    return found


def engine_lists(text: str) -> list[list[str]]:
    """The `engine: [...]` argument lists of the KubeRay examples."""
    return [json.loads(m) for m in re.findall(r"engine: (\[[^\]]*\])", text, flags=re.S)]


def parse(argv: list[str]) -> None:
    if argv[0] == "atombatch.serve.ray":
        from atombatch.serve.ray import _parser
        _, rest = _parser().parse_known_args(argv[1:])
        serve_parser().parse_args(rest)
    else:
        serve_parser().parse_args(argv[1:])


CASES = [(doc.name, argv) for doc in DOCS for argv in commands(doc.read_text())] + \
    [(doc.name, ["atombatch.serve.ray", *argv]) for doc in DOCS
     for argv in engine_lists(doc.read_text())]


def test_the_docs_show_serve_commands() -> None:
    assert any(argv[0] == "atombatch.serve.ray" for _, argv in CASES)
    assert sum(argv[0] == "atombatch.serve" for _, argv in CASES) >= 3


@pytest.mark.parametrize(("doc", "argv"), CASES, ids=[f"{d}:{' '.join(a)[:60]}" for d, a in CASES])
def test_every_documented_flag_exists(doc: str, argv: list[str]) -> None:
    parse(argv)


# -- every flag of every documented command line, inline code and indented blocks included ------
class _Parsed(Exception):
    """Raised instead of parsing: the parser a program builds, caught before it runs."""


def program_flags(program: str) -> set[str]:
    """Option strings of `python -m <program>` (a bench subcommand's parser built by its main)."""
    import argparse
    import importlib
    from unittest import mock

    if program == "atombatch.serve":
        parsers = [serve_parser()]
    elif program == "atombatch.serve.ray":
        from atombatch.serve.ray import _parser
        parsers = [_parser(), serve_parser()]
    elif program == "atombatch.bench":  # the short default run (no subcommand)
        from atombatch.bench.__main__ import default_parser
        parsers = [default_parser()]
    else:
        built: list[argparse.ArgumentParser] = []

        def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
            built.append(self)
            raise _Parsed

        module = importlib.import_module(program)
        with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), \
                mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture), \
                pytest.raises(_Parsed):
            module.main([])
        parsers = built
    return {flag for p in parsers for action in p._actions for flag in action.option_strings}


def documented_commands(text: str) -> list[tuple[str, str]]:
    """(program, command line) of every `python -m atombatch...` in code: inline spans, fenced and
    indented blocks (continuation lines joined, comments dropped)."""
    found = []
    for span in re.findall(r"`(python -m atombatch[^`]*)`", text):
        found.append(" ".join(span.split()))
    joined = text.replace("\\\n", " ")
    for line in joined.splitlines():
        line = line.strip().removeprefix("$ ")
        if line.startswith("python -m atombatch"):
            found.append(line.split("  #")[0].split(" &")[0].split("`")[0])
    out = []
    for command in found:
        words = command.split()
        program = words[2]
        if program == "atombatch.bench" and len(words) > 3 and not words[3].startswith(("-", "[")):
            program = f"atombatch.bench.{words[3]}"
        out.append((program, command))
    return out


FLAG_CASES = sorted({(doc.name, program, command) for doc in DOCS
                     for program, command in documented_commands(doc.read_text())})


def test_the_docs_show_bench_commands_in_every_form() -> None:
    programs = {program for _, program, _ in FLAG_CASES}
    assert {"atombatch.bench.serve", "atombatch.bench.http", "atombatch.bench.cluster",
            "atombatch.serve", "atombatch.serve.ray"} <= programs


@pytest.mark.parametrize(("doc", "program", "command"), FLAG_CASES,
                         ids=[f"{d}:{c[10:70]}" for d, _, c in FLAG_CASES])
def test_every_documented_flag_name_exists(doc: str, program: str, command: str) -> None:
    if program.startswith("atombatch.bench.") and program.rsplit(".", 1)[1] not in SUBCOMMANDS:
        pytest.fail(f"{doc}: {command!r} names no bench subcommand ({', '.join(SUBCOMMANDS)})")
    flags = set(re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", command.split(" ", 3)[-1]))
    unknown = sorted(flags - program_flags(program))
    assert not unknown, f"{doc}: {command!r}: {program} has no {', '.join(unknown)}"


def test_a_flag_no_parser_has_is_caught() -> None:
    (case,) = documented_commands("run `python -m atombatch.bench serve --no-plots --json x`")
    assert case == ("atombatch.bench.serve", "python -m atombatch.bench serve --no-plots --json x")
    with pytest.raises(AssertionError, match="has no --no-plots"):
        test_every_documented_flag_name_exists("x.md", *case)

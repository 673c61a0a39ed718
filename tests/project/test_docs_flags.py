"""Every flag the docs show on a `python -m atombatch.serve[.ray]` command line exists: each
command is parsed by the parsers the programs use (an unknown flag exits with status 2)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from atombatch.serve.cli import parser as serve_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


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

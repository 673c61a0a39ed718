"""The README's embedding example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_embedding_example_runs(capsys):
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    example = blocks[0]
    assert len(example.strip().splitlines()) <= 12
    exec(compile(example, str(README), "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].endswith("length")
    assert len(lines) == 8  # one streamed output per generated token


def test_readme_quick_start_is_two_commands_and_ci_runs_the_second():
    text = README.read_text()
    quick = re.search(r"## Quick start.*?```bash\n(.*?)```", text, flags=re.S).group(1)
    commands = [line for line in quick.strip().splitlines() if line.strip()]
    assert len(commands) == 2 and "python -m atombatch.bench" in commands[0]
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1] in ci

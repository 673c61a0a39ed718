"""docs/architecture.md's module table names every module of `atombatch/`, and names nothing else.

A module is named by its path under `atombatch/` in backticks anywhere in the table
(`` `serve/limits.py` ``), or by its file name in backticks in the row of its package, the row whose
first cell names the package's directory (`` `core/` `` ... `` `client.py` ``); that row also
stands for the package's `__init__.py`. The compiled `_blocks.pyx` counts as a module.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "atombatch"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def modules() -> list[str]:
    """Every module's path under `atombatch/` (`engine.py`, `serve/ray/router.py`, `_blocks.pyx`)."""
    found = [path.relative_to(PACKAGE).as_posix()
             for pattern in ("*.py", "*.pyx") for path in PACKAGE.rglob(pattern)]
    return sorted(found)


def table_rows(text: str) -> list[tuple[list[str], list[str]]]:
    """The rows of the "## Modules" table: (the names in backticks in the first cell, the names in
    backticks anywhere in the row). A row's first cell holds no `|`; its description may."""
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("|") or line.startswith("|---") or line.startswith("| module |"):
            continue
        first = line[1:].split("|", 1)[0]
        rows.append((re.findall(r"`([^`]+)`", first), re.findall(r"`([^`]+)`", line)))
    return rows


def unnamed(names: list[str], text: str) -> list[str]:
    """The modules among `names` that the table of `text` does not name."""
    rows = table_rows(text)
    anywhere = {token for _, tokens in rows for token in tokens}
    missing = []
    for module in names:
        if module in anywhere:
            continue
        directory, _, file_name = module.rpartition("/")
        if directory:
            package_rows = [tokens for first, tokens in rows if f"{directory}/" in first]
            if package_rows and (file_name == "__init__.py"
                                 or any(file_name in tokens for tokens in package_rows)):
                continue
        missing.append(module)
    return missing


def test_the_table_names_every_module_of_the_package() -> None:
    names = modules()
    assert "engine/batcher.py" in names and "serve/app.py" in names and "kernel/_blocks.pyx" in names
    missing = unnamed(names, ARCHITECTURE.read_text())
    assert not missing, f"docs/architecture.md's module table does not name: {missing}"


def test_every_path_in_the_tables_first_column_exists() -> None:
    stale = [name for first, _ in table_rows(ARCHITECTURE.read_text()) for name in first
             if name.endswith((".py", ".pyx", "/")) and not (PACKAGE / name).exists()]
    assert not stale, f"docs/architecture.md's module table names what atombatch/ lacks: {stale}"


def test_the_check_sees_a_module_left_out_and_a_module_named_in_its_package_row() -> None:
    """The rule itself, on a table written here: a top-level module needs its own name, a
    subpackage's module its name in its package's row (another row's mention does not count)."""
    text = ("# A\n\n## Modules\n\n| module | what it owns |\n|---|---|\n"
            "| `engine.py` | the engine; not `kv_manager` |\n"
            "| `core/` | `client.py` (the client), a `[a|b]` pipe |\n"
            "| `serve/` | `serve/limits.py`; `messages.py` |\n\n## Layers\n\n| `policy.py` | x |\n")
    names = ["engine.py", "kv_manager.py", "policy.py", "core/__init__.py", "core/client.py",
             "core/messages.py", "serve/limits.py", "serve/app.py", "bench/__init__.py"]
    assert unnamed(names, text) == ["kv_manager.py", "policy.py", "core/messages.py",
                                    "serve/app.py", "bench/__init__.py"]

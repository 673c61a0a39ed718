"""DEVELOPERS.md's "Test layout" section describes tests/ as it is.

- every path it names in backticks exists: a test file (`test_scheduler.py`, `core/test_core_process.py`,
  a glob such as `test_pd*.py`), a helper (`support/served.py`, `tests/support/ledger.py`) or a
  directory (`engine/overlap/`); a bare file name is looked for anywhere under tests/;
- every directory of tests/ that holds test files, and every helper module in tests/support/, is
  named there (`engine/overlap/`, `overlap.py`), so a new area or helper gets its line;
- no test file imports another (shared code lives in tests/support/), which is what lets the
  layout move files between areas.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
DEVELOPERS = ROOT / "DEVELOPERS.md"


def layout_section(text: str) -> str:
    """The text of the "## Test layout" section, up to the next second-level heading."""
    return text.split("\n## Test layout\n", 1)[1].split("\n## ", 1)[0]


def named_paths(section: str) -> list[str]:
    """The backticked names in `section` that are paths: no spaces, not a URL route (`/ping`), a
    flag or a placeholder or tag (`tests/<area>/`, `</think>`), and a file (`.py`) or something
    with a directory in it."""
    names = []
    for token in re.findall(r"`([^`\s]+)`", section):
        if token.startswith(("/", "-")) or "<" in token:
            continue
        if token.endswith(".py") or "/" in token:
            names.append(token)
    return names


def exists(name: str, tests: Path = TESTS) -> bool:
    """Whether `name` is a path under the repository or under tests/, or (a bare file name or
    glob) the name of a file somewhere under tests/."""
    root = tests.parent
    for base in (root, tests):
        if any(base.glob(name.rstrip("/"))):
            return True
    return "/" not in name and any(tests.rglob(name))


def test_every_path_the_section_names_exists() -> None:
    section = layout_section(DEVELOPERS.read_text())
    names = named_paths(section)
    assert "support/" in names and any(name.startswith("test_") for name in names)
    missing = [name for name in names if not exists(name)]
    assert not missing, f"DEVELOPERS.md's test layout names what tests/ lacks: {missing}"


def test_every_test_directory_and_helper_is_named() -> None:
    section = layout_section(DEVELOPERS.read_text())
    names = set(re.findall(r"`([^`\s]+)`", section))
    areas = sorted({path.parent.relative_to(TESTS).as_posix() + "/"
                    for path in TESTS.rglob("test_*.py")})
    assert "engine/" in areas and "engine/overlap/" in areas
    unnamed_areas = [area for area in areas if area not in names]
    assert not unnamed_areas, f"DEVELOPERS.md's test layout does not name {unnamed_areas}"
    helpers = sorted(path.name for path in (TESTS / "support").glob("*.py")
                     if path.name != "__init__.py")
    unnamed_helpers = [helper for helper in helpers
                       if not {helper, f"support/{helper}", f"tests/support/{helper}"} & names]
    assert not unnamed_helpers, f"DEVELOPERS.md's test layout does not name {unnamed_helpers}"


def imported_modules(path: Path) -> list[str]:
    """The top-level names of every module `path` imports, at any depth of its code, and the
    modules named by `from X import` / `import X` lines inside its string literals (a script
    a test hands to a child process)."""
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names += re.findall(r"^\s*(?:from|import)\s+([\w.]+)", node.value, flags=re.M)
    return names


def test_no_test_file_imports_another() -> None:
    test_modules = {path.stem for path in TESTS.rglob("test_*.py")}
    offenders = {}
    for path in TESTS.rglob("*.py"):
        if "fakerebel" in path.parts:
            continue
        wrong = sorted({name for name in imported_modules(path)
                        if name.split(".")[0] in test_modules | {"conftest"}})
        if wrong:
            offenders[path.relative_to(TESTS).as_posix()] = wrong
    assert not offenders, f"test modules imported outside pytest's collection: {offenders}"


def test_the_checks_see_a_stale_name_and_an_import_of_a_test(tmp_path: Path) -> None:
    """The rules themselves, on a tree and a section written here."""
    tests = tmp_path / "tests"
    (tests / "engine" / "overlap").mkdir(parents=True)
    (tests / "engine" / "overlap" / "test_overlap.py").write_text("")
    (tests / "support").mkdir()
    (tests / "support" / "overlap.py").write_text("")
    section = layout_section("# D\n\n## Test layout\n\n`engine/overlap/`, `test_overlap.py`, "
                             "`test_over*.py`, `support/overlap.py`, `test_gone.py`, "
                             "`engine/gone/`, `/v1/models/{id}`, `--flag`, `impl`, `tests/<area>/`, "
                             "`</think>`\n\n## Next\n"
                             "`test_after.py`\n")
    names = named_paths(section)
    assert names == ["engine/overlap/", "test_overlap.py", "test_over*.py", "support/overlap.py",
                     "test_gone.py", "engine/gone/"]
    assert [name for name in names if not exists(name, tests)] == ["test_gone.py", "engine/gone/"]
    script = tmp_path / "test_child.py"
    script.write_text('import os\nCODE = """\nimport sys\nfrom test_other import x\n"""\n'
                      "def f():\n    from support.overlap import greedy\n")
    assert sorted(imported_modules(script)) == ["os", "support.overlap", "sys", "test_other"]

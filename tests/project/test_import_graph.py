"""The import graph of `atombatch/`: no circle, no upward arrow (docs/architecture.md, "Layers").

The graph is read with `ast` from every module's source, so an import inside a function (a lazy
import) or under `TYPE_CHECKING` is an arrow like any other: a circle hidden behind a lazy import is
still a circle. The nodes are atombatch's own modules (`_blocks.pyx` included, its Python imports
read from the source); an import of another distribution (the optional ones, `rebel`, `ray`,
`transformers`, imported lazily where they are used) is no arrow of this graph, and the last test
checks those stay out of a plain `import atombatch`.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "atombatch"

#: Lowest first. A module may import its own layer or a lower one; the areas are the first name
#: under `atombatch`: a folder, or one of the two foundation modules. Keep this table and
#: docs/architecture.md in step.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("errors", "logs")),
    ("kernel", ("kernel",)),
    ("artifact", ("artifact",)),
    ("api", ("api",)),
    ("sampling", ("sampling",)),
    ("device", ("pd", "runtime")),
    ("engine", ("engine",)),
    ("facade", ("__init__",)),
    ("processes", ("core", "cluster")),
    ("front", ("serve",)),
    ("tools", ("bench",)),
)
LAYER_OF = {area: rank for rank, (_, areas) in enumerate(LAYERS) for area in areas}
EXTENSION = "atombatch.kernel._blocks"


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its `__init__.py`)."""
    found = {EXTENSION: PACKAGE / "kernel" / "_blocks.pyx"}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported_names(module: str, path: Path) -> list[tuple[str, int]]:
    """(dotted name, line) of every import in the module, wherever it sits in the file."""
    if path.suffix == ".pyx":  # Cython: its Python-level imports, read line by line
        text = path.read_text()
        return [(m.group(1), text.count("\n", 0, m.start()) + 1)
                for m in re.finditer(r"^\s*(?:from|import)\s+(atombatch[\w.]*)", text, flags=re.M)]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the importing module's package
                base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from package import name`: an arrow to the submodule when `name` is one
            names += [(f"{source}.{alias.name}", node.lineno) for alias in node.names]
    return names


def graph() -> dict[str, dict[str, int]]:
    """module -> {imported atombatch module: line of the first such import}."""
    mods = modules()
    edges: dict[str, dict[str, int]] = {}
    for module, path in mods.items():
        out = edges.setdefault(module, {})
        for name, line in _imported_names(module, path):
            while name and name not in mods:  # `a.b.C` (a class) -> `a.b`; `a.b` -> `a` if no module
                name = name.rpartition(".")[0]
            if name.startswith("atombatch") and name != module:
                out.setdefault(name, line)
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_graph_sees_lazy_and_cython_imports() -> None:
    edges = graph()
    assert "atombatch.kernel.codes" in edges[EXTENSION]               # _blocks.pyx's Python import
    assert "atombatch.runtime.rebel" in edges["atombatch.serve.cli"]   # a lazy one, in a function
    assert "atombatch.serve.app" in edges["atombatch.serve"]          # `from pkg.mod import X`
    assert "atombatch.pd.checks" in edges["atombatch.engine.pd_intake"]      # `from pkg import mod`


def test_cycles_finds_a_circle_through_a_lazy_import() -> None:
    edges = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 9}, "d": {"a": 1}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_circle() -> None:
    edges = graph()
    described = [
        "\n".join(f"  {a} -> {b} (line {edges[a][b]})" for a in component for b in edges[a]
                  if b in component)
        for component in cycles(edges)]
    assert not described, "import circles:\n" + "\n\n".join(described)


def test_every_module_has_a_layer() -> None:
    unplaced = sorted({area(m) for m in modules()} - LAYER_OF.keys())
    assert not unplaced, f"put {unplaced} in LAYERS (and docs/architecture.md's Layers)"


def test_no_upward_arrow() -> None:
    upward = [f"{a} ({LAYERS[LAYER_OF[area(a)]][0]}) -> {b} ({LAYERS[LAYER_OF[area(b)]][0]}), "
              f"line {line}"
              for a, out in sorted(graph().items()) for b, line in out.items()
              if LAYER_OF.get(area(b), -1) > LAYER_OF.get(area(a), len(LAYERS))]
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_the_wire_is_a_leaf() -> None:
    """core/messages.py (what front and core say) imports only the layers up to api/ (the values),
    never the engine or cluster/ whose reports it carries (issue 40)."""
    edges = graph()
    out = edges["atombatch.core.messages"]
    assert out, "the wire imports its structs from somewhere"
    above = {m: line for m, line in out.items() if LAYER_OF[area(m)] > LAYER_OF["api"]}
    assert not above, f"core/messages.py imports above the api layer: {above}"


def test_the_layers_are_the_documented_ones() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    for name, areas in LAYERS:
        row = next((line for line in section.splitlines() if line.startswith(f"| {name} |")), None)
        assert row is not None, f"docs/architecture.md's Layers has no row {name!r}"
        listed = re.findall(r"`([\w/]+?)/?`", row.split("|")[2])
        assert sorted(a if a != "__init__" else "atombatch" for a in areas) == sorted(listed), row


def test_optional_dependencies_stay_out_of_a_plain_import() -> None:
    optional = ["ray", "rebel", "transformers", "torch", "matplotlib", "vllm"]
    code = ("import sys, atombatch, atombatch.runtime, atombatch.serve, atombatch.pd, "
            "atombatch.core, atombatch.cluster, atombatch.bench, atombatch.artifact.rbln_config; "
            f"print(sorted(m for m in {optional!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    assert out.stdout.strip() == "[]", "a plain import of atombatch imports " + out.stdout


def test_the_vllm_scheduler_probe_imports_nothing_of_atombatch() -> None:
    """bench/vllm_scheduler_probe.py runs in vLLM's own venv, where atombatch is not installed;
    bench/vllm_scheduler.py, which micro and the cases import, imports none of atombatch either."""
    edges = graph()
    assert edges["atombatch.bench.vllm_scheduler_probe"] == {}
    assert edges["atombatch.bench.vllm_scheduler"] == {}
    assert "atombatch.bench.vllm_scheduler" in edges["atombatch.bench.cases"]

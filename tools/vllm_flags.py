"""List every flag of `vllm serve` from a vLLM wheel, without installing or importing vLLM.

    python tools/vllm_flags.py vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl \
        -o docs/vllm-flags/vllm-0.34.0.txt
    python tools/vllm_flags.py vllm_rbln-0.12.0-py3-none-any.whl -o docs/vllm-flags/vllm-rbln-0.12.0.txt

(`pip download --no-deps -d DIR vllm==X` fetches a wheel.) The wheel's sources are read as text
and walked with `ast`: `make_arg_parser` (the serve subcommand's own flags), the frontend argument
dataclasses (`BaseFrontendArgs` / `FrontendArgs`: every field is a flag), and
`EngineArgs.add_cli_args` / `AsyncEngineArgs.add_cli_args` (each `add_argument` call, whose
arity comes from its explicit keywords or, for `**x_kwargs["field"]`, from the field's type
annotation, the way vLLM's `get_kwargs` derives it: a `bool` field is a `--x` / `--no-x` pair, a
`bool | str | None` field takes an optional value, a list takes one or more, anything else one).
A vllm-rbln wheel gives its `--rbln-*` flags (the fields of its config classes).

One line per option string: `FLAG ARITY DEST`, sorted; ARITY is `switch` (no value), `value`,
`values` (one or more) or `optional` (zero or one). `#` lines carry the source.

    python tools/vllm_flags.py --table docs/from-vllm.md

rewrites docs/from-vllm.md's flag table from atombatch/serve/vllm_flags.py (each flag's fate).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Flag:
    names: list[str]
    arity: str
    dest: str


@dataclass
class Sources:
    """The wheel's Python files, parsed on demand, with an index of their classes."""

    archive: zipfile.ZipFile
    trees: dict[str, ast.Module] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    prefix: str = "vllm/"

    def tree(self, path: str) -> ast.Module:
        if path not in self.trees:
            self.trees[path] = ast.parse(self.archive.read(path).decode(), path)
        return self.trees[path]

    def find(self, *candidates: str) -> str:
        names = set(self.archive.namelist())
        for path in candidates:
            if path in names:
                return path
        raise SystemExit(f"none of {', '.join(candidates)} in the wheel")

    def index_classes(self, prefix: str) -> None:
        self.prefix = prefix

    def class_named(self, name: str) -> ast.ClassDef | None:
        """The first class `name` in the package's files (found by text, then parsed)."""
        if name not in self.classes:
            needle = f"class {name}".encode()
            for path in self.archive.namelist():
                if not (path.startswith(self.prefix) and path.endswith(".py")):
                    continue
                if needle not in self.archive.read(path):
                    continue
                for node in ast.walk(self.tree(path)):
                    if isinstance(node, ast.ClassDef) and node.name == name:
                        self.classes[name] = node
                        return node
            return None
        return self.classes[name]

    def fields(self, name: str) -> dict[str, tuple[str, ast.AnnAssign]]:
        """A dataclass's fields (bases first), name -> (annotation text, node)."""
        cls = self.class_named(name)
        if cls is None:
            return {}
        out: dict[str, tuple[str, ast.AnnAssign]] = {}
        for base in cls.bases:
            if isinstance(base, ast.Name):
                out.update(self.fields(base.id))
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                text = ast.unparse(stmt.annotation)
                if not text.startswith(("ClassVar", "typing.ClassVar")):
                    out[stmt.target.id] = (text, stmt)
        return out


def arity_of_annotation(text: str) -> str:
    """vLLM's `get_kwargs` rule for a field annotation."""
    parts = {p.strip() for p in re.split(r"\|(?![^\[]*\])", text)}
    if parts == {"bool", "str", "None"}:
        return "optional"
    if "bool" in parts:
        return "switch"
    if any(p.startswith(("list[", "tuple[", "set[", "List[", "Tuple[", "Set["))
           for p in parts) and not text.startswith("Literal"):
        return "values"
    return "value"


def keyword_arity(call: ast.Call) -> str | None:
    """The arity an `add_argument` call states with `action=` / `nargs=`, if it does."""
    for kw in call.keywords:
        if kw.arg == "nargs" and isinstance(kw.value, ast.Constant):
            return {"?": "optional", "+": "values", "*": "values"}.get(str(kw.value.value),
                                                                       "value")
        if kw.arg == "action":
            text = ast.unparse(kw.value)
            if text.strip("'\"") in ("store_true", "store_false", "count", "store_const"):
                return "switch"
            if "BooleanOptionalAction" in text:
                return "bool-pair"
            if text.strip("'\"") == "append":
                return "value"
    return None


def overrides(function: ast.AST) -> dict[tuple[str, str], dict[str, str]]:
    """`x_kwargs["field"]["nargs"|"action"] = ...` and `del x_kwargs["field"]["nargs"]`."""
    out: dict[tuple[str, str], dict[str, str]] = {}
    for node in ast.walk(function):
        targets: list[ast.expr] = []
        value = ""
        if isinstance(node, ast.Assign):
            targets, value = node.targets, ast.unparse(node.value)
        elif isinstance(node, ast.Delete):
            targets, value = node.targets, "<del>"
        for target in targets:
            if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Subscript)
                    and isinstance(target.value.value, ast.Name)
                    and isinstance(target.slice, ast.Constant)
                    and isinstance(target.value.slice, ast.Constant)):
                key = (target.value.value.id, str(target.value.slice.value))
                out.setdefault(key, {})[str(target.slice.value)] = value
    return out


def apply_overrides(arity: str, changes: dict[str, str]) -> str:
    if "action" in changes:
        action = changes["action"]
        if "BooleanOptionalAction" in action:
            return "bool-pair"
        if action.strip("'\"") in ("store_true", "store_false"):
            return "switch"
        if action.strip("'\"") == "append":
            return "value"
    if changes.get("nargs") == "<del>":
        return "value"
    if "nargs" in changes:
        return {"'?'": "optional", "'+'": "values", "'*'": "values"}.get(changes["nargs"], arity)
    return arity


def kwargs_classes(function: ast.AST) -> dict[str, str]:
    """`x_kwargs = get_kwargs(Class)` -> {"x_kwargs": "Class"}."""
    out = {}
    for node in ast.walk(function):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "get_kwargs"
                and node.value.args and isinstance(node.value.args[0], ast.Name)):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value.args[0].id
    return out


def field_arity(src: Sources, cls: str, name: str) -> str:
    fields = src.fields(cls)
    if name not in fields:
        return "value"
    arity = arity_of_annotation(fields[name][0])
    return "bool-pair" if arity == "switch" else arity


def add_argument_calls(src: Sources, function: ast.AST, flags: list[Flag]) -> None:
    classes = kwargs_classes(function)
    changes = overrides(function)
    for node in ast.walk(function):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        names = [a.value for a in node.args
                 if isinstance(a, ast.Constant) and isinstance(a.value, str)
                 and a.value.startswith("-")]
        if not names:
            continue
        arity = keyword_arity(node)
        dest = max(names, key=len).lstrip("-").replace("-", "_")
        spread = [kw.value for kw in node.keywords if kw.arg is None]
        for value in list(spread):  # **{**x_kwargs["field"], "default": None}
            if isinstance(value, ast.Dict):
                spread += [v for k, v in zip(value.keys, value.values, strict=True) if k is None]
                stated = {str(k.value): ast.unparse(v) for k, v in zip(value.keys, value.values, strict=True)
                          if isinstance(k, ast.Constant) and k.value in ("action", "nargs")}
                if stated:
                    arity = apply_overrides(arity or "value", stated)
        for kw in node.keywords:
            if kw.arg == "dest" and isinstance(kw.value, ast.Constant):
                dest = str(kw.value.value)
        for value in spread:
            if (isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name)
                    and isinstance(value.slice, ast.Constant)):
                var, fname = value.value.id, str(value.slice.value)
                dest = fname
                if arity is None:
                    arity = field_arity(src, classes.get(var, ""), fname)
                    arity = apply_overrides(arity, changes.get((var, fname), {}))
        if arity is None:
            arity = "value"
        flags.append(Flag(names, arity, dest))


def function_named(tree: ast.AST, name: str, in_class: str | None = None) -> ast.AST | None:
    for node in ast.walk(tree):
        if in_class is not None:
            if isinstance(node, ast.ClassDef) and node.name == in_class:
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == name:
                        return item
        elif isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def frontend_flags(src: Sources, path: str, flags: list[Flag]) -> None:
    """Every field of the frontend dataclasses, with `_customize_cli_kwargs`'s changes."""
    tree = src.tree(path)
    classes = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
               and n.name in ("BaseFrontendArgs", "FrontendArgs")]
    changes: dict[tuple[str, str], dict[str, str]] = {}
    extra: dict[str, list[str]] = {}
    for name in classes:
        function = function_named(tree, "_customize_cli_kwargs", name) or \
            function_named(tree, "add_cli_args", name)
        if function is None:
            continue
        for (_, fname), change in overrides(function).items():
            changes.setdefault(fname, {}).update(change)
        for node in ast.walk(function):  # frontend_kwargs["x"]["flags"] = ["-y"]
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.List)
                    and isinstance(node.targets[0], ast.Subscript)
                    and isinstance(node.targets[0].slice, ast.Constant)
                    and node.targets[0].slice.value == "flags"
                    and isinstance(node.targets[0].value, ast.Subscript)
                    and isinstance(node.targets[0].value.slice, ast.Constant)):
                extra[str(node.targets[0].value.slice.value)] = [
                    e.value for e in node.value.elts if isinstance(e, ast.Constant)]
        # FrontendArgs may add arguments by hand too
        add_argument_calls(src, function, flags)
    fields: dict[str, tuple[str, ast.AnnAssign]] = {}
    for name in classes:
        fields.update(src.fields(name))
    for fname, (annotation, _) in fields.items():
        arity = arity_of_annotation(annotation)
        arity = "bool-pair" if arity == "switch" else arity
        arity = apply_overrides(arity, changes.get(fname, {}))
        flags.append(Flag([*extra.get(fname, []), f"--{fname.replace('_', '-')}"], arity, fname))


def vllm_flags(src: Sources) -> list[Flag]:
    src.index_classes("vllm/")
    flags: list[Flag] = []
    cli_args = src.find("vllm/entrypoints/common/cli_args.py",
                        "vllm/entrypoints/launchers/cli_args.py",
                        "vllm/entrypoints/openai/cli_args.py")
    make = function_named(src.tree(cli_args), "make_arg_parser")
    assert make is not None, "make_arg_parser not found"
    add_argument_calls(src, make, flags)
    frontend_flags(src, cli_args, flags)
    arg_utils = src.tree("vllm/engine/arg_utils.py")
    for cls in ("EngineArgs", "AsyncEngineArgs"):
        function = function_named(arg_utils, "add_cli_args", cls)
        assert function is not None, f"{cls}.add_cli_args not found"
        add_argument_calls(src, function, flags)
    return flags


def rbln_flags(src: Sources) -> list[Flag]:
    """vllm-rbln's `--rbln-*` flags: the fields of its config classes (not `no_flag` ones)."""
    src.index_classes("vllm_rbln/")
    flags: list[Flag] = []
    seen: set[str] = set()
    for cls in ("OptimumRBLNConfig", "RBLNConfig"):
        for fname, (annotation, node) in src.fields(cls).items():
            if fname in seen or "no_flag" in ast.unparse(node) or "_DERIVED" in ast.unparse(node) \
                    or "_NO_FLAG" in ast.unparse(node):
                continue
            seen.add(fname)
            arity = arity_of_annotation(annotation)
            arity = "bool-pair" if arity == "switch" else arity
            flags.append(Flag([f"--rbln-{fname.replace('_', '-')}"], arity, f"rbln_{fname}"))
    return flags


def lines(flags: list[Flag]) -> list[str]:
    out: dict[str, str] = {}
    for flag in flags:
        for name in flag.names:
            arity = "switch" if flag.arity == "bool-pair" else flag.arity
            out.setdefault(name, f"{name} {arity} {flag.dest}")
            if flag.arity == "bool-pair" and name.startswith("--"):
                negated = f"--no-{name[2:]}"
                out.setdefault(negated, f"{negated} switch {flag.dest}")
    return [out[name] for name in sorted(out)]


FLAGS_DIR = Path(__file__).resolve().parents[1] / "docs" / "vllm-flags"
TABLE_START, TABLE_END = "<!-- flags:start -->", "<!-- flags:end -->"
ORIGIN = {"-O": "vLLM's parser (`-O3`)"}  # flags of no list, and where they come from
FATE_WORDS = {"honoured": "honoured", "warn": "accepted, one warning", "refused": "refused"}


def listed() -> dict[str, list[str]]:
    """flag -> the lists of docs/vllm-flags/ that hold it (by version)."""
    found: dict[str, list[str]] = {}
    for path in sorted(FLAGS_DIR.glob("*.txt")):
        version = path.stem
        for line in path.read_text().splitlines():
            if line and not line.startswith("#"):
                found.setdefault(line.split()[0], []).append(version)
    return found


def table() -> str:
    """docs/from-vllm.md's flag table: every row of atombatch.serve.vllm_flags, its fate, why."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from atombatch.serve.cli import parser
    from atombatch.serve.vllm_flags import FLAGS, REASONS

    ours = parser()._option_string_actions
    where = listed()
    rows = ["| flag | in | fate | why |", "|---|---|---|---|"]
    for flag in sorted(FLAGS, key=lambda f: f.lstrip("-")):
        row = FLAGS[flag]
        versions = ", ".join(where.get(flag, [ORIGIN.get(flag, "earlier vLLM")]))
        if row.fate == "values":
            fate = f"honoured: {', '.join(f'`{v}`' for v in row.allowed)}; else refused"
            why = REASONS[row.reason]
        elif row.fate == "honoured" and not row.reason:
            fate = "honoured"
            main_spelling = ours[flag].option_strings[0]
            why = f"as `{main_spelling}`" if main_spelling != flag else "the same flag"
        else:
            fate, why = FATE_WORDS[row.fate], REASONS[row.reason]
        rows.append(f"| `{flag}` | {versions} | {fate} | {why} |")
    return "\n".join(rows)


def write_table(path: Path) -> None:
    text = path.read_text()
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    path.write_text(f"{head}{TABLE_START}\n{table()}\n{TABLE_END}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wheel", type=Path, nargs="?")
    p.add_argument("-o", "--output", type=Path, help="default: standard output")
    p.add_argument("--table", type=Path, metavar="MD",
                   help="instead: rewrite the flag table between the flags:start/end markers of "
                   "MD (docs/from-vllm.md) from atombatch.serve.vllm_flags")
    args = p.parse_args(argv)
    if args.table:
        write_table(args.table)
        return 0
    if args.wheel is None:
        p.error("give a wheel, or --table")
    with zipfile.ZipFile(args.wheel) as archive:
        src = Sources(archive)
        rbln = any(n.startswith("vllm_rbln/") for n in archive.namelist())
        flags = rbln_flags(src) if rbln else vllm_flags(src)
    text = "\n".join([f"# flags of {args.wheel.name}, read by tools/vllm_flags.py",
                      "# FLAG ARITY DEST", *lines(flags)]) + "\n"
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

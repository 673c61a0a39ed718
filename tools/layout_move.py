"""Rewrites old top-level module paths of atombatch to the folders by layer (issue 40, item 1).

Idempotent: run it on any tree (a branch made before the move) to bring its imports, patch targets
and file paths to the new layout. `--move` also performs the `git mv`s (once, on the old tree).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MOVES = {
    "codes": "kernel.codes", "_blocks": "kernel._blocks", "_blocks_py": "kernel._blocks_py",
    "blocks": "kernel.blocks", "prefix": "kernel.prefix",
    "config": "artifact.config", "rbln_config": "artifact.rbln_config", "plan": "artifact.plan",
    "policy": "api.policy", "structured": "api.structured", "structs": "api.structs",
    "validation": "api.validation", "reports": "api.reports", "mailbox": "api.mailbox",
    "sampling": "sampling.sampler", "argmax": "sampling.argmax", "grammar": "sampling.grammar",
    "grammar_check": "sampling.grammar_check", "detokenizer": "sampling.detokenizer",
    "engine": "engine.batcher", "overlap": "engine.pipeline", "scheduler": "engine.scheduler",
    "kv_manager": "engine.kv_manager", "request": "engine.request", "groups": "engine.groups",
    "outputs": "engine.outputs", "checkpoints": "engine.checkpoints",
    "pd_intake": "engine.pd_intake", "aio": "engine.aio",
}
# modules that moved between packages (dotted under atombatch)
NESTED = {"cluster.pd_pool": "pd.pool"}
FOLDERS = ("kernel", "artifact", "api", "sampling", "engine")
NEW_SUBMODULES = {new.split(".")[1] for new in MOVES.values()}
SUFFIXES = (".py", ".pyx", ".pxd", ".md", ".toml", ".txt", ".cfg", ".ini", ".sh", ".json", ".yaml",
            ".yml")


def _dotted(match: re.Match[str]) -> str:
    return "atombatch." + MOVES[match.group(1)]


def _pattern() -> tuple[re.Pattern[str], re.Pattern[str]]:
    names = sorted(MOVES, key=len, reverse=True)
    alt = "|".join(re.escape(n) for n in names)
    sub = "|".join(sorted(NEW_SUBMODULES))
    # `atombatch.engine` is both an old module and a new folder: a name already under the folder
    # (`atombatch.engine.scheduler`) is left alone, so the rewrite can run twice.
    dotted = re.compile(rf"\batombatch\.({alt})(?!\w)(?!\.(?:{sub})\b)"
                        rf"(?!\s+import\s+(?:{sub})\b)")
    slashed = re.compile(rf"\batombatch/({alt})(\.pyx|\.pxd|\.py)\b")
    return dotted, slashed


def _from_import(match: re.Match[str]) -> str:
    indent, name, alias = match.group(1), match.group(2), match.group(3)
    folder, leaf = MOVES[name].split(".")
    alias = alias or ("" if leaf == name else f" as {name}")
    return f"{indent}from atombatch.{folder} import {leaf}{alias}"


def rewrite(text: str) -> str:
    for old, new in NESTED.items():
        text = re.sub(rf"\batombatch\.{re.escape(old)}\b", "atombatch." + new, text)
        text = re.sub(rf"\batombatch/{re.escape(old.replace('.', '/'))}\.py\b",
                      "atombatch/" + new.replace(".", "/") + ".py", text)
        package, leaf = old.rsplit(".", 1)
        new_package, new_leaf = new.rsplit(".", 1)
        alias = "" if leaf == new_leaf else f" as {leaf}"
        text = re.sub(rf"^(\s*)from atombatch\.{package} import {leaf}\b(?! as)",
                      rf"\1from atombatch.{new_package} import {new_leaf}{alias}", text, flags=re.M)
    dotted, slashed = _pattern()
    alt = "|".join(re.escape(n) for n in sorted(MOVES, key=len, reverse=True))
    text = dotted.sub(_dotted, text)
    text = slashed.sub(lambda m: "atombatch/" + MOVES[m.group(1)].replace(".", "/") + m.group(2),
                       text)
    return re.sub(rf"^(\s*)from atombatch import ({alt})( as \w+)?(?=\s*(?:#.*)?$)",
                  _from_import, text, flags=re.M)


def files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [ROOT / f for f in out if f.endswith(SUFFIXES) and not f.startswith("tools/layout_move")
            and not f.startswith("docs/records/") and not f.startswith("docs/bench/")]


def move() -> None:
    for folder in FOLDERS:
        (ROOT / "atombatch" / folder).mkdir(exist_ok=True)
    for old, new in MOVES.items():
        for suffix in (".py", ".pyx", ".pxd"):
            src = ROOT / "atombatch" / (old + suffix)
            if src.exists():
                dst = ROOT / "atombatch" / (new.replace(".", "/") + suffix)
                subprocess.run(["git", "mv", str(src), str(dst)], cwd=ROOT, check=True)
    for old, new in NESTED.items():
        src = ROOT / "atombatch" / (old.replace(".", "/") + ".py")
        if src.exists():
            subprocess.run(["git", "mv", str(src), str(ROOT / "atombatch" / (new.replace(".", "/")
                                                                             + ".py"))],
                           cwd=ROOT, check=True)


def main() -> None:
    if "--move" in sys.argv:
        move()
    changed = 0
    for path in files():
        if not path.exists():
            continue
        text = path.read_text()
        new = rewrite(text)
        if new != text:
            path.write_text(new)
            changed += 1
    print(f"rewrote {changed} files")


if __name__ == "__main__":
    main()

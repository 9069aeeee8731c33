#!/usr/bin/env python3
"""The module map of ``cupaged/``: who imports whom, read from the code.

Each module's package-internal imports, split into those made when it is
imported (module level) and those made on first use (inside a function,
which is how a few modules break an import cycle or keep CuPy out of a
CPU-only import). Modules are listed by depth: a module's depth is one more
than the deepest module it imports at load time, so every module-level
import points up the table.

    python3 scripts/module_map.py            # print the table (Markdown)
    python3 scripts/module_map.py --write    # replace it in docs/architecture.md
    python3 scripts/module_map.py --check    # exit 1 when the doc's table is stale

tests/test_docs.py checks that docs/architecture.md holds the current table.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cupaged"
DOC = ROOT / "docs" / "architecture.md"
START, END = "<!-- module-map:start (scripts/module_map.py --write) -->", "<!-- module-map:end -->"


def _imported(node: ast.ImportFrom) -> set[str]:
    """The package modules one relative import names (``from . import a, b``
    or ``from .a import x``)."""
    if node.level != 1:
        return set()
    return {node.module.split(".")[0]} if node.module else {a.name for a in node.names}


def imports() -> dict[str, tuple[set[str], set[str]]]:
    """``{module: (imported at load, imported on first use only)}`` for every
    module of the package (``__init__`` and ``__main__`` aside)."""
    modules = {p.stem: p for p in sorted(PACKAGE.glob("*.py")) if p.stem not in ("__init__", "__main__")}
    found = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        load = set().union(*(_imported(n) for n in tree.body if isinstance(n, ast.ImportFrom)))
        used = set().union(*(_imported(n) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)))
        found[name] = (load & modules.keys(), (used - load) & modules.keys())
    return found


def depths(found: dict[str, tuple[set[str], set[str]]]) -> dict[str, int]:
    """Each module's depth in the module-level import graph (0: imports no
    package module at load); ``ValueError`` naming a cycle's modules."""
    depth: dict[str, int] = {}
    visiting: set[str] = set()

    def visit(m: str) -> int:
        if m in depth:
            return depth[m]
        if m in visiting:
            raise ValueError(f"module-level import cycle through {sorted(visiting)}")
        visiting.add(m)
        depth[m] = 1 + max((visit(d) for d in found[m][0]), default=-1)
        visiting.discard(m)
        return depth[m]

    for m in found:
        visit(m)
    return depth


def render() -> str:
    """The Markdown table, one row per module, by depth then name."""
    found = imports()
    depth = depths(found)
    names = lambda mods: ", ".join(f"`{m}`" for m in sorted(mods)) or "–"  # noqa: E731
    rows = ["| depth | module | imports at load | on first use only |", "|---|---|---|---|"]
    for m in sorted(found, key=lambda m: (depth[m], m)):
        load, lazy = found[m]
        rows.append(f"| {depth[m]} | `{m}` | {names(load)} | {names(lazy)} |")
    return "\n".join(rows)


def doc_table(text: str) -> str | None:
    """The table between the markers of docs/architecture.md, or None."""
    if START not in text or END not in text:
        return None
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the table in docs/architecture.md")
    mode.add_argument("--check", action="store_true", help="exit 1 when docs/architecture.md's table is stale")
    args = p.parse_args(argv)
    table = render()
    if not (args.write or args.check):
        print(table)
        return 0
    text = DOC.read_text(encoding="utf-8")
    current = doc_table(text)
    if args.check:
        if current != table:
            print(f"{DOC.relative_to(ROOT)}: the module map is stale; run scripts/module_map.py --write",
                  file=sys.stderr)
            return 1
        return 0
    if current is None:
        print(f"{DOC.relative_to(ROOT)} has no {START} ... {END} markers", file=sys.stderr)
        return 1
    before, rest = text.split(START, 1)
    DOC.write_text(f"{before}{START}\n{table}\n{END}{rest.split(END, 1)[1]}", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

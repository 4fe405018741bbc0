"""Docs for readers: ``docs/architecture.md`` names every module once, in one short sentence, and
module docstrings orient in a few lines (theory of operation lives in ``docs/``).

An entry is a line ``- `name` — sentence`` in the "## Modules" section: ``blocks/pool`` for
``blocks/pool.py``, ``offload/tiers/`` for a package's ``__init__.py``, ``kvplane`` for the top one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kvplane"
DOC = ROOT / "docs" / "architecture.md"

MAX_ENTRY_CHARS = 200
MAX_DOCSTRING_LINES = 12

# Modules that implement a subtle mechanism keep its theory of operation at the top.
THEORY = {
    "pd/states.py",  # the transition tables: who decides, the ledger's release paths
    "transfer/planner.py",  # the planner's three steps (segments, folding, coalescing)
}

# Modules still waiting for a short docstring (none left: every theory moved to docs/).
PENDING: set[str] = set()

ALLOWED_LONG = THEORY | PENDING

ENTRY = re.compile(r"^- `([^`]+)` — \S")


def modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def entry_name(path: Path) -> str:
    """The name a module's entry uses: ``pkg/mod``, ``pkg/`` for a package, ``kvplane`` on top."""
    rel = path.relative_to(SRC)
    if rel.name == "__init__.py":
        return "kvplane" if rel.parent == Path() else f"{rel.parent.as_posix()}/"
    return rel.with_suffix("").as_posix()


def module_lines() -> list[str]:
    """The lines of the "## Modules" section, up to the next second-level heading."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    start = lines.index("## Modules")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start + 1 : end]


def entries() -> list[tuple[str, str]]:
    """(name, whole line) of every entry in the Modules section."""
    found = []
    for line in module_lines():
        m = ENTRY.match(line)
        if m:
            found.append((m.group(1), line))
        else:
            assert not line.startswith("- "), f"not an entry (- `name` — sentence): {line!r}"
    return found


def docstring_lines(path: Path) -> int:
    """Source lines of the module docstring, quotes included; 0 without one."""
    body = ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body
    if not body or not isinstance(body[0], ast.Expr):
        return 0
    node = body[0]
    if not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
        return 0
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def test_every_module_has_exactly_one_entry() -> None:
    names = [name for name, _ in entries()]
    expected = {entry_name(p) for p in modules()}
    twice = sorted({n for n in names if names.count(n) > 1})
    missing = sorted(expected - set(names))
    unknown = sorted(set(names) - expected)
    assert twice == [], f"modules with more than one entry: {twice}"
    assert missing == [], f"modules without an entry in docs/architecture.md: {missing}"
    assert unknown == [], f"entries naming no module under src/kvplane: {unknown}"


def test_every_entry_is_short() -> None:
    long = [f"{len(line)}: {name}" for name, line in entries() if len(line) > MAX_ENTRY_CHARS]
    assert long == [], f"entries over {MAX_ENTRY_CHARS} characters: {long}"


def test_module_docstrings_are_short() -> None:
    long = [
        f"{p.relative_to(SRC).as_posix()} ({n} lines)"
        for p in modules()
        if (n := docstring_lines(p)) > MAX_DOCSTRING_LINES
        and p.relative_to(SRC).as_posix() not in ALLOWED_LONG
    ]
    assert long == [], (
        f"module docstrings over {MAX_DOCSTRING_LINES} lines (move the theory to docs/): {long}"
    )


def test_allow_list_names_modules() -> None:
    stale = sorted(n for n in ALLOWED_LONG if not (SRC / n).is_file())
    assert stale == [], f"allow-listed files that do not exist: {stale}"


def test_entry_name_forms() -> None:
    assert entry_name(SRC / "__init__.py") == "kvplane"
    assert entry_name(SRC / "offload" / "tiers" / "__init__.py") == "offload/tiers/"
    assert entry_name(SRC / "blocks" / "pool.py") == "blocks/pool"
    assert entry_name(SRC / "__main__.py") == "__main__"

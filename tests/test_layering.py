"""The layering rule of docs/architecture.md, enforced by parsing every import in src/kvplane.

A module's rank is (layer, position of its top-level name in that layer's list). An import of
another kvplane module is allowed when the target's top-level name is the same (inside one
package) or the target's rank is lower. Inside a package with a sub-package list (``- serving:
producers, *, router``; ``*`` is the package's own modules) the same rule ranks its parts.
``testing`` may import anything; only ``apps.bench`` imports it. Import cycles are forbidden.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kvplane"
DOC = ROOT / "docs" / "architecture.md"


def read_layers() -> dict[str, tuple[int, int]]:
    ranks: dict[str, tuple[int, int]] = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^- L(\d+): (.+)$", line.strip())
        if m:
            for pos, name in enumerate(n.strip() for n in m.group(2).split(",")):
                ranks[name] = (int(m.group(1)), pos)
    return ranks


def read_parts() -> dict[str, list[str]]:
    """Package name → its parts bottom up (sub-package names and ``*`` for its own modules)."""
    parts: dict[str, list[str]] = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^- ([a-z_]+): ([a-z_*, ]+)$", line.strip())
        if m and not m.group(1).startswith("L"):
            parts[m.group(1)] = [n.strip() for n in m.group(2).split(",")]
    return parts


TESTING = "testing"
TESTING_USERS = ("kvplane.apps.bench",)


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def kvplane_imports(path: Path) -> set[str]:
    """Absolute names of the kvplane modules (or packages) ``path`` imports, at any depth
    (parsed once per version of the file: three tests read every module)."""
    return set(_imports_of(path, path.stat().st_mtime_ns))


@functools.cache
def _imports_of(path: Path, mtime_ns: int) -> frozenset[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "kvplane")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] != "kvplane":
                continue
            found.add(target)
            for alias in node.names:  # "from kvplane import ids" imports the module kvplane.ids
                sub = f"{target}.{alias.name}"
                if (SRC.parent / Path(*sub.split("."))).with_suffix(".py").exists() or (
                    SRC.parent / Path(*sub.split("."))
                ).is_dir():
                    found.add(sub)
    return frozenset(found)


def top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def part(name: str, package: str, modules: dict[str, Path]) -> str:
    """The unit of ``package`` that ``name`` belongs to: a sub-package name or ``*``."""
    rest = name.split(".")[2:]
    if rest and f"kvplane.{package}.{rest[0]}" in modules and (SRC / package / rest[0]).is_dir():
        return rest[0]
    return "*"


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in SRC.rglob("*.py")}


def test_every_top_level_module_has_a_layer() -> None:
    ranks = read_layers()
    missing = sorted({top(m) for m in all_modules() if top(m)} - set(ranks) - {TESTING})
    assert not missing, f"add these to the layer list in docs/architecture.md: {missing}"


def test_imports_point_downward() -> None:
    ranks = read_layers()
    bad = []
    for mod, path in all_modules().items():
        src_top = top(mod)
        if not src_top:  # kvplane/__init__.py imports nothing of its own
            assert not kvplane_imports(path), "kvplane/__init__.py must stay import-free"
            continue
        for target in kvplane_imports(path):
            dst_top = top(target)
            if not dst_top or src_top in (dst_top, TESTING):
                continue
            if dst_top == TESTING:
                if not mod.startswith(TESTING_USERS):
                    bad.append(f"{mod} imports {target}: only benches and tests may")
                continue
            if ranks[dst_top] >= ranks[src_top]:
                bad.append(f"{mod} (L{ranks[src_top][0]}) imports {target} (L{ranks[dst_top][0]})")
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def test_sub_packages_import_downward() -> None:
    modules = all_modules()
    bad = []
    for package, order in read_parts().items():
        for mod, path in modules.items():
            if top(mod) != package:
                continue
            src_part = part(mod, package, modules)
            for target in kvplane_imports(path):
                if top(target) != package:
                    continue
                dst_part = part(target, package, modules)
                if dst_part != src_part and order.index(dst_part) > order.index(src_part):
                    bad.append(f"{mod} ({src_part}) imports {target} ({dst_part})")
    assert not bad, "upward imports inside a package:\n" + "\n".join(sorted(bad))


def test_no_import_cycles() -> None:
    modules = all_modules()
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        graph[mod] = {t for t in kvplane_imports(path) if t in modules and t != mod}
    # a package's __init__ importing its own submodules is not a cycle through the package name
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    white, grey, black = 0, 1, 2
    color = dict.fromkeys(graph, white)
    stack: list[str] = []

    def visit(node: str) -> None:
        color[node] = grey
        stack.append(node)
        for nxt in sorted(graph[node]):
            if color[nxt] == grey:
                cycle = [*stack[stack.index(nxt) :], nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if color[nxt] == white:
                visit(nxt)
        stack.pop()
        color[node] = black

    for node in sorted(graph):
        if color[node] == white:
            visit(node)


def test_layering_test_detects_violations(tmp_path: Path) -> None:
    """The parser sees relative and absolute imports (so the rule cannot pass vacuously)."""
    assert kvplane_imports(SRC / "cli.py") >= {"kvplane.apps.demo", "kvplane.errors"}
    ranks = read_layers()
    assert ranks["errors"] < ranks["ids"] < ranks["blocks"] < ranks["layout"] < ranks["pd"]

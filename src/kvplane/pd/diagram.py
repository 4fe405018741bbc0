"""Mermaid state diagrams generated from the transition tables (the docs never drift).

``docs/pd-states.md`` is exactly :func:`document`; regenerate it with
``.venv/bin/python -m kvplane.pd.diagram > docs/pd-states.md``.
"""

from __future__ import annotations

from collections import defaultdict

from kvplane.pd.states import (
    LEDGER_TABLE,
    RELEASING,
    TABLES,
    TERMINAL,
    EventKind,
    Ownership,
    Role,
    SessionState,
)

_KIND_ORDER = {k: i for i, k in enumerate(EventKind)}


def session_mermaid(role: Role) -> str:
    """The ``stateDiagram-v2`` of one role's session table."""
    table = TABLES[role]
    edges: dict[tuple[SessionState, SessionState], list[EventKind]] = defaultdict(list)
    loops: dict[SessionState, list[EventKind]] = defaultdict(list)
    for (src, kind), dst in table.items():
        (loops[src] if src == dst else edges[(src, dst)]).append(kind)
    lines = ["stateDiagram-v2", f"    [*] --> {SessionState.BOOTSTRAPPING.name}"]
    for (src, dst), kinds in sorted(
        edges.items(),
        key=lambda e: (list(SessionState).index(e[0][0]), list(SessionState).index(e[0][1])),
    ):
        label = ", ".join(k.value for k in sorted(kinds, key=_KIND_ORDER.__getitem__))
        lines.append(f"    {src.name} --> {dst.name}: {label}")
    for state in SessionState:
        if state in TERMINAL:
            lines.append(f"    {state.name} --> [*]")
    for state in SessionState:
        if loops[state]:
            stay = ", ".join(k.value for k in sorted(loops[state], key=_KIND_ORDER.__getitem__))
            lines.append(f"    note right of {state.name}: stays on {stay}")
    return "\n".join(lines)


def ledger_mermaid() -> str:
    """The ``stateDiagram-v2`` of the ownership ledger table."""
    lines = ["stateDiagram-v2", f"    [*] --> {Ownership.ADMITTED.name}"]
    for (src, step), dst in LEDGER_TABLE.items():
        lines.append(f"    {src.name} --> {dst.name}: {step.value}")
    for state in Ownership:
        if state in RELEASING:
            lines.append(f"    {state.name} --> [*]: release")
    return "\n".join(lines)


def document() -> str:
    """The full text of ``docs/pd-states.md``."""
    parts = [
        "# PD protocol states",
        "",
        "Generated from `kvplane.pd.states` by `python -m kvplane.pd.diagram`; "
        "`tests/pd/test_diagram.py` fails when this file and the tables disagree.",
        "",
        "A pair absent from a table is illegal: the session raises `ProtocolError` and nothing "
        "changes. ABORTED, FAILED and SUCCESS are terminal and sticky. The receiver commits every "
        "outcome; the sender follows its verdict, or fails on its own deadline or peer loss.",
    ]
    for role in Role:
        parts += [
            "",
            f"## {role.value.capitalize()} session",
            "",
            "```mermaid",
            session_mermaid(role),
            "```",
        ]
    parts += [
        "",
        "## Ownership ledger (per session and peer, one entry per unit of memory)",
        "",
        "Entering NOT_SUBMITTED, BACKEND_DONE or EXPIRED releases the unit exactly once; "
        "IN_DOUBT leaves only through its fail-closed deadline (EXPIRED).",
        "",
        "```mermaid",
        ledger_mermaid(),
        "```",
        "",
    ]
    return "\n".join(parts)


if __name__ == "__main__":  # pragma: no cover
    print(document(), end="")

"""docs/pd-states.md is generated from the tables and must match them exactly."""

from __future__ import annotations

from pathlib import Path

from kvplane.pd.diagram import document, ledger_mermaid, session_mermaid
from kvplane.pd.states import LEDGER_TABLE, TABLES, Role

DOC = Path(__file__).resolve().parents[2] / "docs" / "pd-states.md"


def test_the_committed_diagram_matches_the_tables() -> None:
    assert DOC.read_text() == document(), (
        "regenerate: python -m kvplane.pd.diagram > docs/pd-states.md"
    )


def test_every_row_of_every_table_appears_in_the_diagram() -> None:
    for role in Role:
        text = session_mermaid(role)
        for (src, kind), dst in TABLES[role].items():
            if src == dst:
                note = next(
                    line
                    for line in text.splitlines()
                    if line.strip().startswith(f"note right of {src.name}:")
                )
                assert kind.value in note.split(": stays on ", 1)[1].split(", ")
            else:
                edge = next(
                    line
                    for line in text.splitlines()
                    if line.strip().startswith(f"{src.name} --> {dst.name}:")
                )
                assert kind.value in edge.split(": ", 1)[1].split(", ")
    for (src, step), dst in LEDGER_TABLE.items():
        assert f"{src.name} --> {dst.name}: {step.value}" in ledger_mermaid()

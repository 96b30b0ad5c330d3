"""The Mermaid diagram in docs/design.md is generated from the table and must be current."""

from __future__ import annotations

from pathlib import Path

from agentruns.connectors import diagram_doc
from agentruns.processors import diagram
from agentruns.processors.state import RunStatus

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"


def test_design_doc_diagram_is_current() -> None:
    text = DESIGN.read_text(encoding="utf-8")
    start = text.index(diagram.BEGIN) + len(diagram.BEGIN)
    stop = text.index(diagram.END)
    assert text[start:stop].strip() == diagram.mermaid().strip(), (
        "stale: run python -m agentruns.connectors.diagram_doc --write docs/design.md"
    )
    assert diagram.render_into(text) == text


def test_every_status_appears() -> None:
    block = diagram.mermaid()
    for status in RunStatus:
        assert status.value in block


def test_cli_prints_and_writes(tmp_path: Path, capsys: object) -> None:
    doc = tmp_path / "d.md"
    doc.write_text(f"before\n{diagram.BEGIN}\nold\n{diagram.END}\nafter\n", encoding="utf-8")
    assert diagram_doc.main(["--write", str(doc)]) == 0
    written = doc.read_text(encoding="utf-8")
    assert written.startswith("before\n") and written.endswith("after\n") and "old" not in written
    assert diagram_doc.main([]) == 0

"""The one way a bench reports: its figures written to its results file (pretty JSON) and
printed as one JSON object on the last line of stdout (what `agentruns bench repeat` reads)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def report(figures: Mapping[str, Any], out: str | Path) -> None:
    """Write ``figures`` to ``out`` (its folder made if missing), then print them on one line."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures), flush=True)

"""R1: the core imports only the standard library's pure parts, pydantic and jsonschema."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "processors"
FORBIDDEN = {
    "confluent_kafka",
    "httpx",
    "psycopg",
    "os",
    "time",
    "random",
    "uuid",
    "socket",
    "subprocess",
    "datetime",
    "threading",
    "asyncio",
    "secrets",
    "faust",
    "fastavro",
    "streams",
    "connectors",
}
MODULES = sorted(CORE.glob("*.py"))


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            roots.add("<dynamic import>")
    return roots


def test_core_modules_found() -> None:
    assert {p.name for p in MODULES} >= {"transition.py", "state.py", "events.py", "effects.py"}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_core_module_is_pure(path: Path) -> None:
    bad = imported_roots(path) & (FORBIDDEN | {"<dynamic import>"})
    assert not bad, f"{path.name} imports {sorted(bad)}"


def test_detector_catches_forbidden_import(tmp_path: Path) -> None:
    sample = tmp_path / "bad.py"
    sample.write_text("import os\nfrom time import time\nimport confluent_kafka.admin\n")
    assert imported_roots(sample) >= {"os", "time", "confluent_kafka"}

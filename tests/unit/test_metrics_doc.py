"""docs/metrics.md lists every metric the services register, and only those; every service
logs JSON (`setup_logging`), none configures plain-text logging."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

from prometheus_client import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"

#: Every module whose import registers a service's metrics.
SERVICE_MODULES = (
    "agentruns.connectors.runtime.processor",
    "agentruns.connectors.runtime.timers",
    "agentruns.connectors.runtime.scanner",
    "agentruns.connectors.monolith",
    "agentruns.connectors.executors.model",
    "agentruns.connectors.executors.tool",
    "agentruns.connectors.projection.sink",
    "agentruns.connectors.projection.audit",
    "agentruns.connectors.api.http",
    "agentruns.connectors.api.serve",
)


def _exposed_names() -> set[str]:
    """The project's metric families as scraped: counters with their ``_total`` suffix."""
    for module in SERVICE_MODULES:
        importlib.import_module(module)
    names = set()
    for family in REGISTRY.collect():
        if not family.name.startswith("agentruns_"):
            continue
        names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def test_every_registered_metric_is_documented_and_every_documented_one_exists() -> None:
    exposed = _exposed_names()
    assert {"agentruns_executor_effects_total", "agentruns_timers_fired_total"} <= exposed
    documented = set(re.findall(r"^\| `(agentruns_\w+)`", DOC.read_text(), re.MULTILINE))
    assert sorted(exposed - documented) == []
    assert sorted(documented - exposed) == []


def _calls(path: Path, name: str) -> list[int]:
    tree = ast.parse(path.read_text())
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute | ast.Name)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == name
    ]


def test_no_service_configures_plain_text_logging() -> None:
    sources = [
        p for top in ("connectors", "streams", "processors") for p in (ROOT / top).rglob("*.py")
    ]
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in sources for n in _calls(p, "basicConfig")]
    assert offenders == []


def test_every_service_entry_point_sets_up_json_logs() -> None:
    for module in SERVICE_MODULES:
        if module.endswith(".http"):
            continue  # the app; `serve` is its entry point
        path = ROOT / (module.removeprefix("agentruns.").replace(".", "/") + ".py")
        text = path.read_text()
        assert (
            _calls(path, "setup_logging")
            or _calls(path, "run_service")
            or ("serve_executor" in text)
        ), module

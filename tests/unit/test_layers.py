"""The import rules of the source tree, read from the code itself.

- Everything imports the project as ``agentruns.*``; a bare ``import streams`` would load a
  second copy of a module (or a user's own ``streams`` package).
- The core (``processors/``) imports only what is on its allowlist: the standard library's pure
  parts, msgspec, pydantic, jsonschema and RE2, and itself (R1).
- Layers import one way: ``processors`` <- ``streams`` <- ``connectors``; ``bench`` is imported by
  nothing but itself and the tests of the benches.
- The production parts of ``connectors`` (API, executors, projection, runtime, Postgres) import
  nothing from the dev stack, the test backends or the demo at module level; a service's
  ``main`` may resolve its services lazily.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP = ("processors", "streams", "schemas", "connectors", "bench")

CORE_ALLOWED = {
    "__future__",
    "collections",
    "contextlib",
    "contextvars",
    "dataclasses",
    "enum",
    "functools",
    "hashlib",
    "json",
    "math",
    "re",
    "reprlib",
    "typing",
    "uuid",  # uuid5: a name-based hash (ids.run_id_for_key), no clock or randomness
    "msgspec",
    "pydantic",
    "jsonschema",
    "referencing",
    "re2",
    "agentruns.processors",
}

PRODUCTION = ("api", "executors", "projection", "runtime", "postgres")
DEV_ONLY = (
    "agentruns.connectors.devstack",
    "agentruns.connectors.testing",
    "agentruns.connectors.demo",
)
# `agentruns run --dev-servers` starts the scripted backends in-process.
DEV_ALLOWED = {"connectors/runtime/monolith.py"}


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            found.add("<relative import>")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            found.add("<dynamic import>")
    return found


def allowed(name: str, allowlist: set[str]) -> bool:
    return any(name == ok or name.startswith(ok + ".") for ok in allowlist)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


ALL = [p for top in (*TOP, "tests") for p in modules(top)]


@pytest.mark.parametrize("path", ALL, ids=rel)
def test_the_project_is_imported_through_its_namespace(path: Path) -> None:
    bare = {m for m in imports(path) if m.split(".")[0] in TOP or m.startswith("<")}
    assert not bare, f"{rel(path)} imports {sorted(bare)}: use agentruns.<layer>"


@pytest.mark.parametrize("path", modules("processors"), ids=rel)
def test_the_core_imports_only_its_allowlist(path: Path) -> None:
    allow = CORE_ALLOWED
    # `from x import name` adds both x and x.name: judge the module named by the statement.
    found = {m for m in imports(path) if not any(m.startswith(o + ".") for o in imports(path))}
    bad = {m for m in found if not allowed(m, allow)}
    assert not bad, f"{rel(path)} imports {sorted(bad)}, outside the core's allowlist"


@pytest.mark.parametrize("path", modules("streams") + modules("schemas"), ids=rel)
def test_streams_import_only_the_core(path: Path) -> None:
    bad = {m for m in imports(path) if allowed(m, {"agentruns.connectors", "agentruns.bench"})}
    assert not bad, f"{rel(path)} imports a higher layer: {sorted(bad)}"


@pytest.mark.parametrize("path", modules("connectors"), ids=rel)
def test_nothing_outside_bench_imports_bench(path: Path) -> None:
    bad = {m for m in imports(path) if allowed(m, {"agentruns.bench"})}
    assert not bad, f"{rel(path)} imports {sorted(bad)}"


# The benches' own tests import them; every other test takes nothing from bench.
BENCH_TESTS = [
    p
    for p in modules("tests")
    if p.name.startswith("test_bench_") or p.name == "test_core_bench.py"
]


@pytest.mark.parametrize("path", [p for p in modules("tests") if p not in BENCH_TESTS], ids=rel)
def test_tests_take_no_fixture_from_bench(path: Path) -> None:
    bad = {m for m in imports(path) if allowed(m, {"agentruns.bench"})}
    assert not bad, f"{rel(path)} imports {sorted(bad)}"


PRODUCTION_MODULES = [
    p
    for p in modules("connectors")
    if p.parent == ROOT / "connectors" or p.relative_to(ROOT / "connectors").parts[0] in PRODUCTION
]


@pytest.mark.parametrize("path", PRODUCTION_MODULES, ids=rel)
def test_production_code_does_not_import_the_dev_stack(path: Path) -> None:
    if rel(path) in DEV_ALLOWED or path.name == "cli.py":
        return
    bad = {m for m in imports(path, top_level_only=True) if allowed(m, set(DEV_ONLY))}
    assert not bad, f"{rel(path)} imports {sorted(bad)} at module level"


def test_the_detector_sees_forbidden_imports(tmp_path: Path) -> None:
    sample = tmp_path / "bad.py"
    sample.write_text(
        "import os\nfrom time import time\nimport streams.codec\nfrom . import x\n"
        "def f():\n    import agentruns.bench.core\n"
    )
    found = imports(sample)
    assert {
        "os",
        "time.time",
        "streams.codec",
        "<relative import>",
        "agentruns.bench.core",
    } <= found
    assert "agentruns.bench.core" not in imports(sample, top_level_only=True)
    assert not allowed("os", CORE_ALLOWED)
    assert allowed("agentruns.processors.ids", CORE_ALLOWED)

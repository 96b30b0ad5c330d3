"""The import rules of the source tree, read from the code itself.

- Everything imports the project as ``agentruns.*``; a bare ``import streams`` would load a
  second copy of a module (or a user's own ``streams`` package).
- The core (``processors/``) imports only what is on its allowlist: the standard library's pure
  parts, msgspec, pydantic, jsonschema and RE2, and itself (R1).
- Layers import one way: ``processors`` <- ``streams`` <- ``connectors``; ``bench`` is imported by
  nothing but itself, the tests of the benches and (lazily) the `agentruns bench` commands.
- Production code (all of ``connectors`` but ``connectors/dev/``, the development harness: the
  local stack, the scripted servers, the demo) imports nothing from the harness, not even inside
  a function; only the command line's development commands and ``agentruns run`` reach it, and
  every production module imports with the harness made unimportable.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
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

HARNESS = "agentruns.connectors.dev"
# The command line's `dev`, `demo`, `chaos` and `bench` commands, and `agentruns run` (which
# starts a local stack, and the scripted servers with --dev-servers), reach the harness lazily.
HARNESS_ALLOWED = {"connectors/cli.py", "connectors/monolith.py"}


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


# `agentruns bench ...` runs a bench: the command line's development commands load it lazily.
BENCH_COMMANDS = ROOT / "connectors" / "dev" / "commands.py"


@pytest.mark.parametrize("path", modules("connectors"), ids=rel)
def test_nothing_outside_bench_imports_bench(path: Path) -> None:
    if path == BENCH_COMMANDS:
        path_imports = imports(path, top_level_only=True)
        assert not {m for m in path_imports if allowed(m, {"agentruns.bench"})}
        return
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


HARNESS_DIR = ROOT / "connectors" / "dev"
PRODUCTION_MODULES = [p for p in modules("connectors") if HARNESS_DIR not in p.parents]


@pytest.mark.parametrize("path", PRODUCTION_MODULES, ids=rel)
def test_production_code_does_not_import_the_harness(path: Path) -> None:
    if rel(path) in HARNESS_ALLOWED:
        bad = {m for m in imports(path, top_level_only=True) if allowed(m, {HARNESS})}
        assert not bad, f"{rel(path)} imports {sorted(bad)} at module level"
        return
    bad = {m for m in imports(path) if allowed(m, {HARNESS})}
    assert not bad, f"{rel(path)} imports {sorted(bad)}: production code takes the settings"


# Imports every production module while the harness cannot be imported, then runs a service
# with nothing configured: it must refuse in one line, without reaching for the harness.
WITHOUT_HARNESS = """
import importlib, sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "agentruns.connectors.dev" or name.startswith("agentruns.connectors.dev."):
            raise ImportError("the development harness is not for production: " + name)
        return None

sys.meta_path.insert(0, Refuse())
for name in sys.argv[1:]:
    importlib.import_module(name)
from agentruns.connectors.cli import main
sys.exit(main(["processor"]))
"""


def test_production_modules_import_and_refuse_without_the_harness(tmp_path: Path) -> None:
    names = [
        "agentruns." + ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in PRODUCTION_MODULES
    ]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KAFKA_BOOTSTRAP_SERVERS", "DATABASE_URL", "AGENTRUNS_KAFKA_CONFIG")
    }
    env["AGENTRUNS_STATE_DIR"] = str(tmp_path / "state")  # nothing recorded there
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_HARNESS, *names],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("agentruns: no Kafka cluster configured"), lines[0]
    assert "KAFKA_BOOTSTRAP_SERVERS" in lines[0]
    assert not (tmp_path / "state").exists()  # nothing started


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

"""The import contracts of pyproject.toml ([tool.importlinter]), run with `lint-imports`: kept by
the source tree, and broken by a wrong-way import in a tree of the same layout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("processors", "streams", "schemas", "connectors", "bench")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports with the project's contracts over the package `agentruns` found in `tree`
    (it puts its working directory first on the path)."""
    assert LINT_IMPORTS.exists(), f"{LINT_IMPORTS} is missing: install the dev extra"
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(ROOT / "pyproject.toml")],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _contract_modules() -> set[str]:
    """The modules the contracts name as sources or forbidden ones."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {
        name
        for contract in contracts["contracts"]
        for key in ("source_modules", "forbidden_modules")
        for name in contract.get(key, [])
    }


def test_the_source_tree_keeps_every_contract(tmp_path: Path) -> None:
    package = tmp_path / "agentruns"
    package.mkdir()
    shutil.copy(ROOT / "agentruns" / "__init__.py", package)
    for layer in LAYERS:
        (package / layer).symlink_to(ROOT / layer, target_is_directory=True)
    done = lint_imports(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(
    ("module", "imported", "contract"),
    [
        ("processors", "agentruns.schemas", "The core imports nothing of ours"),
        ("processors", "agentruns.streams.codec", "Layers"),
        ("streams", "agentruns.connectors.cli", "Streams import neither"),
        ("schemas", "agentruns.processors.events", "Schemas import none of the layers"),
        ("connectors", "agentruns.bench.core", "Connectors do not import the benches"),
        ("streams", "agentruns.connectors.dev", "Production code does not import the development"),
    ],
)
def test_a_wrong_way_import_breaks_a_contract(
    tmp_path: Path, module: str, imported: str, contract: str
) -> None:
    package = tmp_path / "agentruns"
    for layer in LAYERS:
        (package / layer).mkdir(parents=True)
        (package / layer / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    for name in ("streams/codec.py", "connectors/cli.py", "bench/core.py", "processors/events.py"):
        (package / name).write_text("")
    for name in _contract_modules():  # every module a contract names exists in the tree
        folder = tmp_path.joinpath(*name.split("."))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").touch()
    clean = lint_imports(tmp_path)
    assert clean.returncode == 0, clean.stdout + clean.stderr

    (package / module / "wrong_way.py").write_text(f"import {imported}\n")
    broken = lint_imports(tmp_path)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert f"agentruns.{module}.wrong_way -> {imported}" in broken.stdout
    assert f"{contract}" in broken.stdout.split("Broken contracts", 1)[1]

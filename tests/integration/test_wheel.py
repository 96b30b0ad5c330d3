"""The wheel installs one top-level package, `agentruns`, beside any application's own code."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy: an in-tree build would leave build/lib beside the sources.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("agentruns", "processors", "streams", "schemas", "connectors", "bench"):
        shutil.copytree(
            ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "results")
        )
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        cwd=out,
    )
    (found,) = out.glob("agentruns-*.whl")
    return found


def test_the_wheel_holds_agentruns_alone(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top_level = zf.read(next(n for n in names if n.endswith(".dist-info/top_level.txt")))
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"agentruns"}
    assert top_level.decode().split() == ["agentruns"]
    # What the runtime loads from package data travels with it; bench results do not.
    assert "agentruns/connectors/postgres/migrations/0001_artifacts.sql" in names
    assert "agentruns/connectors/dev/stack/kafka/pom.xml" in names
    assert "agentruns/connectors/dev/servers/scenarios/approval.json" in names
    assert "agentruns/schemas/agentruns.Event.v1.avsc" in names
    assert "agentruns/schemas/json/task.schema.json" in names
    assert "agentruns/connectors/api/templates/run.html" in names
    assert "agentruns/connectors/api/static/console.js" in names
    assert "agentruns/connectors/postgres/migrations/0007_console.sql" in names
    assert not [n for n in names if "/results/" in n]


def test_the_client_imports_next_to_an_app_with_its_own_streams_and_schemas(
    wheel: Path, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
    )
    app = tmp_path / "app"
    (app / "streams").mkdir(parents=True)
    (app / "streams" / "__init__.py").write_text("raise ImportError('the app streams package')\n")
    (app / "schemas.py").write_text("raise ImportError('the app schemas module')\n")
    (app / "processors.py").write_text("raise ImportError('the app processors module')\n")
    probe = (
        "import agentruns\n"
        "from agentruns.connectors.api.client import RunsProducer\n"
        "from agentruns.schemas import registry\n"
        "assert agentruns.RunsProducer is RunsProducer\n"
        "assert registry().current('Event') is not None\n"
        "print(agentruns.__file__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=app, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    # The installed copy answered, not the source tree's editable install.
    assert done.stdout.strip().startswith(str(site))

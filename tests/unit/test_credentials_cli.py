"""`agentruns credentials add|list|remove`: the token printed once, only its hash stored, a
bad role or a taken id refused in one line, and the API's store sees each change."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from agentruns.connectors.api.credentials import MIN_TOKEN_CHARS, CredentialStore


def _agentruns(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "from agentruns.connectors.cli import main; raise SystemExit(main())",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "DATABASE_URL"},  # the file only
    )


def test_add_prints_the_token_once_and_stores_its_hash_only(tmp_path: Path) -> None:
    path = tmp_path / "credentials"
    now = [0]
    added = _agentruns(
        "credentials",
        "add",
        "--file",
        str(path),
        "--tenant",
        "billing",
        "--roles",
        "submit,read",
        "--id",
        "ci",
    )
    assert added.returncode == 0, added.stderr
    token = added.stdout.strip()
    assert len(token) >= MIN_TOKEN_CHARS and "shown only now" in added.stderr
    stored = path.read_text()
    assert token not in stored and stored.startswith("ci billing submit,read sha256:")
    assert path.stat().st_mode & 0o077 == 0  # its owner's only
    store = CredentialStore([], path, lambda: now[0], check_every_ms=0)
    found = store.lookup(token)
    assert found is not None and found.tenant == "billing" and not found.may("cancel")
    listed = _agentruns("credentials", "list", "--file", str(path))
    assert listed.stdout == "ci\tbilling\tsubmit,read\n"
    again = _agentruns(
        "credentials", "add", "--file", str(path), "--tenant", "x", "--roles", "read", "--id", "ci"
    )
    assert again.returncode == 2 and "twice" in again.stderr and "Traceback" not in again.stderr
    bad = _agentruns("credentials", "add", "--file", str(path), "--tenant", "x", "--roles", "root")
    assert bad.returncode == 2 and "roles" in bad.stderr
    removed = _agentruns("credentials", "remove", "--file", str(path), "ci")
    assert removed.returncode == 0, removed.stderr
    now[0] = 10
    assert store.lookup(token) is None  # removed: refused from the next look at the file
    missing = _agentruns("credentials", "remove", "--file", str(path), "ci")
    assert missing.returncode == 2 and "no credential ci" in missing.stderr

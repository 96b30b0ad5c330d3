"""When each credential was last used, shared through a real Postgres (each test's own: the
table is pruned to the ids a process holds) by the API processes: two processes (two
credential stores on one database) each list the other's uses, a process with an older use (a
restart, a clock behind) never moves the time back, a credential removed from the file loses
its row, and a Postgres that is down fails no request (the times in memory stay; the use is
written once it is back). `agentruns credentials list` shows the stored time."""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from agentruns.connectors.api.credential_use import CredentialUse
from agentruns.connectors.api.credentials import CredentialStore, token_digest
from agentruns.connectors.dev.stack.local_postgres import LocalPostgres
from tests.support.waiting import wait_for

CI = "ci-" + secrets.token_urlsafe(32)
DESK = "desk-" + secrets.token_urlsafe(32)


def _file(tmp_path: Path, *names: str) -> Path:
    path = tmp_path / "credentials"
    tokens = {"ci": CI, "desk": DESK}
    path.write_text("".join(f"{n} shop read {token_digest(tokens[n])}\n" for n in names))
    return path


@contextmanager
def _replica(
    database_url: str, path: Path, now: list[int], *, thread: bool = True
) -> Iterator[tuple[CredentialStore, CredentialUse]]:
    """An API process's credentials: the file, and the uses it writes (by a thread of its own,
    or, ``thread=False``, when the test calls `flush`)."""
    uses = CredentialUse(database_url, lambda: now[0], flush_every_s=0.05)
    store = CredentialStore([], path, lambda: now[0], check_every_ms=0, uses=uses)
    if thread:
        uses.start()
    try:
        yield store, uses
    finally:
        uses.close()


def _table(database_url: str) -> dict[str, int]:
    """Every row of the table, whatever its columns: the id, then the time."""
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT * FROM credential_use").fetchall()
    assert all(len(row) == 2 for row in rows)  # an id and a time: no token, no hash
    return {row[0]: row[1] for row in rows}


def _listed(store: CredentialStore) -> dict[str, object]:
    return {str(c["id"]): c["last_used_at"] for c in store.described()}


def test_two_processes_see_each_others_use_and_it_never_moves_back(
    own_postgres: LocalPostgres, tmp_path: Path
) -> None:
    url, path = own_postgres.url, _file(tmp_path, "ci", "desk")
    a_now, b_now = [1_000_000], [2_000_000]
    with (
        _replica(url, path, a_now, thread=False) as (a, a_uses),
        _replica(url, path, b_now, thread=False) as (b, b_uses),
    ):
        assert a.lookup(CI) is not None
        a_uses.flush()
        assert _listed(b) == {"ci": 1_000_000, "desk": None}  # a's use, b's list
        assert b.lookup(DESK) is not None and b.lookup(CI) is not None
        b_uses.flush()
        assert _listed(a) == {"ci": 2_000_000, "desk": 2_000_000}  # b's later uses
        a_now[0] = 3_000_000
        assert a.lookup(CI) is not None
        a_uses.flush()
        for _ in range(1000):  # a hot credential: one write a minute, whatever its requests
            a_now[0] += 1
            assert a.lookup(CI) is not None
            a_uses.flush()
        assert _table(url)["ci"] == 3_000_000 and _listed(b)["ci"] == 3_000_000
        assert _listed(a)["ci"] == 3_001_000  # a's own later use: in its list at once
        a_now[0] += 60_000
        a_uses.flush()
        assert _listed(b)["ci"] == 3_001_000
    # a restart whose clock is behind: its older use never moves the stored time back
    with _replica(url, path, [1_500_000], thread=False) as (late, late_uses):
        assert _listed(late) == {"ci": 3_001_000, "desk": 2_000_000}  # from before its start
        assert late.lookup(CI) is not None and late.lookup(DESK) is not None
        late_uses.flush()
        assert _table(url) == {"ci": 3_001_000, "desk": 2_000_000}


def _list(path: Path, database_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "from agentruns.connectors.cli import main; raise SystemExit(main())",
            *("credentials", "list", "--file", str(path)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, DATABASE_URL=database_url),
    )


def test_a_removed_credential_loses_its_row_and_the_cli_lists_the_stored_use(
    own_postgres: LocalPostgres, tmp_path: Path
) -> None:
    url, path = own_postgres.url, _file(tmp_path, "ci", "desk")
    with _replica(url, path, [1_796_601_600_000]) as (a, _):  # 2026-12-07T00:00:00Z
        assert a.lookup(CI) is not None and a.lookup(DESK) is not None
        wait_for(lambda: set(_table(url)) == {"ci", "desk"}, what="both uses written")
        listed = _list(path, url)
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout == (
            "ci\tshop\tread\t2026-12-07T00:00:00Z\ndesk\tshop\tread\t2026-12-07T00:00:00Z\n"
        )
        older = tmp_path / "older"  # a host given the file before desk was added
        older.mkdir()
        with _replica(url, _file(older, "ci"), [0]) as (stale, stale_uses):
            assert stale.lookup(CI) is not None and stale.get("desk") is None
            stale_uses.flush()
            assert set(_table(url)) == {"ci", "desk"}  # a removal it never saw: kept
        path.write_text(f"ci shop read {token_digest(CI)}\nnew shop read {token_digest(DESK)}\n")
        assert a.get("new") is not None  # the file read again (at a request)
        wait_for(lambda: set(_table(url)) == {"ci"}, what="desk's row deleted")
        listed = _list(path, url)
        assert listed.stdout == "ci\tshop\tread\t2026-12-07T00:00:00Z\nnew\tshop\tread\t-\n"
    own_postgres.stop(mode="immediate")
    down = _list(path, url)
    assert down.returncode == 0 and down.stdout == "ci\tshop\tread\nnew\tshop\tread\n"
    assert "Postgres not read" in down.stderr


def test_postgres_down_fails_no_request_and_the_use_is_written_when_it_is_back(
    own_postgres: LocalPostgres, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _file(tmp_path, "ci")
    caplog.set_level(logging.WARNING, "agentruns.api")
    own_postgres.stop(mode="immediate")
    with _replica(own_postgres.url, path, [7_000]) as (store, _):
        started = time.perf_counter()
        for _ in range(200):
            assert store.lookup(CI) is not None
        assert time.perf_counter() - started < 1.0  # never waits for Postgres
        time.sleep(0.5)  # the writer tries, and fails, turn after turn
        assert _listed(store) == {"ci": 7_000}  # the time in memory
        failures = [r for r in caplog.records if "not written" in r.getMessage()]
        assert len(failures) == 1  # once per interval, not once per turn
        own_postgres.start()
        wait_for(lambda: _table(own_postgres.url) == {"ci": 7_000}, what="the use written")

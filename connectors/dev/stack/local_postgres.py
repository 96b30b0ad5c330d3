"""Run a real PostgreSQL server from the system binaries in a data directory of ours.

`initdb` + `pg_ctl` with the server bound to 127.0.0.1 and its socket inside the data
directory, so it never touches a system cluster. Postgres refuses to run as root: when we are
root the binaries run as the `postgres` user of Debian's package (`runuser -u postgres`).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import time
from pathlib import Path

from agentruns.connectors.dev.stack.procs import ensure_ports_free, tail
from agentruns.connectors.errors import MissingToolError, ServiceStartError

DB_NAME = "agentruns"
DB_USER = "agentruns"
INSTALL_HINT = "install PostgreSQL server binaries (as root: apt-get install -y postgresql)"


def find_bindir() -> Path:
    """The directory holding initdb/pg_ctl: $AGENTRUNS_PG_BINDIR, PATH, or Debian's layout."""
    env = os.environ.get("AGENTRUNS_PG_BINDIR")
    candidates: list[Path] = [Path(env)] if env else []
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    debian = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(re.sub(r"\D", "", p.parent.name) or 0),
        reverse=True,
    )
    candidates.extend(debian)
    for c in candidates:
        if (c / "initdb").exists() and (c / "pg_ctl").exists():
            return c
    raise MissingToolError("PostgreSQL's initdb/pg_ctl were not found", hint=INSTALL_HINT)


class LocalPostgres:
    """One Postgres cluster under `directory`, listening on 127.0.0.1:`port`."""

    def __init__(self, directory: Path, *, port: int = 15432, durable: bool = True) -> None:
        self.directory = directory
        self.port = port
        # durable=False (tests, benchmarks): fsync off, which a throw-away cluster can afford.
        self.durable = durable
        self.data = directory / "data"
        self.log_file = directory / "postgres.log"

    @property
    def url(self) -> str:
        return f"postgresql://{DB_USER}@127.0.0.1:{self.port}/{DB_NAME}"

    def _as_owner(self, cmd: list[str]) -> list[str]:
        if os.geteuid() != 0:
            return cmd
        try:
            pwd.getpwnam("postgres")
        except KeyError as exc:
            raise MissingToolError(
                "running as root but there is no `postgres` user to run the server as",
                hint=INSTALL_HINT + " (it creates the user)",
            ) from exc
        runuser = shutil.which("runuser") or "runuser"
        return [runuser, "-u", "postgres", "--", *cmd]

    def _chown(self, path: Path) -> None:
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(path, pw.pw_uid, pw.pw_gid)

    def _check_traversable(self) -> None:
        if os.geteuid() != 0:
            return
        for parent in self.directory.resolve().parents:
            if not parent.stat().st_mode & 0o001:
                raise ServiceStartError(
                    f"the postgres user cannot enter {parent} (mode {parent.stat().st_mode:o})",
                    hint="choose a state directory under /tmp (AGENTRUNS_STATE_DIR)",
                )

    def _run(self, cmd: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self._as_owner(cmd), capture_output=True, text=True, check=False)

    def running(self) -> bool:
        if not (self.data / "postmaster.pid").exists():
            return False
        status = self._run([str(find_bindir() / "pg_ctl"), "-D", str(self.data), "status"])
        return status.returncode == 0

    def start(self, *, timeout: float = 60.0) -> float:
        """initdb (first time only), start, create the database; returns seconds to ready."""
        began = time.monotonic()
        bindir = find_bindir()
        if self.running():
            self._wait_ready(timeout)
            return time.monotonic() - began
        ensure_ports_free(
            [self.port],
            what="Postgres",
            hint="stop the other server, or pick another port with --pg-port / AGENTRUNS_PG_PORT",
        )
        self.directory.mkdir(parents=True, exist_ok=True)
        self._chown(self.directory)
        self._check_traversable()
        if not (self.data / "PG_VERSION").exists():
            if self.data.exists():
                raise ServiceStartError(
                    f"{self.data} exists but is not a Postgres data directory",
                    hint="remove it with `agentruns dev down --wipe`",
                )
            init = self._run(
                [
                    str(bindir / "initdb"),
                    "-D",
                    str(self.data),
                    "-U",
                    DB_USER,
                    "--auth=trust",
                    "-E",
                    "UTF8",
                    "--locale=C",
                    "--no-sync",
                ]
            )
            if init.returncode != 0:
                raise ServiceStartError(
                    f"initdb failed: {tail(init.stdout + init.stderr, 3)}",
                    hint=f"check permissions of {self.directory}",
                )
        options = f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1"
        if not self.durable:
            options += " -c fsync=off -c full_page_writes=off"
        if self.log_file.exists():
            self._chown(self.log_file)
        else:
            self.log_file.touch()
            self._chown(self.log_file)
        started = self._run(
            [
                str(bindir / "pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(self.log_file),
                "-o",
                options,
                "-w",
                "-t",
                str(int(max(timeout, 5))),
                "start",
            ]
        )
        if started.returncode != 0:
            raise ServiceStartError(
                f"Postgres did not start: {tail(self.log_file.read_text(errors='replace'), 3)}",
                hint=f"full log: {self.log_file}",
            )
        self._wait_ready(timeout - (time.monotonic() - began))
        return time.monotonic() - began

    def _wait_ready(self, timeout: float) -> None:
        import psycopg

        deadline = time.monotonic() + max(timeout, 1.0)
        admin_url = f"postgresql://{DB_USER}@127.0.0.1:{self.port}/postgres"
        last = ""
        while time.monotonic() < deadline:
            try:
                with psycopg.connect(admin_url, autocommit=True, connect_timeout=2) as conn:
                    exists = conn.execute(
                        "SELECT 1 FROM pg_database WHERE datname = %s", (DB_NAME,)
                    ).fetchone()
                    if not exists:
                        conn.execute(f'CREATE DATABASE "{DB_NAME}"')
                    return
            except psycopg.OperationalError as exc:
                last = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                time.sleep(0.2)
        raise ServiceStartError(
            f"Postgres on port {self.port} not ready within {timeout:.0f}s ({last})",
            hint=f"see {self.log_file}",
        )

    def stop(self, *, mode: str = "fast") -> None:
        if not (self.data / "postmaster.pid").exists():
            return
        self._run([str(find_bindir() / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"])

    def wipe(self) -> None:
        self.stop(mode="immediate")
        shutil.rmtree(self.directory, ignore_errors=True)

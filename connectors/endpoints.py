"""Where a production command finds Kafka and Postgres: the settings, and nothing else it starts.

1. `KAFKA_BOOTSTRAP_SERVERS` / `DATABASE_URL` (`agentruns.connectors.settings`), checked: an
   unreachable one is an error, never a silent fallback;
2. else the endpoints a development command recorded in the state directory
   (`$AGENTRUNS_STATE_DIR/endpoints.json`, written by `agentruns dev up` and by the local stack
   `agentruns run` starts, removed when they stop it): a file read, no launcher imported;
3. else one line saying what to set (`NotConfiguredError`, exit code 2).

Nothing here starts a broker or a database. Starting them (containers, local processes) is the
development harness's (`agentruns.connectors.dev`), which only the development commands use.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from agentruns.connectors.errors import NotConfiguredError, ServiceUnreachableError
from agentruns.connectors.settings import current
from agentruns.streams.kafka_defaults import client_settings

log = logging.getLogger("agentruns.endpoints")

#: How long a long-running service started while its configured Kafka or Postgres does not
#: answer (a broker restart, a database failover) waits for it before it gives up.
SERVICE_PATIENCE_S = 120.0

#: A recorded local stack that does not answer this fast is taken as stopped.
RECORDED_TIMEOUT_S = 3.0

#: What to do when nothing is configured.
START_ONE = "start one with `agentruns dev up` (or `agentruns run`), or set KAFKA_BOOTSTRAP_SERVERS"


@dataclass
class Endpoints:
    kafka_bootstrap: str
    database_url: str
    kafka_source: str
    postgres_source: str


def state_dir() -> Path:
    """The development state directory (`agentruns dev up`'s data, logs, pid files)."""
    env = os.environ.get("AGENTRUNS_STATE_DIR")
    if env:
        return Path(env)
    return Path(tempfile.gettempdir()) / f"agentruns-{os.geteuid()}"


def _record_file(directory: Path) -> Path:
    return directory / "endpoints.json"


def record(directory: Path, *, kafka: str | None, database: str | None) -> None:
    """Note the local services running under `directory` for the commands run beside them."""
    directory.mkdir(parents=True, exist_ok=True)
    found = {k: v for k, v in (("kafka", kafka), ("database", database)) if v}
    _record_file(directory).write_text(json.dumps(found))


def forget(directory: Path) -> None:
    with suppress(FileNotFoundError):
        _record_file(directory).unlink()


def recorded(directory: Path | None = None) -> dict[str, str]:
    """The endpoints recorded in the state directory; {} when none (or the file is unreadable)."""
    try:
        found = json.loads(_record_file(directory or state_dir()).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(found, dict):
        return {}
    return {k: v for k, v in found.items() if k in ("kafka", "database") and isinstance(v, str)}


def _configured(
    explicit: str | None,
    key: str,
    check: Callable[..., None],
    timeout: float,
    patience_s: float,
) -> str | None:
    """The service named in the settings (``explicit``, checked: it must answer), else the one
    a development command recorded under ``key`` if it answers, else None."""
    if explicit:
        check(explicit, timeout, patience_s=patience_s)
        return explicit
    local = recorded().get(key)
    if local is not None:
        with suppress(ServiceUnreachableError):
            check(local, RECORDED_TIMEOUT_S)
            return local
    return None


def configured_kafka(timeout: float = 10.0, *, patience_s: float = 0.0) -> str:
    """KAFKA_BOOTSTRAP_SERVERS (checked: it must answer within ``timeout``), else the broker a
    development command recorded in the state directory; never starts one."""
    found = _configured(
        current().kafka_bootstrap_servers, "kafka", check_kafka, timeout, patience_s
    )
    if found is not None:
        return found
    raise NotConfiguredError(
        f"no Kafka cluster configured (KAFKA_BOOTSTRAP_SERVERS is not set and no local "
        f"broker runs in {state_dir()})",
        hint=START_ONE,
    )


def configured_postgres(
    *, required: str | None, timeout: float = 10.0, patience_s: float = 0.0
) -> str | None:
    """DATABASE_URL (checked), else the Postgres a development command recorded in the state
    directory, else None; or, when ``required`` is given, an error (``required``: what else
    the user may do, "" when nothing else)."""
    found = _configured(current().database_url, "database", check_postgres, timeout, patience_s)
    if found is not None or required is None:
        return found
    raise NotConfiguredError(
        f"no Postgres configured (DATABASE_URL is not set and no local server runs in "
        f"{state_dir()})",
        hint="start one with `agentruns dev up`, or set DATABASE_URL"
        + (f", or {required}" if required else ""),
    )


def resolve(*, patience_s: float = SERVICE_PATIENCE_S) -> Endpoints:
    """Kafka and Postgres of a long-running service, both required (see the module's order)."""
    kafka = configured_kafka(patience_s=patience_s)
    database = configured_postgres(required="", patience_s=patience_s)
    assert database is not None
    ksrc = "env" if current().kafka_bootstrap_servers else f"recorded in {state_dir()}"
    psrc = "env" if current().database_url else f"recorded in {state_dir()}"
    return Endpoints(kafka, database, ksrc, psrc)


def check_kafka(bootstrap: str, timeout: float = 10.0, *, patience_s: float = 0.0) -> None:
    """Kafka at ``bootstrap`` answers within ``timeout`` and takes the client's credentials (a
    refused login raises at once, from the client's error callback, see ``client_settings``);
    with `patience_s`, an unreachable one is tried that long first (see `_patiently`)."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient

    def attempt() -> None:
        admin = AdminClient({"bootstrap.servers": bootstrap, **client_settings(), "log_level": 0})
        deadline = time.monotonic() + timeout
        while True:
            try:
                admin.list_topics(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
                return
            except KafkaException as exc:
                admin.poll(0.05)  # serves the error callback: a refused login raises here
                if time.monotonic() < deadline:
                    continue
                error = exc.args[0] if exc.args else None
                reason = error.str() if isinstance(error, KafkaError) else str(exc)
                raise ServiceUnreachableError(
                    f"Kafka at {bootstrap} does not answer within {timeout:.0f}s ({reason})",
                    hint="check KAFKA_BOOTSTRAP_SERVERS, or unset it to use a local broker",
                ) from exc

    _patiently(attempt, patience_s)


def check_postgres(url: str, timeout: float = 10.0, *, patience_s: float = 0.0) -> None:
    """Raise ServiceUnreachableError unless Postgres answers; with `patience_s`, keep trying
    that long first (see `_patiently`)."""
    import psycopg

    from agentruns.connectors.postgres.dsn import redact_dsn, scrub_dsn

    def attempt() -> None:
        try:
            with psycopg.connect(url, connect_timeout=max(1, int(timeout))) as conn:
                conn.execute("SELECT 1")
        except psycopg.Error as exc:
            reason = scrub_dsn((str(exc).strip() or type(exc).__name__).splitlines()[0], url)
            raise ServiceUnreachableError(
                f"Postgres at {redact_dsn(url)} does not answer ({reason})",
                hint="check DATABASE_URL, or unset it to use a local server",
            ) from None

    _patiently(attempt, patience_s)


def _patiently(attempt: Callable[[], None], patience_s: float) -> None:
    """Run `attempt` until it succeeds or `patience_s` has passed, then raise its error. A
    service started while its broker restarts (or its database fails over) waits it out
    instead of exiting and being restarted in a loop; a command run by hand fails at once."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            attempt()
            return
        except ServiceUnreachableError as exc:
            if time.monotonic() >= deadline:
                raise
            log.warning("%s; waiting up to %.0fs more", exc, deadline - time.monotonic())
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))

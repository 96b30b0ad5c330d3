"""The development harness's Kafka and Postgres: found, or started, for tests, benchmarks,
`agentruns run` and `agentruns dev`. Production commands never come here: they take what the
settings name (`agentruns.connectors.endpoints`).

1. `KAFKA_BOOTSTRAP_SERVERS` / `DATABASE_URL` when set (checked: an unreachable one is an error,
   never a silent fallback);
2. testcontainers (the `docker` extra), when a Docker daemon answers a ping; without the extra
   that is an error naming it (AGENTRUNS_NO_DOCKER=1 skips Docker);
3. the local processes of `local_kafka` / `local_postgres`: the running `agentruns dev up` stack
   if there is one, otherwise a new one.

`ServiceStack` remembers what it started and `close()` stops exactly that. A local stack started
in the state directory is recorded there (`endpoints.record`) while it runs, so the commands run
beside it (`agentruns submit` in another terminal) find it without starting anything.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from agentruns.connectors.dev.stack.local_kafka import LocalKafka, broker_settings, container_env
from agentruns.connectors.dev.stack.local_postgres import LocalPostgres
from agentruns.connectors.dev.stack.procs import free_port_block
from agentruns.connectors.endpoints import (
    Endpoints,
    check_kafka,
    check_postgres,
    forget,
    record,
    state_dir,
)
from agentruns.connectors.errors import MissingToolError
from agentruns.connectors.settings import current

# testcontainers' KafkaContainer drives Confluent's image; cp-kafka 8.0 is Apache Kafka 4.0 (KRaft).
KAFKA_IMAGE = "confluentinc/cp-kafka:8.0.0"
POSTGRES_IMAGE = "postgres:16-alpine"


@dataclass
class StackConfig:
    """What `dev up` started, saved as stack.json so `dev down`/`dev status` find it."""

    kafka_port: int = 19092
    pg_port: int = 15432
    brokers: int = 1
    durable: bool = True

    @classmethod
    def from_env(cls) -> StackConfig:
        return cls(
            kafka_port=int(os.environ.get("AGENTRUNS_KAFKA_PORT", "19092")),
            pg_port=int(os.environ.get("AGENTRUNS_PG_PORT", "15432")),
            brokers=int(os.environ.get("AGENTRUNS_KAFKA_BROKERS", "1")),
        )

    @classmethod
    def load(cls, directory: Path) -> StackConfig | None:
        try:
            return cls(**json.loads((directory / "stack.json").read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "stack.json").write_text(json.dumps(asdict(self)))


@dataclass
class LocalStack:
    """The local broker(s) and Postgres under one state directory."""

    directory: Path
    config: StackConfig
    # node i's address and command prefix (a network namespace of `netlab`); None: 127.0.0.1
    placed: Sequence[tuple[str, Sequence[str]]] | None = None
    kafka: LocalKafka = field(init=False)
    postgres: LocalPostgres = field(init=False)

    def __post_init__(self) -> None:
        c = self.config
        self.kafka = LocalKafka(
            self.directory / "kafka", port=c.kafka_port, brokers=c.brokers, placed=self.placed
        )
        self.postgres = LocalPostgres(
            self.directory / "postgres", port=c.pg_port, durable=c.durable
        )

    def up(self) -> dict[str, float]:
        self.config.save(self.directory)
        timings = {"kafka_ready_s": self.kafka.start()}
        try:
            timings["postgres_ready_s"] = self.postgres.start()
        except Exception:
            self.kafka.stop()
            raise
        record(self.directory, kafka=self.kafka.bootstrap_servers, database=self.postgres.url)
        return timings

    def down(self, *, wipe: bool = False) -> None:
        forget(self.directory)
        self.kafka.stop()
        self.postgres.stop()
        if wipe:
            shutil.rmtree(self.directory, ignore_errors=True)

    def status(self) -> dict[str, Any]:
        return {
            "state_dir": str(self.directory),
            "kafka": {
                "bootstrap_servers": self.kafka.bootstrap_servers,
                "pids": self.kafka.running(),
                "logs": [str(n.log_file) for n in self.kafka.nodes],
            },
            "postgres": {
                "url": self.postgres.url,
                "running": self.postgres.running(),
                "log": str(self.postgres.log_file),
            },
        }


def running_dev_stack() -> LocalStack | None:
    """The `agentruns dev up` stack, if its broker and database are both running."""
    directory = state_dir()
    config = StackConfig.load(directory)
    if config is None:
        return None
    stack = LocalStack(directory, config)
    if stack.kafka.running() and stack.postgres.running():
        return stack
    return None


def docker_available() -> bool:
    """True when a Docker daemon answers `GET /_ping` (testcontainers can then run services).

    Pinged with a plain socket: cheap, and no client library left holding a socket open.
    """
    if os.environ.get("AGENTRUNS_NO_DOCKER"):
        return False
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        if host.startswith("unix://"):
            path = host.removeprefix("unix://")
            if not os.path.exists(path):
                return False
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: Any = path
        elif host.startswith("tcp://"):
            name, _, port = host.removeprefix("tcp://").partition(":")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            address = (name, int(port or 2375))
        else:
            return False
        with sock:
            sock.settimeout(2)
            sock.connect(address)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            head = sock.recv(64)
        return head.startswith(b"HTTP/1.") and b" 200 " in head
    except OSError:
        return False


ENV, CONTAINER, LOCAL = "env", "container", "local"


@dataclass(frozen=True)
class Plan:
    """Where each service comes from: ENV (configured), CONTAINER or LOCAL."""

    kafka: str
    postgres: str


def plan_sources(kafka: str | None, database: str | None, *, docker: Callable[[], bool]) -> Plan:
    """The resolution order of the module's docstring: a configured service is used, a missing
    one comes from a container when `docker()` says an engine answers (asked only then), else
    from the local processes."""
    missing = LOCAL
    if (kafka is None or database is None) and docker():
        missing = CONTAINER
    return Plan(
        kafka=ENV if kafka is not None else missing,
        postgres=ENV if database is not None else missing,
    )


def require_testcontainers() -> None:
    """Raise MissingToolError, in one line, unless the `docker` extra is installed."""
    try:
        import testcontainers  # noqa: F401
    except ImportError as exc:
        raise MissingToolError(
            "a Docker engine answers but testcontainers is not installed",
            hint="pip install 'agentruns[docker]', or set AGENTRUNS_NO_DOCKER=1 to run Kafka"
            " and Postgres as local processes",
        ) from exc


def kafka_container_env() -> dict[str, str]:
    """The environment of the Kafka container: the local broker's settings (one node)."""
    return container_env(broker_settings(1))


class ServiceStack(AbstractContextManager["ServiceStack"]):
    """Resolve Kafka and Postgres; stop on close only what this object started.

    `ephemeral=True` (tests, benchmarks) never reuses the `dev up` stack: it starts its own in a
    temporary directory on free ports, throw-away and fast (fsync off).
    """

    def __init__(
        self,
        *,
        ephemeral: bool = False,
        brokers: int = 1,
        patience_s: float = 0.0,
        placed: Sequence[tuple[str, Sequence[str]]] | None = None,
    ) -> None:
        self.ephemeral = ephemeral
        self.patience_s = patience_s  # how long a configured Kafka or Postgres may not answer
        self.brokers = brokers
        self.placed = placed  # an ephemeral local cluster's brokers, each where `placed` says
        self._started: list[Any] = []
        self._tmp: Path | None = None
        self.local: LocalStack | None = None
        self.endpoints: Endpoints | None = None
        self._recorded: Path | None = None

    def __enter__(self) -> ServiceStack:
        try:
            self.start()
        except BaseException:
            self.close()  # never leave a half-started system behind
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> Endpoints:
        kafka = current().kafka_bootstrap_servers or None
        database = current().database_url or None
        ksrc, psrc = "env", "env"
        if kafka:
            check_kafka(kafka, patience_s=self.patience_s)
        if database:
            check_postgres(database, patience_s=self.patience_s)
        plan = plan_sources(kafka, database, docker=docker_available)
        if CONTAINER in (plan.kafka, plan.postgres):
            require_testcontainers()
        if plan.kafka == CONTAINER:
            kafka, ksrc = self._kafka_container(), "testcontainers"
        if plan.postgres == CONTAINER:
            database, psrc = self._postgres_container(), "testcontainers"
        if kafka is None or database is None:
            running = None if self.ephemeral else running_dev_stack()
            # A running `dev up` stack is used as is: its services are not ours to stop.
            local = running or self._new_local_stack()
            self.local = local
            where = f"local ({local.directory})"
            # A service already running in the state directory (another command's, e.g. an
            # `agentruns run` that started it) is used but left running when we close.
            if kafka is None:
                if running is None:
                    if not local.kafka.running():
                        self._started.append(local.kafka)
                    local.kafka.start()
                kafka, ksrc = local.kafka.bootstrap_servers, where
            if database is None:
                if running is None:
                    if not local.postgres.running():
                        self._started.append(local.postgres)
                    local.postgres.start()
                database, psrc = local.postgres.url, where
            if running is None and not self.ephemeral:  # for the commands run beside this one
                record(
                    local.directory,
                    kafka=kafka if ksrc == where else None,
                    database=database if psrc == where else None,
                )
                self._recorded = local.directory
        self.endpoints = Endpoints(kafka, database, ksrc, psrc)
        return self.endpoints

    def _new_local_stack(self) -> LocalStack:
        if not self.ephemeral:
            directory = state_dir()
            return LocalStack(directory, StackConfig.load(directory) or StackConfig.from_env())
        self._tmp = Path(tempfile.mkdtemp(prefix="agentruns-run-"))
        self._tmp.chmod(0o755)  # the postgres user (when we are root) must traverse it
        kafka_port = free_port_block(2 * self.brokers)
        pg_port = free_port_block(1, start=kafka_port + 2 * self.brokers)
        config = StackConfig(
            kafka_port=kafka_port, pg_port=pg_port, brokers=self.brokers, durable=False
        )
        return LocalStack(self._tmp, config, self.placed)

    def _kafka_container(self) -> str:
        from testcontainers.community.kafka import KafkaContainer

        container = KafkaContainer(KAFKA_IMAGE).with_kraft()
        for name, value in kafka_container_env().items():
            container.with_env(name, value)
        container.start()
        self._started.append(container)
        return str(container.get_bootstrap_server())

    def _postgres_container(self) -> str:
        from testcontainers.community.postgres import PostgresContainer

        container = PostgresContainer(POSTGRES_IMAGE, driver=None)
        container.start()
        self._started.append(container)
        return str(container.get_connection_url())

    def close(self) -> None:
        if self._recorded is not None and self._started:
            forget(self._recorded)  # what we recorded, we stop
        self._recorded = None
        while self._started:
            service = self._started.pop()
            with suppress(Exception):
                if self._tmp is not None and isinstance(service, LocalKafka):
                    # thrown away with its directory: no controlled shutdown to wait for (the
                    # last nodes of a cluster wait 30 s for a quorum they cannot have)
                    service.kill()
                else:
                    service.stop()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

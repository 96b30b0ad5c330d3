"""Run a real Apache Kafka 4.x broker (KRaft) from Maven Central jars, without Docker.

The jars are resolved once by `connectors/dev/stack/kafka/pom.xml` (`mvn
dependency:copy-dependencies`)
into a cache outside the repo (`~/.cache/agentruns/kafka-<version>/libs`, or
`$AGENTRUNS_KAFKA_HOME`). A cluster is one or more combined broker+controller nodes on
127.0.0.1, each with its own KRaft storage formatted by `kafka.tools.StorageTool`, started as
`java -cp … kafka.Kafka server.properties` in its own session with a pid file, so `stop()` (and
`agentruns dev down` from another process) can end exactly what was started.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from agentruns.connectors.dev.stack.procs import (
    ensure_ports_free,
    pid_alive,
    read_pid,
    stop_pid,
    tail,
)
from agentruns.connectors.errors import MissingToolError, ServiceStartError
from agentruns.streams.kafka_defaults import KAFKA_LOGS

KAFKA_VERSION = "4.1.2"
DEFAULT_HEAP = "-Xms256m -Xmx768m"
POM = "pom.xml"


def kafka_home() -> Path:
    """Where the broker jars live (downloaded once, shared by every checkout)."""
    env = os.environ.get("AGENTRUNS_KAFKA_HOME")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "agentruns" / f"kafka-{KAFKA_VERSION}"


def _pom_path() -> Path:
    return Path(str(resources.files("agentruns.connectors.dev.stack") / "kafka" / POM))


def ensure_jars(home: Path | None = None, *, quiet: bool = True) -> Path:
    """Resolve the broker jars with Maven unless already cached; return the libs directory."""
    libs = (home or kafka_home()) / "libs"
    if any(libs.glob("kafka_2.13-*.jar")) and any(libs.glob("log4j-core-*.jar")):
        return libs
    if shutil.which("java") is None:
        raise MissingToolError(
            "java is not installed", hint="install a JDK 17+ (e.g. apt-get install openjdk-17-jre)"
        )
    mvn = shutil.which("mvn")
    if mvn is None:
        raise MissingToolError(
            f"the Kafka jars are not cached in {libs} and mvn is not installed",
            hint="install Maven (apt-get install maven) or set AGENTRUNS_KAFKA_HOME to a cache",
        )
    libs.parent.mkdir(parents=True, exist_ok=True)
    tmp = libs.with_name("libs.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [
        mvn,
        "-B",
        *(["-q"] if quiet else []),
        "-f",
        str(_pom_path()),
        "dependency:copy-dependencies",
        f"-DoutputDirectory={tmp}",
        "-DincludeScope=runtime",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ServiceStartError(
            "mvn could not resolve the Kafka broker jars",
            hint=f"run `{' '.join(cmd)}` to see why; last output: {tail(proc.stdout, 5)}",
        )
    # Rename into place only when complete, so an interrupted download is never taken as a cache.
    shutil.rmtree(libs, ignore_errors=True)
    tmp.rename(libs)
    return libs


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, URL-safe base64 without padding (as Kafka makes).

    Like Kafka's own Uuid.randomUuid, never one starting with "-": a command line would take
    it for an option."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


@dataclass(frozen=True)
class ScramUser:
    """A SCRAM-SHA-256 user created in the cluster's metadata when its storage is formatted."""

    name: str
    password: str

    MECHANISM = "SCRAM-SHA-256"

    def storage_argument(self) -> str:
        """`kafka-storage format --add-scram`'s value for this user."""
        return f"{self.MECHANISM}=[name={self.name},password={self.password}]"


@dataclass(frozen=True)
class KafkaNode:
    node_id: int
    port: int
    controller_port: int
    directory: Path
    #: The SASL_PLAINTEXT (SCRAM) listener's port, when the cluster has one.
    sasl_port: int | None = None
    #: Where it listens, and what its command runs in (fault tests: a network namespace, see
    #: `agentruns.connectors.dev.stack.netlab`).
    host: str = "127.0.0.1"
    wrap: tuple[str, ...] = ()

    @property
    def pid_file(self) -> Path:
        return self.directory / "kafka.pid"

    @property
    def log_file(self) -> Path:
        return self.directory / "server.out"


def broker_settings(replicas: int) -> dict[str, str]:
    """The settings of every agentruns development broker, whatever runs it: the local nodes
    here, the containers of `agentruns.connectors.dev.stack.services` and
    docker-compose.kafka.yml (unit tests compare them). Internal topics are sized for a local
    cluster of `replicas` brokers; listeners and storage are each launcher's own."""
    min_isr = 1 if replicas == 1 else 2
    return {
        "num.partitions": "1",
        "default.replication.factor": str(replicas),
        "min.insync.replicas": str(min_isr),
        "auto.create.topics.enable": "false",
        "offsets.topic.replication.factor": str(replicas),
        "offsets.topic.num.partitions": "8",
        "transaction.state.log.replication.factor": str(replicas),
        "transaction.state.log.min.isr": str(min_isr),
        "transaction.state.log.num.partitions": "8",
        "share.coordinator.state.topic.replication.factor": str(replicas),
        "share.coordinator.state.topic.min.isr": str(min_isr),
        "group.initial.rebalance.delay.ms": "0",
        # Compaction of the run log and snapshots must actually run on a small local broker.
        "log.cleaner.enable": "true",
        "log.cleaner.threads": "1",
        "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
        # KIP-890 part 1: before appending a transactional produce, the partition leader asks
        # the transaction coordinator whether the partition is in an ongoing transaction. The
        # broker handles one request per connection at a time and librdkafka sends one
        # ProduceRequest per partition, so these round trips queue up: a processor transaction
        # of ~20 partitions took 2x as long (commit mean 102 -> 50 ms; 4 partitions idle:
        # 30 -> 7 ms). What it guards against (a produce request delayed past the end of its
        # transaction opening a "hanging" one) needs a request stuck on the wire; on loopback
        # we take the speed. AGENTRUNS_KAFKA_TXN_VERIFICATION=true restores Kafka's default.
        # See docs/design.md, "Broker settings".
        "transaction.partition.verification.enable": os.environ.get(
            "AGENTRUNS_KAFKA_TXN_VERIFICATION", "false"
        ),
    }


#: The KRaft authorizer: ACLs live in the cluster metadata (`kafka-acls.sh`, the admin API).
STANDARD_AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"


def authorizer_settings() -> dict[str, str]:
    """ACLs enforced, and nothing allowed without one. The PLAINTEXT listeners (brokers and
    controllers among themselves, and an operator's admin client on the PLAINTEXT port) are
    the super user ANONYMOUS; clients of the SASL listener hold only what ACLs grant them."""
    return {
        "authorizer.class.name": STANDARD_AUTHORIZER,
        "super.users": "User:ANONYMOUS",
        "allow.everyone.if.no.acl.found": "false",
    }


def server_properties(
    node: KafkaNode, voters: str, replicas: int, *, authorizer: bool = False
) -> str:
    """The broker+controller config of one node; with ``authorizer``, ACLs are enforced
    (`authorizer_settings`)."""
    listeners = f"PLAINTEXT://{node.host}:{node.port}"
    protocols = "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
    sasl: dict[str, str] = {}
    if node.sasl_port is not None:
        # Clients may authenticate with SCRAM on a second listener; brokers and controllers keep
        # talking PLAINTEXT among themselves.
        listeners += f",SASL_PLAINTEXT://{node.host}:{node.sasl_port}"
        protocols += ",SASL_PLAINTEXT:SASL_PLAINTEXT"
        mechanism = ScramUser.MECHANISM.lower()
        sasl = {
            "sasl.enabled.mechanisms": ScramUser.MECHANISM,
            f"listener.name.sasl_plaintext.{mechanism}.sasl.jaas.config": (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            ),
        }
    lines = {
        "process.roles": "broker,controller",
        "node.id": str(node.node_id),
        "controller.quorum.voters": voters,
        "listeners": f"{listeners},CONTROLLER://{node.host}:{node.controller_port}",
        "advertised.listeners": listeners,
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": protocols,
        **sasl,
        **(authorizer_settings() if authorizer else {}),
        "log.dirs": str(node.directory / "data"),
        **broker_settings(replicas),
    }
    return "".join(f"{k}={v}\n" for k, v in lines.items())


def container_env(settings: dict[str, str]) -> dict[str, str]:
    """Broker settings as the environment of Kafka's Docker images (Apache's and Confluent's):
    `KAFKA_` + the name upper-cased, dots as underscores."""
    return {"KAFKA_" + name.upper().replace(".", "_"): value for name, value in settings.items()}


class LocalKafka:
    """A local KRaft cluster of `brokers` combined nodes under `directory`."""

    def __init__(
        self,
        directory: Path,
        *,
        port: int = 19092,
        brokers: int = 1,
        heap: str = DEFAULT_HEAP,
        libs: Path | None = None,
        scram_user: ScramUser | None = None,
        sasl_port: int | None = None,
        placed: Sequence[tuple[str, Sequence[str]]] | None = None,
        more_users: Sequence[ScramUser] = (),
        authorizer: bool = False,
    ) -> None:
        """``scram_user`` adds a SASL_PLAINTEXT listener (SCRAM-SHA-256) on ``sasl_port`` (+i
        for node i) next to the PLAINTEXT one, with that user; it is created when the storage
        is first formatted, with ``more_users`` beside it; ``authorizer`` enforces ACLs on them
        (`authorizer_settings`). ``placed`` gives node i an address to listen on and a command
        prefix to run in (a network namespace of `netlab`) instead of 127.0.0.1."""
        if (scram_user is None) != (sasl_port is None):
            raise ValueError("scram_user and sasl_port go together")
        self.directory = directory
        self.scram_user = scram_user
        self.more_users = tuple(more_users)
        self.authorizer = authorizer
        self.brokers = brokers
        self.heap = heap
        self._libs = libs
        # Popen handles of the nodes this object started: kept so they are reaped on stop
        # (and no "subprocess still running" warning fires while the broker is meant to run).
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        # Node i listens on port+2i (clients) and port+2i+1 (controller quorum).
        self.nodes = [
            KafkaNode(
                i + 1,
                port + 2 * i,
                port + 2 * i + 1,
                directory / f"node-{i + 1}",
                None if sasl_port is None else sasl_port + i,
                *(() if placed is None else (placed[i][0], tuple(placed[i][1]))),
            )
            for i in range(brokers)
        ]

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"{n.host}:{n.port}" for n in self.nodes)

    @property
    def sasl_bootstrap_servers(self) -> str:
        """The SASL_PLAINTEXT listeners (empty without a ``scram_user``)."""
        return ",".join(f"{n.host}:{n.sasl_port}" for n in self.nodes if n.sasl_port)

    def running(self) -> list[int]:
        """The pids of this cluster's live broker processes."""
        return [pid for n in self.nodes if (pid := read_pid(n.pid_file)) and pid_alive(pid)]

    def start(self, *, timeout: float = 60.0) -> float:
        """Format (first time only) and start every node; wait until ready. Returns seconds."""
        began = time.monotonic()
        if self.running():
            self.wait_ready(timeout)
            return time.monotonic() - began
        libs = self._libs or ensure_jars()
        ensure_ports_free(
            [p for n in self.nodes for p in (n.port, n.controller_port, n.sasl_port) if p],
            what="Kafka",
            hint="stop the other process, or pick other ports with --kafka-port / "
            "AGENTRUNS_KAFKA_PORT",
        )
        voters = ",".join(f"{n.node_id}@{n.host}:{n.controller_port}" for n in self.nodes)
        replicas = min(self.brokers, 3)
        cluster_file = self.directory / "cluster.id"
        self.directory.mkdir(parents=True, exist_ok=True)
        if not cluster_file.exists():
            cluster_file.write_text(new_cluster_id())
        cluster_id = cluster_file.read_text().strip()
        log4j = self.directory / "log4j2.properties"
        log4j.write_text(
            (
                resources.files("agentruns.connectors.dev.stack") / "kafka" / "log4j2.properties"
            ).read_text()
        )
        classpath = f"{libs}/*"
        for node in self.nodes:
            node.directory.mkdir(parents=True, exist_ok=True)
            props = node.directory / "server.properties"
            props.write_text(server_properties(node, voters, replicas, authorizer=self.authorizer))
            if not (node.directory / "data" / "meta.properties").exists():
                self._format(classpath, cluster_id, props, log4j, node)
        for node in self.nodes:
            self._spawn(classpath, node, log4j)
        try:
            self.wait_ready(timeout - (time.monotonic() - began))
        except ServiceStartError:
            self.stop()
            raise
        return time.monotonic() - began

    def _java(self, classpath: str, log4j: Path) -> list[str]:
        java = shutil.which("java")
        if java is None:
            raise MissingToolError(
                "java is not installed", hint="install a JDK 17+ (apt-get install openjdk-17-jre)"
            )
        return [
            java,
            *self.heap.split(),
            # The throughput collector: its write barriers are cheaper than G1's, and on two
            # cores the broker's request threads are what the processes it serves wait for; its
            # pauses stay short, the broker keeping little alive. Measured in docs/design.md,
            # Broker settings.
            "-XX:+UseParallelGC",
            # C1 only by default: C2's compilations went on for minutes after start and took a
            # core from the processes the broker serves (2-core box). processor bench, latency
            # phase, two A/B pairs: p99 147-184 ms vs 299-746 ms. But C2's code is faster once
            # compiled: the loop bench at 64 concurrent runs (minutes of full load) 115-136 vs
            # 147 steps/s. Long-running or heavily loaded local brokers: AGENTRUNS_KAFKA_JIT=c2.
            *([] if os.environ.get("AGENTRUNS_KAFKA_JIT") == "c2" else ["-XX:TieredStopAtLevel=1"]),
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={log4j}",
            "-cp",
            classpath,
        ]

    def _format(
        self, classpath: str, cluster_id: str, props: Path, log4j: Path, node: KafkaNode
    ) -> None:
        cmd = [
            *self._java(classpath, log4j),
            "kafka.tools.StorageTool",
            "format",
            "--cluster-id",
            cluster_id,
            "--config",
            str(props),
            "--ignore-formatted",
            *(
                word
                for user in ([self.scram_user] if self.scram_user else []) + [*self.more_users]
                for word in ("--add-scram", user.storage_argument())
            ),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise ServiceStartError(
                f"formatting KRaft storage in {node.directory / 'data'} failed: "
                f"{tail(proc.stdout + proc.stderr, 3)}",
                hint="a stale data directory? remove it with `agentruns dev down --wipe`",
            )

    def _spawn(self, classpath: str, node: KafkaNode, log4j: Path) -> None:
        cmd = [
            *node.wrap,
            *self._java(classpath, log4j),
            "kafka.Kafka",
            str(node.directory / "server.properties"),
        ]
        with open(node.log_file, "ab") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # survives the CLI that started it; own process group
            )
        node.pid_file.write_text(str(proc.pid))
        self._procs[node.node_id] = proc

    def wait_ready(self, timeout: float) -> None:
        """Ready = every node alive and an AdminClient sees all brokers in the metadata."""
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + max(timeout, 1.0)
        admin = AdminClient(
            {"bootstrap.servers": self.bootstrap_servers, **KAFKA_LOGS, "log_level": 0}
        )
        last_error = "no answer"
        while time.monotonic() < deadline:
            for node in self.nodes:
                pid = read_pid(node.pid_file)
                if pid is None or not pid_alive(pid):
                    raise ServiceStartError(
                        f"Kafka node {node.node_id} exited during start-up: "
                        f"{tail(node.log_file.read_text(errors='replace'), 4)}",
                        hint=f"full log: {node.log_file}",
                    )
            try:
                meta = admin.list_topics(timeout=2.0)
                if len(meta.brokers) >= len(self.nodes):
                    return
                last_error = f"{len(meta.brokers)} of {len(self.nodes)} brokers registered"
            except Exception as exc:  # librdkafka raises KafkaException while it cannot connect
                last_error = str(exc)
            time.sleep(0.2)
        raise ServiceStartError(
            f"Kafka at {self.bootstrap_servers} was not ready within {timeout:.0f}s ({last_error})",
            hint=f"see {self.nodes[0].log_file}",
        )

    def stop(self, *, timeout: float = 30.0) -> None:
        """SIGTERM every node (controlled shutdown), SIGKILL what is left after `timeout`."""
        for node in self.nodes:
            stop_pid(node.pid_file, sig=signal.SIGTERM, timeout=timeout)
            self._reap(node)

    def _reap(self, node: KafkaNode) -> None:
        proc = self._procs.pop(node.node_id, None)
        if proc is not None:
            proc.wait(timeout=10)

    def node(self, node_id: int) -> KafkaNode:
        return next(n for n in self.nodes if n.node_id == node_id)

    def node_running(self, node_id: int) -> bool:
        pid = read_pid(self.node(node_id).pid_file)
        return pid is not None and pid_alive(pid)

    def start_node(self, node_id: int, *, timeout: float = 60.0) -> float:
        """Start one node of a started cluster again (after `kill`, fault tests) and wait until
        every broker is registered again. Returns seconds."""
        began = time.monotonic()
        node = self.node(node_id)
        if not self.node_running(node_id):
            self._reap(node)
            log4j = self.directory / "log4j2.properties"
            self._spawn(f"{self._libs or ensure_jars()}/*", node, log4j)
        if all(self.node_running(n.node_id) for n in self.nodes):
            self.wait_ready(timeout)
        return time.monotonic() - began

    def active_controller(self) -> int | None:
        """The node id of the KRaft quorum's leader (the active controller), as the live voters
        last recorded it in their quorum-state files: the highest epoch's leader."""
        best: tuple[int, int] | None = None
        for node in self.nodes:
            if not self.node_running(node.node_id):
                continue
            state = node.directory / "data" / "__cluster_metadata-0" / "quorum-state"
            try:
                data = json.loads(state.read_text())
            except (OSError, ValueError):  # being rewritten: the others say it
                continue
            epoch, leader = int(data.get("leaderEpoch", -1)), int(data.get("leaderId", -1))
            if leader >= 0 and (best is None or epoch > best[0]):
                best = (epoch, leader)
        return None if best is None else best[1]

    def kill(self, node_ids: Sequence[int] | None = None) -> None:
        """SIGKILL nodes (fault tests)."""
        for node in self.nodes:
            if node_ids is None or node.node_id in node_ids:
                stop_pid(node.pid_file, sig=signal.SIGKILL, timeout=10.0)
                self._reap(node)

    def pause(self) -> None:
        """SIGSTOP every node (fault tests): a broker that stands still, connections open, as in
        a long GC pause or a stalled disk."""
        for pid in self.running():
            os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in self.running():
            os.kill(pid, signal.SIGCONT)

    def restart(self, *, timeout: float = 60.0) -> float:
        self.stop()
        return self.start(timeout=timeout)

    def wipe(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

"""Least privilege on Kafka: a broker with the KRaft authorizer on, one SCRAM user per service
holding only the ACLs `agentruns kafka acls --service NAME` prints, and the pipeline (processor,
both executors, timer, sink, each a process of its own with its own credentials) carries a run
from its submission (by an upstream producer, and through the API) to its result and its
projection; the scanner finds a run whose model executor is gone by the executor group's lag;
the admin creates the topics, the auditor replays a run. Every service of
`agentruns.streams.access.SERVICES` runs with its own user. A service refused one of its ACLs
ends with one line naming what was refused."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import psycopg
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AclBindingFilter, AdminClient

from agentruns.connectors.dev.servers import model_server, tool_server
from agentruns.connectors.dev.stack.local_kafka import LocalKafka, ScramUser
from agentruns.connectors.dev.stack.procs import free_port_block
from agentruns.connectors.kafka_acls import apply, bindings
from agentruns.processors.events import Message, RunSubmitted
from agentruns.processors.state import ToolSpec
from agentruns.streams.access import (
    SERVICES as ACL_SERVICES,
)
from agentruns.streams.access import (
    Acl,
    acls,
    executor_group,
    transactional_id_prefix,
)
from agentruns.streams.codec import encode
from agentruns.streams.partitioning import partition_for
from agentruns.streams.records import input_record
from agentruns.streams.topics import INBOX, TopicNames, effect_suffix, topic_name
from tests.support.executors import fast_registry
from tests.support.pipeline import read_all
from tests.support.waiting import wait_for

PREFIX = "acl"
PARTITIONS = 2
SERVICES = (
    "admin",
    "processor",
    "model-executor",
    "tool-executor",
    "timer",
    "sink",
    "submitter",
    "audit",
    "api",
    "scanner",
)
USERS = {s: ScramUser(f"agentruns-{s}", f"password-of-{s}-0123456789") for s in SERVICES}
MODULES = {
    "processor": "agentruns.connectors.runtime.processor",
    "model-executor": "agentruns.connectors.executors.model",
    "tool-executor": "agentruns.connectors.executors.tool",
    "timer": "agentruns.connectors.runtime.timers",
    "sink": "agentruns.connectors.projection.sink",
    "admin": "agentruns.connectors.cli",
    "api": "agentruns.connectors.api.serve",
    "scanner": "agentruns.connectors.runtime.scanner",
}
API_TOKEN = "api_" + secrets.token_urlsafe(32)


@pytest.fixture(scope="module")
def secured_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    port = free_port_block(3)  # PLAINTEXT (the super user ANONYMOUS), controller, SASL
    kafka = LocalKafka(
        tmp_path_factory.mktemp("acl-kafka"),
        port=port,
        scram_user=USERS["submitter"],
        sasl_port=port + 2,
        more_users=[u for s, u in USERS.items() if s != "submitter"],
        authorizer=True,
    )
    kafka.start(timeout=120)
    try:
        yield kafka
    finally:
        kafka.wipe()


def properties_file(directory: Path, user: ScramUser) -> Path:
    path = directory / f"{user.name}.properties"
    path.write_text(
        "security.protocol=SASL_PLAINTEXT\n"
        "sasl.mechanism=SCRAM-SHA-256\n"
        f"sasl.username={user.name}\n"
        f"sasl.password={user.password}\n"
    )
    return path


def start(
    service: str,
    kafka: LocalKafka,
    database_url: str,
    tmp: Path,
    *args: str,
    env_extra: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTRUNS_")}
    env.update(
        KAFKA_BOOTSTRAP_SERVERS=kafka.sasl_bootstrap_servers,
        DATABASE_URL=database_url,
        AGENTRUNS_KAFKA_CONFIG=str(properties_file(tmp, USERS[service])),
        AGENTRUNS_LOG_LEVEL="WARNING",
        **(env_extra or {}),
    )
    return subprocess.Popen(
        [sys.executable, "-m", MODULES[service], "--prefix", PREFIX, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def submit(kafka: LocalKafka, tmp: Path, run_id: str, tools: tuple[ToolSpec, ...]) -> None:
    """The task, produced with the submitter's credentials (Write on the inbox only)."""
    user = USERS["submitter"]
    producer = Producer(
        {
            "bootstrap.servers": kafka.sasl_bootstrap_servers,
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "SCRAM-SHA-256",
            "sasl.username": user.name,
            "sasl.password": user.password,
            "enable.idempotence": True,
        }
    )
    event = RunSubmitted(
        run_id=run_id,
        event_id=f"{run_id}:submit",
        at=int(time.time() * 1000),
        trace_id=uuid.uuid4().hex,
        goal="The printer on floor 3 is offline: open a ticket and tell facilities.",
        messages=(Message(role="user", content="The printer on floor 3 is offline."),),
        tools=tools,
        model_route="scenario:multi_tool",
    )
    producer.produce(
        topic_name(INBOX, PREFIX),
        key=run_id.encode(),
        value=encode("Input", input_record(event)),
        partition=partition_for(run_id, PARTITIONS),
    )
    assert producer.flush(30) == 0


def stop(procs: dict[str, subprocess.Popen[str]]) -> dict[str, str]:
    """Stop every process; their stderr, by service."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    return {name: proc.communicate(timeout=60)[1] for name, proc in procs.items()}


def test_every_service_with_acls_runs_as_its_own_user_here() -> None:
    assert set(SERVICES) == set(ACL_SERVICES)


def test_the_pipeline_runs_on_its_acls_and_a_missing_one_is_one_line(
    secured_kafka: LocalKafka, database_url: str, tmp_path: Path
) -> None:
    admin = secured_kafka.bootstrap_servers  # PLAINTEXT: the super user grants the ACLs
    for service in SERVICES:
        apply(admin, acls(service, PREFIX), f"User:{USERS[service].name}")
    # the admin principal creates the topics (`agentruns topics create`) with its ACLs only
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTRUNS_")}
    created = subprocess.run(
        [
            sys.executable,
            "-m",
            MODULES["admin"],
            "topics",
            "create",
            "--prefix",
            PREFIX,
            "--partitions",
            str(PARTITIONS),
        ],
        env={
            **env,
            "KAFKA_BOOTSTRAP_SERVERS": secured_kafka.sasl_bootstrap_servers,
            "AGENTRUNS_KAFKA_CONFIG": str(properties_file(tmp_path, USERS["admin"])),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert created.returncode == 0, created.stderr
    assert created.stdout.count("created") == len(TopicNames.for_prefix(PREFIX).all())

    registry = fast_registry(tmp_path, "http://127.0.0.1:9")
    procs: dict[str, subprocess.Popen[str]] = {}
    with (
        model_server.serve("127.0.0.1", 0) as models,
        tool_server.serve("127.0.0.1", 0) as tools,
        ExitStack() as cleanup,
    ):
        data = json.loads(registry.read_text())
        data["base_url"] = tools.url
        registry.write_text(json.dumps(data))
        specs = tuple(
            ToolSpec(
                name=t["name"], parameters=t["parameters"], permission=t["permission"],
                is_async=t["async"],
            )
            for t in data["tools"]
            if t["permission"] != "admin"
        )  # fmt: skip
        reg = ("--registry", str(registry))
        try:
            procs["processor"] = start("processor", secured_kafka, database_url, tmp_path, *reg)
            procs["model-executor"] = start(
                "model-executor",
                secured_kafka,
                database_url,
                tmp_path,
                "--base-url",
                models.url + "/v1",
                *reg,
            )
            procs["tool-executor"] = start(
                "tool-executor",
                secured_kafka,
                database_url,
                tmp_path,
                "--base-url",
                tools.url,
                *reg,
            )
            procs["timer"] = start("timer", secured_kafka, database_url, tmp_path)
            procs["sink"] = start("sink", secured_kafka, database_url, tmp_path)
            run_id = f"run-acl-{uuid.uuid4().hex[:12]}"
            submit(secured_kafka, tmp_path, run_id, specs)

            def result() -> dict[str, object] | None:
                ended = [p for p, proc in procs.items() if proc.poll() is not None]
                assert not ended, f"{ended} exited: {stop(procs)}"
                found = [
                    r.value
                    for r in read_all(admin, topic_name("results", PREFIX), "Result")
                    if r.value["run_id"] == run_id
                ]
                return found[0] if found else None

            outcome = wait_for(result, 60, "the run's result")
            assert outcome["status"] == "SUCCEEDED", outcome
            assert wait_for(projected(database_url, run_id), 30, "the projection") == "SUCCEEDED"

            # the API produces a task with its own user (Write on the inbox only)
            api_port = free_port_block(1, start=29300)
            procs["api"] = start(
                "api",
                secured_kafka,
                database_url,
                tmp_path,
                *("--port", str(api_port)),
                env_extra={"AGENTRUNS_API_TOKEN": API_TOKEN},
            )
            api = httpx.Client(
                base_url=f"http://127.0.0.1:{api_port}",
                headers={"Authorization": f"Bearer {API_TOKEN}"},
                timeout=15,
            )
            cleanup.callback(api.close)
            wait_for(lambda: api_ready(api), 60, "the API ready")
            submitted = api.post(
                "/runs",
                json={
                    "goal": "The printer on floor 3 is offline: open a ticket.",
                    "tools": [s.model_dump() for s in specs],
                    "model_route": "scenario:multi_tool",
                },
                headers={"Idempotency-Key": f"acl-{uuid.uuid4().hex}"},
            )
            assert submitted.status_code == 202, submitted.text
            run_id = submitted.json()["run_id"]
            outcome = wait_for(result, 60, "the API's run's result")
            assert outcome["status"] == "SUCCEEDED", outcome

            # no model executor: a run waits on it, and the scanner, with its own user, finds
            # the effect in the executor group's lag (Describe on the group and the topic)
            gone = procs.pop("model-executor")
            gone.terminate()
            assert "Traceback" not in gone.communicate(timeout=60)[1]
            run_id = f"run-acl-{uuid.uuid4().hex[:12]}"
            submit(secured_kafka, tmp_path, run_id, specs)
            status = wait_for(
                lambda: (s := projected_status(database_url, run_id)) in WAITING_ON_MODEL and s,
                30,
                "the run waiting on the model executor",
            )
            scanned = start(
                "scanner",
                secured_kafka,
                database_url,
                tmp_path,
                *("--stale-after", "0", "--json"),
            )
            out, err = scanned.communicate(timeout=60)
            assert scanned.returncode == 0, err
            (found,) = [d for d in map(json.loads, out.splitlines()) if d["run_id"] == run_id]
            model_topic = topic_name(effect_suffix("model"), PREFIX)
            assert (found["status"], found["waiting_on"]) == (status, "model executor")
            # the lag counts the transactions' commit markers too: at least the one effect
            waiting = re.fullmatch(rf"(\d+) effects waiting in {model_topic}: .*", found["detail"])
            assert waiting is not None and int(waiting[1]) >= 1, found
            # an auditor reads the run's log back with its own principal
            env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTRUNS_")}
            replayed = subprocess.run(
                [sys.executable, "-m", MODULES["admin"], "replay", "--prefix", PREFIX, run_id],
                env={
                    **env,
                    "KAFKA_BOOTSTRAP_SERVERS": secured_kafka.sasl_bootstrap_servers,
                    "AGENTRUNS_KAFKA_CONFIG": str(properties_file(tmp_path, USERS["audit"])),
                },
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert replayed.returncode == 0, replayed.stderr
            assert "RunSubmitted" in replayed.stdout, replayed.stdout[-2000:]
        finally:
            errors = stop(procs)
        for name, text in errors.items():
            assert "Traceback" not in text, f"{name}: {text}"

    # One ACL less: the tool executor's transactional ids. A new tool executor ends at once
    # with one line naming the transactional id it was refused.
    (txn,) = [a for a in acls("tool-executor", PREFIX) if a.resource == "TransactionalId"]
    revoke(admin, txn, "tool-executor")
    line = refused_line(start("tool-executor", secured_kafka, database_url, tmp_path, *reg))
    expected = f"transactional id {transactional_id_prefix(executor_group(PREFIX, 'tool'))}0-a"
    assert expected in line and "TRANSACTIONAL_ID_AUTHORIZATION_FAILED" in line, line
    # The sink refused Read on the results topic: one line naming the topic.
    results = topic_name("results", PREFIX)
    (read,) = [a for a in acls("sink", PREFIX) if a.name == results and a.operation == "Read"]
    revoke(admin, read, "sink")
    sink = start("sink", secured_kafka, database_url, tmp_path, "--log-level", "WARNING")
    line = refused_line(sink)
    assert f"Read on topic {results}" in line and "TOPIC_AUTHORIZATION_FAILED" in line, line


WAITING_ON_MODEL = ("READY", "MODEL_RUNNING")


def projected_status(database_url: str, run_id: str) -> str | None:
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT status FROM runs WHERE run_id = %s", (run_id,)).fetchone()
    return str(row[0]) if row else None


def projected(database_url: str, run_id: str) -> Callable[[], str | None]:
    """The run's projected status once it is SUCCEEDED (for `wait_for`)."""
    return lambda: "SUCCEEDED" if projected_status(database_url, run_id) == "SUCCEEDED" else None


def api_ready(api: httpx.Client) -> bool:
    try:
        return api.get("/readyz").status_code == 200
    except httpx.TransportError:
        return False


def revoke(admin: str, acl: Acl, service: str) -> None:
    """Delete one ACL of ``service``'s principal (as the super user)."""
    (binding,) = bindings([acl], f"User:{USERS[service].name}")
    match = AclBindingFilter(
        binding.restype,
        binding.name,
        binding.resource_pattern_type,
        binding.principal,
        binding.host,
        binding.operation,
        binding.permission_type,
    )
    client = AdminClient({"bootstrap.servers": admin})
    for future in client.delete_acls([match]).values():
        assert len(future.result(timeout=30)) == 1


def refused_line(proc: subprocess.Popen[str]) -> str:
    """The one line a service refused an ACL ends with (exit 2, within 30 s, no stack)."""
    began = time.monotonic()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert time.monotonic() - began < 30
    return lines[0]

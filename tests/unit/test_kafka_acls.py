"""The ACLs each service needs (`agentruns.streams.access`), derived from the names the
services use: the group and transactional ids the clients are built with, the command lines
and JSON `agentruns kafka acls` prints, and the table docs/security.md carries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.executors.config import ExecutorConfig
from agentruns.connectors.kafka_acls import main, markdown_table
from agentruns.connectors.projection.sink import SinkConfig
from agentruns.streams.access import SERVICES, acls, processor_group
from agentruns.streams.processor import ProcessorConfig
from agentruns.streams.topics import DEFAULT_PREFIX, TopicNames
from agentruns.streams.transaction import Clients

DOCS = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def granted(service: str, prefix: str = "p") -> set[tuple[str, str, str, str]]:
    return {(a.resource, a.name, a.pattern, a.operation) for a in acls(service, prefix)}


def test_the_services_groups_and_transactional_ids_are_the_ones_granted() -> None:
    processor = ProcessorConfig("b:9092", prefix="p")
    assert processor.group_id == processor_group("p")
    clients = Clients.of(processor, processor.group_id)
    txn = clients.producer_config("a", {})["transactional.id"]
    [prefixed] = [a for a in acls("processor", "p") if a.resource == "TransactionalId"]
    assert prefixed.pattern == "prefixed" and txn.startswith(prefixed.name)
    tool = ExecutorConfig("b:9092", "pg://", "tool", prefix="p")
    assert ("Group", tool.group, "literal", "Read") in granted("tool-executor")
    sink = SinkConfig("b:9092", "pg://", prefix="p")
    assert ("Group", sink.group_id, "literal", "Read") in granted("sink")


def test_each_service_reads_and_writes_only_its_own_topics() -> None:
    t = TopicNames.for_prefix("p")
    writes = {
        s: {n for r, n, _, op in granted(s) if r == "Topic" and op == "Write"} for s in SERVICES
    }
    assert writes["api"] == writes["submitter"] == {t.inbox}
    assert writes["tool-executor"] == writes["model-executor"] == {t.inbox, t.dlq}
    assert writes["sink"] == {t.dlq}
    assert t.inbox not in writes["processor"] and set(t.outputs()) == writes["processor"]
    reads = {n for r, n, _, op in granted("model-executor") if op == "Read" and r == "Topic"}
    assert reads == {t.effect("model")}
    assert not any(r == "TransactionalId" for r, *_ in granted("sink"))
    with pytest.raises(ValueError, match="unknown service"):
        acls("everything")


def test_a_given_group_replaces_the_default_one() -> None:
    names = {a.name for a in acls("processor", "p", group="blue")}
    assert {"blue", "blue-restore", "blue-"} <= names and processor_group("p") not in names


def test_the_command_prints_kafka_acls_lines_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--service", "tool-executor", "--prefix", "p"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(lines) == len(acls("tool-executor", "p"))
    head = "kafka-acls.sh --bootstrap-server $KAFKA_BOOTSTRAP_SERVERS"
    assert all(line.startswith(head) for line in lines)
    assert any(
        "--transactional-id p-executor-tool- --resource-pattern-type prefixed" in line
        and "--allow-principal User:agentruns-tool-executor" in line
        for line in lines
    )
    assert main(["--service", "sink", "--prefix", "p", "--json", "--principal", "User:s"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["principal"] for r in rows} == {"User:s"}
    assert {r["operation"] for r in rows} == {"Read", "Write"}
    for principal in ("s", "User:", "Group:x"):
        with pytest.raises(AgentrunsError):
            main(["--service", "sink", "--principal", principal])


def test_docs_security_md_carries_the_generated_table() -> None:
    assert markdown_table(DEFAULT_PREFIX) in DOCS.read_text()

"""What each agentruns service may do on Kafka: the consumer groups and transactional ids it
names, and the ACLs it needs, derived from those names and the topic names (`topics`).

The services take their default group ids from here (`processor_group`, `executor_group`, ...)
and their transactional ids from `transactional_id_prefix`, so what `acls` grants is what they
use; `agentruns kafka acls --service NAME` prints it for an operator to apply, and an
end-to-end test runs the pipeline on a broker whose users hold only these ACLs.

Kafka's implications keep the lists short: Read or Write on a topic implies Describe on it,
Read on a group implies Describe, Write on a transactional id implies Describe. An idempotent
producer needs no cluster permission since Kafka 2.8 (KIP-679), only Write on a topic.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from agentruns.streams.topics import DEFAULT_PREFIX, EFFECT_KINDS, TopicNames

__all__ = [
    "SERVICES",
    "Acl",
    "acls",
    "executor_group",
    "processor_group",
    "reader_group_prefix",
    "restore_group",
    "sink_group",
    "timer_group",
    "transactional_id_prefix",
]

TOPIC = "Topic"
GROUP = "Group"
TRANSACTIONAL_ID = "TransactionalId"
CLUSTER = "Cluster"
#: The one cluster resource's name in Kafka's ACLs.
CLUSTER_NAME = "kafka-cluster"
LITERAL = "literal"
PREFIXED = "prefixed"


def processor_group(prefix: str = DEFAULT_PREFIX) -> str:
    """The processors' consumer group (one per deployment prefix)."""
    return f"{prefix}-processor"


def executor_group(prefix: str, kind: str) -> str:
    """The consumer group of the executors of ``kind`` (model, tool)."""
    return f"{prefix}-executor-{kind}"


def timer_group(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}-timer"


def sink_group(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}-sink"


def restore_group(group: str) -> str:
    """The group id of a processor's restore reader (assigned partitions, never a member)."""
    return f"{group}-restore"


def reader_group_prefix(topic: str) -> str:
    """What the group ids of a reader of ``topic`` (replay, audit) start with: it assigns
    partitions and never commits, but librdkafka still asks for its group's coordinator."""
    return f"{topic}-audit-"


def transactional_id_prefix(group: str) -> str:
    """What every transactional id of a transactional loop of ``group`` starts with: its ids
    are ``<group>-<instance>-<slot>`` (`streams.transaction.Clients`)."""
    return f"{group}-"


@dataclass(frozen=True, order=True)
class Acl:
    """One ALLOW rule for a service's principal (from any host)."""

    resource: str  # Topic, Group, TransactionalId, Cluster
    name: str
    pattern: str  # literal or prefixed
    operation: str  # Read, Write, Describe, DescribeConfigs, Create, AlterConfigs, Alter


#: The services, each with what it does on Kafka (shown by `agentruns kafka acls`).
SERVICES: dict[str, str] = {
    "processor": "consumes the inbox, writes the log, snapshots, results, effects (transactions)",
    "model-executor": "consumes model effects, answers to the inbox (transactions)",
    "tool-executor": "consumes tool effects, answers to the inbox (transactions)",
    "timer": "consumes timer effects, fires timers into the inbox",
    "sink": "projects the log, snapshots, results and dead letters into Postgres",
    "scanner": "reads the executors' committed offsets; --redrive writes the inbox",
    "api": "produces tasks, replies and cancels to the inbox",
    "submitter": "an upstream producer (agentruns submit/reply/cancel/fork): the inbox",
    "audit": "agentruns replay/audit: read the log and the snapshots (assigned, no group)",
    "admin": "agentruns topics create/list: creates the topics and aligns their configs",
}


def _on(resource: str, names: Iterable[str], *operations: str, pattern: str = LITERAL) -> list[Acl]:
    return [Acl(resource, name, pattern, op) for name in names for op in operations]


def acls(service: str, prefix: str = DEFAULT_PREFIX, *, group: str | None = None) -> list[Acl]:
    """The ACLs ``service`` needs with topics of ``prefix``; ``group`` is its consumer group
    when it was given another than its default (``--group``). Sorted, without duplicates;
    ValueError for an unknown service."""
    t = TopicNames.for_prefix(prefix)
    found: list[Acl]
    if service == "processor":
        g = group or processor_group(prefix)
        found = [
            *_on(TOPIC, [t.inbox, t.state, t.runs], "Read"),  # the inbox; restores
            *_on(TOPIC, t.outputs(), "Write", "DescribeConfigs"),  # record size limits
            *_on(CLUSTER, [CLUSTER_NAME], "DescribeConfigs"),  # the broker's message.max.bytes
            *_on(GROUP, [g, restore_group(g)], "Read"),
            *_on(TRANSACTIONAL_ID, [transactional_id_prefix(g)], "Write", pattern=PREFIXED),
        ]
    elif service in ("model-executor", "tool-executor"):
        kind = service.split("-", 1)[0]
        g = group or executor_group(prefix, kind)
        found = [
            *_on(TOPIC, [t.effect(kind)], "Read"),
            *_on(TOPIC, [t.inbox, t.dlq], "Write"),
            *_on(GROUP, [g], "Read"),
            *_on(TRANSACTIONAL_ID, [transactional_id_prefix(g)], "Write", pattern=PREFIXED),
        ]
    elif service == "timer":
        found = [
            *_on(TOPIC, [t.effect("timer")], "Read"),
            *_on(TOPIC, [t.inbox, t.dlq], "Write"),
            *_on(GROUP, [group or timer_group(prefix)], "Read"),
        ]
    elif service == "sink":
        found = [
            *_on(TOPIC, [t.events, t.state, t.results, t.dlq], "Read"),
            *_on(TOPIC, [t.dlq], "Write"),
            *_on(GROUP, [group or sink_group(prefix)], "Read"),
        ]
    elif service == "scanner":
        called = [k for k in EFFECT_KINDS if k != "timer"]
        found = [
            *_on(TOPIC, [t.effect(k) for k in called], "Describe"),
            *_on(GROUP, [executor_group(prefix, k) for k in called], "Describe"),
            *_on(TOPIC, [t.inbox], "Write"),
        ]
    elif service in ("api", "submitter"):
        found = _on(TOPIC, [t.inbox], "Write")
    elif service == "audit":
        found = [
            *_on(TOPIC, [t.events, t.state], "Read"),
            *_on(GROUP, [reader_group_prefix(t.events), reader_group_prefix(t.state)], "Read",
                 pattern=PREFIXED),
        ]  # fmt: skip
    elif service == "admin":
        found = _on(TOPIC, t.all(), "Create", "Describe", "DescribeConfigs", "AlterConfigs")
    else:
        raise ValueError(f"unknown service {service!r}; known: {', '.join(SERVICES)}")
    return sorted(set(found))


def default_principal(service: str) -> str:
    """The principal `agentruns kafka acls` names when given none."""
    return f"User:agentruns-{service}"

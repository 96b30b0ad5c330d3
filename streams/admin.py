"""Create and describe the pipeline's topics from the one spec in `agentruns.streams.topics`.

Idempotent: an existing topic is left as it is when its partition count matches and its
configs are brought to the spec with an incremental alter; a partition mismatch is an error
(changing it would move runs between partitions and break co-partitioning).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicCollection
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from agentruns.streams.errors import AgentrunsKafkaError
from agentruns.streams.kafka_defaults import client_settings
from agentruns.streams.topics import (
    DEFAULT_PARTITIONS,
    DEFAULT_PREFIX,
    INBOX,
    TopicSpec,
    topic_name,
    topic_specs,
)

TIMEOUT_S = 30.0
log = logging.getLogger("agentruns.admin")


def _admin(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap, **client_settings(), "log_level": 3})


#: How long `ensure_topics` retries what a cluster without a controller, or with brokers
#: coming back, answers with a timeout or a retriable error.
PATIENCE_S = 120.0
_TRANSIENT = frozenset(
    {
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.NOT_CONTROLLER,
        KafkaError._DESTROY_BROKER,  # a broker leaving the metadata while a request waited
    }
)


class KafkaUnreachableError(AgentrunsKafkaError):
    """No broker answered the first request."""


def _transient(exc: BaseException) -> bool:
    """A timeout or a retriable Kafka error, itself or as the cause of ours."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, TimeoutError):  # a future's result(timeout=...) ran out
            return True
        if isinstance(seen, KafkaException) and seen.args:
            error = seen.args[0]
            if isinstance(error, KafkaError) and (error.retriable() or error.code() in _TRANSIENT):
                return True
        seen = seen.__cause__
    return False


def ensure_topics(
    bootstrap: str,
    *,
    prefix: str = DEFAULT_PREFIX,
    partitions: int | None = None,
    specs: list[TopicSpec] | None = None,
    patience_s: float = PATIENCE_S,
) -> dict[str, str]:
    """Create missing topics, align configs of existing ones; return name -> what was done.
    A timeout or a retriable error (a cluster electing a controller, brokers coming back) is
    retried for ``patience_s``, with a warning each time."""
    deadline = time.monotonic() + patience_s
    answered = False
    while True:
        try:
            return _ensure_topics(bootstrap, prefix, partitions, specs)
        except (AgentrunsKafkaError, KafkaException, TimeoutError) as exc:
            # unreachable from the start: fail fast; after it answered: brokers coming back
            unreachable = isinstance(exc, KafkaUnreachableError) and not answered
            answered = True
            if unreachable or not _transient(exc) or time.monotonic() > deadline:
                if isinstance(exc, TimeoutError):
                    raise AgentrunsKafkaError(
                        f"Kafka at {bootstrap} did not answer an admin request within "
                        f"{TIMEOUT_S:.0f} s while the topics were checked"
                    ) from exc
                raise
            log.warning(
                "checking the topics failed, trying again: %s", str(exc) or type(exc).__name__
            )
            time.sleep(1.0)


def _ensure_topics(
    bootstrap: str,
    prefix: str,
    partitions: int | None,
    specs: list[TopicSpec] | None,
) -> dict[str, str]:
    admin = _admin(bootstrap)
    try:
        metadata = admin.list_topics(timeout=TIMEOUT_S)
    except KafkaException as exc:
        # not retried: the services wait for Kafka before (ServiceStack), commands fail fast
        raise KafkaUnreachableError(f"cannot reach Kafka at {bootstrap}: {exc}") from exc
    existing = metadata.topics
    inbox_name = topic_name(INBOX, prefix)
    replicas = min(3, len(metadata.brokers))
    # No count asked for: an existing inbox decides, so every process of a deployment agrees
    # with the first one that created the topics.
    derived = specs is None and partitions is None
    if specs is None:
        if partitions is None:
            inbox = existing.get(inbox_name)
            partitions = len(inbox.partitions) if inbox is not None else DEFAULT_PARTITIONS
        specs = topic_specs(prefix, partitions, replicas)
    outcome: dict[str, str] = {}
    missing = [s for s in specs if s.name(prefix) not in existing]
    if missing:
        futures = admin.create_topics(
            [
                NewTopic(
                    s.name(prefix), s.partitions, s.replication_factor, config=s.kafka_configs()
                )
                for s in missing
            ],
            operation_timeout=TIMEOUT_S,
        )
        for name, future in futures.items():
            try:
                future.result(timeout=TIMEOUT_S)
                outcome[name] = "created"
            except KafkaException as exc:
                # It exists after all: another process created it between our list and create,
                # or the metadata we listed was stale. Checked below like any existing topic.
                if exc.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                    outcome[name] = _unchecked(name)
                elif exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise AgentrunsKafkaError(f"creating topic {name} failed: {exc}") from exc
        raced = [s.name(prefix) for s in missing if s.name(prefix) not in outcome]
        if raced:
            existing = _wait_listed(admin, raced)
            listed = existing.get(inbox_name)
            if derived and inbox_name in raced and listed is not None and listed.partitions:
                # the first listing missed an inbox that existed (metadata from a broker that
                # had not caught up): its count decides, not the default
                specs = topic_specs(prefix, len(listed.partitions), replicas)
    for spec in specs:
        name = spec.name(prefix)
        if name in outcome:
            continue
        if name not in existing:
            raise AgentrunsKafkaError(f"topic {name} exists but is not in the broker's metadata")
        have = len(existing[name].partitions)
        if have != spec.partitions:
            raise AgentrunsKafkaError(
                f"topic {name} has {have} partitions, the spec says {spec.partitions}",
                hint="use --partitions to match, or a new --prefix; never repartition run topics",
            )
        outcome[name] = "exists" if _align_configs(admin, name, spec) else _unchecked(name)
    return outcome


#: What `ensure_topics` reports for a topic its principal may not create, or whose configs it
#: may not read or set: with ACLs, a service's principal holds only what the service needs
#: (`streams.access`), and the operator's admin principal creates the topics.
UNCHECKED = "unchecked"


def _unchecked(name: str) -> str:
    log.info(
        "topic %s: this principal may not create it or set its configs (no ACL); "
        "the admin's `agentruns topics create` keeps it",
        name,
    )
    return UNCHECKED


def _wait_listed(admin: AdminClient, names: list[str]) -> dict[str, Any]:
    """Topic metadata once every name in ``names`` is listed (metadata can lag a create)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        topics = admin.list_topics(timeout=TIMEOUT_S).topics
        if all(n in topics and topics[n].partitions for n in names) or time.monotonic() > deadline:
            return dict(topics)
        time.sleep(0.1)


def configs_to_set(current: Mapping[str, str | None], wanted: Mapping[str, str]) -> dict[str, str]:
    """The entries of ``wanted`` whose value ``current`` (a topic's effective configs) does not
    have already."""
    return {k: v for k, v in wanted.items() if current.get(k) != v}


def _align_configs(admin: AdminClient, name: str, spec: TopicSpec) -> bool:
    """Set what differs from the spec, and nothing else: every service checks the topics when
    it starts, and a config change is not free. A change of ``min.insync.replicas`` (even to the
    value it has) clears the partitions' eligible leader replicas (Kafka 4.1's ELR, KIP-966),
    so services restarting after two brokers were down left every pipeline partition whose ISR
    had emptied without a leader for good. False when the principal may not read or set them."""
    topic = ConfigResource(ResourceType.TOPIC, name)
    try:
        (described,) = admin.describe_configs([topic]).values()
        current = {k: e.value for k, e in described.result(timeout=TIMEOUT_S).items()}
    except KafkaException as exc:
        if _not_permitted(exc):
            return False
        raise AgentrunsKafkaError(f"reading the configs of {name} failed: {exc}") from exc
    changed = configs_to_set(current, spec.kafka_configs())
    if not changed:
        return True
    resource = ConfigResource(
        ResourceType.TOPIC,
        name,
        incremental_configs=[
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET)
            for k, v in changed.items()
        ],
    )
    futures = admin.incremental_alter_configs([resource])
    try:
        for future in futures.values():
            future.result(timeout=TIMEOUT_S)
    except KafkaException as exc:
        if _not_permitted(exc):
            return False
        raise AgentrunsKafkaError(f"aligning the configs of {name} failed: {exc}") from exc
    return True


def _not_permitted(exc: KafkaException) -> bool:
    error = exc.args[0] if exc.args else None
    return isinstance(error, KafkaError) and error.code() in (
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    )


def describe_topics(bootstrap: str, *, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """One line per pipeline topic that exists: name, partitions and the spec'd configs."""
    admin = _admin(bootstrap)
    topics = admin.list_topics(timeout=TIMEOUT_S).topics
    names = sorted(t for t in topics if t.startswith(f"{prefix}."))
    if not names:
        return [f"no topics with prefix {prefix!r} (create them with `agentruns topics create`)"]
    futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, n) for n in names])
    keys = ("cleanup.policy", "retention.ms", "min.insync.replicas")
    rows = []
    for resource, future in sorted(futures.items(), key=lambda kv: kv[0].name):
        configs = future.result(timeout=TIMEOUT_S)
        shown = " ".join(f"{k}={configs[k].value}" for k in keys if k in configs)
        rows.append(f"{resource.name}  partitions={len(topics[resource.name].partitions)}  {shown}")
    return rows


def record_limits(bootstrap: str, topics: list[str], timeout_s: float = 10.0) -> dict[str, int]:
    """The largest record each of `topics` takes: its `max.message.bytes` (the topic's own, or
    the broker's `message.max.bytes` it inherits). Topics whose config cannot be read are left
    out; the broker's value, under the key "", stands for them when it could be read."""
    admin = _admin(bootstrap)
    limits: dict[str, int] = {}
    try:
        brokers = admin.list_topics(timeout=timeout_s).brokers
        resources = [ConfigResource(ResourceType.TOPIC, t) for t in topics]
        if brokers:
            resources.append(ConfigResource(ResourceType.BROKER, str(min(brokers))))
        futures = admin.describe_configs(resources)
    except KafkaException:
        return limits
    for resource, future in futures.items():
        name = "max.message.bytes" if resource.restype == ResourceType.TOPIC else None
        try:
            configs = future.result(timeout=timeout_s)
        except (KafkaException, TimeoutError):  # a broker down: its answer never comes
            continue
        entry = configs.get(name or "message.max.bytes")
        if entry is not None and entry.value is not None and str(entry.value).isdigit():
            limits[resource.name if name else ""] = int(entry.value)
    return limits


def topic_id(bootstrap: str, topic: str) -> str:
    """The id the cluster gave `topic` when it was created (a recreated topic has another),
    waiting out a cluster that does not answer yet; raises if the topic does not exist."""
    admin = _admin(bootstrap)
    deadline = time.monotonic() + PATIENCE_S
    while True:
        try:
            (future,) = admin.describe_topics(TopicCollection([topic])).values()
            return str(future.result(timeout=TIMEOUT_S).topic_id)
        except (KafkaException, TimeoutError) as exc:
            if not _transient(exc) or time.monotonic() > deadline:
                raise AgentrunsKafkaError(f"cannot describe topic {topic}: {exc}") from exc
            time.sleep(1.0)

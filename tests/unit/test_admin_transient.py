"""Which admin failures `ensure_topics` waits out: timeouts and retriable errors (a cluster
electing a controller, brokers coming back), not a broker that never answered nor a refusal."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException

from agentruns.streams.admin import KafkaUnreachableError, _transient, configs_to_set
from agentruns.streams.errors import AgentrunsKafkaError


def _wrapped(error: KafkaError) -> AgentrunsKafkaError:
    try:
        try:
            raise KafkaException(error)
        except KafkaException as exc:
            raise AgentrunsKafkaError("aligning the configs failed") from exc
    except AgentrunsKafkaError as outer:
        return outer


def test_a_futures_timeout_is_transient() -> None:
    assert _transient(TimeoutError())


def test_timeouts_and_retriable_errors_are_transient_through_our_errors() -> None:
    assert _transient(_wrapped(KafkaError(KafkaError.REQUEST_TIMED_OUT)))
    assert _transient(_wrapped(KafkaError(KafkaError.NOT_CONTROLLER)))
    assert _transient(_wrapped(KafkaError(KafkaError.UNKNOWN, retriable=True)))


def test_refusals_are_not() -> None:
    assert not _transient(_wrapped(KafkaError(KafkaError.POLICY_VIOLATION)))
    assert not _transient(AgentrunsKafkaError("topic x has 2 partitions, the spec says 6"))
    assert issubclass(KafkaUnreachableError, AgentrunsKafkaError)


def test_only_configs_that_differ_are_set() -> None:
    wanted = {"cleanup.policy": "compact", "retention.ms": "-1", "min.insync.replicas": "2"}
    current = {"cleanup.policy": "compact", "retention.ms": "604800000", "min.insync.replicas": "2"}
    assert configs_to_set(current, wanted) == {"retention.ms": "-1"}
    # an aligned topic gets no config change at all (a no-op change still clears ELR)
    assert configs_to_set({**current, "retention.ms": "-1", "segment.ms": "1"}, wanted) == {}
    assert configs_to_set({}, wanted) == wanted
    assert configs_to_set({"min.insync.replicas": None}, wanted)["min.insync.replicas"] == "2"

"""A refusal for want of an ACL is one error naming what was refused: from a consumer's
message (the topic it names, or the group), and never for another error."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError

from agentruns.streams.authorization import KafkaAuthorizationError, refused
from agentruns.streams.polling import check_fatal


class _Message:
    """What `check_fatal` reads of a consumer's message."""

    def __init__(self, error: KafkaError | None, topic: str | None) -> None:
        self._error, self._topic = error, topic

    def error(self) -> KafkaError | None:
        return self._error

    def topic(self) -> str | None:
        return self._topic


def test_refusals_name_the_resource_and_other_errors_are_not_refusals() -> None:
    txn = refused(
        KafkaError(KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED),
        name="g-0-a",
        operation="Write",
    )
    assert txn is not None
    assert "Write on transactional id g-0-a (TRANSACTIONAL_ID_AUTHORIZATION_FAILED)" in str(txn)
    assert "agentruns kafka acls" in txn.one_line()
    unnamed = refused(KafkaError(KafkaError.CLUSTER_AUTHORIZATION_FAILED))
    assert unnamed is not None and "on a cluster (" in str(unnamed)
    assert refused(KafkaError(KafkaError._TRANSPORT)) is None
    assert refused(None) is None


def test_a_consumer_refused_a_topic_or_its_group_raises_one_error_naming_it() -> None:
    fine = _Message(None, "p.inbox")
    assert check_fatal([fine], "g") == [fine]  # type: ignore[list-item]
    topic = _Message(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), "p.inbox")
    with pytest.raises(KafkaAuthorizationError, match=r"Read on topic p\.inbox"):
        check_fatal([fine, topic], "g")  # type: ignore[list-item]
    group = _Message(KafkaError(KafkaError.GROUP_AUTHORIZATION_FAILED), None)
    with pytest.raises(KafkaAuthorizationError, match="Read on group g "):
        check_fatal([group], "g")  # type: ignore[list-item]
    # a consumer error of another kind is the loop's to log and skip, as before
    other = _Message(KafkaError(KafkaError._PARTITION_EOF), "p.inbox")
    assert check_fatal([other], "g") == [other]  # type: ignore[list-item]

"""A Kafka refusal for want of an ACL, as one error naming what was refused.

With an authorizer on, a principal without an ACL it needs gets ``*_AUTHORIZATION_FAILED``
from the broker; librdkafka's text says which kind of resource ("Topic authorization failed")
but not which one. The service knows which topic, group or transactional id it asked for, so
it raises `refused(...)`: the process ends with one line (exit 2) naming the resource and the
operation instead of retrying, since no retry grants an ACL.
"""

from __future__ import annotations

from confluent_kafka import KafkaError

from agentruns.streams.errors import AgentrunsKafkaError

#: The refusals for want of an ACL, by the kind of resource refused.
REFUSALS: dict[int, str] = {
    KafkaError.TOPIC_AUTHORIZATION_FAILED: "topic",
    KafkaError.GROUP_AUTHORIZATION_FAILED: "group",
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: "transactional id",
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: "cluster",
}


class KafkaAuthorizationError(AgentrunsKafkaError):
    """The broker refused an operation for want of an ACL."""


def refused(
    error: KafkaError | None, *, name: str = "", operation: str = ""
) -> KafkaAuthorizationError | None:
    """The error to raise when ``error`` is a refusal for want of an ACL on ``name`` (the
    topic, group or transactional id asked for), else None."""
    if error is None or error.code() not in REFUSALS:
        return None
    kind = REFUSALS[error.code()]
    # without the name the caller asked for, librdkafka's own text is all there is
    what = f"{kind} {name}" if name else f"a {kind} ({error.str()})"
    return KafkaAuthorizationError(
        f"Kafka refused {operation or 'access'} on {what} ({error.name()}): "
        "the principal lacks that ACL",
        hint="grant it; `agentruns kafka acls --service NAME` prints every ACL a service needs",
    )


__all__ = ["REFUSALS", "KafkaAuthorizationError", "refused"]

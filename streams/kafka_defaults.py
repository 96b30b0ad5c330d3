"""librdkafka settings every transactional producer of ours shares."""

from __future__ import annotations

from typing import Any

TRANSACTIONAL_PRODUCER: dict[str, Any] = {
    "enable.idempotence": True,
    # Right after a commit the coordinator is still writing that transaction's markers and
    # answers the next AddOffsetsToTxn/AddPartitionsToTxn with CONCURRENT_TRANSACTIONS;
    # librdkafka retries after retry.backoff.ms, 100 ms by default. That wait was most of every
    # transaction here: send_offsets_to_transaction p50 112 ms -> 22 ms with 10 ms (one
    # producer, local broker, 60 back-to-back transactions). The Java client retries these
    # after 20 ms for the same reason (KAFKA-5477).
    "retry.backoff.ms": 10,
}

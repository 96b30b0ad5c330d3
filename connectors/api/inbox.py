"""The API's producer of inputs: encoded records to the run's inbox partition, waiting for the
broker's acknowledgement; a broker that does not answer in time is a 503 `ApiError`.
"""

from __future__ import annotations

from confluent_kafka import KafkaException, Producer

from agentruns.connectors.api.config import ApiConfig
from agentruns.connectors.api.errors import ApiError
from agentruns.streams.acked import NotAcknowledgedError, produce_acked
from agentruns.streams.kafka_defaults import NO_DELAY, client_settings, partition_count, release
from agentruns.streams.partitioning import partition_for
from agentruns.streams.topics import INBOX, topic_name


class Inbox:
    """Produces encoded inputs to the run's inbox partition and waits for the broker's ack."""

    def __init__(self, config: ApiConfig) -> None:
        self.topic = topic_name(INBOX, config.prefix)
        self.timeout = config.produce_timeout_s
        self._producer = Producer(
            {
                "bootstrap.servers": config.bootstrap,
                **client_settings(),
                "enable.idempotence": True,
                "linger.ms": 1,
                **NO_DELAY,
                "log_level": 3,
                **config.extra_producer,
            }
        )
        self.partitions = config.partitions or partition_count(self._producer, self.topic)

    def produce(
        self, run_id: str, value: bytes, headers: list[tuple[str, str | bytes | None]] | None = None
    ) -> None:
        try:
            failure = produce_acked(
                self._producer,
                self.topic,
                key=run_id.encode(),
                value=value,
                partition=partition_for(run_id, self.partitions),
                headers=headers,
                timeout_s=self.timeout,
            )
        except (KafkaException, BufferError) as exc:
            raise ApiError(503, "kafka_unavailable", f"producing to {self.topic}: {exc}") from exc
        except NotAcknowledgedError:
            raise ApiError(503, "kafka_unavailable", f"no ack from {self.topic} in time") from None
        if failure is not None:
            raise ApiError(503, "kafka_unavailable", f"producing to {self.topic}: {failure}")

    def close(self) -> None:
        release(self._producer, 5)

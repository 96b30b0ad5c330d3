"""The API's producer of inputs: encoded records to the run's inbox partition, waiting for the
broker's acknowledgement; a broker that does not answer in time is a 503 `ApiError`.
"""

from __future__ import annotations

import threading
import time

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from agentruns.connectors.api.config import ApiConfig
from agentruns.connectors.api.errors import ApiError
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
        done = threading.Event()
        failure: list[KafkaError] = []

        def delivered(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                failure.append(err)
            done.set()

        try:
            self._producer.produce(
                self.topic,
                key=run_id.encode(),
                value=value,
                partition=partition_for(run_id, self.partitions),
                headers=headers or None,
                on_delivery=delivered,
            )
            deadline = time.monotonic() + self.timeout
            while not done.is_set() and time.monotonic() < deadline:
                self._producer.poll(0.05)
        except (KafkaException, BufferError) as exc:
            raise ApiError(503, "kafka_unavailable", f"producing to {self.topic}: {exc}") from exc
        if not done.is_set():
            raise ApiError(503, "kafka_unavailable", f"no ack from {self.topic} in time")
        if failure:
            raise ApiError(503, "kafka_unavailable", f"producing to {self.topic}: {failure[0]}")

    def close(self) -> None:
        release(self._producer, 5)

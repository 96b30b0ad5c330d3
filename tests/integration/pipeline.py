"""Test support for the pipeline: submit runs, play the executors, read topics back.

The executor double answers effects the way the real executors do (result inputs on the inbox
with input_id = effect key + ":result"), from a script: a model call at step < `steps` asks for
one `search_docs` call; at step `steps` it answers with a final text.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from agentruns.processors.effects import CallModel, CallTool
from agentruns.processors.events import (
    Candidate,
    Event,
    ModelCallCompleted,
    ModelOutcome,
    RunSubmitted,
    ToolCallRequest,
    ToolCallSucceeded,
)
from agentruns.processors.state import Budgets, ToolSpec
from agentruns.streams.clock import now_ms
from agentruns.streams.codec import decode, encode
from agentruns.streams.kafka_defaults import LONG_POLL_MS, release
from agentruns.streams.partitioning import partition_for
from agentruns.streams.records import input_record, parse_effect_body
from agentruns.streams.topics import INBOX, effect_suffix, topic_name
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

SEARCH = ToolSpec(
    name="search_docs",
    parameters={
        "type": "object",
        "properties": {"query": {"type": "string"}},
        "required": ["query"],
        "additionalProperties": False,
    },
)


def submitted(run_id: str, *, at: int | None = None, max_steps: int = 20) -> RunSubmitted:
    return RunSubmitted(
        run_id=run_id,
        event_id=f"{run_id}:submit",
        at=now_ms() if at is None else at,
        trace_id=uuid.uuid5(uuid.NAMESPACE_URL, run_id).hex,
        goal="find three documents",
        tools=(SEARCH,),
        budgets=Budgets(max_steps=max_steps),
    )


class Inbox:
    """An idempotent producer writing inputs to the run's inbox partition."""

    def __init__(self, bootstrap: str, prefix: str, partitions: int) -> None:
        self.topic = topic_name(INBOX, prefix)
        self.partitions = partitions
        self._producer = Producer(
            {"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 1}
        )

    def send(self, record: dict[str, Any]) -> None:
        self.send_raw(record["run_id"], encode("Input", record))

    def send_raw(self, run_id: str, value: bytes, *, key: bytes | None = None) -> None:
        self._producer.produce(
            self.topic,
            key=run_id.encode() if key is None else key,
            value=value,
            partition=partition_for(run_id, self.partitions),
        )

    def flush(self) -> None:
        assert self._producer.flush(30) == 0

    def close(self) -> None:
        release(self._producer, 5)


@dataclass
class Record:
    partition: int
    offset: int
    key: bytes | None
    value: dict[str, Any]


def read_all(bootstrap: str, topic: str, name: str, *, timeout: float = 30) -> list[Record]:
    """Every committed record of `topic` (decoded as `name`), read to the end of each partition."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex[:8]}",
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "enable.auto.commit": False,
            "log_level": 3,
        }
    )
    try:
        meta = consumer.list_topics(topic, timeout=10).topics[topic]
        partitions = sorted(meta.partitions)
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        pending = set(partitions)
        out: list[Record] = []
        deadline = time.monotonic() + timeout
        while pending:
            assert time.monotonic() < deadline, f"reading {topic} did not reach the end"
            for msg in consumer.consume(500, 0.5):
                err = msg.error()
                if err is not None:
                    assert err.code() == KafkaError._PARTITION_EOF, err
                    pending.discard(msg.partition())
                    continue
                value = msg.value()
                assert value is not None
                out.append(
                    Record(msg.partition(), msg.offset(), msg.key(), decode(value, name).record)
                )
        return out
    finally:
        consumer.close()


@contextmanager
def running_on_thread(run: Callable[[threading.Event], None], name: str) -> Iterator[None]:
    """`run(stop)` on a daemon thread until the block ends; then stop it and join it."""
    stop = threading.Event()
    thread = threading.Thread(target=run, args=(stop,), daemon=True, name=name)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)
        assert not thread.is_alive(), f"{name} did not stop"


def wait_for(
    condition: Callable[[], bool], *, timeout: float, what: str, every: float = 0.2
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class ExecutorDouble(threading.Thread):
    """Answers model and tool effects like the executors would (a test double for them)."""

    def __init__(self, bootstrap: str, prefix: str, partitions: int, *, steps: int = 3) -> None:
        super().__init__(daemon=True, name="executor-double")
        self.steps = steps
        self.inbox = Inbox(bootstrap, prefix, partitions)
        self.stop = threading.Event()
        self.answered: dict[str, int] = {}
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"double-{uuid.uuid4().hex[:8]}",
                "isolation.level": "read_committed",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": True,
                "fetch.wait.max.ms": LONG_POLL_MS,
                "log_level": 3,
            }
        )
        self._consumer.subscribe(
            [topic_name(effect_suffix("model"), prefix), topic_name(effect_suffix("tool"), prefix)]
        )

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                for msg in self._consumer.consume(200, 0.1):
                    value = msg.value()
                    if msg.error() is not None or value is None:
                        continue
                    effect = parse_effect_body(decode(value, "Effect").record["body"])
                    for answer in self.answer(effect):
                        self.inbox.send(input_record(answer))
                self.inbox.flush()
        finally:
            self._consumer.close()
            self.inbox.close()

    def answer(self, effect: Any) -> Iterable[Event]:
        key = effect.idempotency_key
        self.answered[key] = self.answered.get(key, 0) + 1
        ids = {"run_id": effect.run_id, "event_id": f"{key}:result", "trace_id": effect.trace_id}
        if isinstance(effect, CallModel):
            final = effect.step >= self.steps
            call = ToolCallRequest(
                id=f"call-{effect.step}",
                name="search_docs",
                arguments_json=f'{{"query":"q{effect.step}"}}',
            )
            yield ModelCallCompleted(
                **ids,
                at=now_ms(),
                step=effect.step,
                attempt=effect.attempt,
                outcome=ModelOutcome.FINISHED,
                candidate_ref="sha256:" + "a" * 64,
                candidate=Candidate(
                    content="three documents found" if final else "",
                    tool_calls=() if final else (call,),
                ),
            )
        elif isinstance(effect, CallTool):
            yield ToolCallSucceeded(
                **ids,
                at=now_ms(),
                step=effect.step,
                operation_key=effect.operation.key,
                dispatch=effect.operation.dispatch,
                result_ref="sha256:" + "b" * 64,
            )

    def close(self) -> None:
        self.stop.set()
        self.join(timeout=30)

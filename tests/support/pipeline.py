"""Test support for the pipeline: submit runs, play the executors, read topics back.

The executor double answers effects the way the real executors do (result inputs on the inbox
with input_id = effect key + ":result"), from a script: a model call at step < `steps` asks for
one `search_docs` call; at step `steps` it answers with a final text. :func:`running_pipeline`
runs the real thing instead: the processor, both executors and both test servers.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from agentruns.connectors.dev.servers import model_server, tool_server
from agentruns.connectors.dev.servers.httpserver import ServerHandle
from agentruns.connectors.executors.config import ExecutorConfig
from agentruns.connectors.executors.model import ModelExecutor, RouteConfig, Routes
from agentruns.connectors.executors.tool import ToolExecutor
from agentruns.connectors.postgres.artifacts import PostgresArtifactStore
from agentruns.connectors.runtime.timers import TimerService
from agentruns.processors.effects import CallModel, CallTool
from agentruns.processors.events import (
    Candidate,
    Event,
    Message,
    ModelCallCompleted,
    ModelOutcome,
    RunSubmitted,
    ToolCallRequest,
    ToolCallSucceeded,
)
from agentruns.processors.state import Budgets, ToolSpec
from agentruns.streams.admin import ensure_topics
from agentruns.streams.clock import now_ms
from agentruns.streams.codec import decode, encode
from agentruns.streams.kafka_defaults import KAFKA_LOGS, LONG_POLL_MS, close_consumer, release
from agentruns.streams.partitioning import partition_for
from agentruns.streams.processor import ArtifactWriter, Processor, ProcessorConfig
from agentruns.streams.records import input_record, parse_effect_body
from agentruns.streams.topics import INBOX, RESULTS, effect_suffix, topic_name
from tests.support.executors import fast_registry
from tests.support.waiting import wait_for

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
            {
                "bootstrap.servers": bootstrap,
                **KAFKA_LOGS,
                "enable.idempotence": True,
                "linger.ms": 1,
            }
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
class RawRecord:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None  # None: a tombstone
    headers: list[tuple[str, bytes]] = field(default_factory=list)


@dataclass
class Record:
    partition: int
    offset: int
    key: bytes | None
    value: dict[str, Any]


def read_raw(
    bootstrap: str,
    topic: str,
    *,
    partitions: Iterable[int] | None = None,
    isolation: str = "read_committed",
) -> list[RawRecord]:
    """Every record of `topic` visible under `isolation`, read from the start to the end of
    each partition (all of them, or those in `partitions`)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            **KAFKA_LOGS,
            "group.id": f"reader-{uuid.uuid4().hex[:8]}",
            "isolation.level": isolation,
            "enable.partition.eof": True,
            "enable.auto.commit": False,
            "log_level": 3,
        }
    )
    try:
        if partitions is None:
            partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        pending = set(partitions)
        consumer.assign([TopicPartition(topic, p, 0) for p in sorted(pending)])
        out: list[RawRecord] = []
        deadline = time.monotonic() + 30
        while pending:
            assert time.monotonic() < deadline, f"reading {topic} did not reach the end"
            for msg in consumer.consume(500, 0.5):
                err = msg.error()
                if err is not None:
                    assert err.code() == KafkaError._PARTITION_EOF, err
                    pending.discard(msg.partition())
                    continue
                partition, offset = msg.partition(), msg.offset()
                assert partition is not None and offset is not None
                headers = [(k, bytes(v or b"")) for k, v in msg.headers() or []]
                out.append(RawRecord(partition, offset, msg.key(), msg.value(), headers))
        return out
    finally:
        close_consumer(consumer, 10)


def read_all(
    bootstrap: str, topic: str, name: str, *, partitions: Iterable[int] | None = None
) -> list[Record]:
    """Every committed record of `topic` (decoded as `name`), read to the end of each partition."""
    out: list[Record] = []
    for m in read_raw(bootstrap, topic, partitions=partitions):
        assert m.value is not None, f"a tombstone in {topic}"
        out.append(Record(m.partition, m.offset, m.key, decode(m.value, name).record))
    return out


def result_statuses(bootstrap: str, prefix: str) -> dict[str, str]:
    """run_id -> status of every committed result."""
    return {
        r.value["run_id"]: r.value["status"]
        for r in read_all(bootstrap, topic_name(RESULTS, prefix), "Result")
    }


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


@contextmanager
def running_processor(
    config: ProcessorConfig, artifacts: str | ArtifactWriter
) -> Iterator[Processor]:
    """A processor on a thread of this process until the block ends. `artifacts` is where it
    writes its artifacts: a database URL (a store of its own, closed at the end) or a writer."""
    with contextlib.ExitStack() as cleanup:
        if isinstance(artifacts, str):
            store = PostgresArtifactStore(artifacts)
            cleanup.callback(store.close)
            artifacts = store.put_many
        proc = Processor(config, artifacts)
        with running_on_thread(proc.run, "processor"):
            yield proc


def model_answer(
    effect: CallModel, ids: dict[str, str], *, final: bool, call_id: str = "call"
) -> ModelCallCompleted:
    """The model's answer to `effect`: the final one, or a call of `search_docs`."""
    call = ToolCallRequest(
        id=f"{call_id}-{effect.step}",
        name="search_docs",
        arguments_json=f'{{"query":"q{effect.step}"}}',
    )
    return ModelCallCompleted(
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


class ExecutorDouble(threading.Thread):
    """Answers model and tool effects like the executors would (a test double for them)."""

    def __init__(
        self,
        bootstrap: str,
        prefix: str,
        partitions: int,
        *,
        steps: int = 3,
        kinds: tuple[str, ...] = ("model", "tool"),
    ) -> None:
        super().__init__(daemon=True, name="executor-double")
        self.steps = steps
        self.inbox = Inbox(bootstrap, prefix, partitions)
        self.stop = threading.Event()
        self.answered: dict[str, int] = {}
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                **KAFKA_LOGS,
                "group.id": f"double-{uuid.uuid4().hex[:8]}",
                "isolation.level": "read_committed",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": True,
                "fetch.wait.max.ms": LONG_POLL_MS,
                "log_level": 3,
            }
        )
        # the effects of `kinds` only: a test may run a real executor for the others
        self._consumer.subscribe([topic_name(effect_suffix(kind), prefix) for kind in kinds])

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
            close_consumer(self._consumer, 10)
            self.inbox.close()

    def answer(self, effect: Any) -> Iterable[Event]:
        key = effect.idempotency_key
        self.answered[key] = self.answered.get(key, 0) + 1
        ids = {"run_id": effect.run_id, "event_id": f"{key}:result", "trace_id": effect.trace_id}
        if isinstance(effect, CallModel):
            yield model_answer(effect, ids, final=effect.step >= self.steps)
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


@dataclass
class Pipeline:
    """Processor + both executors + both servers, one topic prefix."""

    bootstrap: str
    prefix: str
    models: ServerHandle
    tools: ServerHandle
    tool_specs: tuple[Any, ...]
    inbox: Any

    def submit(
        self, run_id: str, scenario: str = "multi_tool", budgets: Budgets | None = None
    ) -> None:
        submitted = RunSubmitted(
            run_id=run_id,
            event_id=f"{run_id}:submit",
            at=int(time.time() * 1000),
            trace_id=f"trace-{run_id}",
            goal="The printer on floor 3 is offline: open a ticket and tell facilities.",
            messages=(Message(role="user", content="The printer on floor 3 is offline."),),
            tools=self.tool_specs,
            model_route=f"scenario:{scenario}",
            budgets=budgets or Budgets(),
        )
        self.inbox.send(input_record(submitted))
        self.inbox.flush()

    def _read(self, suffix: str, name: str, run_id: str) -> list[dict[str, Any]]:
        topic = topic_name(suffix, self.prefix)
        return [
            r.value for r in read_all(self.bootstrap, topic, name) if r.value["run_id"] == run_id
        ]

    def result(self, run_id: str, timeout: float = 90) -> dict[str, Any]:
        (result,) = wait_for(lambda: self._read("results", "Result", run_id), timeout, "result")
        found: dict[str, Any] = result
        return found

    def results(self, run_ids: list[str], timeout: float = 90) -> dict[str, dict[str, Any]]:
        """The terminal results of every run in ``run_ids`` (one topic read per attempt)."""
        topic = topic_name("results", self.prefix)
        wanted = set(run_ids)

        def read() -> dict[str, dict[str, Any]] | None:
            found = {
                r.value["run_id"]: r.value
                for r in read_all(self.bootstrap, topic, "Result")
                if r.value["run_id"] in wanted
            }
            return found if len(found) == len(wanted) else None

        done: dict[str, dict[str, Any]] = wait_for(read, timeout, "every result")
        return done

    def effects(self, kind: str, run_id: str) -> list[dict[str, Any]]:
        """The bodies of the run's effects on ``effects.<kind>`` (model, tool, timer)."""
        return [json.loads(r["body"]) for r in self._read(effect_suffix(kind), "Effect", run_id)]

    def status(self, run_id: str) -> str | None:
        snapshots = self._read("state", "Snapshot", run_id)
        return snapshots[-1]["status"] if snapshots else None

    def events(self, run_id: str) -> list[dict[str, Any]]:
        return self._read("events", "Event", run_id)

    def tool_fault(self, **rule: Any) -> None:
        httpx.post(self.tools.url + "/faults", json=rule, timeout=5).raise_for_status()

    def model_fault(self, **rule: Any) -> None:
        httpx.post(self.models.url + "/faults", json=rule, timeout=5).raise_for_status()

    def executions(self, tool: str) -> list[tuple[int, int]]:
        """(executions, requests) per operation key of ``tool`` at the tool server."""
        app: Any = self.tools.app
        stats = app.stats()
        keys = [k for k, op in app.operations.items() if op.tool == tool]
        return [(stats["executions"].get(k, 0), stats["calls"].get(k, 0)) for k in keys]


@contextlib.contextmanager
def running_pipeline(
    kafka_bootstrap: str,
    database_url: str,
    tmp: Path,
    *,
    timers: bool = False,
    extra_tools: Sequence[dict[str, Any]] = (),
    model_executor: bool = True,
) -> Iterator[Pipeline]:
    """Processor, both executors (threads of this process), both servers in threads, and the
    timer service when ``timers`` (back-off and user-expiry timers fire); ``extra_tools``:
    registry entries added to the example registry's (tools of kind run); without
    ``model_executor`` the test runs the model executor itself (as a process it can kill)."""
    prefix = f"t-e2e-exec-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    ensure_topics(kafka_bootstrap, prefix=prefix, partitions=2)
    models = model_server.serve("127.0.0.1", 0)
    tools = tool_server.serve("127.0.0.1", 0)
    registry = fast_registry(tmp, tools.url)
    spec = json.loads(registry.read_text())
    if extra_tools:
        spec["tools"].extend(extra_tools)
        registry.write_text(json.dumps(spec))
    store = PostgresArtifactStore(database_url)
    stop = threading.Event()

    def config(kind: str) -> ExecutorConfig:
        return ExecutorConfig(kafka_bootstrap, database_url, kind, prefix=prefix, max_in_flight=64)

    routes = Routes({}, RouteConfig(base_url=models.url + "/v1"))
    processor_config = ProcessorConfig(kafka_bootstrap, prefix=prefix, group_id=f"{prefix}-p")
    workers: list[Any] = [
        Processor(processor_config, store.put_many),
        ToolExecutor(config("tool"), registry),
    ]
    if model_executor:
        workers.append(ModelExecutor(config("model"), routes, registry))
    if timers:
        workers.append(TimerService(kafka_bootstrap, database_url, prefix=prefix))
    threads = [threading.Thread(target=w.run, args=(stop,), daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    specs = tuple(
        ToolSpec(
            name=t["name"], parameters=t["parameters"], permission=t["permission"],
            is_async=t.get("async", False), kind=t.get("kind", msgspec.UNSET),
        )
        for t in spec["tools"]
        if t["permission"] != "admin"
    )  # fmt: skip
    try:
        yield Pipeline(
            kafka_bootstrap, prefix, models, tools, specs, Inbox(kafka_bootstrap, prefix, 2)
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        store.close()
        models.close()
        tools.close()

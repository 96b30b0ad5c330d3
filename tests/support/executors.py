"""Playing the processor around one executor: effects in, the inbox's answers out.

A :class:`Harness` produces Effect records to ``effects.<kind>`` as the processor does and reads
the Input records the executor commits to the inbox (read_committed).
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psycopg
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from agentruns.connectors.dev.servers import tool_server
from agentruns.connectors.dev.servers.httpserver import ServerHandle
from agentruns.connectors.executors.config import ExecutorConfig
from agentruns.connectors.executors.loop import Executor
from agentruns.connectors.postgres.artifacts import PostgresArtifactStore
from agentruns.processors.effects import (
    CallModel,
    CallTool,
    CancelTool,
    Effect,
    OperationSpec,
    PollTool,
    Reconcile,
    RepairNote,
)
from agentruns.processors.events import Event, ModelCallCompleted
from agentruns.processors.ids import canonical_json
from agentruns.streams.admin import ensure_topics
from agentruns.streams.codec import decode, encode
from agentruns.streams.kafka_defaults import KAFKA_LOGS, LONG_POLL_MS, close_consumer
from agentruns.streams.partitioning import partition_for
from agentruns.streams.records import effect_record, parse_event_body
from agentruns.streams.topics import INBOX, effect_suffix, topic_name
from tests.support.waiting import wait_for

PARTITIONS = 2
E = TypeVar("E")
TICKET = {"title": "Printer offline", "priority": "high"}


class InboxReader:
    """Reads the inbox (read_committed) into input_id -> list of (raw bytes, record)."""

    def __init__(self, bootstrap: str, prefix: str) -> None:
        self.topic = topic_name(INBOX, prefix)
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                **KAFKA_LOGS,
                "group.id": f"{prefix}-reader",
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": LONG_POLL_MS,
                "log_level": 3,
            }
        )
        self.consumer.assign([TopicPartition(self.topic, p, 0) for p in range(PARTITIONS)])
        self.seen: dict[str, list[tuple[bytes, dict[str, Any]]]] = {}
        self.partitions: dict[str, int] = {}

    def drain(self) -> int:
        """Read what is there; return how many input ids have been seen so far."""
        for message in self.consumer.consume(1000, 0.05):
            if message.error() is not None:
                continue
            value = message.value()
            assert value is not None
            record = decode(value, expected_name="Input").record
            self.seen.setdefault(record["input_id"], []).append((value, record))
            self.partitions[record["input_id"]] = message.partition() or 0
        return len(self.seen)

    def event(self, effect: Effect, timeout: float = 20.0) -> Event:
        input_id = f"{effect.idempotency_key}:result"

        def ready() -> bool:
            self.drain()
            return input_id in self.seen

        wait_for(ready, timeout, f"the answer to {effect.type} {effect.idempotency_key[:8]}")
        _, record = self.seen[input_id][0]
        assert self.partitions[input_id] == partition_for(effect.run_id, PARTITIONS)
        event = parse_event_body(record["body"])
        assert record["kind"] == event.type and event.event_id == input_id
        assert record["run_id"] == effect.run_id and record["trace_id"] == effect.trace_id
        return event

    def typed(self, effect: Effect, kind: type[E], timeout: float = 20.0) -> E:
        event = self.event(effect, timeout)
        assert isinstance(event, kind), event
        return event

    def close(self) -> None:
        close_consumer(self.consumer, 10)


class Effects:
    """Produces effect records like the processor does (key run_id)."""

    def __init__(self, bootstrap: str, prefix: str, kind: str) -> None:
        self.topic = topic_name(effect_suffix(kind), prefix)
        self.producer = Producer(
            {"bootstrap.servers": bootstrap, **KAFKA_LOGS, "linger.ms": 0, "log_level": 3}
        )
        self.seq = 0

    def send(self, *effects: Effect) -> None:
        for effect in effects:
            self.seq += 1
            record = effect_record(effect, seq=self.seq, at=int(time.time() * 1000))
            self.producer.produce(
                self.topic, key=effect.run_id.encode(), value=encode("Effect", record)
            )
        self.producer.flush(10)


@dataclass
class Harness:
    bootstrap: str
    database_url: str
    prefix: str
    inbox: InboxReader
    effects: Effects
    executor: Executor | None = None
    thread: threading.Thread | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self, executor: Executor) -> None:
        self.executor = executor
        self.stop = threading.Event()
        self.thread = threading.Thread(target=executor.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def stop_executor(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(30)
            assert not self.thread.is_alive()

    def close(self) -> None:
        """Stop the executor and drop the Kafka clients now (not when the broker is already
        gone at session end)."""
        self.stop_executor()
        self.inbox.close()
        self.executor = None
        self.effects.producer.flush(5)
        del self.effects.producer
        gc.collect()

    def tool_executor_command(
        self, registry: Path, instance: str, *, workers: int, max_batch: int
    ) -> list[str]:
        """`agentruns executor tool` as a process of its own on this harness's topics (the
        tests that kill it -9)."""
        return [
            sys.executable, "-m", "agentruns.connectors.executors.tool",
            "--bootstrap", self.bootstrap, "--database-url", self.database_url,
            "--prefix", self.prefix, "--instance", instance, "--registry", str(registry),
            "--workers", str(workers), "--max-batch", str(max_batch),
        ]  # fmt: skip

    def config(self, kind: str, **overrides: Any) -> ExecutorConfig:
        values: dict[str, Any] = {"max_in_flight": 64, "max_batch": 64, **overrides}
        return ExecutorConfig(
            bootstrap=self.bootstrap,
            database_url=self.database_url,
            kind=kind,
            prefix=self.prefix,
            **values,
        )

    def record(self, key: str) -> tuple[Any, ...] | None:
        with psycopg.connect(self.database_url) as conn:
            row = conn.execute(
                "SELECT status, starts, result_kind, input_json FROM executed_actions"
                " WHERE idempotency_key = %s",
                (key,),
            ).fetchone()
        return None if row is None else tuple(row)

    def artifact(self, ref: str) -> Any:
        store = PostgresArtifactStore(self.database_url)
        try:
            text = store.get(ref)
        finally:
            store.close()
        assert text is not None, f"artifact {ref} missing"
        return json.loads(text)


def make_harness(bootstrap: str, database_url: str, prefix: str, kind: str) -> Harness:
    ensure_topics(bootstrap, prefix=prefix, partitions=PARTITIONS)
    return Harness(
        bootstrap,
        database_url,
        prefix,
        InboxReader(bootstrap, prefix),
        Effects(bootstrap, prefix, kind),
    )


class Ids:
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.n = 0

    def _base(self, kind: str) -> dict[str, Any]:
        self.n += 1
        return {
            "idempotency_key": f"{self.run_id}:{kind}:{self.n}",
            "run_id": self.run_id,
            "step": 1,
            "attempt": 1,
            "trace_id": f"trace-{self.run_id}",
        }

    def call(
        self,
        tool: str,
        args: dict[str, Any],
        op_key: str | None = None,
        dispatch: int = 1,
        *,
        policy_decision: str = "allow",
        permission: str | None = None,
    ) -> CallTool:
        base = self._base("call")
        operation = OperationSpec(
            key=op_key or f"op-{base['idempotency_key']}",
            tool=tool,
            arguments_json=canonical_json(args),
            expected_version=None,
            policy_decision=policy_decision,
            dispatch=dispatch,
            permission=permission,
        )
        return CallTool(**base, operation=operation)

    def reconcile(self, call: CallTool) -> Reconcile:
        op = call.operation
        return Reconcile(
            **self._base("reconcile"), operation_key=op.key, tool=op.tool, dispatch=op.dispatch
        )

    def poll(self, call: CallTool, poll: int) -> PollTool:
        op = call.operation
        return PollTool(
            **self._base("poll"),
            operation_key=op.key,
            tool=op.tool,
            dispatch=op.dispatch,
            poll=poll,
        )

    def cancel(self, call: CallTool) -> CancelTool:
        op = call.operation
        return CancelTool(
            **self._base("cancel"), operation_key=op.key, tool=op.tool, dispatch=op.dispatch
        )


def fast_registry(tmp: Path, base_url: str) -> Path:
    """The example registry with short timeouts (a 'late' answer costs 0.4 s, not 5 s)."""
    data = json.loads((tool_server.DEFAULT_REGISTRY).read_text())
    data["base_url"] = base_url
    for tool in data["tools"]:
        tool["timeout_ms"] = 400
    offline = dict(data["tools"][0], name="offline_tool", endpoint="http://127.0.0.1:9/x")
    data["tools"].append(offline)
    path = tmp / "tools.json"
    path.write_text(json.dumps(data))
    return path


def ids_for(request: pytest.FixtureRequest) -> Ids:
    return Ids(f"run-{request.node.name[:30]}-{time.monotonic_ns() % 10**9}")


MODEL_TOOLS = [
    {"name": "search_docs", "parameters": {"type": "object"}, "permission": "read"},
    {"name": "create_ticket", "parameters": {"type": "object"}, "permission": "write"},
]


@dataclass
class ModelEnv:
    harness: Harness
    server: ServerHandle
    http: httpx.Client
    store: PostgresArtifactStore

    def context(
        self,
        run_id: str,
        step: int = 1,
        previous: str | None = None,
        candidate: str | None = None,
        inputs: tuple[str, ...] = (),
        scenario: str = "multi_tool",
    ) -> str:
        registry = self.store.put(canonical_json(MODEL_TOOLS))
        first = previous is None
        messages = [
            {"role": "system", "content": f"scenario:{scenario}"},
            {"role": "user", "content": "The printer on floor 3 is offline."},
        ]
        body = {
            "run_id": run_id,
            "step": step,
            "goal": "fix the printer",
            "previous_context": previous,
            "previous_candidate": candidate,
            "messages": messages if first else [],
            "inputs": list(inputs),
            "memory_ref": None,
            "evidence_refs": [],
            "tool_registry": registry,
            "policy": {},
            "model_route": "default",
            "remaining": {},
        }
        return self.store.put(canonical_json(body))

    def effect(
        self,
        run_id: str,
        context_ref: str,
        step: int = 1,
        attempt: int = 1,
        route: str = "default",
        repair: RepairNote | None = None,
    ) -> CallModel:
        return CallModel(
            idempotency_key=f"{run_id}:model:{step}:{attempt}",
            run_id=run_id,
            step=step,
            attempt=attempt,
            trace_id=f"trace-{run_id}",
            context_ref=context_ref,
            model_route=route,
            repair=repair,
        )

    def call(self, effect: CallModel) -> ModelCallCompleted:
        self.harness.effects.send(effect)
        event = self.harness.inbox.typed(effect, ModelCallCompleted)
        assert (event.step, event.attempt) == (effect.step, effect.attempt)
        return event

    def fault(self, **rule: Any) -> None:
        self.http.post("/faults", json=rule).raise_for_status()

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self.http.get("/stats").json()
        return result

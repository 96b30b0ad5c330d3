"""Hostile inputs through every door of the pipeline, and what each must end as (R30).

Each case injects one bad input through one door (the inbox as an upstream producer would
write it, the API, an effect or event topic, the scripted model server in its OpenAI and
Anthropic modes, the example tool server, the example MCP server) and names its one allowed
ending: a dead-letter record at the input's position whose reason or class names what was
wrong, a terminal result of its run with a status and a reason, or an HTTP status from the
API. The hostile suite and `agentruns chaos --hostile` run them beside good runs and check
every ending (`check`), so nothing is lost, nothing crash-loops and the good runs still
succeed.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    Message,
    Producer,
    TopicPartition,
)

from agentruns.connectors.api.operator import MAX_REASON_CHARS
from agentruns.processors.events import ForkedFrom, RunSubmitted, UserReplied
from agentruns.processors.events import Message as ChatMessage
from agentruns.processors.ids import canonical_json, operation_key
from agentruns.processors.state import Budgets, LoopLimits, ParentLink, Policy, ToolSpec
from agentruns.processors.transition import transition
from agentruns.streams.codec import encode
from agentruns.streams.kafka_defaults import client_settings
from agentruns.streams.partitioning import partition_for
from agentruns.streams.records import input_record
from agentruns.streams.topics import EVENTS, INBOX, effect_suffix, topic_name

Headers = list[tuple[str, str | bytes | None]]


@dataclass(frozen=True)
class Ending:
    """The one allowed ending of a hostile input.

    ``dlq``: a dead letter at the input's position whose reason or error class contains it;
    ``status``/``reason``: the run's terminal result (the reason contains ``reason``);
    ``http``: the API answered this status (and produced nothing)."""

    dlq: str | None = None
    status: str | None = None
    reason: str | None = None
    http: int | None = None


@dataclass
class Injected:
    """What one injection did: where its record landed, the run it concerns, the HTTP answer."""

    case: str
    run_id: str | None = None
    position: tuple[str, int, int] | None = None  # topic, partition, offset (delivery report)
    http: int | None = None
    error: str | None = None  # a delivery that failed: the case was not injected


@dataclass
class Doors:
    """Where hostile inputs go in: the cluster, the API and the two outside servers."""

    bootstrap: str
    prefix: str
    partitions: int
    model_url: str
    tool_url: str
    tools: tuple[ToolSpec, ...]
    mcp_url: str | None = None  # the example MCP server (the tool executor's ``shop``)
    api_url: str | None = None
    api_token: str | None = None
    operator_token: str | None = None  # for the operator routes (resolve, reopen, redrive)
    scoped_token: str | None = None  # a credential without the admin role (else api_token's)
    _producer: Producer | None = field(default=None, repr=False)
    _placed: set[tuple[str, int, int]] = field(default_factory=set, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _unplaced: list[tuple[Injected, str, int, bytes | None, bytes | None]] = field(
        default_factory=list, repr=False
    )

    def producer(self) -> Producer:
        if self._producer is None:
            self._producer = Producer(
                {
                    "bootstrap.servers": self.bootstrap,
                    **client_settings(),
                    "enable.idempotence": True,
                    "log_level": 3,
                }
            )
        return self._producer

    def produce(
        self,
        injected: Injected,
        topic: str,
        value: bytes | None,
        *,
        key: bytes | None,
        partition: int,
        headers: Headers | None = None,
    ) -> None:
        """Produce one record; its delivery report fills ``injected.position`` (or error)."""

        def delivered(error: KafkaError | None, message: Message) -> None:
            with self._lock:
                if error is not None:
                    injected.error = str(error)
                elif (offset := message.offset()) is not None and offset >= 0:
                    injected.position = (topic, partition, offset)
                    self._placed.add(injected.position)
                else:
                    # Persisted, but the broker answered a retried request as a duplicate of
                    # one that timed out: no offset. Found by reading the partition (flush).
                    self._unplaced.append((injected, topic, partition, key, value))

        self.producer().produce(
            topic,
            value=value,
            key=key,
            partition=partition,
            headers=headers,
            on_delivery=delivered,
        )
        self.producer().poll(0)

    def inbox(self) -> str:
        return topic_name(INBOX, self.prefix)

    def flush(self, timeout_s: float = 60.0) -> int:
        """Wait for every delivery report; how many records are still unacknowledged."""
        left = 0 if self._producer is None else self._producer.flush(timeout_s)
        if self._unplaced:
            self._place(timeout_s)
        return left

    def _place(self, timeout_s: float) -> None:
        """The position of each record delivered without an offset: the first record of its
        partition with its key and value that no other injection holds."""
        with self._lock:
            unplaced, self._unplaced = self._unplaced, []
            taken = set(self._placed)
        reader = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                **client_settings(),
                "group.id": f"hostile-place-{self.prefix}",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "log_level": 3,
            }
        )
        try:
            wanted = {(topic, partition) for _, topic, partition, _, _ in unplaced}
            reader.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t, p in wanted])
            pending, deadline = set(wanted), time.monotonic() + timeout_s
            while pending and unplaced and time.monotonic() < deadline:
                for message in reader.consume(500, 0.5):
                    where = (message.topic() or "", message.partition() or 0)
                    if message.error() is not None:
                        pending.discard(where)
                        continue
                    position = (*where, message.offset() or 0)
                    for n, (injected, topic, partition, key, value) in enumerate(unplaced):
                        if (
                            (topic, partition) == where
                            and (key, value)
                            == (
                                message.key(),
                                message.value(),
                            )
                            and position not in taken
                        ):
                            injected.position = position
                            taken.add(position)
                            self._placed.add(position)
                            del unplaced[n]
                            break
        finally:
            reader.close()
        for injected, *_ in unplaced:
            injected.error = "delivered without an offset, and not found in its partition"

    def close(self) -> None:
        from agentruns.streams.kafka_defaults import release

        if self._producer is not None:
            release(self._producer, 30)
            self._producer = None

    def api(self, method: str, path: str, *, token: str | None = None, **kwargs: Any) -> int:
        """The status the API answers, the request sent with ``token`` (default: the API's)."""
        token = token or self.api_token
        assert self.api_url is not None and token is not None
        headers = {"Authorization": f"Bearer {token}", **kwargs.pop("headers", {})}
        response = httpx.request(
            method, f"{self.api_url}{path}", headers=headers, timeout=30, **kwargs
        )
        return response.status_code


Inject = Callable[[Doors, str], Injected]


@dataclass(frozen=True)
class Case:
    name: str
    door: str  # inbox | api | effects | events | model | tool | mcp
    ending: Ending
    inject: Inject
    needs_api: bool = False


# --------------------------------------------------------------------------- building inputs


def _task(run_id: str, doors: Doors, **fields: Any) -> RunSubmitted:
    scenario = fields.pop("scenario", "multi_tool")
    base: dict[str, Any] = {
        "run_id": run_id,
        "event_id": f"{run_id}:submit",
        "at": fields.pop("at", 1_800_000_000_000),
        "trace_id": fields.pop("trace_id", f"trace-{run_id}"),
        "goal": f"hostile {run_id}",
        "messages": (ChatMessage(role="user", content=f"scenario:{scenario} {run_id}"),),
        "tools": doors.tools,
        "model_route": f"scenario:{scenario}",
    }
    return RunSubmitted(**{**base, **fields})


def _raw_task(run_id: str, doors: Doors, patch: Callable[[dict[str, Any]], None]) -> bytes:
    """An Input record whose body is a task edited as JSON (values the core's types refuse)."""
    record = input_record(_task(run_id, doors))
    body = json.loads(record["body"])
    patch(body)
    record["body"] = json.dumps(body)
    return encode("Input", record)


def _send(
    doors: Doors,
    run_id: str,
    value: bytes | None,
    *,
    key: bytes | None = None,
    headers: Headers | None = None,
    run: bool = True,
) -> Injected:
    injected = Injected(case="", run_id=run_id if run else None)
    doors.produce(
        injected,
        doors.inbox(),
        value,
        key=run_id.encode() if key is None else key,
        partition=partition_for(run_id, doors.partitions),
        headers=headers,
    )
    return injected


def _inbox_task(**fields: Any) -> Inject:
    def inject(doors: Doors, run_id: str) -> Injected:
        return _send(doors, run_id, encode("Input", input_record(_task(run_id, doors, **fields))))

    return inject


def _inbox_fork(source: Callable[[str], str], state_of: Callable[[str], str]) -> Inject:
    """A fork's first record written to the inbox by hand: it names `source(run_id)` as its
    source and carries the submitted state of the run `state_of(run_id)`."""

    def inject(doors: Doors, run_id: str) -> Injected:
        state = transition(None, _task(state_of(run_id), doors)).state
        assert state is not None
        record = ForkedFrom(
            run_id=run_id,
            event_id=f"{run_id}:submit",
            at=1_800_000_000_000,
            trace_id=f"trace-{run_id}",
            source_run_id=source(run_id),
            source_seq=1,
            state=state,
        )
        return _send(doors, run_id, encode("Input", input_record(record)))

    return inject


def _inbox_child(parent: Callable[[str], tuple[str, tuple[str, ...]]]) -> Inject:
    """A task written to the inbox by hand as a child run's: ``parent(run_id)`` gives the
    parent it names and the ancestors (its depth is their number)."""

    def inject(doors: Doors, run_id: str) -> Injected:
        named, ancestors = parent(run_id)
        link = ParentLink(
            run_id=named,
            trace_id=f"trace-{named}",
            operation_key=operation_key(named, 1, "ask", "{}"),
            tool="ask",
            step=1,
            depth=len(ancestors),
            ancestors=ancestors,
        )
        task = _task(run_id, doors, parent=link)
        return _send(doors, run_id, encode("Input", input_record(task)))

    return inject


def _inbox_patched(patch: Callable[[dict[str, Any]], None]) -> Inject:
    def inject(doors: Doors, run_id: str) -> Injected:
        return _send(doors, run_id, _raw_task(run_id, doors, patch))

    return inject


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def patch(body: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = body
        for name in parents:
            node = node.setdefault(name, {})
        node[last] = value

    return patch


def _nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = {"a": value}
    return value


def _raw(
    value: bytes | None, *, key: bytes | None = None, headers: Headers | None = None
) -> Inject:
    def inject(doors: Doors, run_id: str) -> Injected:
        return _send(doors, run_id, value, key=key, headers=headers, run=False)

    return inject


def _envelope(patch: Callable[[dict[str, Any]], None]) -> Inject:
    """A valid single-object Input whose envelope fields are edited."""

    def inject(doors: Doors, run_id: str) -> Injected:
        record = input_record(_task(run_id, doors))
        patch(record)
        return _send(doors, run_id, encode("Input", record), run=False)

    return inject


def _on_topic(suffix: str, value: bytes) -> Inject:
    def inject(doors: Doors, run_id: str) -> Injected:
        injected = Injected(case="")
        doors.produce(
            injected, topic_name(suffix, doors.prefix), value, key=run_id.encode(), partition=0
        )
        return injected

    return inject


def _reply_without_question(doors: Doors, run_id: str) -> Injected:
    """A user reply to a run that never asked anything: the core rejects it, the run goes on."""
    _send(doors, run_id, encode("Input", input_record(_task(run_id, doors))))
    reply = UserReplied(
        run_id=run_id,
        event_id=f"{run_id}:reply",
        at=1_800_000_000_001,
        trace_id=f"trace-{run_id}",
        question_id="no-such-question",
        token_id="forged",
        state_version=1,
        response={"approved": True},
    )
    return _send(doors, run_id, encode("Input", input_record(reply)))


def _scripted(scenario: str, turns: list[dict[str, Any]], **fields: Any) -> Inject:
    """A task whose model answers from a scenario registered on the scripted model server for
    this case (what a misbehaving model would stream)."""

    def inject(doors: Doors, run_id: str) -> Injected:
        name = f"{scenario}-{run_id}"
        body = {"name": name, "description": f"hostile case {scenario}", "turns": turns}
        httpx.post(f"{doors.model_url}/scenarios", json=body, timeout=30).raise_for_status()
        task = _task(run_id, doors, scenario=name, **fields)
        return _send(doors, run_id, encode("Input", input_record(task)))

    return inject


def _model_fault(fault: dict[str, Any], *, then_answer: bool = True, **fields: Any) -> Inject:
    """The model answers the first turn with ``fault`` (``times: null``: every attempt),
    then, after one tool result, with a final answer."""
    first: dict[str, Any] = {
        "tool_calls": [{"name": "search_docs", "arguments": {"query": "hostile"}}],
        "faults": [fault],
    }
    turns = [first, {"content": "done"}] if then_answer else [first]
    return _scripted(f"model-{fault['kind']}", turns, **fields)


def _anthropic_fault(fault: dict[str, Any]) -> Inject:
    """As :func:`_model_fault`, the run's route the model server's Anthropic mode (its events
    instead of chat completion chunks)."""
    return _model_fault(fault, model_route=ANTHROPIC_ROUTE)


def _mcp_call(kind: str | None) -> Inject:
    """The model calls the example MCP server's ``lookup_order`` at every turn; the server
    answers each call of this run with the wire fault ``kind`` (a rule naming the run: the
    other runs' calls are not touched), so the second classified failure in a row ends the run
    as a loop of that error (the task's limit: 2). ``kind`` None: no fault, and the model's
    second turn is a final answer."""

    def inject(doors: Doors, run_id: str) -> Injected:
        assert doors.mcp_url is not None, "no MCP server among the doors"
        call = {"tool_calls": [{"name": SHOP_LOOKUP.name, "arguments": {"order_id": "A-1"}}]}
        if kind is None:
            return _scripted("mcp-good", [call, {"content": "done"}], tools=(SHOP_LOOKUP,))(
                doors, run_id
            )
        rule = {"target": "lookup_order", "kind": kind, "run": run_id, "times": None}
        httpx.post(f"{doors.mcp_url}/faults", json=rule, timeout=30).raise_for_status()
        loop = LoopLimits(max_repeat_error=2)
        return _scripted(f"mcp-{kind}", [call], tools=(SHOP_LOOKUP,), loop=loop)(doors, run_id)

    return inject


def _tool_fault(fault: dict[str, Any]) -> Inject:
    """The model calls ``search_docs`` once (arguments unique to the run), and the tool server
    answers that call, by its idempotency key, with ``fault``; then a final answer."""

    def inject(doors: Doors, run_id: str) -> Injected:
        arguments = {"query": f"hostile {run_id}"}
        key = operation_key(run_id, 1, "search_docs", canonical_json(arguments))
        rule = {"target": "search_docs", "key": key, **fault}
        httpx.post(f"{doors.tool_url}/faults", json=rule, timeout=30).raise_for_status()
        turns = [{"tool_calls": [{"name": "search_docs", "arguments": arguments}]}]
        return _scripted(f"tool-{fault['kind']}", [*turns, {"content": "done"}])(doors, run_id)

    return inject


# The model route a chaos run sends to the scripted model server's Anthropic mode.
ANTHROPIC_ROUTE = "hostile-anthropic"
# The example MCP server's read-only tool, as the tool executor names it (server ``shop``).
SHOP_LOOKUP = ToolSpec(
    name="shop__lookup_order",
    parameters={
        "type": "object",
        "properties": {"order_id": {"type": "string"}},
        "required": ["order_id"],
    },
    permission="read",
    idempotent=True,
)

LOOKUP_REDOS = ToolSpec(
    name="lookup",
    parameters={
        "type": "object",
        "properties": {"q": {"type": "string", "pattern": "^(a+)+$"}},
        "required": ["q"],
    },
)


def _api_submit(task: Callable[[str], Mapping[str, Any] | bytes]) -> Inject:
    def inject(doors: Doors, run_id: str) -> Injected:
        body = task(run_id)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        status = doors.api(
            "POST",
            "/runs",
            content=content,
            headers={"Content-Type": "application/json", "Idempotency-Key": run_id},
        )
        return Injected(case="", http=status)

    return inject


def _api_task(doors_tools: Iterable[ToolSpec], run_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "goal": f"hostile {run_id}",
        "messages": [{"role": "user", "content": f"scenario:multi_tool {run_id}"}],
        "tools": [t.model_dump(mode="json") for t in doors_tools],
        "model_route": "scenario:multi_tool",
        **fields,
    }


def _api_raw_header(doors: Doors, run_id: str) -> Injected:
    """A request whose header value carries CR/LF and bytes that are not UTF-8, written on
    the socket (HTTP clients refuse to send it)."""
    assert doors.api_url is not None
    url = urlsplit(doors.api_url)
    request = (
        b"GET /runs/" + run_id.encode() + b" HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer \xff\xfe\r\nX-Trace: a\rb\r\n\r\n"
    )
    with socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), 10) as sock:
        sock.sendall(request)
        head = sock.recv(64)
    status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/") else 0
    return Injected(case="", http=status)


def _api_reply_without_question(doors: Doors, run_id: str) -> Injected:
    status = doors.api(
        "POST",
        f"/runs/{run_id}/replies",
        json={"resume_token": "forged", "response": {"approved": True}},
    )
    return Injected(case="", http=status)


def _api_operator(action: str, body: bytes, *, scope: bool = True) -> Inject:
    """A request to an operator route (``POST /runs/{id}/<action>``) with ``body``, sent with
    the operator's token, or with a credential without the admin role when ``scope`` is False."""

    def inject(doors: Doors, run_id: str) -> Injected:
        assert doors.operator_token is not None
        status = doors.api(
            "POST",
            f"/runs/{run_id}/{action}",
            token=doors.operator_token if scope else (doors.scoped_token or doors.api_token),
            content=body,
            headers={"Content-Type": "application/json"},
        )
        return Injected(case="", http=status)

    return inject


# --------------------------------------------------------------------------- the cases

TOO_BIG = 1 << 62 << 1  # 2**63: over an Avro long and a Postgres bigint
BAD_FINGERPRINT = b"\xc3\x01" + b"\x00" * 8 + b"\x02"

CASES: tuple[Case, ...] = (
    # upstream producers writing the inbox
    Case("inbox_garbage_bytes", "inbox", Ending(dlq="NOT_SINGLE_OBJECT"), _raw(b"\x00not avro")),
    Case("inbox_null_value", "inbox", Ending(dlq="null value"), _raw(None)),
    Case("inbox_unknown_fingerprint", "inbox", Ending(dlq="FINGERPRINT"), _raw(BAD_FINGERPRINT)),
    Case(
        "inbox_body_not_json",
        "inbox",
        Ending(dlq="INVALID_EVENT"),
        _envelope(lambda r: r.update(body="{not json")),
    ),
    Case(
        "inbox_kind_mismatch",
        "inbox",
        Ending(dlq="envelope says"),
        _envelope(lambda r: r.update(kind="UserReplied")),
    ),
    Case(
        "inbox_key_not_run_id",
        "inbox",
        Ending(dlq="is not the run_id"),
        lambda d, r: _send(d, r, encode("Input", input_record(_task(r, d))), key=b"x", run=False),
    ),
    Case(
        "inbox_non_utf8_key_and_crlf_headers",
        "inbox",
        Ending(dlq="is not the run_id"),
        lambda d, r: _send(
            d,
            r,
            encode("Input", input_record(_task(r, d))),
            key=b"\xff\xfe\xfd",
            headers=[("trace\r\nx", b"a\r\nb"), ("bin", b"\xff\x00\xfe")],
            run=False,
        ),
    ),
    Case(
        "inbox_task_with_crlf_and_binary_headers_runs",
        "inbox",
        Ending(status="SUCCEEDED"),
        lambda d, r: _send(
            d,
            r,
            encode("Input", input_record(_task(r, d))),
            headers=[("x-note", b"line1\r\nline2"), ("x-bin", b"\xff\x00")],
        ),
    ),
    Case(
        "inbox_trace_id_400_kb",
        "inbox",
        Ending(dlq="INVALID_EVENT"),
        _inbox_patched(_set("trace_id", "t" * 400_000)),
    ),
    Case(
        "inbox_goal_over_limit",
        "inbox",
        Ending(dlq="INVALID_EVENT"),
        _inbox_patched(_set("goal", "g" * 300_000)),
    ),
    Case(
        "inbox_at_2_63", "inbox", Ending(dlq="INVALID_EVENT"), _inbox_patched(_set("at", TOO_BIG))
    ),
    Case(
        "inbox_deadline_2_63",
        "inbox",
        Ending(dlq="INVALID_EVENT"),
        _inbox_patched(_set("budgets.deadline_at", TOO_BIG)),
    ),
    Case(
        "inbox_user_wait_3e14",
        "inbox",
        Ending(dlq="INVALID_EVENT"),
        _inbox_patched(_set("policy.user_wait_ms", 3e14)),
    ),
    Case(
        "inbox_max_steps_2_31",
        "inbox",
        Ending(dlq="INVALID_EVENT"),
        _inbox_patched(_set("budgets.max_steps", 2**31)),
    ),
    Case(
        "inbox_tool_schema_not_json_schema",
        "inbox",
        Ending(status="FAILED", reason="invalid_input:tool_schema"),
        _inbox_task(tools=(ToolSpec(name="lookup", parameters={"type": "int"}),)),
    ),
    Case(
        "inbox_tool_pattern_not_linear",
        "inbox",
        Ending(status="FAILED", reason="invalid_input:tool_schema"),
        _inbox_task(
            tools=(
                ToolSpec(
                    name="lookup",
                    parameters={"type": "object", "properties": {"q": {"pattern": "(?=a)a"}}},
                ),
            )
        ),
    ),
    Case(
        "inbox_duplicate_tool_names",
        "inbox",
        Ending(status="FAILED", reason="invalid_input:duplicate_tool"),
        _inbox_task(tools=(ToolSpec(name="search_docs"), ToolSpec(name="search_docs"))),
    ),
    Case(
        "inbox_tool_schema_nested_too_deep",
        "inbox",
        Ending(status="FAILED", reason="invalid_input:tool_schema"),
        _inbox_task(tools=(ToolSpec(name="deep", parameters=_nested(200)),)),
    ),
    Case(
        "inbox_deadline_at_the_last_valid_ms_runs",
        "inbox",
        Ending(status="SUCCEEDED"),
        _inbox_task(budgets=Budgets(deadline_at=253_402_300_799_999)),
    ),
    Case(
        "inbox_reply_without_question_is_rejected",
        "inbox",
        Ending(status="SUCCEEDED"),
        _reply_without_question,
    ),
    Case(
        "inbox_user_wait_of_a_year_runs",
        "inbox",
        Ending(status="SUCCEEDED"),
        _inbox_task(policy=Policy(user_wait_ms=366 * 24 * 3600 * 1000)),
    ),
    # the model: tool-call arguments the core must refuse without stopping
    Case(
        "model_arguments_nested_300_deep",
        "model",
        Ending(status="FAILED", reason="ARGUMENTS_TOO_DEEP"),
        _scripted(
            "deep-arguments",
            [{"tool_calls": [{"name": "search_docs", "arguments": {"query": _nested(300)}}]}],
        ),
    ),
    Case(
        "model_arguments_against_a_backtracking_pattern",
        "model",
        Ending(status="FAILED", reason="SCHEMA_VIOLATION"),
        _scripted(
            "redos",
            [{"tool_calls": [{"name": "lookup", "arguments": {"q": "a" * 40 + "!"}}]}],
            tools=(LOOKUP_REDOS,),
        ),
    ),
    # the model's stream
    Case(
        "model_stream_that_never_ends",
        "model",
        Ending(status="FAILED"),
        _model_fault({"kind": "keepalive", "times": None, "delay_ms": 200}, then_answer=False),
    ),
    Case(
        "model_stream_one_byte_per_second",
        "model",
        Ending(status="FAILED"),
        _model_fault({"kind": "drip", "times": None, "delay_ms": 1000}, then_answer=False),
    ),
    Case(
        "model_chunk_of_the_wrong_shape",
        "model",
        Ending(status="FAILED"),
        _model_fault({"kind": "bad_chunk", "shape": "delta_string", "times": None}),
    ),
    Case(
        "model_stream_over_the_size_cap",
        "model",
        Ending(status="FAILED"),
        _model_fault({"kind": "huge_stream", "size": 6 << 20, "times": None}),
    ),
    Case(
        "model_stream_not_utf8",
        "model",
        Ending(status="FAILED"),
        _model_fault({"kind": "bad_utf8", "times": None}),
    ),
    *(
        Case(
            f"model_retry_after_{label}",
            "model",
            Ending(status="SUCCEEDED"),
            _model_fault({"kind": "429", "retry_after": value, "times": 1}),
        )
        for label, value in (("inf", "inf"), ("1e300", "1e300"), ("minus_1", "-1"))
    ),
    # the model's stream over Anthropic Messages: an untrusted stream is retried, then ends the
    # run with the class of what went wrong
    Case(
        "anthropic_stream_ends_mid_tool_input",
        "model",
        Ending(status="FAILED", reason="model:retries_exhausted:incomplete"),
        _anthropic_fault({"kind": "incomplete", "after_chunks": 3, "times": None}),
    ),
    Case(
        "anthropic_stream_ends_mid_tool_input_once_is_retried",
        "model",
        Ending(status="SUCCEEDED"),
        _anthropic_fault({"kind": "incomplete", "after_chunks": 3, "times": 1}),
    ),
    Case(
        "anthropic_unknown_content_block_type",
        "model",
        Ending(status="FAILED", reason="model:retries_exhausted:incomplete"),
        _anthropic_fault(
            {"kind": "bad_chunk", "shape": "unknown_block", "after_chunks": 1, "times": None}
        ),
    ),
    Case(
        "anthropic_error_event_mid_stream",
        "model",
        Ending(status="FAILED", reason="model:retries_exhausted:incomplete"),
        _anthropic_fault({"kind": "api_error", "after_chunks": 3, "times": None}),
    ),
    Case(
        "anthropic_overloaded_event_mid_stream_backs_off",
        "model",
        Ending(status="SUCCEEDED"),
        _anthropic_fault({"kind": "overloaded", "after_chunks": 3, "times": 1}),
    ),
    # an MCP server's answer: a classified failure the model is told of, every time
    Case(
        "mcp_answer_not_json",
        "mcp",
        Ending(status="FAILED", reason="loop:repeated_error:UNKNOWN:invalid_output:not_json"),
        _mcp_call("malformed"),
    ),
    Case(
        "mcp_answer_to_another_request_id",
        "mcp",
        Ending(status="FAILED", reason="loop:repeated_error:UNKNOWN:invalid_output:wrong_id"),
        _mcp_call("wrong_id"),
    ),
    Case(
        "mcp_content_block_of_an_unknown_type",
        "mcp",
        Ending(status="FAILED", reason="loop:repeated_error:UNKNOWN:invalid_output:bad_result"),
        _mcp_call("unknown_block"),
    ),
    Case("mcp_call_beside_the_hostile_answers", "mcp", Ending(status="SUCCEEDED"), _mcp_call(None)),
    # the tool's answer
    Case(
        "tool_body_nested_1000_deep",
        "tool",
        Ending(status="SUCCEEDED"),
        _tool_fault({"kind": "deep", "depth": 1000, "times": None}),
    ),
    Case(
        "tool_body_over_the_size_cap",
        "tool",
        Ending(status="SUCCEEDED"),
        _tool_fault({"kind": "huge", "size": 12 << 20, "framing": "chunked", "times": None}),
    ),
    Case(
        "tool_answer_one_byte_per_second",
        "tool",
        Ending(status="SUCCEEDED"),
        _tool_fault({"kind": "drip", "delay_ms": 1000, "times": 1}),
    ),
    *(
        Case(
            f"tool_retry_after_{label}",
            "tool",
            Ending(status="SUCCEEDED"),
            _tool_fault({"kind": "429", "retry_after": value, "times": 1}),
        )
        for label, value in (("inf", "inf"), ("1e300", "1e300"), ("garbage", "soon"))
    ),
    # the executors' and the timer's topics
    Case(
        "model_effects_garbage",
        "effects",
        Ending(dlq="NOT_SINGLE_OBJECT"),
        _on_topic(effect_suffix("model"), b"\x00junk"),
    ),
    Case(
        "tool_effects_garbage",
        "effects",
        Ending(dlq="NOT_SINGLE_OBJECT"),
        _on_topic(effect_suffix("tool"), b"\x00junk"),
    ),
    Case(
        "timer_effects_garbage",
        "effects",
        Ending(dlq="NOT_SINGLE_OBJECT"),
        _on_topic(effect_suffix("timer"), b"\x00junk"),
    ),
    Case(
        "events_garbage", "events", Ending(dlq="NOT_SINGLE_OBJECT"), _on_topic(EVENTS, b"\x00junk")
    ),
    # the API
    Case(
        "api_body_over_limit",
        "api",
        Ending(http=413),
        _api_submit(lambda r: b'{"goal": "' + b"x" * (9 << 20) + b'"}'),
        needs_api=True,
    ),
    Case(
        "api_tool_schema_not_json_schema",
        "api",
        Ending(http=422),
        lambda d, r: _api_submit(
            lambda run: _api_task((ToolSpec(name="lookup", parameters={"type": "int"}),), run)
        )(d, r),
        needs_api=True,
    ),
    Case(
        "api_json_nested_too_deep",
        "api",
        Ending(http=422),
        _api_submit(lambda r: b'{"goal": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
        needs_api=True,
    ),
    Case(
        "api_deadline_2_63",
        "api",
        Ending(http=422),
        lambda d, r: _api_submit(
            lambda run: _api_task(d.tools, run, budgets={"deadline_at": TOO_BIG})
        )(d, r),
        needs_api=True,
    ),
    Case("api_crlf_and_binary_header", "api", Ending(http=400), _api_raw_header, needs_api=True),
    Case(
        "api_reply_with_a_forged_token",
        "api",
        Ending(http=409),
        _api_reply_without_question,
        needs_api=True,
    ),
    # the operator routes: each refused before the run is looked up, the first with the run
    Case(
        "api_operator_route_without_operator_scope",
        "api",
        Ending(http=403),
        _api_operator("redrive", b"{}", scope=False),
        needs_api=True,
    ),
    Case(
        "api_operator_body_not_an_object",
        "api",
        Ending(http=400),
        _api_operator("resolve", b'["fail"]'),
        needs_api=True,
    ),
    Case(
        "api_operator_body_unknown_field",
        "api",
        Ending(http=422),
        _api_operator("resolve", b'{"action": "fail", "actor": "operator:mallory"}'),
        needs_api=True,
    ),
    Case(
        "api_operator_reason_over_limit",
        "api",
        Ending(http=422),
        _api_operator("reopen", b'{"reason": "' + b"x" * (MAX_REASON_CHARS + 1) + b'"}'),
        needs_api=True,
    ),
    Case(
        "api_operator_verdict_nested_too_deep",
        "api",
        Ending(http=422),
        _api_operator(
            "resolve",
            b'{"action": "reconcile", "outcome": "found_succeeded", "result": '
            + b"[" * 5000
            + b"]" * 5000
            + b"}",
        ),
        needs_api=True,
    ),
    Case(
        "api_operator_action_on_an_unknown_run",
        "api",
        Ending(http=404),
        _api_operator("resolve", b'{"action": "fail", "reason": "hostile"}'),
        needs_api=True,
    ),
    # forks: of a run that does not exist, at no seq, a record whose state is not its source's
    Case(
        "api_fork_of_an_unknown_run",
        "api",
        Ending(http=404),
        _api_operator("fork", b'{"at": 1}'),
        needs_api=True,
    ),
    Case(
        "api_resume_of_an_unknown_run",
        "api",
        Ending(http=404),
        _api_operator("resume", b"{}"),
        needs_api=True,
    ),
    Case(
        "api_fork_at_seq_zero",
        "api",
        Ending(http=422),
        _api_operator("fork", b'{"at": 0, "model_route": "x"}'),
        needs_api=True,
    ),
    Case(
        "inbox_fork_whose_state_is_not_its_source",
        "inbox",
        Ending(dlq="not the source's"),
        _inbox_fork(lambda run: f"{run}-source", lambda run: f"{run}-other"),
    ),
    Case(
        "inbox_fork_of_itself",
        "inbox",
        Ending(dlq="a run id of its own"),
        _inbox_fork(lambda run: run, lambda run: run),
    ),
    # child runs: a child that names itself as its parent, a cycle through its ancestors, a
    # task that sets the parent link through the API (only the tool executor may)
    Case(
        "inbox_child_naming_itself_as_its_parent",
        "inbox",
        Ending(status="FAILED", reason="invalid_input:child_cycle"),
        _inbox_child(lambda run: (run, (run,))),
    ),
    Case(
        "inbox_child_in_a_cycle_of_ancestors",
        "inbox",
        Ending(status="FAILED", reason="invalid_input:child_cycle"),
        _inbox_child(lambda run: (f"{run}-b", (f"{run}-a", run, f"{run}-b"))),
    ),
    Case(
        "api_task_naming_a_parent",
        "api",
        Ending(http=422),
        lambda d, r: _api_submit(
            lambda run: _api_task(
                d.tools,
                run,
                parent={
                    "run_id": run,
                    "trace_id": "t",
                    "operation_key": "k",
                    "tool": "ask",
                    "step": 1,
                    "depth": 1,
                    "ancestors": [run],
                },
            )
        )(d, r),
        needs_api=True,
    ),
)


def cases(*, api: bool) -> tuple[Case, ...]:
    return tuple(c for c in CASES if api or not c.needs_api)


def inject(case: Case, doors: Doors, run_id: str) -> Injected:
    """Inject one case; any exception of the injection itself is the case's error."""
    try:
        injected = case.inject(doors, run_id)
    except Exception as exc:  # the test harness reports it; it must not stop the others
        injected = Injected(case=case.name, error=f"{type(exc).__name__}: {exc}")
    injected.case = case.name
    return injected


# --------------------------------------------------------------------------- checking


def check(
    case: Case,
    injected: Injected,
    results: Mapping[str, list[dict[str, Any]]],
    dead_letters: Mapping[tuple[str, int, int], list[dict[str, Any]]],
) -> str | None:
    """Why the case did not end as it must (None when it did)."""
    if injected.error is not None:
        return f"not injected: {injected.error}"
    want = case.ending
    if want.http is not None:
        return None if injected.http == want.http else f"HTTP {injected.http}, want {want.http}"
    if want.dlq is not None:
        if injected.position is None:
            return "no delivery report"
        found = dead_letters.get(injected.position, [])
        if not found:
            return f"no dead letter for {injected.position}"
        if not any(want.dlq in d["reason"] or want.dlq in d["error_class"] for d in found):
            return f"dead letter reasons {[d['reason'][:120] for d in found]} lack {want.dlq!r}"
        return None
    assert injected.run_id is not None
    ended = results.get(injected.run_id)
    if not ended:
        return f"run {injected.run_id} has no terminal result"
    last = ended[-1]
    if want.status is not None and last["status"] != want.status:
        return f"ended {last['status']} ({last.get('summary', '')}), want {want.status}"
    summary = str(last.get("summary", ""))
    if want.reason is not None and want.reason not in summary:
        return f"ended with {summary!r}, want a reason with {want.reason!r}"
    return None


def positions(dead_letters: Iterable[dict[str, Any]]) -> dict[tuple[str, int, int], list[Any]]:
    """Dead letters by the position of the record they refused."""
    out: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for record in dead_letters:
        where = (record["source_topic"], record["source_partition"], record["source_offset"])
        out.setdefault(where, []).append(record)
    return out

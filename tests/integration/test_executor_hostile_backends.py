"""The executors against hostile backends: our tool and model servers' fault kinds, the real
broker and the real Postgres.

Every test sends a bad effect together with a good one (one batch): the good one gets its
normal answer, the bad one its failure answer within its deadline, and no batch is retried
(the executor's ``batch_retries`` stays put, the bad effect was started once).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import psycopg
import pytest

from agentruns.connectors.dev.servers import model_server, tool_server
from agentruns.connectors.executors.base import ActionRecord, Ahead, Outcome
from agentruns.connectors.executors.loop import Executor
from agentruns.connectors.executors.model import ModelHandler, RouteConfig, Routes
from agentruns.connectors.executors.tool import MAX_RETRY_AFTER_MS, ToolHandler, ToolRegistry
from agentruns.connectors.postgres.artifacts import PostgresArtifactStore
from agentruns.processors.effects import CallModel, CallTool, Effect
from agentruns.processors.events import (
    ModelCallCompleted,
    ModelOutcome,
    ReconcileCompleted,
    ReconcileOutcome,
    ToolCallFailed,
    ToolCallSucceeded,
    ToolCallTimedOut,
)
from agentruns.processors.state import ErrorClass
from agentruns.streams.topics import DLQ, topic_name
from tests.support.executors import (
    TICKET,
    Harness,
    Ids,
    ModelEnv,
    fast_registry,
    ids_for,
    make_harness,
)
from tests.support.pipeline import read_all
from tests.support.waiting import wait_for

TOOL_BODY_CAP = 1024 * 1024
ARTIFACT_CAP = 64 * 1024
HANDLER_ATTEMPTS = 3
MODEL_DEADLINE_S = 2.0
STREAM_CAP = 256 * 1024


def detail_of(harness: Harness, key: str) -> str:
    with psycopg.connect(harness.database_url) as conn:
        row = conn.execute(
            "SELECT detail FROM executed_actions WHERE idempotency_key = %s", (key,)
        ).fetchone()
    assert row is not None
    return str(row[0])


def assert_no_batch_retried(harness: Harness, *effects: Effect) -> None:
    assert harness.executor is not None
    assert harness.executor.stats.batch_retries == 0
    for effect in effects:
        status, starts, _, _ = harness.record(effect.idempotency_key) or ()
        assert (status, starts) == ("completed", 1)


# --------------------------------------------------------------------------- tool side


class ExplodingToolHandler(ToolHandler):
    """The real tool handler, except for ``search_docs`` queries ``explode:<how>``: it raises
    (a stand-in for a handler bug on one backend answer), counting its attempts per key."""

    def __init__(self, registry: ToolRegistry, **kwargs: Any) -> None:
        super().__init__(registry, **kwargs)
        self.attempts: dict[str, int] = {}

    async def execute(self, effect: Effect, previous: ActionRecord | None, ahead: Ahead) -> Outcome:
        if isinstance(effect, CallTool) and "explode:" in effect.operation.arguments_json:
            key = effect.idempotency_key
            self.attempts[key] = self.attempts.get(key, 0) + 1
            if "explode:value" in effect.operation.arguments_json:
                raise ValueError("a handler bug")
            if "explode:oserror_once" not in effect.operation.arguments_json:
                raise ConnectionResetError("connection reset by peer")
            if self.attempts[key] == 1:
                raise ConnectionResetError("connection reset by peer")
        return await super().execute(effect, previous, ahead)


@dataclass
class ToolEnv:
    harness: Harness
    handler: ExplodingToolHandler
    http: httpx.Client

    def fault(self, **rule: Any) -> None:
        self.http.post("/faults", json=rule).raise_for_status()

    def executions(self, key: str) -> int:
        return int(self.http.get(f"/executions/{key}").json()["count"])


@pytest.fixture(scope="module")
def tool_env(
    kafka_bootstrap: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ToolEnv]:
    server = tool_server.serve("127.0.0.1", 0)
    registry = ToolRegistry.load(fast_registry(tmp_path_factory.mktemp("tools"), server.url))
    prefix = f"t-hostile-tool-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    harness = make_harness(kafka_bootstrap, database_url, prefix, "tool")
    handler = ExplodingToolHandler(registry, max_body_bytes=TOOL_BODY_CAP)
    config = harness.config(
        "tool",
        max_artifact_bytes=ARTIFACT_CAP,
        handler_attempts=HANDLER_ATTEMPTS,
        handler_backoff_ms=10,
        max_throttle_s=0.05,  # a 429 of one test must not hold the next one's calls
    )
    harness.start(Executor(config, handler))
    http = httpx.Client(base_url=server.url, timeout=5.0)
    try:
        yield ToolEnv(harness, handler, http)
    finally:
        harness.close()
        http.close()
        server.close()


@pytest.fixture
def tools(tool_env: ToolEnv) -> ToolEnv:
    tool_env.http.delete("/faults").raise_for_status()
    return tool_env


def good_and_bad(tools: ToolEnv, ids: Ids, bad: CallTool) -> None:
    """Send a good call and ``bad`` in one batch; the good one succeeds as usual."""
    good = ids.call("create_ticket", TICKET)
    tools.harness.effects.send(good, bad)
    tools.harness.inbox.typed(good, ToolCallSucceeded)


def test_a_handler_that_raises_fails_only_its_effect_without_retrying_the_batch(
    tools: ToolEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    bad = ids.call("search_docs", {"query": "explode:value"})
    assert tools.harness.executor is not None
    stats = tools.harness.executor.stats
    errors, gave_up = stats.handler_errors, stats.gave_up
    good_and_bad(tools, ids, bad)
    failed = tools.harness.inbox.typed(bad, ToolCallFailed)
    assert (failed.error_class, failed.error_code) == (ErrorClass.UNKNOWN, "executor_error")
    assert "ValueError: a handler bug" in failed.message
    assert tools.handler.attempts[bad.idempotency_key] == 1  # a bug is not tried again
    assert (stats.handler_errors, stats.gave_up) == (errors + 1, gave_up + 1)
    assert_no_batch_retried(tools.harness, bad)


def test_a_transient_handler_error_is_retried_for_that_effect_alone_then_answered(
    tools: ToolEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    always = ids.call("search_docs", {"query": "explode:oserror"})
    once = ids.call("search_docs", {"query": "explode:oserror_once"})
    good_and_bad(tools, ids, always)
    tools.harness.effects.send(once)
    failed = tools.harness.inbox.typed(always, ToolCallFailed)
    assert (failed.error_class, failed.error_code) == (ErrorClass.UNKNOWN, "executor_error")
    assert tools.handler.attempts[always.idempotency_key] == HANDLER_ATTEMPTS
    tools.harness.inbox.typed(once, ToolCallSucceeded)
    assert tools.handler.attempts[once.idempotency_key] == 2
    assert_no_batch_retried(tools.harness, always, once)


def test_a_tool_body_nested_a_thousand_deep_fails_the_call_as_invalid_output(
    tools: ToolEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    bad = ids.call("create_ticket", TICKET)
    tools.fault(target="create_ticket", key=bad.operation.key, kind="deep", depth=1000)
    good_and_bad(tools, ids, bad)
    failed = tools.harness.inbox.typed(bad, ToolCallFailed)
    assert (failed.error_class, failed.error_code) == (
        ErrorClass.UNKNOWN,
        "invalid_output:too_deep",
    )
    assert_no_batch_retried(tools.harness, bad)


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
def test_a_tool_body_over_the_cap_fails_the_call_as_too_large(
    tools: ToolEnv, request: pytest.FixtureRequest, framing: str
) -> None:
    ids = ids_for(request)
    bad = ids.call("create_ticket", TICKET)
    size = 2 * TOOL_BODY_CAP
    tools.fault(
        target="create_ticket", key=bad.operation.key, kind="huge", size=size, framing=framing
    )
    good_and_bad(tools, ids, bad)
    failed = tools.harness.inbox.typed(bad, ToolCallFailed)
    assert (failed.error_class, failed.error_code) == (
        ErrorClass.UNKNOWN,
        "invalid_output:too_large",
    )
    assert_no_batch_retried(tools.harness, bad)


def test_a_tool_that_answers_one_byte_at_a_time_times_out_at_its_deadline(
    tools: ToolEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    bad = ids.call("create_ticket", TICKET)
    # ~100 bytes at 0.2 s each: the whole answer would take ~20 s; the tool's deadline is 0.4 s
    tools.fault(target="create_ticket", key=bad.operation.key, kind="drip", delay_ms=200)
    good_and_bad(tools, ids, bad)
    tools.harness.inbox.typed(bad, ToolCallTimedOut, timeout=10)  # UNKNOWN, as any timeout
    assert_no_batch_retried(tools.harness, bad)
    reconcile = ids.reconcile(bad)  # it executed: the look-up finds it
    tools.harness.effects.send(reconcile)
    found = tools.harness.inbox.typed(reconcile, ReconcileCompleted)
    assert found.outcome is ReconcileOutcome.FOUND_SUCCEEDED
    assert tools.executions(bad.operation.key) == 1


HTTP_DATE_PAST = "Wed, 21 Oct 2015 07:28:00 GMT"
HTTP_DATE_FAR = "Fri, 31 Dec 9999 23:59:59 GMT"


@pytest.mark.parametrize(
    ("retry_after", "expected"),
    [
        ("inf", None),
        ("NaN", None),
        ("garbage", None),
        ("1e300", None),
        ("99999999999999999999999999", None),
        ("3600", MAX_RETRY_AFTER_MS),
        ("-1", 0),
        ("2.5", 2500),
        (HTTP_DATE_PAST, 0),
        (HTTP_DATE_FAR, None),
    ],
)
def test_a_retry_after_a_tool_sends_is_clamped_or_ignored(
    tools: ToolEnv, request: pytest.FixtureRequest, retry_after: str, expected: int | None
) -> None:
    ids = ids_for(request)
    bad = ids.call("create_ticket", TICKET)
    tools.fault(target="create_ticket", key=bad.operation.key, kind="429", retry_after=retry_after)
    good_and_bad(tools, ids, bad)
    limited = tools.harness.inbox.typed(bad, ToolCallFailed)
    assert limited.error_class is ErrorClass.RATE_LIMIT
    assert limited.retry_after_ms == expected
    assert_no_batch_retried(tools.harness, bad)


def test_an_artifact_over_the_store_cap_becomes_the_failure_too_large(
    tools: ToolEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    bad = ids.call("search_docs", {"query": "refund", "size": 2 * ARTIFACT_CAP})
    good_and_bad(tools, ids, bad)
    failed = tools.harness.inbox.typed(bad, ToolCallFailed)
    assert (failed.error_class, failed.error_code) == (
        ErrorClass.UNKNOWN,
        "invalid_output:too_large",
    )
    assert_no_batch_retried(tools.harness, bad)


def test_a_run_id_with_a_nul_character_is_recorded_and_answered(
    tools: ToolEnv, request: pytest.FixtureRequest
) -> None:
    """Postgres text refuses NUL: kept out of the records, else the batch fails every time."""
    ids = ids_for(request)
    call = ids.call("create_ticket", TICKET)
    bad = msgspec.structs.replace(call, run_id=f"run-nul\x00-{time.monotonic_ns() % 10**9}")
    good_and_bad(tools, ids, bad)
    tools.harness.inbox.typed(bad, ToolCallSucceeded)
    assert_no_batch_retried(tools.harness, bad)


def test_an_effect_whose_key_holds_a_nul_is_a_dead_letter_and_the_batch_goes_on(
    tools: ToolEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    call = ids.call("create_ticket", TICKET)
    bad = msgspec.structs.replace(call, idempotency_key=call.idempotency_key + "\x00")
    good_and_bad(tools, ids, bad)
    dlq_topic = topic_name(DLQ, tools.harness.prefix)

    def dead_letter_for_bad() -> bool:
        letters = [r.value for r in read_all(tools.harness.bootstrap, dlq_topic, "DeadLetter")]
        return any(
            str(d["reason"]).startswith("invalid_input:key_with_nul")
            and call.idempotency_key in json.dumps(d, default=str)
            for d in letters
        )

    wait_for(dead_letter_for_bad, 20, "the dead letter of the effect")
    assert tools.harness.record(bad.idempotency_key.replace("\x00", "")) is None


def test_an_effect_started_too_often_without_an_answer_is_answered_without_a_call(
    tools: ToolEnv, request: pytest.FixtureRequest
) -> None:
    """A crash loop (the handler kills the process, say): after ``max_starts`` starts the
    effect is answered with its failure instead of being run again."""
    ids = ids_for(request)
    bad = ids.call("create_ticket", TICKET)
    assert tools.harness.executor is not None
    starts = tools.harness.executor.config.max_starts
    with psycopg.connect(tools.harness.database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO executed_actions (idempotency_key, effect_type, run_id, step, attempt,"
            " operation_key, status, executor, starts) VALUES (%s, 'CallTool', %s, 1, 1, %s,"
            " 'started', %s, %s)",  # this member's own starts: it restarted each time
            (
                bad.idempotency_key,
                bad.run_id,
                bad.operation.key,
                tools.harness.executor.member,
                starts,
            ),
        )
    good_and_bad(tools, ids, bad)
    failed = tools.harness.inbox.typed(bad, ToolCallFailed)
    assert (failed.error_class, failed.error_code) == (
        ErrorClass.UNKNOWN,
        "executor_error:restarts",
    )
    assert tools.http.get(f"/executions/{bad.operation.key}").json()["calls"] == 0


def test_a_batch_the_database_refuses_is_retried_with_a_growing_backoff_until_it_passes(
    kafka_bootstrap: str, database_url: str, tools: ToolEnv, request: pytest.FixtureRequest
) -> None:
    """The database refuses the batch's records (here a check constraint on this test's keys;
    an outage looks the same to the loop): the batch is re-read after a back-off that doubles
    up to its maximum, and answered once the database takes it; the back-off starts over."""
    prefix = f"t-hostile-db-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    harness = make_harness(kafka_bootstrap, database_url, prefix, "tool")
    config = harness.config("tool", retry_backoff_s=0.05, retry_backoff_max_s=0.4)
    executor = Executor(config, ToolHandler(tools.handler.registry))
    ids = Ids(f"dbdown-{time.monotonic_ns() % 10**9}")
    call = ids.call("create_ticket", TICKET)
    refuse = (
        "ALTER TABLE executed_actions ADD CONSTRAINT hostile_refuses"
        " CHECK (idempotency_key NOT LIKE 'dbdown-%') NOT VALID"
    )
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(refuse)
        try:
            harness.start(executor)
            harness.effects.send(call)
            wait_for(lambda: executor.stats.batch_retries >= 5, 30, "five batch retries")
            assert executor.retry_backoff_s == config.retry_backoff_max_s
        finally:
            conn.execute("ALTER TABLE executed_actions DROP CONSTRAINT hostile_refuses")
    try:
        harness.inbox.typed(call, ToolCallSucceeded)
        wait_for(lambda: executor.retry_backoff_s == config.retry_backoff_s, 10, "reset")
        assert tools.executions(call.operation.key) == 1
    finally:
        harness.close()


# --------------------------------------------------------------------------- model side


class ExplodingModelHandler(ModelHandler):
    """The real model handler, except for the route ``explode``: it raises."""

    async def execute(self, effect: Effect, previous: ActionRecord | None, ahead: Ahead) -> Outcome:
        if isinstance(effect, CallModel) and effect.model_route == "explode":
            raise KeyError("choices")
        return await super().execute(effect, previous, ahead)


def hostile_routes(base: str) -> Routes:
    """One route per fault kind, selected by the ``X-Fault`` header the route sends."""

    def faulty(fault: str, **overrides: Any) -> RouteConfig:
        values: dict[str, Any] = {
            "base_url": base,
            "model": "scenario:multi_tool",
            "total_timeout_s": MODEL_DEADLINE_S,
            "max_stream_bytes": STREAM_CAP,
            "headers": {"X-Fault": fault},
            **overrides,
        }
        return RouteConfig(**values)

    routes = {
        "default": faulty(""),
        "explode": faulty(""),
        "keepalive": faulty("keepalive; delay_ms=50; after_chunks=2"),
        "drip": faulty("drip; delay_ms=20"),
        "huge_stream": faulty(f"huge_stream; size={4 * STREAM_CAP}"),
        "huge_line": faulty("huge_line; size=1048576", max_stream_bytes=4 * 1024 * 1024),
        "bad_utf8": faulty("bad_utf8"),
        # a 1.5 MB answer within the stream's bounds: too large for one Kafka record
        "too_large": faulty(
            "huge_line; size=1500000",
            max_stream_bytes=8 * 1024 * 1024,
            max_line_bytes=4 * 1024 * 1024,
        ),
    }
    for shape in sorted(model_server.BAD_SHAPES):
        routes[f"bad:{shape}"] = faulty(f"bad_chunk; shape={shape}")
    for value in ("inf", "1e300", "-1", "NaN", "garbage", HTTP_DATE_FAR):
        routes[f"429:{value}"] = faulty(f"429; retry_after={value}")
    return Routes(routes, RouteConfig(base_url=base))


@pytest.fixture(scope="module")
def model_env(kafka_bootstrap: str, database_url: str) -> Iterator[ModelEnv]:
    server = model_server.serve("127.0.0.1", 0)
    prefix = f"t-hostile-model-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    harness = make_harness(kafka_bootstrap, database_url, prefix, "model")
    handler = ExplodingModelHandler(database_url, hostile_routes(server.url + "/v1"))
    harness.start(Executor(harness.config("model"), handler))
    http = httpx.Client(base_url=server.url, timeout=5.0)
    store = PostgresArtifactStore(database_url)
    try:
        yield ModelEnv(harness, server, http, store)
    finally:
        harness.close()
        store.close()
        http.close()
        server.close()


def model_call(env: ModelEnv, request: pytest.FixtureRequest, route: str) -> ModelCallCompleted:
    """A good call and one on ``route``, in one batch; the good one finishes as usual."""
    stamp = f"{request.node.name[:40]}-{time.monotonic_ns() % 10**9}"
    good_run, bad_run = f"run-good-{stamp}", f"run-bad-{stamp}"
    good = env.effect(good_run, env.context(good_run))
    bad = env.effect(bad_run, env.context(bad_run), route=route)
    env.harness.effects.send(good, bad)
    assert env.harness.inbox.typed(good, ModelCallCompleted).outcome is ModelOutcome.FINISHED
    # bounded: the call's deadline plus the time to commit
    event = env.harness.inbox.typed(bad, ModelCallCompleted, timeout=MODEL_DEADLINE_S + 15)
    assert (event.step, event.attempt) == (bad.step, bad.attempt)
    assert event.candidate is None or not event.candidate.tool_calls  # nothing half-trusted
    assert_no_batch_retried(env.harness, bad)
    return event


def incomplete_detail(env: ModelEnv, request: pytest.FixtureRequest, route: str) -> str:
    event = model_call(env, request, route)
    assert event.outcome is ModelOutcome.INCOMPLETE
    key = f"{event.run_id}:model:1:1"
    return detail_of(env.harness, key)


def test_a_model_stream_of_keep_alive_comments_ends_at_the_call_deadline(
    model_env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    assert "total timeout exceeded" in incomplete_detail(model_env, request, "keepalive")


def test_a_model_stream_dripping_byte_by_byte_ends_at_the_call_deadline(
    model_env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    assert "total timeout exceeded" in incomplete_detail(model_env, request, "drip")


@pytest.mark.parametrize("shape", sorted(model_server.BAD_SHAPES))
def test_a_model_chunk_of_an_unexpected_shape_makes_the_call_incomplete(
    model_env: ModelEnv, request: pytest.FixtureRequest, shape: str
) -> None:
    assert "malformed stream" in incomplete_detail(model_env, request, f"bad:{shape}")


def test_a_model_stream_over_the_size_cap_makes_the_call_incomplete(
    model_env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    assert f"answer over {STREAM_CAP} bytes" in incomplete_detail(model_env, request, "huge_stream")


def test_a_model_stream_line_over_the_line_cap_makes_the_call_incomplete(
    model_env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    assert "an SSE line over" in incomplete_detail(model_env, request, "huge_line")


def test_a_model_chunk_that_is_not_utf8_makes_the_call_incomplete(
    model_env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    assert "not utf8" in incomplete_detail(model_env, request, "bad_utf8")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("inf", None),
        ("NaN", None),
        ("garbage", None),
        ("1e300", None),
        ("-1", 0),
        (HTTP_DATE_FAR, None),
    ],
)
def test_a_retry_after_a_model_sends_is_clamped_or_ignored(
    model_env: ModelEnv, request: pytest.FixtureRequest, value: str, expected: int | None
) -> None:
    event = model_call(model_env, request, f"429:{value}")
    assert event.outcome is ModelOutcome.RATE_LIMITED
    assert event.retry_after_ms == expected


def test_a_model_answer_too_large_for_one_record_is_a_transport_error(
    model_env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    event = model_call(model_env, request, "too_large")
    assert event.outcome is ModelOutcome.TRANSPORT_ERROR and event.candidate_ref is None
    detail = detail_of(model_env.harness, f"{event.run_id}:model:1:1")
    assert "invalid_output:too_large" in detail


def test_a_model_handler_that_raises_answers_a_transport_error(
    model_env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    event = model_call(model_env, request, "explode")
    assert event.outcome is ModelOutcome.TRANSPORT_ERROR and event.candidate_ref is None
    assert "executor_error: KeyError" in detail_of(model_env.harness, f"{event.run_id}:model:1:1")


def test_an_if_match_with_cr_lf_fails_that_call_and_sends_nothing(
    tools: ToolEnv, request: pytest.FixtureRequest
) -> None:
    """A model-chosen ``expected_version`` becomes the ``If-Match`` header: with CR/LF in it
    the request would be split into a second one carrying the tool's headers. The call fails
    (UNKNOWN: not retried), nothing reaches the backend, the batch's good call succeeds."""
    ids = ids_for(request)
    call = ids.call("update_record", {"record_id": "R-1", "fields": {"a": 1}})
    smuggled = "1\r\nContent-Length: 0\r\n\r\nPOST /tools/create_ticket HTTP/1.1\r\nX-A: b"
    operation = msgspec.structs.replace(call.operation, expected_version=smuggled)
    bad = msgspec.structs.replace(call, operation=operation)
    good_and_bad(tools, ids, bad)
    failed = tools.harness.inbox.typed(bad, ToolCallFailed)
    assert (failed.error_class, failed.error_code) == (ErrorClass.UNKNOWN, "invalid_request")
    assert "If-Match holds CR, LF or NUL" in failed.message
    assert tools.executions(bad.operation.key) == 0

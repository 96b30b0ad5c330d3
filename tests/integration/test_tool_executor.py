"""The tool executor against the real broker, the real Postgres and the example tool server.

The tests play the processor: they produce Effect records to ``effects.tool`` and read the
Input records the executor commits to the inbox (read_committed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from agentruns.connectors.dev.servers import tool_server
from agentruns.connectors.dev.servers.httpserver import ServerHandle
from agentruns.connectors.executors.loop import Executor
from agentruns.connectors.executors.tool import ToolExecutor
from agentruns.processors.effects import CallTool
from agentruns.processors.events import (
    CancelConfirmed,
    CancelUnconfirmed,
    ReconcileCompleted,
    ReconcileOutcome,
    ToolCallAccepted,
    ToolCallFailed,
    ToolCallSucceeded,
    ToolCallTimedOut,
    ToolStatusReported,
)
from agentruns.processors.ids import canonical_json
from agentruns.processors.state import ErrorClass
from agentruns.streams.polling import Linger
from tests.support.executors import (
    TICKET,
    Harness,
    Ids,
    fast_registry,
    ids_for,
    make_harness,
)
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]


class Callbacks:
    """A tiny HTTP receiver for X-Callback-URL completions."""

    def __init__(self) -> None:
        received: list[tuple[str | None, Any]] = []
        self.received = received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                received.append((self.headers.get("Idempotency-Key"), json.loads(body)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/callbacks"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class ToolEnv:
    harness: Harness
    server: ServerHandle
    http: httpx.Client
    registry: Path
    callbacks: Callbacks

    def fault(self, **rule: Any) -> None:
        self.http.post("/faults", json=rule).raise_for_status()

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self.http.get("/stats").json()
        return result

    def counts(self, key: str) -> tuple[int, int]:
        """(executions, calls) of an operation key at the tool server."""
        data = self.http.get(f"/executions/{key}").json()
        return int(data["count"]), int(data["calls"])


@pytest.fixture(scope="module")
def tool_env(
    kafka_bootstrap: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ToolEnv]:
    tmp = tmp_path_factory.mktemp("tools")
    server = tool_server.serve("127.0.0.1", 0, report_delay_ms=100)
    registry = fast_registry(tmp, server.url)
    callbacks = Callbacks()
    prefix = f"t-tool-exec-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    harness = make_harness(kafka_bootstrap, database_url, prefix, "tool")
    harness.start(ToolExecutor(harness.config("tool"), registry, callback_url=callbacks.url))
    http = httpx.Client(base_url=server.url, timeout=5.0)
    try:
        yield ToolEnv(harness, server, http, registry, callbacks)
    finally:
        harness.close()
        http.close()
        callbacks.close()
        server.close()


@pytest.fixture
def env(tool_env: ToolEnv, request: pytest.FixtureRequest) -> ToolEnv:
    tool_env.http.delete("/faults").raise_for_status()
    return tool_env


# --------------------------------------------------------------------------- tests


def test_success_stores_the_raw_output_and_records_the_action(
    env: ToolEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    call = ids.call("create_ticket", TICKET)
    env.harness.effects.send(call)
    event = env.harness.inbox.typed(call, ToolCallSucceeded)
    assert event.operation_key == call.operation.key and event.summary is None
    artifact = env.harness.artifact(event.result_ref)
    assert artifact["type"] == "tool_result" and artifact["tool"] == "create_ticket"
    assert artifact["arguments"] == TICKET and artifact["operation_key"] == call.operation.key
    assert artifact["output"]["ticket_id"].startswith("T-")
    status, starts, kind, _ = env.harness.record(call.idempotency_key) or ()
    assert (status, starts, kind) == ("completed", 1, "ToolCallSucceeded")
    assert env.counts(call.operation.key) == (1, 1)


def test_large_output_gets_a_deterministic_summary(
    env: ToolEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    call = ids.call("search_docs", {"query": "refund", "size": 60_000})
    env.harness.effects.send(call)
    event = env.harness.inbox.typed(call, ToolCallSucceeded)
    assert event.summary is not None and event.result_bytes > 60_000
    assert event.summary.byte_count == event.result_bytes
    raw = env.harness.artifact(event.result_ref)
    assert len(canonical_json(raw["output"])) == event.result_bytes


@pytest.mark.parametrize(
    ("fault", "error_class", "code"),
    [
        ({"kind": "403"}, ErrorClass.PERMISSION_DENIED, "permission_denied"),
        ({"kind": "409"}, ErrorClass.STATE_CONFLICT, "stale_version"),
        ({"kind": "429", "retry_after": 2.5}, ErrorClass.RATE_LIMIT, "rate_limited"),
        ({"kind": "300"}, ErrorClass.OBJECT_AMBIGUOUS, "ambiguous"),
        ({"kind": "500"}, ErrorClass.TRANSIENT, None),
        ({"kind": "503"}, ErrorClass.TRANSIENT, None),
    ],
)
def test_status_classes(
    env: ToolEnv,
    request: pytest.FixtureRequest,
    fault: dict[str, Any],
    error_class: ErrorClass,
    code: str | None,
) -> None:
    ids = ids_for(request)
    call = ids.call("create_ticket", TICKET)
    env.fault(target="create_ticket", key=call.operation.key, **fault)
    env.harness.effects.send(call)
    event = env.harness.inbox.typed(call, ToolCallFailed)
    assert event.error_class is error_class
    assert code is None or event.error_code == code  # else the server's own error code
    if fault["kind"] == "429":
        assert event.retry_after_ms == 2500
    assert env.counts(call.operation.key)[0] == 0  # rejections execute nothing


def test_real_rejections_and_unreachable_tools(
    env: ToolEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    ambiguous = ids.call(
        "update_record", {"name": "Acme", "fields": {"x": 1}, "expected_version": 1}
    )
    stale = ids.call("update_record", {"record_id": "R-3", "fields": {}, "expected_version": 99})
    invalid = ids.call("create_ticket", {"nope": True})
    unknown = ids.call("no_such_tool", {})
    offline = ids.call("offline_tool", {"query": "x"})
    env.harness.effects.send(ambiguous, stale, invalid, unknown, offline)
    inbox = env.harness.inbox
    assert inbox.typed(ambiguous, ToolCallFailed).error_class is ErrorClass.OBJECT_AMBIGUOUS
    assert inbox.typed(stale, ToolCallFailed).error_class is ErrorClass.STATE_CONFLICT
    bad = inbox.typed(invalid, ToolCallFailed)
    assert (bad.error_class, bad.error_code) == (ErrorClass.UNKNOWN, "invalid_arguments")
    assert inbox.typed(unknown, ToolCallFailed).error_code == "unknown_tool"
    down = inbox.typed(offline, ToolCallFailed)  # nothing was sent: safe to retry
    assert (down.error_class, down.error_code) == (ErrorClass.TRANSIENT, "connect_failed")


def test_timeout_but_executed_then_reconcile_finds_it(
    env: ToolEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    call = ids.call("create_ticket", TICKET)
    env.fault(target="create_ticket", key=call.operation.key, kind="late", delay_ms=1500)
    env.harness.effects.send(call)
    env.harness.inbox.typed(call, ToolCallTimedOut)  # UNKNOWN, never failed
    reconcile = ids.reconcile(call)
    env.harness.effects.send(reconcile)
    found = env.harness.inbox.typed(reconcile, ReconcileCompleted)
    assert found.outcome is ReconcileOutcome.FOUND_SUCCEEDED and found.result_ref
    assert env.harness.artifact(found.result_ref)["output"]["ticket_id"].startswith("T-")
    assert env.counts(call.operation.key) == (1, 1)


def test_dropped_before_execution_then_resend_with_the_same_key(
    env: ToolEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    call = ids.call("send_email", {"to": "a@example.com", "subject": "s", "body": "b"})
    env.fault(target="send_email", key=call.operation.key, kind="drop")
    env.harness.effects.send(call)
    env.harness.inbox.typed(call, ToolCallTimedOut)
    reconcile = ids.reconcile(call)
    env.harness.effects.send(reconcile)
    outcome = env.harness.inbox.typed(reconcile, ReconcileCompleted).outcome
    assert outcome is ReconcileOutcome.NOT_EXECUTED
    resend = ids.call(
        call.operation.tool,
        {"to": "a@example.com", "subject": "s", "body": "b"},
        op_key=call.operation.key,
        dispatch=2,
    )
    env.harness.effects.send(resend)
    assert env.harness.inbox.typed(resend, ToolCallSucceeded).dispatch == 2
    assert env.counts(call.operation.key) == (1, 2)  # two requests, one execution


def test_undeterminable_lookup(env: ToolEnv, request: pytest.FixtureRequest) -> None:
    ids = ids_for(request)
    call = ids.call("create_ticket", TICKET)
    env.fault(target="create_ticket", key=call.operation.key, kind="drop_after")
    env.fault(target="operations", key=call.operation.key, kind="unknown")
    env.harness.effects.send(call)
    env.harness.inbox.typed(call, ToolCallTimedOut)
    reconcile = ids.reconcile(call)
    env.harness.effects.send(reconcile)
    outcome = env.harness.inbox.typed(reconcile, ReconcileCompleted).outcome
    assert outcome is ReconcileOutcome.UNDETERMINABLE
    assert env.counts(call.operation.key) == (1, 1)


def test_async_tool_accepted_then_poll_and_callback(
    env: ToolEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    call = ids.call("run_report", {"report": "sales", "duration_ms": 300})
    env.harness.effects.send(call)
    env.harness.inbox.typed(call, ToolCallAccepted)
    first = ids.poll(call, 1)
    env.harness.effects.send(first)
    running = env.harness.inbox.typed(first, ToolStatusReported)
    assert running.poll == 1 and running.status == "running"
    wait_for(
        lambda: any(k == call.operation.key for k, _ in env.callbacks.received), 10, "callback"
    )
    body = next(b for k, b in env.callbacks.received if k == call.operation.key)
    assert body["status"] == "succeeded"
    second = ids.poll(call, 2)
    env.harness.effects.send(second)
    done = env.harness.inbox.typed(second, ToolCallSucceeded)
    assert env.harness.artifact(done.result_ref)["output"] == body["result"]


def test_cancel_confirmed_and_unconfirmed(env: ToolEnv, request: pytest.FixtureRequest) -> None:
    ids = ids_for(request)
    running = ids.call("run_report", {"report": "long", "duration_ms": 60_000})
    finished = ids.call("run_report", {"report": "short", "duration_ms": 1})
    no_cancel_url = ids.call("create_ticket", TICKET)
    env.harness.effects.send(running, finished, no_cancel_url)
    env.harness.inbox.typed(running, ToolCallAccepted)
    env.harness.inbox.typed(finished, ToolCallAccepted)
    env.harness.inbox.typed(no_cancel_url, ToolCallSucceeded)
    key = finished.operation.key
    wait_for(lambda: env.http.get(f"/operations/{key}").json()["status"] == "succeeded", 10, "done")
    cancels = [ids.cancel(running), ids.cancel(finished), ids.cancel(no_cancel_url)]
    env.harness.effects.send(*cancels)
    assert isinstance(env.harness.inbox.event(cancels[0]), CancelConfirmed)
    assert isinstance(env.harness.inbox.event(cancels[1]), CancelUnconfirmed)
    assert isinstance(env.harness.inbox.event(cancels[2]), CancelUnconfirmed)


def test_redelivered_effect_is_answered_from_the_record(
    env: ToolEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    call = ids.call("create_ticket", TICKET)
    env.harness.effects.send(call)
    env.harness.inbox.typed(call, ToolCallSucceeded)
    env.harness.effects.send(call)  # the same effect again (a redelivery)
    input_id = f"{call.idempotency_key}:result"
    wait_for(
        lambda: (env.harness.inbox.drain(), len(env.harness.inbox.seen[input_id]) == 2)[1],
        20,
        "the second answer",
    )
    (a, _), (b, _) = env.harness.inbox.seen[input_id]
    assert a == b  # byte-identical: same input id, same at, same body
    assert env.counts(call.operation.key) == (1, 1)  # no second request


def _mark_started(
    harness: Harness, call: CallTool, member: str | None = None, ago_s: float = 0.0
) -> None:
    """The record of a start ``ago_s`` seconds ago by ``member`` (default: the harness's
    executor, as if it had crashed and restarted under its own name)."""
    assert harness.executor is not None
    with psycopg.connect(harness.database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO executed_actions (idempotency_key, effect_type, run_id, step, attempt,"
            " operation_key, status, executor, started_at) VALUES (%s, 'CallTool', %s, 1, 1,"
            " %s, 'started', %s, now() - %s * interval '1 second')",
            (
                call.idempotency_key,
                call.run_id,
                call.operation.key,
                member or harness.executor.member,
                ago_s,
            ),
        )


def test_started_record_is_reconciled_not_called_again(
    env: ToolEnv, request: pytest.FixtureRequest
) -> None:
    """A crash between the call and the commit: the redelivery looks the key up first, at once
    for the member's own starts (it restarted) and for another member's whose lease has ended
    (that member's call is over)."""
    ids = ids_for(request)
    executed = ids.call("create_ticket", TICKET)
    never_sent = ids.call("create_ticket", {"title": "Other"})
    unknowable = ids.call("create_ticket", {"title": "Third"})
    # the "crashed" executor had sent the first call; not the second; the third can't be told
    env.http.post(
        "/tools/create_ticket", json=TICKET, headers={"Idempotency-Key": executed.operation.key}
    ).raise_for_status()
    _mark_started(env.harness, executed)
    _mark_started(env.harness, never_sent, member="another", ago_s=3600)
    _mark_started(env.harness, unknowable)
    env.fault(target="operations", key=unknowable.operation.key, kind="unknown")
    env.harness.effects.send(executed, never_sent, unknowable)
    env.harness.inbox.typed(executed, ToolCallSucceeded)
    env.harness.inbox.typed(never_sent, ToolCallSucceeded)
    env.harness.inbox.typed(unknowable, ToolCallTimedOut)
    assert env.counts(executed.operation.key) == (1, 1)  # looked up, not called again
    assert env.counts(never_sent.operation.key) == (1, 1)  # 404, then called once
    assert env.counts(unknowable.operation.key) == (0, 0)  # never blindly called
    assert (env.harness.record(executed.idempotency_key) or ())[1] == 2  # starts


def test_a_second_executor_joining_mid_stream_executes_nothing_twice(
    env: ToolEnv, request: pytest.FixtureRequest
) -> None:
    """Scale-out: a rebalance moves partitions while batches are in flight (commits of the
    old owner may fail and rewind); every effect is answered, every key executed once."""
    base = ids_for(request).run_id

    def make(n: int) -> list[CallTool]:  # one run per call: effects spread over partitions
        first = len(calls)
        return [
            Ids(f"{base}-{i}").call("create_ticket", {"title": f"scale {i}"})
            for i in range(first, first + n)
        ]

    env.fault(target="create_ticket", kind="slow", delay_ms=10, times=None)
    second = Harness(
        env.harness.bootstrap, env.harness.database_url, env.harness.prefix,
        env.harness.inbox, env.harness.effects,
    )  # fmt: skip
    calls: list[CallTool] = []
    try:
        second.start(ToolExecutor(env.harness.config("tool", instance_id="1"), env.registry))
        assert second.executor is not None
        executor = second.executor

        def taken_over() -> bool:  # keep effects flowing until it takes over
            if executor.stats.effects:
                return True
            wave = make(10)
            env.harness.effects.send(*wave)
            calls.extend(wave)
            return False

        wait_for(taken_over, 60, "the second executor to get a partition")
        wave = make(100)
        env.harness.effects.send(*wave)
        calls.extend(wave)
        for call in calls:
            env.harness.inbox.event(call, timeout=60)
    finally:
        second.stop_executor()
        env.http.delete("/faults")
    stats = env.stats()
    executed = {c.operation.key: stats["executions"].get(c.operation.key, 0) for c in calls}
    assert {k: n for k, n in executed.items() if n != 1} == {}, "keys not executed once"
    for call in calls:
        copies = {raw for raw, _ in env.harness.inbox.seen[f"{call.idempotency_key}:result"]}
        assert len(copies) == 1


HANDED_OVER = 24
HELD_MS = 10_000


def _hand_over_running_calls(
    env: ToolEnv, request: pytest.FixtureRequest, tmp_path: Path, *, give_back: bool
) -> tuple[Executor, Executor]:
    """Calls of `HELD_MS` running at one member when a second joins and takes some of their
    partitions (the first waits only 0.5 s for them); with ``give_back``, the second leaves
    again while the calls still run. Every call answered once and requested once at the tool.
    Returns (the first member, the second)."""
    registry = json.loads(env.registry.read_text())
    for tool in registry["tools"]:
        tool["timeout_ms"] = 20_000  # the held calls run to their end
    registry_path = tmp_path / "tools.json"
    registry_path.write_text(json.dumps(registry))
    base = ids_for(request).run_id
    calls = [
        Ids(f"{base}-{i}").call("create_ticket", {"title": f"handed over {i}"})
        for i in range(HANDED_OVER)
    ]  # one run each: spread over the partitions
    keys = [c.operation.key for c in calls]
    prefix = f"t-handover-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    first = make_harness(env.harness.bootstrap, env.harness.database_url, prefix, "tool")
    second = Harness(
        first.bootstrap, first.database_url, prefix, first.inbox, first.effects
    )  # fmt: skip
    env.fault(target="create_ticket", kind="slow", delay_ms=HELD_MS, times=None)
    try:
        old = ToolExecutor(first.config("tool", revoke_wait_s=0.5), registry_path)
        first.start(old)
        first.effects.send(*calls)
        wait_for(
            lambda: all(k in env.stats()["calls"] for k in keys), 30, "every call to be running"
        )
        new = ToolExecutor(second.config("tool", instance_id="1"), registry_path)
        second.start(new)
        if give_back:
            wait_for(lambda: new.stats.held_elsewhere > 0, 30, "a call put off by the new member")
            second.stop_executor()
        answers = [first.inbox.typed(c, ToolCallSucceeded, timeout=90) for c in calls]
    finally:
        second.stop_executor()
        env.http.delete("/faults")
        first.close()
    assert len(answers) == HANDED_OVER
    stats = env.stats()
    requests = {k: stats["calls"].get(k, 0) for k in keys}
    assert {k: n for k, n in requests.items() if n != 1} == {}, "keys requested again"
    assert all(stats["executions"].get(k) == 1 for k in keys)
    for call in calls:
        copies = {raw for raw, _ in first.inbox.seen[f"{call.idempotency_key}:result"]}
        assert len(copies) == 1
    # what the tests are about happened: calls moved while running, and were waited for
    assert old.stats.handed_back >= 1, "no call was still running when its partition moved"
    assert new.stats.held_elsewhere >= 1
    assert new.stats.executed == 0  # nothing called by the new member
    return old, new


def test_a_call_still_running_at_its_old_owner_is_not_sent_again_by_the_new_one(
    env: ToolEnv, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A partition moves while its calls run longer than their old owner waits for them
    (`revoke_wait_s`): the new owner finds them started by another member, within their lease,
    and sends no second request beside them (a look-up now would say `not_found` and lead to
    one); it waits for the old owner's recorded answers and sends those, each once."""
    _, new = _hand_over_running_calls(env, request, tmp_path, give_back=False)
    assert new.stats.effects >= 1  # answered from the old member's records


def test_a_call_whose_partition_comes_back_while_it_runs_is_answered_by_its_member(
    env: ToolEnv, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The member that took the partitions leaves before the calls end: they come back to the
    member still running them, which answers them when they end (a call it had let go of is
    its own again once its record comes back)."""
    old, new = _hand_over_running_calls(env, request, tmp_path, give_back=True)
    assert new.stats.effects == 0
    assert old.stats.effects == HANDED_OVER


BURST = 10
PAIRS = 120


def test_effects_coming_fast_are_gathered_into_shared_batches(
    env: ToolEnv, request: pytest.FixtureRequest
) -> None:
    """Pairs of effects 3 ms apart, 5 ms between pairs, each effect on the wire on its own,
    after a burst: once effects have come faster than one per `gather_ms` (10) for a second,
    the executor waits that long after a batch's first effect (`Linger`), and a pair shares a
    batch. Without gathering the second of a pair lands while the first executes: its own
    batch."""
    executor = env.harness.executor
    assert executor is not None and executor.config.gather_ms >= 10
    ids = ids_for(request)
    pairs = [
        [ids.call("create_ticket", {"title": f"pair {i} {j}"}) for j in range(2)]
        for i in range(PAIRS)
    ]
    # The executor is shared by the module's tests: leftovers of an earlier one (an effect
    # redelivered after its rebalance) are let through before counting (a clean-clone run
    # counted 61 effects).
    quiet = {"since": time.monotonic(), "seen": executor.stats.effects}

    def idle() -> bool:
        if executor.stats.effects != quiet["seen"]:
            quiet.update(since=time.monotonic(), seen=executor.stats.effects)
        return time.monotonic() - quiet["since"] >= 2.0

    wait_for(idle, 60, "the executor to go idle", every=0.1)
    burst = [ids.call("create_ticket", {"title": f"burst {i}"}) for i in range(BURST)]
    batches, effects = executor.stats.batches, executor.stats.effects
    # the burst lands while its first effect executes: a batch of more than one
    env.harness.effects.send(*burst)
    time.sleep(0.04)
    lingered = executor.stats.lingered
    for first, second in pairs:
        env.harness.effects.send(first)  # flushed: one record per produce request
        time.sleep(0.003)
        env.harness.effects.send(second)
        time.sleep(0.005)
    for call in [*burst, *(call for pair in pairs for call in pair)]:
        env.harness.inbox.event(call, timeout=60)
    # a leftover that still slips in counts at most one batch of its own
    leftovers = executor.stats.effects - effects - BURST - 2 * PAIRS
    assert leftovers >= 0
    # the burst's batches (at most one each), then a batch an effect until a second's worth of
    # effects says a window brings company (`Linger`), then a batch a pair; room for pairs a
    # busy host pulls apart (without gathering: close to one batch an effect)
    ours = executor.stats.batches - batches - leftovers
    assert ours <= BURST + 1.7 * PAIRS, (ours, leftovers)
    assert executor.stats.lingered > lingered


def test_a_trickle_of_lone_effects_is_never_held_for_company(
    env: ToolEnv, request: pytest.FixtureRequest
) -> None:
    """Effects one every 60 ms, under one per `gather_ms`: a gathering window would bring none
    of them company, and each is on its run's critical path, so no poll lingers."""
    executor = env.harness.executor
    assert executor is not None
    ids = ids_for(request)
    time.sleep(Linger.HORIZON_S)  # what came before is out of the linger's horizon
    lingered = executor.stats.lingered
    calls = [ids.call("create_ticket", {"title": f"trickle {i}"}) for i in range(15)]
    for call in calls:
        env.harness.effects.send(call)
        time.sleep(0.06)
    for call in calls:
        env.harness.inbox.event(call, timeout=60)
    assert executor.stats.lingered == lingered


def test_callback_headers_are_per_dispatch_signed_with_the_callback_key_and_expire() -> None:
    from agentruns.connectors.executors.tool import ToolHandler, ToolRegistry
    from agentruns.connectors.keys import CallbackRefused, Keys, verify_callback

    registry = ToolRegistry.load(tool_server.DEFAULT_REGISTRY)
    template = "http://api.test/operations/{key}/callback"
    key = Keys.derive(b"the API's secret").callback
    handler = ToolHandler(registry, callback_url=template, callback_key=key, callback_ttl_ms=1000)
    try:
        headers = handler.callback_headers("k 1", 2, now=5_000)
    finally:
        handler.close()
    # the URL carries no signature: access logs record URLs
    assert headers["X-Callback-URL"] == "http://api.test/operations/k%201/callback"
    signature = headers["X-Callback-Signature"]
    assert verify_callback(key, "k 1", signature, now_ms=5_999) == 2
    for op_key, now in (("k 1", 6_000), ("k 2", 5_000)):
        with pytest.raises(CallbackRefused):
            verify_callback(key, op_key, signature, now_ms=now)
    unsigned = ToolHandler(registry, callback_url=template)
    try:
        assert "X-Callback-Signature" not in unsigned.callback_headers("k1", 1)
    finally:
        unsigned.close()


def test_kill_9_mid_batch_and_restart_executes_no_key_twice(
    env: ToolEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    calls = [ids.call("create_ticket", {"title": f"ticket {i}"}) for i in range(400)]
    # a little latency per call so the kill lands while calls are in flight
    env.fault(target="create_ticket", kind="slow", delay_ms=20, times=None)
    before = env.stats()["tool_calls"]
    command = env.harness.tool_executor_command(env.registry, "k9", workers=16, max_batch=50)
    env.harness.stop_executor()  # the subprocesses take over the executor group
    try:
        first = subprocess.Popen(command, cwd=REPO)
        env.harness.effects.send(*calls)
        wait_for(lambda: env.stats()["tool_calls"] >= before + 120, 60, "calls in flight")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        env.harness.inbox.drain()
        answered = sum(f"{c.idempotency_key}:result" in env.harness.inbox.seen for c in calls)
        assert answered < len(calls)  # the kill landed mid-run
        second = subprocess.Popen(command, cwd=REPO)
        try:
            for call in calls:
                env.harness.inbox.event(call, timeout=60)
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(30) == 0
    finally:
        env.http.delete("/faults")
        env.harness.start(
            ToolExecutor(env.harness.config("tool"), env.registry, callback_url=env.callbacks.url)
        )
    stats = env.stats()
    for call in calls:
        key = call.operation.key
        assert stats["executions"].get(key) == 1, key
        assert stats["calls"].get(key) == 1, key  # never a blind second request
        copies = {raw for raw, _ in env.harness.inbox.seen[f"{call.idempotency_key}:result"]}
        assert len(copies) == 1  # one answer per effect (re-sends are byte-identical)

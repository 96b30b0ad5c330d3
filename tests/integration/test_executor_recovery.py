"""R22 end to end: each tool error class, produced by the real tool server and classified by the
real tool executor, leads the run to its recovery action.

Processor, model executor, tool executor and timer service run as threads against the real broker
and Postgres; the scripted model server drives the conversation (``multi_tool``: search_docs,
create_ticket, update_record, send_email, search_docs, final answer) and the example tool server
injects the faults.

- PERMISSION_DENIED (403 on create_ticket, every time): FAILED `tool:PERMISSION_DENIED:...`
  after one request, never retried;
- OBJECT_AMBIGUOUS (300 on update_record): a clarification question, WAITING_USER;
- RATE_LIMIT (429 `Retry-After: 0.3` on send_email): a back-off timer fires, the same key is
  resent, SUCCEEDED;
- STATE_CONFLICT (409 on update_record): no resend; a new step whose frozen context carries
  `refresh:update_record:stale_version`;
- TRANSIENT (503 on search_docs): resent at once with the same key in the same step, SUCCEEDED;
- UNKNOWN (update_record of a record that does not exist: 404): no resend; a new step whose
  context carries `failed:update_record:UNKNOWN:not_found`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentruns.connectors.dev.servers.model_server import Scenario
from agentruns.connectors.postgres.artifacts import PostgresArtifactStore
from tests.support.pipeline import Pipeline, running_pipeline
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def pipeline(
    kafka_bootstrap: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    tmp = tmp_path_factory.mktemp("recovery")
    with running_pipeline(kafka_bootstrap, database_url, tmp, timers=True) as pipe:
        yield pipe


@pytest.fixture
def e2e(pipeline: Pipeline) -> Pipeline:
    """A fresh tool server state per test (seeded records: R-1 back at version 1, no faults,
    zero counters); the earlier tests' runs are terminal or waiting for a person."""
    tools: Any = pipeline.tools.app
    tools.reset()
    httpx.delete(pipeline.models.url + "/faults", timeout=5).raise_for_status()
    return pipeline


@pytest.fixture(scope="module")
def store(database_url: str) -> Iterator[PostgresArtifactStore]:
    artifacts = PostgresArtifactStore(database_url)
    yield artifacts
    artifacts.close()


def new_run(name: str) -> str:
    return f"r22-{name}-{time.monotonic_ns() % 10**9}"


def bodies(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [json.loads(e["body"]) for e in events if e["type"] == kind]


def counts(e2e: Pipeline, tool: str) -> list[tuple[int, int]]:
    """(executions, requests) per executed operation key of ``tool`` in this test."""
    return e2e.executions(tool)


def failed(events: list[dict[str, Any]]) -> dict[str, Any]:
    found = bodies(events, "ToolCallFailed")
    assert len(found) == 1, [
        (f["step"], f["error_class"], f["error_code"], f["operation_key"][:8]) for f in found
    ]
    return found[0]


def context_inputs(e2e: Pipeline, store: PostgresArtifactStore, run_id: str, step: int) -> Any:
    """The ``inputs`` frozen into the context of ``step`` (R7): the CallModel effect of that
    step names the context artifact."""
    calls = e2e.effects("model", run_id)
    refs = {c["context_ref"] for c in calls if c["type"] == "CallModel" and c["step"] == step}
    assert len(refs) == 1, calls
    content = store.get(refs.pop())
    assert content is not None
    return json.loads(content)["inputs"]


def requests(e2e: Pipeline, operation_key: str) -> int:
    """How many requests the tool server received with this idempotency key."""
    app: Any = e2e.tools.app
    return int(app.stats()["calls"].get(operation_key, 0))


def recovered_run(
    e2e: Pipeline, name: str, tool: str, fault: str, retry_after: float | None = None
) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """Inject ``fault`` into ``tool`` once, run a scenario to SUCCEEDED; its events and failure."""
    e2e.tool_fault(
        target=tool, kind=fault, **({} if retry_after is None else {"retry_after": retry_after})
    )
    run_id = new_run(name)
    e2e.submit(run_id)
    assert e2e.result(run_id)["status"] == "SUCCEEDED"
    events = e2e.events(run_id)
    return run_id, events, failed(events)


def test_permission_denied_is_never_retried_and_fails_the_run(e2e: Pipeline) -> None:
    e2e.tool_fault(target="create_ticket", kind="403", times=None)
    run_id = new_run("denied")
    e2e.submit(run_id)
    result = e2e.result(run_id)
    assert result["status"] == "FAILED", result
    assert "PERMISSION_DENIED" in json.dumps(result), result
    event = failed(e2e.events(run_id))
    assert (event["error_class"], event["error_code"]) == ("PERMISSION_DENIED", "permission_denied")
    assert requests(e2e, event["operation_key"]) == 1  # never retried
    assert counts(e2e, "create_ticket") == []  # a rejection executes nothing


def test_ambiguous_object_asks_the_user(e2e: Pipeline) -> None:
    e2e.tool_fault(target="update_record", kind="300")
    run_id = new_run("ambiguous")
    e2e.submit(run_id)
    wait_for(lambda: e2e.status(run_id) == "WAITING_USER", 90, "WAITING_USER")
    events = e2e.events(run_id)
    event = failed(events)
    assert (event["error_class"], event["error_code"]) == ("OBJECT_AMBIGUOUS", "ambiguous")
    types = [e["type"] for e in events]
    # asked, not replanned: no model call after the failure
    assert "ModelCallCompleted" not in types[types.index("ToolCallFailed") :]
    assert requests(e2e, event["operation_key"]) == 1


def test_rate_limit_backs_off_through_a_timer_then_resends_the_same_key(e2e: Pipeline) -> None:
    run_id, events, event = recovered_run(e2e, "ratelimit", "send_email", "429", retry_after=0.3)
    assert (event["error_class"], event["retry_after_ms"]) == ("RATE_LIMIT", 300)
    types = [e["type"] for e in events]
    after = types[types.index("ToolCallFailed") :]
    # the back-off timer fired before the resend succeeded, within the same step
    assert after.index("TimerFired") < after.index("ToolCallSucceeded")
    assert "ModelCallCompleted" not in after[: after.index("ToolCallSucceeded")]
    scheduled = e2e.effects("timer", run_id)
    backoff = {t["timer_id"] for t in scheduled if t.get("purpose") == "TOOL_BACKOFF"}
    assert len(backoff) == 1, scheduled
    assert backoff <= {b["timer_id"] for b in bodies(events, "TimerFired")}
    assert counts(e2e, "send_email") == [(1, 2)]  # two requests, one key, one execution


def test_state_conflict_refreshes_and_replans_in_a_new_step(
    e2e: Pipeline, store: PostgresArtifactStore
) -> None:
    run_id, _, event = recovered_run(e2e, "conflict", "update_record", "409")
    assert (event["error_class"], event["error_code"]) == ("STATE_CONFLICT", "stale_version")
    assert requests(e2e, event["operation_key"]) == 1  # not resent
    inputs = context_inputs(e2e, store, run_id, event["step"] + 1)
    assert "refresh:update_record:stale_version" in inputs, inputs


def test_transient_error_is_resent_with_the_same_key(e2e: Pipeline) -> None:
    _, events, event = recovered_run(e2e, "transient", "search_docs", "503")
    assert (event["error_class"], event["error_code"]) == ("TRANSIENT", "unavailable")
    types = [e["type"] for e in events]
    after = types[types.index("ToolCallFailed") :]
    assert after[: after.index("ToolCallSucceeded")].count("ModelCallCompleted") == 0
    first, *_ = counts(e2e, "search_docs")
    assert first == (1, 2)  # resent once with the same key, executed once


UNKNOWN_SCENARIO = Scenario.model_validate(
    {
        "name": "r22_unknown",
        "turns": [
            {
                "tool_calls": [
                    {
                        "name": "update_record",
                        "arguments": {
                            "record_id": "R-404",
                            "fields": {"status": "escalated"},
                            "expected_version": 1,
                        },
                    }
                ]
            },
            {"content": "Record R-404 does not exist; nothing was changed."},
        ],
    }
)


def test_unknown_error_is_not_retried_and_goes_to_the_next_step(
    e2e: Pipeline, store: PostgresArtifactStore
) -> None:
    app: Any = e2e.models.app
    app.add_scenario(UNKNOWN_SCENARIO)
    run_id = new_run("unknown")
    e2e.submit(run_id, scenario=UNKNOWN_SCENARIO.name)
    result = e2e.result(run_id)
    events = e2e.events(run_id)
    event = failed(events)
    assert (event["error_class"], event["error_code"]) == ("UNKNOWN", "not_found")
    assert requests(e2e, event["operation_key"]) == 1  # not resent
    inputs = context_inputs(e2e, store, run_id, event["step"] + 1)
    assert "failed:update_record:UNKNOWN:not_found" in inputs, inputs
    assert result["status"] in ("SUCCEEDED", "FAILED"), result


def test_a_tool_body_nested_too_deep_fails_the_call_once_and_the_run_goes_on(
    e2e: Pipeline, store: PostgresArtifactStore
) -> None:
    run_id, _, event = recovered_run(e2e, "deep", "search_docs", "deep")
    assert (event["error_class"], event["error_code"]) == ("UNKNOWN", "invalid_output:too_deep")
    assert requests(e2e, event["operation_key"]) == 1  # not resent
    inputs = context_inputs(e2e, store, run_id, event["step"] + 1)
    assert "failed:search_docs:UNKNOWN:invalid_output:too_deep" in inputs, inputs


def test_a_model_chunk_of_the_wrong_shape_is_an_incomplete_call_then_a_new_attempt(
    e2e: Pipeline,
) -> None:
    rule = {"kind": "bad_chunk", "shape": "delta_string", "times": 1}
    httpx.post(e2e.models.url + "/faults", json=rule, timeout=5).raise_for_status()
    run_id = new_run("badchunk")
    e2e.submit(run_id)
    assert e2e.result(run_id)["status"] == "SUCCEEDED"
    outcomes = [
        (m["step"], m["attempt"], m["outcome"])
        for m in bodies(e2e.events(run_id), "ModelCallCompleted")
    ]
    assert outcomes[0] == (1, 1, "incomplete") and outcomes[1] == (1, 2, "finished"), outcomes

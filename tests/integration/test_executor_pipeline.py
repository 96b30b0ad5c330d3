"""The whole pipeline with the real executors: the processor, the model and tool executors and
both test servers run as threads of this process against the real broker and Postgres; the
tool server injects the faults the executors must recover from.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.pipeline import Pipeline, running_pipeline
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def pipeline(
    kafka_bootstrap: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    with running_pipeline(kafka_bootstrap, database_url, tmp_path_factory.mktemp("e2e")) as pipe:
        yield pipe


@pytest.fixture
def e2e(pipeline: Pipeline) -> Pipeline:
    httpx.delete(pipeline.tools.url + "/faults", timeout=5).raise_for_status()
    httpx.delete(pipeline.models.url + "/faults", timeout=5).raise_for_status()
    return pipeline


def test_e2e_five_tool_calls_reach_succeeded(e2e: Pipeline) -> None:
    run_id = f"e2e-ok-{time.monotonic_ns() % 10**9}"
    e2e.submit(run_id)
    result = e2e.result(run_id)
    assert result["status"] == "SUCCEEDED", result
    types = [e["type"] for e in e2e.events(run_id)]
    assert types.count("ToolCallSucceeded") == 5 and types.count("ModelCallCompleted") == 6
    for tool in ("search_docs", "create_ticket", "update_record", "send_email"):
        assert all(executed == 1 for executed, _ in e2e.executions(tool))


def test_e2e_timeout_where_the_tool_ran_is_reconciled_not_redone(e2e: Pipeline) -> None:
    before = len(e2e.executions("create_ticket"))
    e2e.tool_fault(target="create_ticket", kind="late")  # executes, answers after the timeout
    run_id = f"e2e-late-{time.monotonic_ns() % 10**9}"
    e2e.submit(run_id)
    assert e2e.result(run_id)["status"] == "SUCCEEDED"
    types = [e["type"] for e in e2e.events(run_id)]
    assert "ToolCallTimedOut" in types and "ReconcileCompleted" in types
    (counts,) = e2e.executions("create_ticket")[before:]
    assert counts == (1, 1)  # executed once, requested once: found by the look-up


def test_e2e_timeout_where_the_tool_did_not_run_is_resent_with_the_same_key(
    e2e: Pipeline,
) -> None:
    before = len(e2e.executions("send_email"))
    e2e.tool_fault(target="send_email", kind="drop")  # connection closed, nothing executed
    run_id = f"e2e-drop-{time.monotonic_ns() % 10**9}"
    e2e.submit(run_id)
    assert e2e.result(run_id)["status"] == "SUCCEEDED"
    reconciled = [e for e in e2e.events(run_id) if e["type"] == "ReconcileCompleted"]
    assert json.loads(reconciled[0]["body"])["outcome"] == "not_executed"
    (counts,) = e2e.executions("send_email")[before:]
    assert counts == (1, 2)  # two requests with the same key, one execution


def test_e2e_undeterminable_operation_pauses_the_run(e2e: Pipeline) -> None:
    e2e.tool_fault(target="update_record", kind="drop_after")  # executed, answer lost
    e2e.tool_fault(target="operations", kind="unknown", times=None)  # look-ups cannot tell
    run_id = f"e2e-pause-{time.monotonic_ns() % 10**9}"
    e2e.submit(run_id)
    wait_for(lambda: e2e.status(run_id) == "PAUSED", 90, "PAUSED")
    reconciled = [e for e in e2e.events(run_id) if e["type"] == "ReconcileCompleted"]
    assert json.loads(reconciled[-1]["body"])["outcome"] == "undeterminable"


def test_e2e_mid_stream_disconnect_retries_the_same_context(e2e: Pipeline) -> None:
    run_id = f"e2e-cut-{time.monotonic_ns() % 10**9}"
    e2e.model_fault(kind="disconnect", conversation=run_id, turn=1, after_chunks=3)
    before = len(e2e.executions("create_ticket"))
    e2e.submit(run_id)
    assert e2e.result(run_id)["status"] == "SUCCEEDED"
    completed = [
        json.loads(e["body"]) for e in e2e.events(run_id) if e["type"] == "ModelCallCompleted"
    ]
    cut = [c for c in completed if c["outcome"] == "incomplete"]
    assert len(cut) == 1 and cut[0]["step"] == 2
    retry = next(c for c in completed if c["step"] == 2 and c["attempt"] == cut[0]["attempt"] + 1)
    assert retry["outcome"] == "finished" and len(retry["candidate"]["tool_calls"]) == 1
    (counts,) = e2e.executions("create_ticket")[before:]
    assert counts == (1, 1)  # one tool call, not one per stream

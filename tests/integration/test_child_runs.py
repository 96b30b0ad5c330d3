"""Child runs (tools of kind run) end to end: processor, model and tool executors and the timer
service against the real broker and Postgres, the scripted model and tool servers behind them.

- A parent hands a question to a specialist (``delegate``): the child runs its own steps
  (``specialist``: a read, then its answer), the parent waits in WAITING_TOOL and resumes with
  the child's answer as its tool result; the child's submission names its parent, its tools
  are among the parent's, its budget within the parent's remainder.
- The child's budget runs out: the child alone ends BUDGET_EXHAUSTED; the parent's model
  reads the tool error and the parent succeeds.
- Fan-out and depth over the catalog entries' limits are refused with their reason.
- Cancelling the parent cancels its child.
- A call effect delivered again (its executed-action record gone) submits the same child
  again, which the processor takes once; with the tool executor killed with SIGKILL between
  the child's submission and the call's answer, the restarted executor starts no second child.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psycopg
import pytest
from confluent_kafka import Producer

from agentruns.connectors.api.config import ApiConfig
from agentruns.connectors.api.serve import serving
from agentruns.connectors.dev.servers import model_server, tool_server
from agentruns.connectors.dev.servers.hostile import Doors, cases, check, inject
from agentruns.connectors.executors.config import ExecutorConfig
from agentruns.connectors.executors.model import ModelExecutor, RouteConfig, Routes
from agentruns.connectors.postgres.artifacts import PostgresArtifactStore
from agentruns.processors.children import CHILD_PARAMETERS, child_run_id
from agentruns.processors.events import CancelRequested, Message, RunSubmitted
from agentruns.processors.state import ToolSpec
from agentruns.streams.admin import ensure_topics
from agentruns.streams.processor import Processor, ProcessorConfig
from agentruns.streams.records import input_record
from agentruns.streams.topics import effect_suffix, topic_name
from tests.support.api import SECRET, TOKEN
from tests.support.console import csrf_of
from tests.support.executors import fast_registry
from tests.support.pipeline import Inbox, Pipeline, read_raw, running_pipeline
from tests.support.runlog import running_sink
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
AGENTRUNS = str(Path(sys.executable).parent / "agentruns")

CHILD_TOOLS: list[dict[str, Any]] = [
    {
        "name": "ask_specialist",
        "kind": "run",
        "description": "Hand a question to a specialist agent (a child run).",
        "permission": "read",
        "parameters": CHILD_PARAMETERS,
        "run": {"model_route": "scenario:specialist", "tools": ["search_docs"], "max_children": 2},
    },
    {
        "name": "ask_nobody",
        "kind": "run",
        "permission": "read",
        "parameters": CHILD_PARAMETERS,
        "run": {"model_route": "scenario:specialist", "max_depth": 0},
    },
    {
        "name": "ask_reporter",
        "kind": "run",
        "permission": "read",
        "parameters": CHILD_PARAMETERS,
        "run": {"model_route": "scenario:slow_report", "tools": ["run_report"]},
    },
]


@pytest.fixture(scope="module")
def pipeline(
    kafka_bootstrap: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    tmp = tmp_path_factory.mktemp("children")
    with (
        running_pipeline(
            kafka_bootstrap, database_url, tmp, timers=True, extra_tools=CHILD_TOOLS
        ) as pipe,
        running_sink(kafka_bootstrap, database_url, pipe.prefix),
    ):
        yield pipe


@pytest.fixture(scope="module")
def api(pipeline: Pipeline, database_url: str) -> Iterator[httpx.Client]:
    """The API and console on the pipeline's prefix, a client with the API's token."""
    config = ApiConfig(
        bootstrap=pipeline.bootstrap,
        database_url=database_url,
        api_token=TOKEN,
        secret=SECRET,
        prefix=pipeline.prefix,
    )
    with serving(config) as url:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
            yield client


@pytest.fixture
def e2e(pipeline: Pipeline) -> Pipeline:
    tools: Any = pipeline.tools.app
    tools.reset()
    httpx.delete(pipeline.models.url + "/faults", timeout=5).raise_for_status()
    return pipeline


@pytest.fixture(scope="module")
def store(database_url: str) -> Iterator[PostgresArtifactStore]:
    artifacts = PostgresArtifactStore(database_url)
    yield artifacts
    artifacts.close()


def submit(pipe: Pipeline, run_id: str, scenario: str, *, cancellable: bool = False) -> None:
    """The parent's task: the pipeline's tools (``run_report`` cancellable when asked)."""
    specs = tuple(
        msgspec.structs.replace(t, cancellable=True)
        if cancellable and t.name == "run_report"
        else t
        for t in pipe.tool_specs
    )
    pipe.inbox.send(
        input_record(
            RunSubmitted(
                run_id=run_id,
                event_id=f"{run_id}:submit",
                at=int(time.time() * 1000),
                trace_id=f"trace-{run_id}",
                goal="Find out how printer problems are escalated.",
                messages=(Message(role="user", content="How are printer problems escalated?"),),
                tools=specs,
                model_route=f"scenario:{scenario}",
            )
        )
    )
    pipe.inbox.flush()


def new_run(name: str) -> str:
    return f"{name}-{time.monotonic_ns() % 10**9}"


def bodies(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [json.loads(e["body"]) for e in events if e["type"] == kind]


def child_calls(pipe: Pipeline, run_id: str) -> list[dict[str, Any]]:
    """The parent's calls that start child runs (their CallTool effects)."""
    return [
        e
        for e in pipe.effects("tool", run_id)
        if e["type"] == "CallTool" and "child" in e["operation"]
    ]


def test_a_parent_waits_for_its_child_and_resumes_with_its_answer(
    e2e: Pipeline, store: PostgresArtifactStore
) -> None:
    parent = new_run("parent")
    submit(e2e, parent, "delegate")
    assert e2e.result(parent)["status"] == "SUCCEEDED"
    (call,) = child_calls(e2e, parent)
    child = child_run_id(call["operation"]["key"])
    assert e2e.result(child)["status"] == "SUCCEEDED"
    # the child's log begins with its submission, which names its parent and the operation
    events = e2e.events(child)
    assert events[0]["type"] == "RunSubmitted"
    submitted = json.loads(events[0]["body"])
    assert submitted["parent"]["run_id"] == parent
    assert submitted["parent"]["operation_key"] == call["operation"]["key"]
    assert submitted["parent"]["depth"] == 1 and submitted["parent"]["ancestors"] == [parent]
    assert submitted["goal"] == "Find the escalation policy for printers."
    assert submitted["model_route"] == "scenario:specialist"
    assert [t["name"] for t in submitted["tools"]] == ["search_docs"]  # the entry's, the parent's
    assert submitted["budgets"]["max_steps"] == 4  # asked for, and within the parent's 19 left
    assert len(bodies(events, "RunSubmitted")) == 1
    # the parent waited (accepted, as an asynchronous tool) and took the child's answer
    parent_events = e2e.events(parent)
    assert [e["type"] for e in parent_events].count("ToolCallAccepted") == 1
    (succeeded,) = bodies(parent_events, "ToolCallSucceeded")
    assert succeeded["operation_key"] == call["operation"]["key"]
    result = json.loads(store.get(succeeded["result_ref"]) or "{}")
    assert result["output"]["run_id"] == child
    assert result["output"]["answer"] == "Printers escalate to facilities within four hours."
    # what the child spent is charged to the parent
    (child_end,) = [json.loads(s["state"]) for s in e2e._read("state", "Snapshot", child)][-1:]
    assert succeeded["child_usage"] == child_end["usage"] and child_end["usage"]["input_tokens"]
    states = [json.loads(s["state"]) for s in e2e._read("state", "Snapshot", parent)]
    assert "WAITING_TOOL" in {s["status"] for s in states}
    assert states[-1]["children"] == 1


def test_the_api_and_the_console_show_a_childs_parent_and_a_runs_tree_of_children(
    e2e: Pipeline, api: httpx.Client, database_url: str
) -> None:
    parent = new_run("tree")
    submit(e2e, parent, "delegate")
    assert e2e.result(parent)["status"] == "SUCCEEDED"
    (call,) = child_calls(e2e, parent)
    child = child_run_id(call["operation"]["key"])

    def shown(run_id: str) -> dict[str, Any] | None:
        r = api.get(f"/runs/{run_id}")
        return dict(r.json()) if r.status_code == 200 and r.json()["terminal"] else None

    above = wait_for(lambda: shown(parent), 60, "the parent projected")
    below = wait_for(lambda: shown(child), 60, "the child projected")
    assert below["parent"]["run_id"] == parent and below["parent"]["tool"] == "ask_specialist"
    assert below["children"] == [] and above["parent"] is None
    assert above["children"] == [
        {
            "run_id": child,
            "status": "SUCCEEDED",
            "goal": "Find the escalation policy for printers.",
            "children": [],
        }
    ]
    # audit folds both logs again and finds the projection (the lineage column too) the same
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": e2e.bootstrap, "DATABASE_URL": database_url}
    audited = subprocess.run(
        [AGENTRUNS, "audit", "--run", parent, "--run", child, "--prefix", e2e.prefix],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert audited.returncode == 0, audited.stdout + audited.stderr
    assert "audited 2 runs: 0 differences" in audited.stdout
    replayed = subprocess.run(
        [AGENTRUNS, "replay", "--prefix", e2e.prefix, child],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert f"started by {parent} (its call of ask_specialist" in replayed.stdout
    assert f"effect: NotifyParent {parent} op={call['operation']['key']} SUCCEEDED" in (
        replayed.stdout
    )
    with httpx.Client(base_url=str(api.base_url), timeout=30) as viewer:
        form = viewer.get("/ui/login")
        done = viewer.post("/ui/login", data={"csrf": csrf_of(form.text), "token": TOKEN})
        assert done.status_code == 303, done.text
        page = viewer.get(f"/ui/runs/{parent}")
        assert 'id="child-runs"' in page.text and f"/runs/{child}" in page.text
        page = viewer.get(f"/ui/runs/{child}")
        assert 'id="parent-run"' in page.text and f"/runs/{parent}" in page.text


def test_the_hostile_child_cases_end_as_they_must(e2e: Pipeline, api: httpx.Client) -> None:
    """The child-run cases of the hostile suite (`agentruns chaos --hostile` runs them beside
    good runs), here against this pipeline: a child naming itself as its parent and a cycle
    through its ancestors fail, a task naming a parent through the API is refused."""
    doors = Doors(
        e2e.bootstrap,
        e2e.prefix,
        2,
        e2e.models.url,
        e2e.tools.url,
        e2e.tool_specs,
        api_url=str(api.base_url),
        api_token=TOKEN,
    )
    child_cases = [c for c in cases(api=True) if "child" in c.name or "parent" in c.name]
    assert len(child_cases) == 3
    try:
        injected = [(c, inject(c, doors, new_run("hostile"))) for c in child_cases]
        doors.flush()
        ran = [i.run_id for c, i in injected if c.ending.status is not None]
        assert None not in ran
        ended = e2e.results([r for r in ran if r is not None], timeout=60)
        results = {run_id: [result] for run_id, result in ended.items()}
        for case, done in injected:
            assert check(case, done, results, {}) is None, (case.name, done)
        for run_id in ran:  # a link that cannot be answers nobody
            assert run_id is not None
            assert not [e for e in e2e.effects("tool", run_id) if e["type"] == "NotifyParent"]
    finally:
        doors.close()


def test_a_child_over_its_budget_fails_alone_and_its_parent_reads_the_error(
    e2e: Pipeline,
) -> None:
    parent = new_run("tight")
    submit(e2e, parent, "delegate_tight")
    assert e2e.result(parent)["status"] == "SUCCEEDED"
    (call,) = child_calls(e2e, parent)
    child = child_run_id(call["operation"]["key"])
    assert e2e.result(child)["status"] == "BUDGET_EXHAUSTED"
    (failed,) = bodies(e2e.events(parent), "ToolCallFailed")
    assert failed["error_code"] == "child_budget_exhausted"
    assert child in failed["message"]


def test_fan_out_and_depth_over_the_limits_are_refused_with_a_reason(e2e: Pipeline) -> None:
    parent = new_run("fanout")
    submit(e2e, parent, "delegate_fanout")
    assert e2e.result(parent)["status"] == "SUCCEEDED"
    parent_events = e2e.events(parent)
    failed = {f["error_code"]: f for f in bodies(parent_events, "ToolCallFailed")}
    assert set(failed) == {"child_fanout_exceeded", "child_depth_exceeded"}
    assert "over the limit of 2" in failed["child_fanout_exceeded"]["message"]
    assert "over the limit of 0" in failed["child_depth_exceeded"]["message"]
    assert len(bodies(parent_events, "ToolCallSucceeded")) == 2
    calls = child_calls(e2e, parent)
    assert len(calls) == 4
    started = [child_run_id(c["operation"]["key"]) for c in calls]
    results = e2e.results([r for r in started if e2e.events(r)], timeout=60)
    assert len(results) == 2 and {r["status"] for r in results.values()} == {"SUCCEEDED"}


def test_cancelling_the_parent_cancels_its_child(e2e: Pipeline) -> None:
    parent = new_run("cancel")
    submit(e2e, parent, "delegate_slow", cancellable=True)
    calls = wait_for(lambda: child_calls(e2e, parent), 60, "the child's call")
    child = child_run_id(calls[0]["operation"]["key"])
    wait_for(lambda: e2e.status(child) == "WAITING_TOOL", 60, "the child waiting on its report")
    assert e2e.status(parent) == "WAITING_TOOL"
    cancel = CancelRequested(
        run_id=parent,
        event_id=f"{parent}:cancel",
        at=int(time.time() * 1000),
        trace_id=f"trace-{parent}",
        reason="the operator changed their mind",
    )
    e2e.inbox.send(input_record(cancel))
    e2e.inbox.flush()
    assert e2e.result(parent)["status"] == "CANCELLED"
    assert e2e.result(child)["status"] == "CANCELLED"
    (asked,) = bodies(e2e.events(child), "CancelRequested")
    assert parent in asked["reason"]


def test_a_call_delivered_again_submits_the_same_child_which_runs_once(
    e2e: Pipeline, database_url: str
) -> None:
    parent = new_run("again")
    submit(e2e, parent, "delegate")
    assert e2e.result(parent)["status"] == "SUCCEEDED"
    (call,) = child_calls(e2e, parent)
    child = child_run_id(call["operation"]["key"])
    # the call's record, as the tool executor read it, delivered again with no record of it
    topic = topic_name(effect_suffix("tool"), e2e.prefix)
    (raw,) = [
        r
        for r in read_raw(e2e.bootstrap, topic)
        if call["idempotency_key"].encode() in dict(r.headers).get("idempotency_key", b"")
    ]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "DELETE FROM executed_actions WHERE idempotency_key = %s", (call["idempotency_key"],)
        )
    producer = Producer({"bootstrap.servers": e2e.bootstrap})
    producer.produce(topic, key=raw.key, value=raw.value, partition=raw.partition)
    producer.flush(10)
    # the executor carried it out again: the child's submission is on the inbox twice

    def twice() -> list[bytes] | None:
        found = child_submissions(e2e, child)
        return found if len(found) >= 2 else None

    submissions = wait_for(twice, 60, "the child submitted again")
    assert len(submissions) == 2 and submissions[0] == submissions[1]  # the same bytes, twice
    processed(e2e, child)
    assert len(bodies(e2e.events(child), "RunSubmitted")) == 1  # taken once
    assert e2e.result(child)["status"] == "SUCCEEDED"


def processed(pipe: Pipeline, run_id: str) -> None:
    """Waits until the processor took every input of ``run_id`` sent so far: a marker sent
    after them (a cancel of the ended run, recorded as late) is in its log."""
    marker = f"{run_id}:marker-{time.monotonic_ns()}"
    cancel = CancelRequested(
        run_id=run_id, event_id=marker, at=int(time.time() * 1000), trace_id="marker"
    )
    pipe.inbox.send(input_record(cancel))
    pipe.inbox.flush()
    wait_for(
        lambda: any(json.loads(e["body"]).get("event_id") == marker for e in pipe.events(run_id)),
        60,
        "the marker",
    )


def child_submissions(pipe: Pipeline, child: str) -> list[bytes]:
    """The child's submissions on the inbox (raw values)."""
    topic = topic_name("inbox", pipe.prefix)
    return [
        r.value
        for r in read_raw(pipe.bootstrap, topic)
        if r.key == child.encode() and b"RunSubmitted" in r.value
    ]


# --------------------------------------------------------------------------- SIGKILL


@contextlib.contextmanager
def blocked_completion(
    database_url: str, run_id: str, start: Callable[[], None]
) -> Iterator[dict[str, Any]]:
    """Calls ``start``, then holds the lock of the run's child-call record as soon as it is
    ``started``, so the tool executor's completion of it waits: the child is submitted, the
    call is not answered. Yields ``{"locked": bool}``; on leaving, the executor's waiting
    statement is ended first (its client is gone: the statement must not complete the record
    after it)."""
    conn = psycopg.connect(database_url)
    state: dict[str, Any] = {"locked": False}
    start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT idempotency_key FROM executed_actions WHERE run_id = %s"
                " AND effect_type = 'CallTool' AND status = 'started' FOR UPDATE",
                (run_id,),
            ).fetchone()
            if row is not None:
                state["locked"] = True
                break
            conn.rollback()
            time.sleep(0.001)
        yield state
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND query LIKE '%executed_actions%'"
                " AND pid <> pg_backend_pid()"
            )
        conn.rollback()
        conn.close()


@pytest.mark.timeout(300)
def test_the_tool_executor_killed_mid_dispatch_starts_no_second_child(
    kafka_bootstrap: str, database_url: str, tmp_path: Path
) -> None:
    prefix = f"t-child-kill-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    ensure_topics(kafka_bootstrap, prefix=prefix, partitions=2)
    models = model_server.serve("127.0.0.1", 0)
    tools = tool_server.serve("127.0.0.1", 0)
    registry = fast_registry(tmp_path, tools.url)
    spec = json.loads(registry.read_text())
    spec["tools"].extend(CHILD_TOOLS)
    registry.write_text(json.dumps(spec))
    command = [
        sys.executable, "-m", "agentruns.connectors.executors.tool",
        "--bootstrap", kafka_bootstrap, "--database-url", database_url, "--prefix", prefix,
        "--registry", str(registry),
    ]  # fmt: skip
    executor = subprocess.Popen(command, cwd=REPO)
    store = PostgresArtifactStore(database_url)
    stop = threading.Event()
    workers: list[Any] = [
        Processor(ProcessorConfig(kafka_bootstrap, prefix=prefix, group_id=f"{prefix}-p"),
                  store.put_many),
        ModelExecutor(
            ExecutorConfig(kafka_bootstrap, database_url, "model", prefix=prefix),
            Routes({}, RouteConfig(base_url=models.url + "/v1")),
            registry,
        ),
    ]  # fmt: skip
    threads = [threading.Thread(target=w.run, args=(stop,), daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    pipe = Pipeline(
        kafka_bootstrap,
        prefix,
        models,
        tools,
        tuple(
            ToolSpec(
                name=t["name"],
                parameters=t["parameters"],
                permission=t["permission"],
                kind=t.get("kind", msgspec.UNSET),
            )
            for t in spec["tools"]
            if t["permission"] != "admin"
        ),
        Inbox(kafka_bootstrap, prefix, 2),
    )
    try:
        parent = new_run("killed")
        with blocked_completion(
            database_url, parent, lambda: submit(pipe, parent, "delegate")
        ) as held:
            assert held["locked"], "the child's call was answered before its record was held"
            key = wait_for(lambda: child_calls(pipe, parent), 60, "the child's call")
            child = child_run_id(key[0]["operation"]["key"])
            # the child is submitted, the call not answered: the executor dies here
            wait_for(lambda: child_submissions(pipe, child), 60, "the child's submission")
            executor.send_signal(signal.SIGKILL)
            executor.wait(10)
        assert not [e for e in pipe.events(parent) if e["type"] == "ToolCallAccepted"]
        executor = subprocess.Popen(command, cwd=REPO)
        assert pipe.result(parent, timeout=120)["status"] == "SUCCEEDED"
        assert pipe.result(child)["status"] == "SUCCEEDED"
        submissions = child_submissions(pipe, child)
        assert len(submissions) == 2 and submissions[0] == submissions[1]  # submitted again
        processed(pipe, child)
        assert len(bodies(pipe.events(child), "RunSubmitted")) == 1  # one child, once
        assert len(child_calls(pipe, parent)) == 1
    finally:
        executor.send_signal(signal.SIGTERM)
        executor.wait(30)
        stop.set()
        for thread in threads:
            thread.join(30)
        pipe.inbox.close()
        store.close()
        models.close()
        tools.close()

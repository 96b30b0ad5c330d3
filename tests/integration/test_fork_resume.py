"""`agentruns resume` and `agentruns fork` end to end: processor, model and tool executors and the
timer service against the real broker and Postgres, the scripted model and tool servers behind
them, the commands run as an operator runs them (the console script).

- A run fails on a tool bug (create_ticket answers 500 every time: retried, then the repeated
  error fails the run); the tool is fixed; `agentruns resume` finishes it as a fork, and the
  servers' own counters show nothing before the failure was asked again.
- A fork at a later seq with another model route runs to its own end; the source's records on
  the event topic are the same bytes before and after.
- Hostile: a fork of a run that does not exist, a seq past the end, a resume of a run that
  succeeded; a fork of a fork of a fork names its direct source.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from agentruns.connectors.postgres.artifacts import PostgresArtifactStore
from agentruns.processors.ids import run_id_for_key
from agentruns.processors.state import Budgets
from agentruns.streams.clock import now_ms
from agentruns.streams.topics import topic_name
from tests.support.pipeline import Pipeline, read_raw, running_pipeline
from tests.support.runlog import running_sink
from tests.support.waiting import wait_for

AGENTRUNS = str(Path(sys.executable).parent / "agentruns")


@pytest.fixture(scope="module")
def pipeline(
    kafka_bootstrap: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    tmp = tmp_path_factory.mktemp("forks")
    with (
        running_pipeline(kafka_bootstrap, database_url, tmp, timers=True) as pipe,
        running_sink(kafka_bootstrap, database_url, pipe.prefix),
    ):
        yield pipe


@pytest.fixture(scope="module")
def database(database_url: str) -> str:
    return database_url


@pytest.fixture
def e2e(pipeline: Pipeline) -> Pipeline:
    tools: Any = pipeline.tools.app
    tools.reset()
    httpx.delete(pipeline.models.url + "/faults", timeout=5).raise_for_status()
    return pipeline


def agentruns(
    e2e: Pipeline, *args: str, database: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": e2e.bootstrap}
    if database is not None:
        env["DATABASE_URL"] = database
    return subprocess.run(
        [AGENTRUNS, *args, "--prefix", e2e.prefix],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def forked(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stdout + result.stderr
    answer: dict[str, Any] = json.loads(result.stdout)
    return answer


def refused(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentruns: "), result.stderr
    return lines[0]


def new_run(name: str) -> str:
    return f"fork-{name}-{time.monotonic_ns() % 10**9}"


def bodies(e2e: Pipeline, run_id: str, kind: str | None = None) -> list[dict[str, Any]]:
    return [json.loads(e["body"]) for e in e2e.events(run_id) if kind in (None, e["type"])]


def raw_log(e2e: Pipeline, run_id: str) -> list[bytes]:
    """The run's records on the event topic, as bytes."""
    topic = topic_name("events", e2e.prefix)
    mine = (run_id + ":").encode()
    return [r.value for r in read_raw(e2e.bootstrap, topic) if (r.key or b"").startswith(mine)]


def projected(database: str, run_id: str) -> dict[str, list[str]]:
    """The run's rows in the projection, as text (every column)."""
    tables = {"runs": "run_id", "events": "seq", "operations": "op_key"}
    out: dict[str, list[str]] = {}
    with psycopg.connect(database) as conn:
        for table, order in tables.items():
            rows = conn.execute(
                f"SELECT t::text FROM {table} t WHERE run_id = %s ORDER BY {order}", (run_id,)
            ).fetchall()
            out[table] = [r[0] for r in rows]
    return out


def projected_to(database: str, run_id: str, seq: int) -> None:
    def there() -> bool:
        with psycopg.connect(database) as conn:
            row = conn.execute("SELECT last_seq FROM runs WHERE run_id = %s", (run_id,)).fetchone()
        return row is not None and row[0] >= seq

    wait_for(there, 60, f"the projection of {run_id} to seq {seq}")


def tool_calls(e2e: Pipeline) -> dict[str, int]:
    app: Any = e2e.tools.app
    return dict(app.stats()["calls"])


def model_turns(e2e: Pipeline, run_id: str) -> dict[int, int]:
    app: Any = e2e.models.app
    return dict(app.turns(run_id))


def test_resume_after_a_tool_fix_repeats_nothing_before_the_failure(e2e: Pipeline) -> None:
    e2e.tool_fault(target="create_ticket", kind="500", times=None)  # the tool's bug
    run_id = new_run("bug")
    e2e.submit(run_id)
    result = e2e.result(run_id)
    assert result["status"] == "FAILED", result
    failures = bodies(e2e, run_id, "ToolCallFailed")
    assert len(failures) == 3 and len({f["operation_key"] for f in failures}) == 1
    (search,) = [k for k in bodies(e2e, run_id, "ToolCallSucceeded")]
    source_bytes = raw_log(e2e, run_id)
    turns_before = model_turns(e2e, run_id)
    assert sorted(turns_before) == [0, 1]  # search_docs, then create_ticket
    calls_before = tool_calls(e2e)
    assert calls_before[search["operation_key"]] == 1
    assert calls_before[failures[0]["operation_key"]] == 3

    app: Any = e2e.tools.app
    app.clear_rules()  # the fix
    answer = forked(agentruns(e2e, "resume", run_id))
    fork_id = answer["run_id"]
    assert answer["source_run_id"] == run_id and answer["status"] == "TOOL_RUNNING"
    first_failure_seq = next(e["seq"] for e in e2e.events(run_id) if e["type"] == "ToolCallFailed")
    assert answer["source_seq"] == first_failure_seq - 1
    assert e2e.result(fork_id)["status"] == "SUCCEEDED"

    # the fork's log begins with its lineage and alone explains it
    fork_events = e2e.events(fork_id)
    assert fork_events[0]["seq"] == 1 and fork_events[0]["type"] == "ForkedFrom"
    lineage = json.loads(fork_events[0]["body"])
    assert (lineage["source_run_id"], lineage["source_seq"]) == (run_id, answer["source_seq"])
    # nothing before the failure ran again: the source's search_docs was called once, the
    # failed create_ticket went out again once under the fork's key, and the model was asked
    # only the turns after it
    calls = tool_calls(e2e)
    assert calls[search["operation_key"]] == 1
    assert calls[failures[0]["operation_key"]] == 3
    ticket = [b for b in bodies(e2e, fork_id, "ToolCallSucceeded") if b["step"] == 2]
    assert len(ticket) == 1 and calls[ticket[0]["operation_key"]] == 1
    assert ticket[0]["operation_key"] != failures[0]["operation_key"]
    fork_turns = model_turns(e2e, fork_id)
    assert fork_turns and min(fork_turns) == 2, fork_turns
    assert all(n == 1 for n in fork_turns.values()), fork_turns
    assert model_turns(e2e, run_id) == turns_before
    assert raw_log(e2e, run_id) == source_bytes  # the source is never changed

    # resuming again is the same fork (its key derives from the source and the seq)
    again = forked(agentruns(e2e, "resume", run_id))
    assert again["run_id"] == fork_id
    time.sleep(1)
    assert [e["seq"] for e in e2e.events(fork_id)] == [e["seq"] for e in fork_events]


def test_an_expired_run_resumed_with_a_later_deadline_ends_and_keeps_its_spending(
    e2e: Pipeline,
) -> None:
    run_id = new_run("late")
    # the second model call streams slowly (0.8 s a chunk): the deadline passes meanwhile
    e2e.model_fault(kind="slow", conversation=run_id, turn=1, delay_ms=800)
    e2e.submit(run_id, budgets=Budgets(deadline_at=now_ms() + 2500))
    result = e2e.result(run_id)
    assert result["status"] == "EXPIRED", result
    # the same deadline expires the resume at once: it needs a later one
    line = refused(agentruns(e2e, "resume", run_id, "--budget", "max_steps=1"))
    assert "never lowers them: max_steps 1 < 20" in line
    answer = forked(
        agentruns(e2e, "resume", run_id, "--budget", "deadline_in_s=600", "--budget",
                  "max_steps=30")
    )  # fmt: skip
    budgets = answer["edits"]["budgets"]
    assert budgets["max_steps"] == 30 and budgets["deadline_at"] > now_ms() + 500_000
    ended = e2e.result(answer["run_id"])
    assert ended["status"] == "SUCCEEDED", json.dumps(ended)[:1500]
    # what the source spent carries over: its tool calls count in the fork's state
    (first,) = [e for e in e2e.events(answer["run_id"]) if e["type"] == "ForkedFrom"]
    state = json.loads(first["body"])["state"]
    assert state["tool_calls"] >= 1, state["tool_calls"]


def test_a_fork_with_a_replaced_answer_goes_on_from_it_without_the_tool(
    e2e: Pipeline, database: str, tmp_path: Path
) -> None:
    e2e.tool_fault(target="create_ticket", kind="500", times=None)
    run_id = new_run("replaced")
    e2e.submit(run_id)
    assert e2e.result(run_id)["status"] == "FAILED"
    failure = next(e for e in e2e.events(run_id) if e["type"] == "ToolCallFailed")
    failed = json.loads(failure["body"])
    calls_before = tool_calls(e2e)
    # what the ticket system would have answered, stored as the call's result artifact
    store = PostgresArtifactStore(database)
    try:
        ref = store.put(json.dumps({"ticket_id": "T-1", "status": "open"}))
    finally:
        store.close()
    answer = {
        "type": "ToolCallSucceeded",
        **{k: failed[k] for k in ("run_id", "at", "trace_id", "step", "operation_key")},
        "event_id": f"{run_id}:operator-answer",
        "dispatch": failed["dispatch"],
        "result_ref": ref,
    }
    path = tmp_path / "answer.json"
    path.write_text(json.dumps(answer))
    seq = str(failure["seq"])
    fork = forked(agentruns(e2e, "fork", run_id, "--at", seq, "--replace-input", f"{seq}={path}"))
    assert fork["edits"]["replaced_inputs"][0]["seq"] == failure["seq"]
    assert fork["status"] == "MODEL_RUNNING"  # the next step: the tool is not called again
    ended = e2e.result(fork["run_id"])
    assert ended["status"] == "SUCCEEDED", json.dumps(ended)[:1500]
    assert not bodies(e2e, fork["run_id"], "ToolCallFailed")
    calls = tool_calls(e2e)
    assert calls[failed["operation_key"]] == calls_before[failed["operation_key"]]
    tickets = [b for b in bodies(e2e, fork["run_id"], "ToolCallSucceeded") if b["step"] == 2]
    assert tickets == []  # step 2's answer is the replacement, in the fork's first record
    projected_to(database, fork["run_id"], e2e.events(fork["run_id"])[-1]["seq"])
    audited = agentruns(e2e, "audit", "--run", fork["run_id"], database=database)
    assert audited.returncode == 0, audited.stdout + audited.stderr
    replay = agentruns(e2e, "replay", fork["run_id"])
    assert f"forked from {run_id} at seq {seq} (edits: replaced records {seq})" in replay.stdout
    # refused: a replacement after the fork point, one that is not JSON, a missing file
    later = refused(agentruns(e2e, "fork", run_id, "--at", "2", "--replace-input", f"{seq}={path}"))
    assert "not at or before the fork point" in later
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    assert "not JSON" in refused(
        agentruns(e2e, "fork", run_id, "--at", seq, "--replace-input", f"{seq}={garbage}")
    )
    assert "cannot read" in refused(
        agentruns(e2e, "fork", run_id, "--at", seq, "--replace-input", f"{seq}={tmp_path}/no")
    )
    assert "SEQ=FILE" in refused(
        agentruns(e2e, "fork", run_id, "--at", seq, "--replace-input", "x")
    )


def test_a_fork_with_another_route_runs_to_its_end_and_leaves_the_source(
    e2e: Pipeline, database: str
) -> None:
    run_id = new_run("route")
    e2e.submit(run_id)
    assert e2e.result(run_id)["status"] == "SUCCEEDED"
    source_bytes = raw_log(e2e, run_id)
    projected_to(database, run_id, e2e.events(run_id)[-1]["seq"])
    source_rows = projected(database, run_id)
    # the fork point: step 4 (the seq after which the model is asked its fourth turn)
    seq = next(
        e["seq"]
        for e in e2e.events(run_id)
        if e["type"] == "ToolCallSucceeded" and json.loads(e["body"])["step"] == 3
    )
    key = f"route-fork-{run_id}"
    answer = forked(
        agentruns(e2e, "fork", run_id, "--at", str(seq), "--route", "scenario:multi_tool",
                  "--key", key)
    )  # fmt: skip
    fork_id = answer["run_id"]
    assert fork_id == run_id_for_key(key)
    assert answer["edits"] == {
        "model_route": "scenario:multi_tool",
        "messages": [],
        "replaced_inputs": [],
        "budgets": None,
    }
    assert e2e.result(fork_id)["status"] == "SUCCEEDED"
    calls = [c for c in e2e.effects("model", fork_id) if c["type"] == "CallModel"]
    assert calls and all(c["model_route"] == "scenario:multi_tool" for c in calls)
    assert min(c["step"] for c in calls) == 4  # steps 1-3 are the source's, not asked again
    assert sorted(model_turns(e2e, fork_id)) == [3, 4, 5]  # turns 4 to 6, counted from 0
    assert raw_log(e2e, run_id) == source_bytes

    # the projection shows the lineage both ways, and the source's rows did not change
    last = e2e.events(fork_id)[-1]["seq"]
    projected_to(database, fork_id, last)
    assert projected(database, run_id) == source_rows
    with psycopg.connect(database) as conn:
        row = conn.execute(
            "SELECT forked_from_run_id, forked_from_seq FROM runs WHERE run_id = %s", (fork_id,)
        ).fetchone()
        forks = conn.execute(
            "SELECT run_id FROM runs WHERE forked_from_run_id = %s", (run_id,)
        ).fetchall()
    assert row == (run_id, seq) and forks == [(fork_id,)]
    # replay shows the ForkedFrom record, audit passes on both (the lineage checked too)
    replay = agentruns(e2e, "replay", fork_id)
    assert replay.returncode == 0, replay.stderr
    assert f"forked from {run_id} at seq {seq} (edits: model_route=scenario:multi_tool)" in (
        replay.stdout
    )
    assert replay.stdout.splitlines()[1].split()[2] == "ForkedFrom"
    audited = agentruns(e2e, "audit", "--run", run_id, "--run", fork_id, database=database)
    assert audited.returncode == 0, audited.stdout + audited.stderr
    assert "audited 2 runs: 0 differences" in audited.stdout

    # a fork of a fork of a fork: each names its direct source
    source, chain = fork_id, [run_id, fork_id]
    for generation in range(2):
        answer = forked(agentruns(e2e, "fork", source, "--at", "1", "--key", f"{key}-{generation}"))
        assert answer["source_run_id"] == source and answer["source_seq"] == 1
        source = answer["run_id"]
        chain.append(source)
        assert e2e.result(source)["status"] == "SUCCEEDED"
    assert len(set(chain)) == 4


def test_a_fork_with_messages_asks_the_model_with_them(
    e2e: Pipeline, database: str, tmp_path: Path
) -> None:
    run_id = new_run("messages")
    e2e.submit(run_id)
    assert e2e.result(run_id)["status"] == "SUCCEEDED"
    events = e2e.events(run_id)
    # the seq where the model was asked its third turn: the record before its answer
    answers = [e for e in events if e["type"] == "ModelCallCompleted"]
    seq = str(answers[2]["seq"] - 1)
    note = [{"role": "user", "content": "Mention the ticket number in the email."}]
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(note))
    fork = forked(agentruns(e2e, "fork", run_id, "--at", seq, "--messages", str(path)))
    assert fork["status"] == "MODEL_RUNNING" and fork["edits"]["messages"] == note
    assert e2e.result(fork["run_id"])["status"] == "SUCCEEDED"
    # the fork's first model call: step 3 (the effect topic's partitions do not keep run order)
    (first,) = [c for c in e2e.effects("model", fork["run_id"]) if c["step"] == 3]
    store = PostgresArtifactStore(database)
    try:
        context = json.loads(store.get(first["context_ref"]) or "{}")
    finally:
        store.close()
    assert context["messages"] == note and context["step"] == 3
    # where the model is not being asked, messages are refused before anything is produced
    tool_seq = str(answers[2]["seq"])
    line = refused(agentruns(e2e, "fork", run_id, "--at", tool_seq, "--messages", str(path)))
    assert "where the model is asked" in line
    path.write_text('[{"role": "robot", "content": "x"}]')
    assert "not a JSON list" in refused(
        agentruns(e2e, "fork", run_id, "--at", seq, "--messages", str(path))
    )


def test_forks_refuse_what_cannot_be_forked(e2e: Pipeline) -> None:
    line = refused(agentruns(e2e, "fork", "run-does-not-exist", "--at", "1"))
    assert "no run run-does-not-exist" in line
    line = refused(agentruns(e2e, "resume", "run-does-not-exist"))
    assert "no run" in line
    run_id = new_run("ok")
    e2e.submit(run_id)
    assert e2e.result(run_id)["status"] == "SUCCEEDED"
    last = e2e.events(run_id)[-1]["seq"]
    line = refused(agentruns(e2e, "fork", run_id, "--at", str(last + 1)))
    assert f"outside the run's log (1..{last})" in line
    line = refused(agentruns(e2e, "fork", run_id, "--at", "0"))
    assert "outside" in line
    line = refused(agentruns(e2e, "resume", run_id))
    assert "SUCCEEDED" in line
    line = refused(agentruns(e2e, "fork", run_id, "--at", "1", "--route", "r" * 600))
    assert "--route" in line
    line = refused(agentruns(e2e, "fork", run_id, "--at", "1", "--key", "k" * 600))
    assert "idempotency key" in line

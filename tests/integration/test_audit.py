"""Audit from the topics alone (R28) and reconciliation of the projection (R27), against the
real broker and Postgres."""

from __future__ import annotations

import json
import os
import random
import threading
from pathlib import Path

import psycopg
import pytest

from agentruns.connectors.dev.servers.workload import START_AT, simulate, submitted
from agentruns.connectors.postgres.artifacts import PostgresArtifactStore
from agentruns.connectors.projection import audit as audit_cli
from agentruns.connectors.projection import reading
from agentruns.connectors.projection import replay as replay_cli
from agentruns.connectors.projection import revalidate as revalidate_cli
from agentruns.connectors.projection.audit import RECONCILE_DIFFERENCES, Reconciler
from agentruns.connectors.projection.reading import read_log
from agentruns.connectors.projection.revalidate import revalidate_runs
from agentruns.processors.events import Candidate, ModelCallCompleted, ModelOutcome, ToolCallRequest
from tests.support.runlog import new_log, projected_events, running_sink, scripted_runs, write_runs
from tests.support.waiting import wait_for

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


@pytest.fixture
def env(kafka_bootstrap: str, database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI entry points resolve services like every command: from the environment."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("DATABASE_URL", database_url)


def test_audit_reports_a_corrupted_postgres_row(
    kafka_bootstrap: str,
    database_url: str,
    unique_name: str,
    env: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    prefix = unique_name
    runs = scripted_runs(prefix, 20, seed=21)
    writer = new_log(kafka_bootstrap, None, prefix)
    keys = write_runs(writer, runs)
    writer.close()
    with running_sink(kafka_bootstrap, database_url, prefix) as sink:
        wait_for(lambda: sink.stats.events >= len(keys), 60, "the projection")
    assert audit_cli.main(["--prefix", prefix]) == 0
    assert "audited 20 runs: 0 differences" in capsys.readouterr().out
    # idempotent: a sink with no stored offsets re-reads the whole log and changes nothing
    with running_sink(kafka_bootstrap, database_url, prefix, group_id=f"{prefix}-again") as again:
        wait_for(lambda: again.stats.skipped >= len(keys), 60, "the second pass")
    assert again.stats.events == 0
    assert projected_events(database_url, prefix) == len(keys)

    first, second = runs[0][0].run_id, runs[1][0].run_id
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "UPDATE runs SET status = 'SUCCEEDED', user_wait_ms = user_wait_ms + 7"
            " WHERE run_id = %s AND status <> 'SUCCEEDED'",
            (first,),
        )
        conn.execute(
            "UPDATE runs SET status = 'FAILED' WHERE run_id = %s AND status <> 'FAILED'", (first,)
        )
        conn.execute("DELETE FROM events WHERE run_id = %s AND seq = 2", (second,))
    assert audit_cli.main(["--prefix", prefix]) == 1
    out = capsys.readouterr().out
    assert f"{first}: postgres: runs.status:" in out
    assert f"{first}: postgres: runs.user_wait_ms:" in out
    assert f"{second}: postgres: events seq 2: expected 'row', found None" in out
    assert "differences in 2 runs" in out

    # the periodic job sees the same differences and counts them
    before = RECONCILE_DIFFERENCES._value.get()
    job = Reconciler(kafka_bootstrap, prefix, database_url, every_s=0.1, sample=None)
    job.run(threading.Event(), rounds=1)
    assert job.differences >= 3
    assert RECONCILE_DIFFERENCES._value.get() - before == job.differences


def _golden_run(prefix: str) -> list:  # type: ignore[type-arg]
    return simulate(random.Random(32), "golden-run-1", steps=3, faults=0.3)


def test_replay_of_a_known_run_matches_the_golden_file(
    kafka_bootstrap: str, unique_name: str, env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = unique_name
    writer = new_log(kafka_bootstrap, None, prefix)
    log = _golden_run(prefix)
    # another run on the same topics must not leak into the timeline
    write_runs(writer, [log, *scripted_runs(prefix, 3)], per_transaction=7)
    writer.close()
    assert replay_cli.main(["golden-run-1", "--prefix", prefix]) == 0
    text = capsys.readouterr().out
    golden = GOLDEN / "replay_golden-run-1.txt"
    if os.environ.get("UPDATE_GOLDEN") or not golden.exists():
        golden.write_text(text)
    assert text == golden.read_text()

    assert replay_cli.main(["golden-run-1", "--prefix", prefix, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [e["seq"] for e in doc["events"]] == list(range(1, len(log) + 1))
    assert doc["final"]["status"] == doc["events"][-1]["status_after"]
    assert replay_cli.main(["no-such-run", "--prefix", prefix]) == 1


def test_a_long_read_says_how_far_it_got(
    kafka_bootstrap: str, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = new_log(kafka_bootstrap, None, unique_name)
    write_runs(writer, scripted_runs(unique_name, 3), per_transaction=7)
    writer.close()
    said: list[str] = []
    monkeypatch.setattr(reading, "PROGRESS_EVERY_S", 0.0)  # every read counts as long here
    logs = read_log(kafka_bootstrap, unique_name, say=said.append)
    assert len(logs) == 3
    assert said and all(line.startswith(f"reading {unique_name}.events: ") for line in said)
    assert "partitions to go" in said[0]


def test_revalidate_reruns_validators_over_stored_candidates(
    kafka_bootstrap: str,
    database_url: str,
    unique_name: str,
    env: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    prefix = unique_name
    run_id = f"{prefix}-v"
    ids = {"run_id": run_id, "trace_id": "trace-v"}
    twice = Candidate(
        tool_calls=(
            ToolCallRequest(id="c0", name="search", arguments_json='{"query": "a"}'),
            ToolCallRequest(id="c0", name="search", arguments_json='{"query": "b"}'),
        )
    )
    log = [
        submitted(run_id, at=START_AT),
        ModelCallCompleted(  # v2 refuses repeated call ids (repair); v1 would dispatch
            **ids,
            event_id="m1",
            at=START_AT + 10,
            step=1,
            attempt=1,
            outcome=ModelOutcome.FINISHED,
            candidate=twice,
        ),
        ModelCallCompleted(
            **ids,
            event_id="m2",
            at=START_AT + 20,
            step=1,
            attempt=2,
            outcome=ModelOutcome.FINISHED,
            candidate=Candidate(content="done"),
        ),
    ]
    store = PostgresArtifactStore(database_url)
    writer = new_log(kafka_bootstrap, store, prefix)  # stores artifacts first, like R2
    write_runs(writer, [log])
    writer.close()
    store.close()
    logs = read_log(kafka_bootstrap, prefix)
    v1 = revalidate_runs(logs, 1, database_url)
    assert [(r.seq, r.recorded_action, r.recorded_error) for r in v1] == [
        (2, "repair", "DUPLICATE_CALL_ID"),
        (3, "finalize", None),
    ]
    assert all(r.reproduced and r.source == "artifacts" for r in v1)
    assert [(r.action, r.changed) for r in v1] == [("dispatch", True), ("finalize", False)]
    v2 = revalidate_runs(logs, 2, database_url)
    assert not any(r.changed for r in v2)

    assert revalidate_cli.main(["--validator-version", "1", "--prefix", prefix]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "v2 repair(DUPLICATE_CALL_ID) -> v1 dispatch  CHANGED" in out[0]
    assert json.loads(out[-1])["changed"] == 1

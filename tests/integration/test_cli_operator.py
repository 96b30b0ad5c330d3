"""`agentruns resolve|reopen|redrive` run as an operator runs them (the console script) against
a live API: each action reaches the run's log with the operator who did it, and each failure
(no operator token, a wrong one, an unknown run, an action the run's status does not allow, an
API that does not answer) ends with exit code 2 and one line on stderr, never a trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from agentruns.connectors.dev.stack.procs import free_port_block
from agentruns.processors.ids import run_id_for_key
from tests.support.api import OPERATOR, OPERATOR_TOKEN, TOKEN, Stack
from tests.support.waiting import wait_for

AGENTRUNS = str(Path(sys.executable).parent / "agentruns")
ACTOR = f"operator:{OPERATOR}"


@pytest.fixture
def operator_env(stack: Stack) -> dict[str, str]:
    """The environment of an operator's shell: the API's URL and the operator's token only."""
    env = {**os.environ, "AGENTRUNS_API_URL": stack.url, "AGENTRUNS_OPERATOR_TOKEN": OPERATOR_TOKEN}
    env.pop("AGENTRUNS_API_TOKEN", None)
    return env


def agentruns(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [AGENTRUNS, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def acted(result: subprocess.CompletedProcess[str], action: str) -> dict[str, Any]:
    """The answer a command that acted printed (one JSON line on stdout)."""
    assert result.returncode == 0, result.stdout + result.stderr
    answer = json.loads(result.stdout)
    assert answer["action"] == action and answer["actor"] == ACTOR, answer
    assert answer["created"] is True, answer
    return dict(answer)


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed command printed on stderr (asserting that is all it printed)."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentruns: "), result.stderr
    assert result.stdout == ""
    return lines[0]


def logged(stack: Stack, run_id: str, kind: str, count: int) -> list[dict[str, Any]]:
    """The run's APPLIED events of ``kind`` once there are ``count`` of them."""
    found: list[dict[str, Any]] = []

    def there() -> bool:
        r = stack.http.get(f"/runs/{run_id}/events", params={"limit": 1000})
        assert r.status_code == 200, r.text
        found[:] = [
            e for e in r.json()["events"] if e["type"] == kind and e["disposition"] == "APPLIED"
        ]
        return len(found) >= count

    wait_for(there, timeout=40, what=f"{count} applied {kind} of {run_id}", every=0.1)
    return found


def at_resolution(stack: Stack, run_id: str, status: str, resolution: int) -> None:
    wait_for(
        lambda: (run := stack.run(run_id))["status"] == status and run["resolution"] == resolution,
        timeout=40,
        what=f"{run_id} {status} at resolution {resolution}",
        every=0.1,
    )


def test_an_operator_continues_fails_and_reopens_a_paused_run(
    stack: Stack, operator_env: dict[str, str]
) -> None:
    key = f"cli-stalled-{uuid.uuid4().hex}"
    run_id = run_id_for_key(key)
    stack.double.stalled_runs.add(run_id)
    stack.submit(key, loop={"max_steps_without_progress": 1})
    at_resolution(stack, run_id, "PAUSED", 0)

    went_on = acted(
        agentruns(["resolve", run_id, "continue", "--reason", "index rebuilt"], operator_env),
        "resolve",
    )
    assert went_on["status"] == "PAUSED" and went_on["run_id"] == run_id
    at_resolution(stack, run_id, "PAUSED", 1)  # it stalls again, on a new resolution
    acted(agentruns(["resolve", run_id, "fail", "--reason", "stuck"], operator_env), "resolve")
    at_resolution(stack, run_id, "FAILED", 2)
    assert stack.run(run_id)["result"]["summary"].startswith("FAILED: resolved:stuck")
    reopen = ["reopen", run_id, "--goal", "find two documents", "--key", f"reopen-{run_id}"]
    acted(agentruns(reopen, operator_env), "reopen")
    at_resolution(stack, run_id, "PAUSED", 3)
    again = agentruns(reopen, operator_env)  # a retry with the same key acts once
    assert again.returncode == 0 and json.loads(again.stdout)["created"] is False

    reopened = logged(stack, run_id, "RunReopened", 2)
    (resolved,) = logged(stack, run_id, "RunResolved", 1)
    assert [e["payload"]["actor"] for e in [*reopened, resolved]] == [ACTOR] * 3
    assert [e["payload"]["reason"] for e in reopened] == ["index rebuilt", "operator"]
    assert reopened[1]["payload"]["goal"] == "find two documents"
    assert (resolved["payload"]["status"], resolved["payload"]["reason"]) == ("FAILED", "stuck")


def test_an_operator_gives_the_verdict_on_a_tool_call_of_unknown_outcome(
    stack: Stack, operator_env: dict[str, str]
) -> None:
    key = f"cli-verdict-{uuid.uuid4().hex}"
    run_id = run_id_for_key(key)
    stack.double.undeterminable_runs.add(run_id)
    stack.submit(key)
    stack.wait_status(run_id, "PAUSED")
    verdict = [
        *("resolve", run_id, "reconcile", "--outcome", "found_succeeded"),
        *("--result", '{"ticket": "T-7"}', "--reason", "found it in the tracker"),
    ]
    acted(agentruns(verdict, operator_env), "resolve")
    stack.wait_status(run_id, "SUCCEEDED")
    given = [e for e in logged(stack, run_id, "ReconcileCompleted", 2) if e["payload"]["actor"]]
    assert [(e["payload"]["actor"], e["payload"]["outcome"]) for e in given] == [
        (ACTOR, "found_succeeded")
    ]


def test_an_operator_redrives_a_run_whose_model_answer_never_comes(
    stack: Stack, operator_env: dict[str, str]
) -> None:
    key = f"cli-silent-{uuid.uuid4().hex}"
    run_id = run_id_for_key(key)
    stack.double.silent_runs.add(run_id)
    stack.submit(key)
    stack.wait_status(run_id, "MODEL_RUNNING")
    redrive = ["redrive", run_id, "--reason", "the model never answered"]
    assert acted(agentruns(redrive, operator_env), "redrive")["status"] == "MODEL_RUNNING"
    stack.wait_status(run_id, "SUCCEEDED")
    (redriven,) = logged(stack, run_id, "RedriveRequested", 1)
    assert redriven["payload"]["actor"] == ACTOR
    assert redriven["payload"]["reason"] == "the model never answered"


def test_the_operator_commands_failures_are_one_line(
    stack: Stack, operator_env: dict[str, str]
) -> None:
    key = f"cli-refused-{uuid.uuid4().hex}"
    run_id = run_id_for_key(key)
    stack.double.stalled_runs.add(run_id)
    stack.submit(key, loop={"max_steps_without_progress": 1})
    at_resolution(stack, run_id, "PAUSED", 0)
    version = stack.run(run_id)["version"]

    no_token = {k: v for k, v in operator_env.items() if k != "AGENTRUNS_OPERATOR_TOKEN"}
    for args in (["resolve", run_id, "fail"], ["reopen", run_id], ["redrive", run_id]):
        assert "AGENTRUNS_OPERATOR_TOKEN is not set" in one_line(agentruns(args, no_token))
    no_api = {k: v for k, v in operator_env.items() if k != "AGENTRUNS_API_URL"}
    for args in (["resolve", run_id, "fail"], ["reopen", run_id], ["redrive", run_id]):
        assert "set --api-url or AGENTRUNS_API_URL" in one_line(agentruns(args, no_api))
    wrong = {**operator_env, "AGENTRUNS_OPERATOR_TOKEN": OPERATOR_TOKEN + "x"}
    assert "HTTP 401" in one_line(agentruns(["resolve", run_id, "fail"], wrong))
    # the API's own token is a valid token without the operator scope
    api_token = {**operator_env, "AGENTRUNS_OPERATOR_TOKEN": TOKEN}
    line = one_line(agentruns(["redrive", run_id], api_token))
    assert "HTTP 403" in line and "insufficient_scope" in line
    line = one_line(agentruns(["resolve", "run-does-not-exist", "fail"], operator_env))
    assert "HTTP 404" in line and "run_not_found" in line
    # a PAUSED run is neither reopened nor re-driven
    for args in (["reopen", run_id], ["redrive", run_id]):
        line = one_line(agentruns(args, operator_env))
        assert "HTTP 409" in line and "action_not_allowed" in line, line
    unreachable = {**operator_env, "AGENTRUNS_API_URL": f"http://127.0.0.1:{free_port_block(1)}"}
    assert "Connection refused" in one_line(agentruns(["redrive", run_id], unreachable))
    bad_result = ["resolve", run_id, "reconcile", "--result", "{not json"]
    assert "--result is not valid JSON" in one_line(agentruns(bad_result, operator_env))

    run = stack.run(run_id)  # nothing reached the run
    assert (run["status"], run["resolution"], run["version"]) == ("PAUSED", 0, version)

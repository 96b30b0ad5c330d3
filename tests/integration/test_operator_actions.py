"""Operator actions over real HTTP against the real broker and Postgres: resolve, reopen and
re-drive need an operator token, refuse hostile bodies (any JSON, any bytes) and actions the
run's status does not allow before anything is stored, act once per request however often it is
repeated, and each one reaches the run's log with the operator who did it; the console offers
them to an operator's session only."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentruns.connectors.api.operator import MAX_REASON_CHARS
from agentruns.connectors.dev.servers.hostile import Doors, cases, check, inject
from agentruns.processors.ids import run_id_for_key
from tests.support.api import (
    GUARDED,
    OPERATOR,
    OPERATOR_TOKEN,
    PARTITIONS,
    TOKEN,
    Stack,
    anonymous,
)
from tests.support.console import csrf_of, logged_in
from tests.support.waiting import wait_for

ACTOR = f"operator:{OPERATOR}"


def _operator(stack: Stack) -> httpx.Client:
    return httpx.Client(
        base_url=stack.url, headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}, timeout=30
    )


def _events(stack: Stack, run_id: str) -> list[dict[str, Any]]:
    r = stack.http.get(f"/runs/{run_id}/events", params={"limit": 1000})
    assert r.status_code == 200, r.text
    return list(r.json()["events"])


def _acted(stack: Stack, run_id: str, kind: str, count: int = 1) -> list[dict[str, Any]]:
    """The run's APPLIED events of `kind` once there are `count` of them."""
    found: list[dict[str, Any]] = []

    def there() -> bool:
        found[:] = [
            e for e in _events(stack, run_id) if e["type"] == kind and e["disposition"] == "APPLIED"
        ]
        return len(found) >= count

    wait_for(there, timeout=40, what=f"{count} applied {kind} of {run_id}", every=0.1)
    return found


def _stored(stack: Stack, run_id: str) -> int:
    with psycopg.connect(stack.database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM api_inputs WHERE run_id = %s AND input_id LIKE 'operator:%%'",
            (run_id,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def _wait(stack: Stack, run_id: str, status: str, resolution: int) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def reached() -> bool:
        seen.update(stack.run(run_id))
        return bool(seen["status"] == status and seen["resolution"] == resolution)

    wait_for(reached, timeout=40, what=f"{run_id} {status} at resolution {resolution}", every=0.1)
    return seen


def test_operator_actions_need_an_operator_token(stack: Stack) -> None:
    stack.double.stalled_runs.add(run_id := stack.submit(f"op-auth-{uuid.uuid4().hex}"))
    for action in ("resolve", "reopen", "redrive"):
        path = f"/runs/{run_id}/{action}"
        with anonymous(stack.url) as anon:
            assert anon.post(path, json={"action": "fail"}).status_code == 401
            forged = {"Authorization": f"Bearer {OPERATOR_TOKEN}x"}
            assert anon.post(path, json={"action": "fail"}, headers=forged).status_code == 401
        # the stack's credential is valid but not an admin
        r = stack.http.post(path, json={"action": "fail"})
        assert r.status_code == 403, r.text
        assert r.json()["error"] == "insufficient_scope" and r.json()["scope"] == "admin"
        assert 'error="insufficient_scope"' in r.headers["www-authenticate"]
    assert _stored(stack, run_id) == 0
    # the operator token also reads, as the API token does
    with _operator(stack) as op:
        assert op.get(f"/runs/{run_id}").status_code == 200


def test_hostile_bodies_and_unknown_runs_are_refused_before_anything_is_stored(
    stack: Stack,
) -> None:
    stack.double.stalled_runs.add(run_id := stack.submit(f"op-hostile-{uuid.uuid4().hex}"))
    path = f"/runs/{run_id}/resolve"
    with _operator(stack) as op:
        for body, code in [
            ({"action": "explode"}, "invalid_body"),
            ({"action": "fail", "by": "mallory"}, "invalid_body"),  # unknown field
            ({"action": "fail", "reason": "x" * (MAX_REASON_CHARS + 1)}, "invalid_body"),
            ({"action": "fail", "reason": ""}, "invalid_body"),
            ({"action": "fail", "reason": 7}, "invalid_body"),
            ({"action": "reconcile", "outcome": "maybe"}, "invalid_body"),
            ({"action": "reconcile", "operation_key": "k" * 600}, "invalid_body"),
        ]:
            r = op.post(path, json=body)
            assert (r.status_code, r.json()["error"]) == (422, code), (body, r.text)
        bad_reopen = op.post(f"/runs/{run_id}/reopen", json={"goal": ""})
        assert bad_reopen.status_code == 422
        assert op.post(f"/runs/{run_id}/redrive", json={"version": 3}).status_code == 422
        assert op.post(path, content=b"[1, 2]").status_code == 400
        assert op.post(path, content=b"{not json").status_code == 400
        huge = op.post(path, content=b'{"action": "fail", "reason": "' + b"x" * 2**21 + b'"}')
        assert huge.status_code == 413
        long_key = op.post(path, json={"action": "fail"}, headers={"Idempotency-Key": "k" * 201})
        assert long_key.status_code == 400
        unknown = op.post("/runs/run-does-not-exist/resolve", json={"action": "fail"})
        assert (unknown.status_code, unknown.json()["error"]) == (404, "run_not_found")
    assert _stored(stack, run_id) == 0


def test_the_hostile_cases_of_the_operator_routes_end_as_they_must(stack: Stack) -> None:
    """The operator routes' cases of the hostile suite (`agentruns chaos --hostile` runs them
    beside good runs), here against the API alone."""
    doors = Doors(
        stack.bootstrap,
        stack.prefix,
        PARTITIONS,
        "http://unused",
        "http://unused",
        (),
        api_url=stack.url,
        api_token=TOKEN,
        operator_token=OPERATOR_TOKEN,
    )
    operator_cases = [c for c in cases(api=True) if c.name.startswith("api_operator_")]
    assert len(operator_cases) >= 5
    try:
        for case in operator_cases:
            run_id = f"hostile-{uuid.uuid4().hex}"
            injected = inject(case, doors, run_id)
            assert check(case, injected, {}, {}) is None, (case.name, injected)
            assert _stored(stack, run_id) == 0
    finally:
        doors.close()


def test_a_run_paused_on_an_undeterminable_tool_call_is_resolved_with_the_verdict(
    stack: Stack,
) -> None:
    key = f"op-verdict-{uuid.uuid4().hex}"
    run_id = _submit_paused_on_a_tool_call(stack, key)
    with _operator(stack) as op:
        # nothing is stuck on a model or tool answer: the look-up answered
        redrive = op.post(f"/runs/{run_id}/redrive", json={})
        assert redrive.status_code == 409 and redrive.json()["run_status"] == "PAUSED"
        # the run waits for a verdict: it cannot simply go on, nor be reopened
        go_on = op.post(f"/runs/{run_id}/resolve", json={"action": "continue"})
        assert go_on.status_code == 409, go_on.text
        assert go_on.json()["run_status"] == "PAUSED" and go_on.json()["unknown_operations"]
        assert op.post(f"/runs/{run_id}/reopen", json={}).status_code == 409
        verdict = {
            "action": "reconcile",
            "outcome": "found_succeeded",
            "result": {"ticket": "T-42"},
            "reason": "found the ticket in the tracker",
        }
        first = op.post(f"/runs/{run_id}/resolve", json=verdict)
        assert first.status_code == 202, first.text
        assert first.json()["actor"] == ACTOR and first.json()["created"] is True
        again = op.post(f"/runs/{run_id}/resolve", json=verdict)
        assert again.status_code == 200 and again.json()["created"] is False
        other = op.post(f"/runs/{run_id}/resolve", json={"action": "fail"})
        if other.status_code == 409:  # unless the projection already moved past the verdict
            assert other.json()["error"] in ("action_conflict", "action_not_allowed")
    run = stack.wait_status(run_id, "SUCCEEDED")
    assert run["resolution"] == 0
    (applied,) = _acted(stack, run_id, "ReconcileCompleted", 2)[1:]
    assert applied["payload"]["actor"] == ACTOR
    assert applied["payload"]["outcome"] == "found_succeeded"
    ref = applied["payload"]["result_ref"]
    with psycopg.connect(stack.database_url) as conn:
        row = conn.execute("SELECT content FROM artifacts WHERE ref = %s", (ref,)).fetchone()
    assert row is not None and b"T-42" in bytes(row[0]) and ACTOR.encode() not in bytes(row[0])
    assert _stored(stack, run_id) == 1  # three requests, one input


def _submit_paused_on_a_tool_call(stack: Stack, key: str) -> str:
    run_id = run_id_for_key(key)
    stack.double.undeterminable_runs.add(run_id)
    assert stack.submit(key) == run_id
    stack.wait_status(run_id, "PAUSED")
    return run_id


def test_a_run_paused_without_progress_is_continued_failed_reopened_and_succeeded(
    stack: Stack,
) -> None:
    key = f"op-stalled-{uuid.uuid4().hex}"
    run_id = run_id_for_key(key)
    stack.double.stalled_runs.add(run_id)
    stack.submit(key, loop={"max_steps_without_progress": 1})
    _wait(stack, run_id, "PAUSED", 0)
    with _operator(stack) as op:
        assert op.post(f"/runs/{run_id}/reopen", json={}).status_code == 409
        go_on = op.post(f"/runs/{run_id}/resolve", json={"action": "continue", "reason": "go"})
        assert go_on.status_code == 202, go_on.text
        _wait(stack, run_id, "PAUSED", 1)  # it stalls again, on a new resolution
        fail = op.post(f"/runs/{run_id}/resolve", json={"action": "fail", "reason": "stuck"})
        assert fail.status_code == 202, fail.text
        failed = _wait(stack, run_id, "FAILED", 2)
        assert failed["result"]["summary"].startswith("FAILED: resolved:stuck")
        # an ended run: not redriven, not resolved to what it is, but reopened
        assert op.post(f"/runs/{run_id}/redrive", json={}).status_code == 409
        same = op.post(f"/runs/{run_id}/resolve", json={"action": "fail"})
        assert same.status_code == 409 and same.json()["run_status"] == "FAILED"
        keyed = {"Idempotency-Key": f"reopen-{run_id}"}
        reopen = op.post(f"/runs/{run_id}/reopen", json={"reason": "retry"}, headers=keyed)
        assert reopen.status_code == 202, reopen.text
        _wait(stack, run_id, "PAUSED", 3)
        # the same key again: the first outcome, nothing new, whatever the run's status now
        repeat = op.post(f"/runs/{run_id}/reopen", json={"reason": "retry"}, headers=keyed)
        assert repeat.status_code == 200 and repeat.json()["created"] is False
        reused = op.post(f"/runs/{run_id}/reopen", json={"reason": "other"}, headers=keyed)
        assert reused.status_code == 422 and reused.json()["error"] == "idempotency_key_reused"
        done = op.post(f"/runs/{run_id}/resolve", json={"action": "succeed", "reason": "ok"})
        assert done.status_code == 202, done.text
    _wait(stack, run_id, "SUCCEEDED", 4)
    reopened = _acted(stack, run_id, "RunReopened", 2)
    resolved = _acted(stack, run_id, "RunResolved", 2)
    assert [e["payload"]["actor"] for e in reopened + resolved] == [ACTOR] * 4
    assert [e["payload"]["status"] for e in resolved] == ["FAILED", "SUCCEEDED"]


def test_redrive_moves_a_run_whose_model_or_tool_answer_never_comes(stack: Stack) -> None:
    model_key, tool_key = f"op-silent-{uuid.uuid4().hex}", f"op-silent-tool-{uuid.uuid4().hex}"
    silent, silent_tool = run_id_for_key(model_key), run_id_for_key(tool_key)
    stack.double.silent_runs.add(silent)
    stack.double.silent_tool_runs.add(silent_tool)
    stack.submit(model_key)
    stack.submit(tool_key)
    stack.wait_status(silent, "MODEL_RUNNING")
    stack.wait_status(silent_tool, "TOOL_RUNNING")
    with _operator(stack) as op:
        for run_id in (silent, silent_tool):
            seen = op.get(f"/runs/{run_id}").json()["version"]
            r = op.post(f"/runs/{run_id}/redrive", json={"reason": "the answer never came"})
            assert r.status_code == 202, r.text
            # a second operator who saw the same state does not drive it twice: the same version
            # is a conflict, or the run already moved on from it
            again = op.post(f"/runs/{run_id}/redrive", json={}, headers={"If-Match": str(seen)})
            assert again.status_code in (409, 412), again.text
    for run_id in (silent, silent_tool):
        stack.wait_status(run_id, "SUCCEEDED")
        (redriven,) = _acted(stack, run_id, "RedriveRequested")
        assert redriven["payload"]["actor"] == ACTOR
    model_calls = [
        e for e in _events(stack, silent) if e["type"] == "ModelCallCompleted" and e["step"] == 1
    ]
    assert [e["attempt"] for e in model_calls] == [2]  # the first attempt never answered
    looked_up = [e for e in _events(stack, silent_tool) if e["type"] == "ReconcileCompleted"]
    assert [e["payload"]["outcome"] for e in looked_up] == ["found_succeeded"]


def test_the_console_offers_operator_actions_to_an_operator_session_only(stack: Stack) -> None:
    run_id = _submit_paused_on_a_tool_call(stack, f"op-console-{uuid.uuid4().hex}")
    with logged_in(stack) as viewer:
        page = viewer.get(f"/ui/runs/{run_id}")
        assert page.status_code == 200 and 'id="operator"' not in page.text
        refused = viewer.post(
            f"/ui/runs/{run_id}/resolve", data={"csrf": csrf_of(page.text), "action": "fail"}
        )
        assert refused.status_code == 403 and "insufficient_scope" in refused.text
    with logged_in(stack, OPERATOR_TOKEN) as operator:
        page = operator.get(f"/ui/runs/{run_id}")
        assert page.status_code == 200 and 'id="resolve"' in page.text
        assert 'value="reconcile"' in page.text and 'id="reopen"' not in page.text
        form = {"action": "fail", "reason": "ticket system is down"}
        assert operator.post(f"/ui/runs/{run_id}/resolve", data=form).status_code == 403
        done = operator.post(
            f"/ui/runs/{run_id}/resolve", data={**form, "csrf": csrf_of(page.text)}
        )
        assert done.status_code == 303, done.text
        stack.wait_status(run_id, "FAILED")
        (resolved,) = _acted(stack, run_id, "RunResolved")
        assert resolved["payload"]["actor"] == ACTOR
        page = operator.get(f"/ui/runs/{run_id}")
        assert f"by {ACTOR}" in page.text and 'id="reopen"' in page.text
    assert TOKEN != OPERATOR_TOKEN


#: JSON values of any shape, and objects that look like the operator bodies: their field names
#: with valid, wrong-typed, out-of-range or nested values.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=12,
)
FIELDS = ("action", "outcome", "operation_key", "result", "reason", "goal", "version", "actor")
CHOICES = ("continue", "fail", "succeed", "reconcile", "found_succeeded", "not_executed")
VALUES = (
    st.sampled_from(CHOICES)
    | st.text(max_size=600)
    | st.text(min_size=MAX_REASON_CHARS, max_size=MAX_REASON_CHARS + 2)
    | JSON
)
BODIES = (
    st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=5).map(
        lambda body: json.dumps(body).encode()
    )
    | JSON.map(lambda value: json.dumps(value).encode())
    | st.binary(max_size=64)
)


@pytest.fixture(scope="module")
def waiting_run(stack: Stack) -> Iterator[str]:
    """A run waiting for its user's approval: no operator action is allowed on it."""
    run_id = stack.submit(
        f"op-any-body-{uuid.uuid4().hex}",
        tools=[GUARDED.model_dump()],
        policy={"approval_required": ["write"]},
    )
    stack.wait_status(run_id, "WAITING_USER")
    yield run_id


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    action=st.sampled_from(["resolve", "reopen", "redrive"]),
    known=st.booleans(),
    body=BODIES,
    keyed=st.booleans(),
    if_match=st.none() | st.from_regex(r"[!-~]{0,30}", fullmatch=True),  # httpx sends no blank
)
def test_any_body_on_the_operator_routes_is_refused_with_a_json_error_and_nothing_stored(
    stack: Stack,
    waiting_run: str,
    action: str,
    known: bool,
    body: bytes,
    keyed: bool,
    if_match: str | None,
) -> None:
    run_id = waiting_run if known else "run-does-not-exist"
    headers = {"Content-Type": "application/json"}
    if keyed:
        headers["Idempotency-Key"] = f"any-body-{uuid.uuid4().hex}"
    if if_match is not None:
        headers["If-Match"] = if_match
    with _operator(stack) as op:
        r = op.post(f"/runs/{run_id}/{action}", content=body, headers=headers)
    assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
    answer = r.json()
    assert isinstance(answer, dict) and isinstance(answer.get("error"), str), r.text
    if r.status_code == 409:
        assert answer["error"] == "action_not_allowed" and answer["run_status"] == "WAITING_USER"
    assert _stored(stack, run_id) == 0
    run = stack.run(waiting_run)
    assert run["status"] == "WAITING_USER" and run["resolution"] == 0

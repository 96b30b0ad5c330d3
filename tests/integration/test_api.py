"""`agentruns api` over real HTTP (uvicorn on a free port) against the real broker and Postgres,
with the in-process processor, the sink (connectors/projection/sink.py) and the executor double."""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psycopg
from jsonschema import Draft202012Validator

from agentruns.connectors.api.client import ResultsConsumer
from agentruns.connectors.api.inputs import MAX_BODY_BYTES
from agentruns.connectors.api.tokens import sign_token, verify_token
from agentruns.connectors.json_schemas import DIRECTORY, task_schema_components
from agentruns.connectors.keys import Keys, sign_callback
from agentruns.processors.ids import run_id_for_key
from agentruns.processors.limits import MAX_JSON_DEPTH
from agentruns.streams.partitioning import partition_for
from agentruns.streams.records import input_record
from agentruns.streams.topics import INBOX, RESULTS, topic_name
from tests.support.api import (
    GUARDED,
    OPERATOR_TOKEN,
    PARTITIONS,
    REPORT,
    SECRET,
    TOKEN,
    Stack,
    anonymous,
    signed_callback,
)
from tests.support.pipeline import SEARCH, Inbox, now_ms, read_all, read_raw, submitted
from tests.support.waiting import wait_for


def committed_result(bootstrap: str, prefix: str, run_id: str) -> dict[str, Any] | None:
    """The run's record on the results topic as a read_committed reader sees it now."""
    topic = topic_name(RESULTS, prefix)
    partition = partition_for(run_id, PARTITIONS)
    found = [r.value for r in read_all(bootstrap, topic, "Result", partitions=[partition])]
    mine = [r for r in found if r["run_id"] == run_id]
    return mine[-1] if mine else None


def test_every_endpoint_but_health_metrics_and_openapi_needs_the_bearer_token(
    stack: Stack,
) -> None:
    with anonymous(stack.url) as anon:
        for method, path in [
            ("POST", "/runs"),
            ("GET", "/runs/x"),
            ("GET", "/runs/x/events"),
            ("POST", "/runs/x/replies"),
            ("POST", "/runs/x/cancel"),
            ("POST", "/operations/k/callback"),
        ]:
            r = anon.request(method, path, json={})
            assert r.status_code == 401, (method, path, r.text)
            assert r.headers["www-authenticate"].startswith("Bearer")
        wrong = anon.get("/runs/x", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        # readiness and each check's code for anyone; its checks' details (error text naming
        # hosts, ports, users) only with an admin credential, and a wrong one is a 401 like
        # anywhere else
        assert anon.get("/healthz").json() == {
            "component": "api",
            "status": "ready",
            "checks": {"kafka": "ok", "postgres": "ok"},
        }
        not_admin = anon.get("/healthz", headers={"Authorization": f"Bearer {TOKEN}"})
        assert not_admin.json() == anon.get("/healthz").json()
        as_operator = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
        detailed = anon.get("/healthz", headers=as_operator).json()
        assert detailed["status"] == "ready" and set(detailed["checks"]) >= {"kafka", "postgres"}
        assert detailed["checks"]["postgres"]["detail"] == "answers"
        guessed = anon.get("/healthz", headers={"Authorization": "Bearer " + "g" * 40})
        assert guessed.status_code == 401
        assert "agentruns_api_requests_total" in anon.get("/metrics").text
        spec = anon.get("/openapi.json").json()
        assert "/runs/{run_id}/replies" in spec["paths"]
        signed = anon.post(
            "/operations/k/callback",
            json={"status": "succeeded"},
            headers={"X-Callback-Signature": "cb1.1.99999999999999.forged"},
        )
        assert signed.status_code == 401


def test_submit_passes_a_valid_traceparent_ignores_a_malformed_one_refuses_a_huge_one(
    stack: Stack,
) -> None:
    body = {"goal": "find three documents", "tools": [SEARCH.model_dump()]}
    valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    sent = {}
    for name, value in [("valid", valid), ("malformed", "00-not-a-trace-context")]:
        key = f"traced-{name}-{uuid.uuid4().hex}"
        answer = stack.http.post(
            "/runs", json=body, headers={"Idempotency-Key": key, "traceparent": value}
        )
        assert answer.status_code == 202, answer.text
        sent[name] = answer.json()["run_id"]
    huge = stack.http.post(
        "/runs",
        json=body,
        headers={"Idempotency-Key": f"traced-{uuid.uuid4().hex}", "traceparent": valid * 20},
    )
    assert huge.status_code == 400 and huge.json()["error"] == "invalid_header"

    headers: dict[str, dict[str, bytes]] = {}
    for r in read_raw(stack.bootstrap, topic_name(INBOX, stack.prefix)):
        if r.key is not None:  # each run's first input is its submit (answers follow it)
            headers.setdefault(r.key.decode(), dict(r.headers))
    # tracing is off here: the caller's context is passed on as it came, none is made up
    assert headers[sent["valid"]]["traceparent"] == valid.encode()
    assert "traceparent" not in headers[sent["malformed"]]


def test_submit_is_idempotent_and_the_result_arrives_through_the_results_consumer(
    stack: Stack,
) -> None:
    key = f"order-{uuid.uuid4().hex}"
    body = {"goal": "find three documents", "tools": [SEARCH.model_dump()]}
    first = stack.http.post("/runs", json=body, headers={"Idempotency-Key": key})
    again = stack.http.post("/runs", json=body, headers={"Idempotency-Key": key})
    assert (first.status_code, again.status_code) == (202, 200), (first.text, again.text)
    run_id = first.json()["run_id"]
    assert again.json()["run_id"] == run_id
    assert first.headers["location"] == f"/runs/{run_id}"
    other = stack.http.post("/runs", json={"goal": "other"}, headers={"Idempotency-Key": key})
    assert other.status_code == 422 and other.json()["error"] == "idempotency_key_reused"
    assert stack.http.post("/runs", json=body).status_code == 400
    bad = stack.http.post("/runs", json={"goal": 3}, headers={"Idempotency-Key": "k-" + key})
    assert bad.status_code == 422 and bad.json()["error"] == "invalid_task"

    with ResultsConsumer(
        stack.bootstrap, group_id=f"{stack.prefix}-results", prefix=stack.prefix
    ) as consumer:
        got = None
        for result in consumer.results(follow=True):
            if result.run_id == run_id:
                got = result
                break
    assert got is not None and got.status == "SUCCEEDED" and got.result_ref

    run = stack.wait_status(run_id, "SUCCEEDED")
    assert run["terminal"] and run["result"]["result_ref"] == got.result_ref
    assert run["result"]["content"] is not None
    assert set(run["waits"]) == {"system_ms", "tool_wait_ms", "user_wait_ms"}
    assert [o["status"] for o in run["operations"]] == ["SUCCEEDED"]
    events = stack.http.get(f"/runs/{run_id}/events").json()["events"]
    assert events[0]["type"] == "RunSubmitted" and events[0]["trace_id"] == run["trace_id"]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    submits = [e for e in events if e["type"] == "RunSubmitted"]
    assert len(submits) == 1  # the repeat was dropped
    assert stack.http.get("/runs/run-unknown").status_code == 404


def test_success_is_never_reported_before_the_terminal_state_is_committed(stack: Stack) -> None:
    run_ids = [stack.submit(f"race-{uuid.uuid4().hex}") for _ in range(4)]
    seen: dict[str, list[str]] = {r: [] for r in run_ids}
    checked: set[str] = set()

    def all_checked() -> bool:
        for run_id in run_ids:
            if run_id in checked:
                continue
            run = stack.http.get(f"/runs/{run_id}").json()
            seen[run_id].append(run["status"])
            if not run["terminal"]:
                assert run["result"] is None
                continue
            assert run["status"] == "SUCCEEDED" and run["result"]["result_ref"]
            # At the moment the API says SUCCEEDED, a read_committed reader already sees it.
            record = committed_result(stack.bootstrap, stack.prefix, run_id)
            assert record is not None and record["status"] == "SUCCEEDED", run_id
            assert record["result_ref"] == run["result"]["result_ref"]
            checked.add(run_id)
        return len(checked) == len(run_ids)

    wait_for(all_checked, 60, "every run to succeed", every=0)
    for statuses in seen.values():
        first_done = statuses.index("SUCCEEDED")
        assert all(s == "SUCCEEDED" for s in statuses[first_done:])
        assert "SUCCEEDED" not in statuses[:first_done]


def _waiting_question(stack: Stack, **policy: Any) -> tuple[str, dict[str, Any]]:
    run_id = stack.submit(
        f"approve-{uuid.uuid4().hex}",
        tools=[GUARDED.model_dump()],
        policy={"approval_required": ["write"], **policy},
    )
    run = stack.wait_status(run_id, "WAITING_USER")
    question = run["question"]
    assert question["kind"] == "approval" and question["resume_token"]
    assert question["content"]["approve"][0]["tool"] == "search_docs"
    assert run["waits"]["current"]["waiting_for"] == "user"
    return run_id, question


def test_replies_with_a_forged_or_reused_token_are_rejected_a_valid_one_is_consumed_once(
    stack: Stack,
) -> None:
    run_id, q = _waiting_question(stack)
    token = q["resume_token"]
    resume_key = Keys.derive(SECRET).resume
    claims = verify_token(resume_key, token)
    assert (claims.run_id, claims.token_id) == (run_id, q["token_id"])

    def reply(tok: str, response: dict[str, Any], run: str = run_id) -> httpx.Response:
        return stack.http.post(
            f"/runs/{run}/replies", json={"resume_token": tok, "response": response}
        )

    head, body, sig = token.split(".")
    forged = [
        f"{head}.{body}.{sig[:-2]}AA",  # tampered signature
        sign_token(b"another secret", claims),  # signed with the wrong key
        sign_token(SECRET, claims),  # signed with the root secret, not the resume-token key
        f"{head}.{sign_token(resume_key, claims).split('.')[1]}x.{sig}",  # tampered claims
        "not-a-token",
    ]
    for tok in forged:
        r = reply(tok, {"approved": True})
        assert r.status_code == 409 and r.json()["error"] == "token_forged", r.text
    other_run = reply(token, {"approved": True}, run="run-someone-else")
    assert other_run.status_code == 404  # not a run of the caller's tenant: nothing more said
    with stack.client(OPERATOR_TOKEN) as admin:  # an admin's, for every tenant's runs
        body = {"resume_token": token, "response": {"approved": True}}
        other_run = admin.post("/runs/run-someone-else/replies", json=body)
    assert other_run.status_code == 409 and other_run.json()["error"] == "token_forged"
    invalid = reply(token, {"approved": "yes"})
    assert invalid.status_code == 422 and invalid.json()["error"] == "response_invalid"

    # four clients race with the same valid token: exactly one reply is accepted
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: reply(token, {"approved": True}), range(4)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [202, 409, 409, 409], [r.text for r in answers]
    assert {r.json()["error"] for r in answers if r.status_code == 409} == {"token_used"}
    again = reply(token, {"approved": True})
    assert again.status_code == 409 and again.json()["error"] == "token_used"

    stack.wait_status(run_id, "SUCCEEDED")
    late = reply(token, {"approved": False})
    assert late.status_code == 409 and late.json()["error"] == "token_used"
    with psycopg.connect(stack.database_url) as conn:
        applied = conn.execute(
            "SELECT count(*) FROM events WHERE run_id = %s AND type = 'UserReplied'"
            " AND disposition = 'APPLIED'",
            (run_id,),
        ).fetchone()
    assert applied == (1,)


def test_a_reply_after_expiry_is_rejected(stack: Stack) -> None:
    run_id, q = _waiting_question(stack, user_wait_ms=1500)
    wait_for(lambda: now_ms() > q["expires_at"], timeout=10, what="the question to expire")
    r = stack.http.post(
        f"/runs/{run_id}/replies",
        json={"resume_token": q["resume_token"], "response": {"approved": True}},
    )
    assert r.status_code == 409 and r.json()["error"] == "token_expired", r.text
    assert stack.run(run_id)["status"] == "WAITING_USER"  # nothing reached the core


def _waiting_tool(stack: Stack) -> tuple[str, dict[str, Any]]:
    key = f"async-{uuid.uuid4().hex}"
    from agentruns.processors.ids import run_id_for_key

    stack.double.async_runs.add(run_id_for_key(key))
    run_id = stack.submit(key, tools=[SEARCH.model_dump(), REPORT.model_dump()])
    run = stack.wait_status(run_id, "WAITING_TOOL")
    [op] = run["operations"]
    assert op["tool"] == "long_report" and op["status"] == "ACCEPTED"
    return run_id, op


def test_cancel_during_a_long_async_tool(stack: Stack) -> None:
    run_id, _op = _waiting_tool(stack)
    r = stack.http.post(f"/runs/{run_id}/cancel", json={"reason": "user changed their mind"})
    assert r.status_code == 202, r.text
    run = stack.wait_status(run_id, "CANCELLED", "CANCEL_UNKNOWN")
    assert run["status"] == "CANCELLED"
    assert run["result"] is not None and run["operations"][0]["status"] == "CANCELLED"
    assert run["waits"]["tool_wait_ms"] >= 0
    again = stack.http.post(f"/runs/{run_id}/cancel", json={})
    assert again.status_code == 409 and again.json()["error"] == "run_terminal"
    assert stack.http.post("/runs/run-nobody/cancel", json={}).status_code == 404


def test_an_async_tool_callback_completes_the_operation(stack: Stack) -> None:
    run_id, op = _waiting_tool(stack)
    url, signed = signed_callback(stack.url, op)
    payload = {"key": op["op_key"], "status": "succeeded", "result": {"rows": 3}}
    with httpx.Client(timeout=10) as backend:  # a tool backend: no bearer token, a signature
        first = backend.post(url, json=payload, headers=signed)
        assert first.status_code == 202, first.text
        run = stack.wait_status(run_id, "SUCCEEDED")
        assert run["operations"][0]["status"] == "SUCCEEDED"
        repeat = backend.post(url, json=payload, headers=signed)
        assert repeat.status_code == 200 and repeat.json()["accepted"] is False
    # without its signature a callback needs an admin's credential
    refused = stack.http.post("/operations/no-such-op/callback", json={"status": "succeeded"})
    assert refused.status_code == 403
    with stack.client(OPERATOR_TOKEN) as admin:
        missing = admin.post("/operations/no-such-op/callback", json={"status": "succeeded"})
    assert missing.status_code == 404


def test_a_callback_signature_is_refused_on_another_dispatch_after_expiry_or_in_the_query(
    stack: Stack,
) -> None:
    """A callback signature binds the operation, its dispatch and an expiry, and travels in a
    header: replayed on another dispatch, after its expiry, for another operation, signed with
    the root secret, or put in the URL (where access logs keep it), it opens nothing."""
    run_id, op = _waiting_tool(stack)
    payload = {"key": op["op_key"], "status": "succeeded", "result": {"rows": 3}}
    url, good = signed_callback(stack.url, op)
    _, other_dispatch = signed_callback(stack.url, op, dispatch=op["dispatch"] + 1)
    _, expired = signed_callback(stack.url, op, expires_ms=int(time.time() * 1000) - 1)
    _, other_op = signed_callback(stack.url, {**op, "op_key": op["op_key"] + "x"})
    root = sign_callback(SECRET, op["op_key"], op["dispatch"], int(time.time() * 1000) + 60_000)
    with anonymous(stack.url) as backend:  # each request from an address of its own
        r = backend.post(url, json=payload, headers=other_dispatch)
        assert r.status_code == 403 and r.json()["error"] == "callback_other_dispatch", r.text
        for headers in (expired, other_op, {"X-Callback-Signature": root}):
            r = backend.post(url, json=payload, headers=headers)
            assert r.status_code == 401, (headers, r.text)
        in_query = backend.post(f"{url}?sig={good['X-Callback-Signature']}", json=payload)
        assert in_query.status_code == 401
        huge = backend.post(url, json=payload, headers={"X-Callback-Signature": "cb1." * 10_000})
        # 400 when the head reaches the server in pieces past h11's bound on an incomplete
        # event (16 KiB), 401 when it came whole and the signature was read and refused
        assert huge.status_code in (400, 401, 431), huge.status_code
        assert stack.http.get(f"/runs/{run_id}").json()["status"] == "WAITING_TOOL"
        taken = backend.post(url, json=payload, headers=good)
        assert taken.status_code == 202, taken.text
    assert stack.wait_status(run_id, "SUCCEEDED")["operations"][0]["status"] == "SUCCEEDED"


# --------------------------------------------------------------------------- hostile input


def _raw_http(url: str, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One request written byte for byte (what httpx refuses to send); the status and body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + b"\r\n\r\n" + body)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    status_line, _, rest = received.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _submit_head(key: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST /runs HTTP/1.1\r\nHost: api\r\nConnection: close\r\n"
        b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
        b"Content-Type: application/json\r\nIdempotency-Key: " + key + extra
    )


def _inbox_run_ids(stack: Stack) -> set[str]:
    return {
        str(r.value["run_id"])
        for r in read_all(stack.bootstrap, topic_name(INBOX, stack.prefix), "Input")
    }


def _stored(stack: Stack, run_ids: Iterable[str]) -> list[str]:
    with psycopg.connect(stack.database_url) as conn:
        rows = conn.execute(
            "SELECT run_id FROM api_inputs WHERE run_id = ANY(%s)", (list(run_ids),)
        ).fetchall()
    return [str(r[0]) for r in rows]


def test_a_body_over_the_limit_is_refused_with_413_and_a_good_task_is_accepted_after(
    stack: Stack,
) -> None:
    limit = MAX_BODY_BYTES
    # declared too large: refused from the headers, the body is never sent
    status, body = _raw_http(
        stack.url, _submit_head(b"huge-declared", f"\r\nContent-Length: {50 * limit}".encode())
    )
    assert status == 413 and json.loads(body)["reason"].startswith("invalid_input:body_too_large")
    # chunked, no length: counted while read, refused once over
    chunks = [b'{"goal": "' + b"x" * (limit // 2), b"x" * (limit // 2), b'"}']
    r = stack.http.post("/runs", content=iter(chunks), headers={"Idempotency-Key": "huge-chunked"})
    assert r.status_code == 413 and r.json()["error"] == "body_too_large"
    # under the body limit, but its record is over the broker's: 413 every time, not a 503
    messages = [{"role": "user", "content": "m" * 200_000} for _ in range(5)]
    key = f"huge-record-{uuid.uuid4().hex}"
    for _ in range(2):
        r = stack.http.post(
            "/runs",
            json={"goal": "g", "messages": messages},
            headers={"Idempotency-Key": key},
        )
        assert r.status_code == 413, r.text
        assert r.json()["reason"].startswith("invalid_input:record_too_large")
    refused = [run_id_for_key(k) for k in ("huge-declared", "huge-chunked", key)]
    good = stack.submit(f"good-after-413-{uuid.uuid4().hex}")
    stack.wait_status(good, "SUCCEEDED")
    assert _stored(stack, refused) == []
    assert not set(refused) & _inbox_run_ids(stack)


def test_a_task_the_core_would_refuse_gets_422_with_its_reason_and_nothing_is_produced(
    stack: Stack,
) -> None:
    search = SEARCH.model_dump()
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(70):
        deep = {"type": "object", "properties": {"x": deep}}
    cases: dict[str, tuple[bytes, str]] = {
        "duplicate": (
            json.dumps({"goal": "g", "tools": [search, search]}).encode(),
            "invalid_input:duplicate_tool",
        ),
        "schema": (
            json.dumps({"goal": "g", "tools": [{**search, "parameters": {"type": 12}}]}).encode(),
            "invalid_input:tool_schema",
        ),
        "schema-depth": (
            json.dumps({"goal": "g", "tools": [{**search, "parameters": deep}]}).encode(),
            "invalid_input:json_too_deep",
        ),
        "deadline": (
            json.dumps({"goal": "g", "budgets": {"deadline_at": 2**63}}).encode(),
            "invalid_input:integer_out_of_range",
        ),
        "type": (json.dumps({"goal": ["not", "text"]}).encode(), "invalid_input:task"),
        "unknown": (json.dumps({"goal": "g", "hue": "red"}).encode(), "invalid_input:task"),
        "latin-1": ('{"goal": "café"}'.encode("latin-1"), "invalid_input:encoding"),
        "nested": (b'{"goal": "g", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                   "invalid_input:json_too_deep"),
    }  # fmt: skip
    keys = {name: f"bad-{name}-{uuid.uuid4().hex}" for name in cases}
    for name, (body, reason) in cases.items():
        r = stack.http.post(
            "/runs",
            content=body,
            headers={"Idempotency-Key": keys[name], "Content-Type": "application/json"},
        )
        assert r.status_code == 422, (name, r.status_code, r.text)
        assert r.json()["reason"].startswith(reason), (name, r.json())
    good = stack.submit(f"good-after-422-{uuid.uuid4().hex}")
    stack.wait_status(good, "SUCCEEDED")
    refused = [run_id_for_key(k) for k in keys.values()]
    assert _stored(stack, refused) == []
    assert not set(refused) & _inbox_run_ids(stack)


def test_the_served_task_schema_is_the_generated_one_and_says_what_the_api_accepts(
    stack: Stack,
) -> None:
    spec = stack.http.get("/openapi.json").json()
    task, parts = task_schema_components("#/components/schemas/{name}")
    schemas = spec["components"]["schemas"]
    assert schemas["Task"] == task
    assert {name: schemas[name] for name in parts} == parts
    body = spec["paths"]["/runs"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/Task"}
    # the published file is the same schema, its references inside the file
    published = json.loads((DIRECTORY / "task.schema.json").read_text(encoding="utf-8"))
    assert published["properties"]["tools"]["items"] == {"$ref": "#/$defs/ToolSpec"}
    assert published["$defs"]["ToolSpec"] == schemas["ToolSpec"]

    served = Draft202012Validator({"$ref": "#/components/schemas/Task", **spec})
    valid = {
        "goal": "find three documents",
        "messages": [{"role": "user", "content": "three documents, please"}],
        "tools": [SEARCH.model_dump()],
        "policy": {"approval_required": ["admin"], "user_wait_ms": 60_000},
        "budgets": {"max_steps": 10, "max_tokens": 100_000},
        "loop": {"max_repeat_action": 2},
        "trace_id": "trace-" + uuid.uuid4().hex,
    }
    served.validate(valid)
    r = stack.http.post("/runs", json=valid, headers={"Idempotency-Key": uuid.uuid4().hex})
    assert r.status_code == 202, r.text
    assert r.json()["trace_id"] == valid["trace_id"]
    stack.wait_status(r.json()["run_id"], "SUCCEEDED")

    invalid = {
        "derived": {**valid, "run_id": "run-mine"},
        "tag": {**valid, "type": "RunSubmitted"},
        "tool-field": {**valid, "tools": [{**SEARCH.model_dump(), "endpoint": "http://x"}]},
        "role": {**valid, "messages": [{"role": "robot", "content": "hi"}]},
        "bound": {**valid, "budgets": {"max_steps": -1}},
        "trace": {**valid, "trace_id": 7},
    }
    for name, task_body in invalid.items():
        assert not served.is_valid(task_body), name
        r = stack.http.post("/runs", json=task_body, headers={"Idempotency-Key": uuid.uuid4().hex})
        assert r.status_code == 422, (name, r.status_code, r.text)
        assert r.json()["reason"].startswith("invalid_input:task"), (name, r.json())


def test_a_reply_nested_too_deep_or_too_large_is_refused_and_a_good_one_is_accepted(
    stack: Stack,
) -> None:
    run_id, q = _waiting_question(stack)
    deep: dict[str, Any] = {"approved": True}
    for _ in range(MAX_JSON_DEPTH):
        deep = {"approved": True, "why": deep}
    r = stack.http.post(
        f"/runs/{run_id}/replies", json={"resume_token": q["resume_token"], "response": deep}
    )
    assert r.status_code == 422 and r.json()["reason"].startswith("invalid_input:response_too_deep")
    big = {"approved": True, "why": "w" * MAX_BODY_BYTES}
    r = stack.http.post(
        f"/runs/{run_id}/replies", json={"resume_token": q["resume_token"], "response": big}
    )
    assert r.status_code == 413 and r.json()["reason"].startswith("invalid_input:body_too_large")
    r = stack.http.post(
        f"/runs/{run_id}/replies",
        json={"resume_token": q["resume_token"], "response": {"approved": True}},
    )
    assert r.status_code == 202, r.text
    stack.wait_status(run_id, "SUCCEEDED")


def test_headers_with_cr_lf_or_non_utf8_bytes_get_a_clean_4xx(stack: Stack) -> None:
    task = json.dumps({"goal": "g", "tools": [SEARCH.model_dump()]}).encode()
    length = f"\r\nContent-Length: {len(task)}".encode()
    heads = {
        "bare CR in a value": _submit_head(b"k-cr", b"\rX-Evil: 1" + length),
        "NUL in a value": _submit_head(b"k-\x00-nul", length),
        "non-UTF-8 key": _submit_head(b"k-\xff\xfe", length),
        "non-UTF-8 trace id": _submit_head(b"k-trace", b"\r\nX-Trace-Id: \xc3\x28" + length),
        "non-UTF-8 token": _submit_head(b"k-auth", b"\r\nAuthorization: Bearer \xff" + length),
        "non-UTF-8 query": b"POST /operations/op-1/callback?x=\xff\xfe HTTP/1.1\r\nHost: api"
        + length,
        "non-ASCII callback signature": b"POST /operations/op-1/callback HTTP/1.1\r\nHost: api"
        + b"\r\nX-Callback-Signature: cb1.\xff\xfe"
        + length,
    }
    for name, head in heads.items():
        status, body = _raw_http(stack.url, head, task)
        assert 400 <= status < 500, (name, status, body)
    # A bare LF ends a header line (RFC 9112 lets a server accept it): what follows it is a
    # header of its own, never part of the key; a line folded over LF is one value joined by a
    # space. Either way no LF reaches the key.
    key = f"k-lf-{uuid.uuid4().hex}"
    for head, seen in [
        (_submit_head(key.encode() + b"\nX-Evil: 1", length), key),
        (_submit_head(key.encode() + b"\n folded", length), key + " folded"),
    ]:
        status, body = _raw_http(stack.url, head, task)
        assert status == 202 and json.loads(body)["run_id"] == run_id_for_key(seen), body
    good = stack.submit(f"good-after-headers-{uuid.uuid4().hex}")
    stack.wait_status(good, "SUCCEEDED")


def test_a_callback_or_cancel_outside_the_limits_is_refused_and_a_good_one_is_taken(
    stack: Stack,
) -> None:
    run_id, op = _waiting_tool(stack)
    url, signed = signed_callback(stack.url, op)
    with httpx.Client(timeout=10) as backend:
        for retry in (2**70, -1, "soon"):
            bad = {"status": "failed", "error_class": "TRANSIENT", "retry_after_ms": retry}
            r = backend.post(url, json=bad, headers=signed)
            assert r.status_code == 422, r.text
            assert r.json()["reason"].startswith("invalid_input:retry_after_ms")
    r = stack.http.post(f"/runs/{run_id}/cancel", json={}, headers={"Idempotency-Key": "k" * 201})
    assert r.status_code == 400 and r.json()["error"] == "invalid_header"
    r = stack.http.post(f"/runs/{run_id}/cancel", json={}, headers={"Idempotency-Key": "k1"})
    assert r.status_code == 202, r.text
    assert stack.wait_status(run_id, "CANCELLED")["operations"][0]["status"] == "CANCELLED"
    with psycopg.connect(stack.database_url) as conn:
        kinds = [k for (k,) in conn.execute(
            "SELECT kind FROM api_inputs WHERE run_id = %s ORDER BY kind", (run_id,)
        )]  # fmt: skip
    assert kinds == ["CancelRequested", "RunSubmitted"]


def test_a_submission_refused_on_kafka_answers_pending_with_its_dead_letter(stack: Stack) -> None:
    """A producer writing straight to the inbox (not through this API) submits a task whose body
    the core refuses: GET /runs/{id} answers PENDING with the reason once the sink has
    projected the dead letter, not 404; a run id nobody submitted stays a 404."""
    run_id = run_id_for_key(f"refused-on-kafka-{uuid.uuid4().hex}")
    event = submitted(run_id)
    record = input_record(event, producer_id="node-client", producer_seq=1)
    body = json.loads(record["body"])
    del body["goal"]  # a task without its goal
    record["body"] = json.dumps(body)
    inbox = Inbox(stack.bootstrap, stack.prefix, PARTITIONS)
    try:
        inbox.send(record)
        inbox.flush()
    finally:
        inbox.close()
    seen: dict[str, Any] = {}

    def refused() -> bool:
        # a submission refused before it named its tenant is an admin's to see
        with stack.client(OPERATOR_TOKEN) as admin:
            answer = admin.get(f"/runs/{run_id}")
        if answer.status_code == 404:  # the sink has not projected the dead letter yet
            return False
        assert answer.status_code == 200, answer.text
        seen.update(answer.json())
        return bool(seen["dead_letters"])

    wait_for(refused, timeout=60, what="the refusal in the run's view", every=0.2)
    assert seen["status"] == "PENDING" and seen["terminal"] is False and seen["result"] is None
    (dead,) = seen["dead_letters"]
    assert dead["error_class"] == "INVALID_EVENT" and "goal" in dead["reason"]
    assert dead["source_topic"] == topic_name(INBOX, stack.prefix)
    assert dead["source_partition"] == partition_for(run_id, PARTITIONS)
    assert isinstance(dead["at"], int) and dead["at"] >= event.at
    assert stack.http.get(f"/runs/{run_id}").status_code == 404  # not the tenant's own
    never = stack.http.get(f"/runs/{run_id_for_key(uuid.uuid4().hex)}")
    assert never.status_code == 404 and never.json()["error"] == "run_not_found"

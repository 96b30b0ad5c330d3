"""The console over plain HTTP: its pages refuse without a session, every form needs its CSRF
token, and what runs, tools and dead letters carry is shown as text, never run as markup."""

from __future__ import annotations

import uuid

import httpx
import psycopg
from agentruns.connectors.postgres.artifacts import StoredArtifact
from agentruns.streams.kafka_defaults import client_settings
from agentruns.streams.topics import INBOX, topic_name
from confluent_kafka import Producer

from tests.support.api import TOKEN, Stack
from tests.support.console import csrf_of, logged_in
from tests.support.waiting import wait_for

HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def test_every_page_refuses_without_a_session_and_the_api_refuses_a_session(stack: Stack) -> None:
    run_id = stack.submit(f"console-anon-{uuid.uuid4().hex}")
    pages = ["/ui/runs", f"/ui/runs/{run_id}", "/ui/dead-letters", "/ui/artifacts/sha256:00"]
    forms = [f"/ui/runs/{run_id}/reply", f"/ui/runs/{run_id}/cancel", "/ui/logout"]
    forged = {"agentruns_console": "99999999999999.nonce.forged"}
    for cookies in ({}, forged):
        with httpx.Client(base_url=stack.url, timeout=30, cookies=cookies) as anon:
            for path in pages:
                r = anon.get(path)
                assert r.status_code == 303 and r.headers["location"] == "/ui/login", path
                live = anon.get(path, headers={"X-Console-Fragment": "live"})
                assert live.status_code == 401 and run_id not in live.text, path
            for path in forms:
                assert anon.post(path, data={"csrf": "x"}).status_code == 401, path
    with logged_in(stack) as console:
        # the session opens the console only: the JSON API still wants the bearer token
        assert console.get("/runs").status_code == 401
        assert console.get(f"/runs/{run_id}").status_code == 401
        page = console.get(f"/ui/runs/{run_id}")
        assert page.status_code == 200 and run_id in page.text
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        logout = console.post("/ui/logout", data={"csrf": csrf_of(page.text)})
        assert logout.status_code == 303
        assert console.get("/ui/runs").status_code == 303


def test_login_sets_an_httponly_strict_cookie_and_needs_the_token_and_its_csrf(
    stack: Stack,
) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        form = client.get("/ui/login")
        csrf = csrf_of(form.text)
        assert client.post("/ui/login", data={"token": TOKEN}).status_code == 403
        assert client.post("/ui/login", data={"token": TOKEN, "csrf": "x"}).status_code == 403
        wrong = client.post("/ui/login", data={"token": "nope", "csrf": csrf})
        assert wrong.status_code == 401 and "agentruns_console=" not in wrong.headers.get(
            "set-cookie", ""
        )
        ok = client.post("/ui/login", data={"token": TOKEN, "csrf": csrf})
        assert ok.status_code == 303
        cookie = next(
            c for c in ok.headers.get_list("set-cookie") if c.startswith("agentruns_console=")
        )
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie


def test_a_form_without_its_csrf_token_changes_nothing(stack: Stack) -> None:
    run_id = stack.submit(
        f"console-csrf-{uuid.uuid4().hex}",
        tools=[{"name": "search_docs", "permission": "write"}],
        policy={"approval_required": ["write"]},
    )
    stack.wait_status(run_id, "WAITING_USER")
    with logged_in(stack) as console:
        page = console.get(f"/ui/runs/{run_id}").text
        token = page.split('name="resume_token" value="')[1].split('"')[0]
        for data in ({}, {"csrf": "forged"}, {"csrf": csrf_of(page) + "x"}):
            reply = {"resume_token": token, "field.approved": "true", **data}
            assert console.post(f"/ui/runs/{run_id}/reply", data=reply).status_code == 403
            assert console.post(f"/ui/runs/{run_id}/cancel", data=data).status_code == 403
    with psycopg.connect(stack.database_url) as conn:
        inputs = conn.execute(
            "SELECT kind FROM api_inputs WHERE run_id = %s ORDER BY created_at", (run_id,)
        ).fetchall()
    assert inputs == [("RunSubmitted",)]
    assert stack.run(run_id)["status"] == "WAITING_USER"


def test_goals_tool_results_and_dead_letters_render_as_text(stack: Stack) -> None:
    run_id = stack.submit(f"console-xss-{uuid.uuid4().hex}", goal=f"find {HOSTILE}")
    stack.wait_status(run_id, "SUCCEEDED")
    artifact = StoredArtifact.of(f'{{"output": "{HOSTILE.replace(chr(34), "")}"}}', "text/plain")
    with psycopg.connect(stack.database_url) as conn:
        conn.execute(
            "INSERT INTO artifacts (ref, media_type, size_bytes, content) VALUES (%s, %s, %s, %s)"
            " ON CONFLICT (ref) DO NOTHING",
            (artifact.ref, artifact.media_type, 10, artifact.content.encode()),
        )
    bad = b"\x00\xff" + HOSTILE.encode() + b"\x1b[31m"
    producer = Producer({"bootstrap.servers": stack.bootstrap, **client_settings()})
    producer.produce(topic_name(INBOX, stack.prefix), key=b"<b>key</b>", value=bad, partition=0)
    assert producer.flush(30) == 0
    with logged_in(stack) as console:
        pages = [
            console.get("/ui/runs", params={"q": run_id}).text,
            console.get(f"/ui/runs/{run_id}").text,
            console.get(f"/ui/artifacts/{artifact.ref}").text,
        ]
        for html in pages:
            assert "<script>alert" not in html and "<img src=x" not in html
            assert "&lt;script&gt;alert(" in html
        found: dict[str, str] = {}

        def dead_lettered() -> bool:
            found["html"] = console.get("/ui/dead-letters").text
            return "onerror=alert(1)" in found["html"]

        wait_for(dead_lettered, 60, "the bad input on the dead-letter page")
        html = found["html"]
        assert "<script>alert" not in html and "<img src=x" not in html and "<b>key" not in html
        assert "&lt;script&gt;alert(" in html and "00 ff 3c 73 63 72 69 70 74 3e" in html
        assert "\x1b" not in html and "\x00" not in html

"""The console over plain HTTP: its pages refuse without a session, every form needs its CSRF
token, wrong tokens are rate-limited per address, cookies are Secure over https, and what runs,
tools and dead letters carry is shown as text, never run as markup. Dead letters come from the
sink's projection of the DLQ (once each, bounded), a run page lists the frozen context chain, the
runs page's step latency comes from the events table."""

from __future__ import annotations

import json
import random
import re
import time
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import psycopg
from confluent_kafka import Consumer, Producer, TopicPartition

from agentruns.connectors.api.console import CHARTS_TTL_MS, MAX_STEPS
from agentruns.connectors.api.queries import step_latency
from agentruns.connectors.postgres.artifacts import StoredArtifact
from agentruns.connectors.projection.rows import STORED_BYTES, UNDECODABLE, run_row
from agentruns.processors.state import RunState
from agentruns.streams import dlq
from agentruns.streams.clock import ms_of
from agentruns.streams.codec import encode
from agentruns.streams.kafka_defaults import client_settings
from agentruns.streams.topics import DLQ, INBOX, topic_name
from tests.support.api import OPERATOR_TOKEN, TOKEN, Stack
from tests.support.console import csrf_of, logged_in
from tests.support.runlog import running_sink
from tests.support.waiting import wait_for

SECURE = re.compile(r";\s*secure\b", re.IGNORECASE)
HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def test_every_page_refuses_without_a_session_and_the_api_refuses_a_session(stack: Stack) -> None:
    run_id = stack.submit(f"console-anon-{uuid.uuid4().hex}")
    pages = [
        "/ui/runs",
        f"/ui/runs/{run_id}",
        f"/ui/runs/{run_id}/transcript",
        "/ui/dead-letters",
        "/ui/tools",
        "/ui/artifacts/sha256:00",
    ]
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
    with logged_in(stack, OPERATOR_TOKEN) as console:
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


def _login_form(client: httpx.Client, **headers: str) -> str:
    return csrf_of(client.get("/ui/login", headers=headers).text)


def test_wrong_tokens_are_limited_per_address_and_cookies_are_secure_over_https(
    stack: Stack,
) -> None:
    # uvicorn takes the client address and scheme from X-Forwarded-* sent by 127.0.0.1 (its
    # default trusted proxy): the addresses here are other tests' neighbours, not 127.0.0.1
    address = f"203.0.113.{random.randrange(1, 255)}"
    nope = uuid.uuid4().hex  # a guess of its own: wrong tokens count per prefix too
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        csrf = _login_form(client)
        for _ in range(5):
            wrong = client.post(
                "/ui/login",
                data={"token": nope, "csrf": csrf},
                headers={"X-Forwarded-For": address},
            )
            assert wrong.status_code == 401
        for token in (nope, TOKEN):  # refused before the token is compared
            limited = client.post(
                "/ui/login",
                data={"token": token, "csrf": csrf},
                headers={"X-Forwarded-For": address},
            )
            assert limited.status_code == 429 and 1 <= int(limited.headers["retry-after"]) <= 60
            assert "agentruns_console=" not in limited.headers.get("set-cookie", "")
        plain = client.post("/ui/login", data={"token": TOKEN, "csrf": csrf})
        assert plain.status_code == 303  # another address logs in
        cookie = next(c for c in plain.headers.get_list("set-cookie") if "agentruns_console=" in c)
        assert not SECURE.search(cookie)
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        https = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "198.51.100.9"}
        form = client.get("/ui/login", headers=https)
        assert all(SECURE.search(c) for c in form.headers.get_list("set-cookie"))
        # a client sends a Secure cookie over https only: sent here by hand
        nonce = form.cookies["agentruns_console_login"]
        ok = client.post(
            "/ui/login",
            data={"token": TOKEN, "csrf": csrf_of(form.text)},
            headers={**https, "Cookie": f"agentruns_console_login={nonce}"},
        )
        assert ok.status_code == 303
        cookies = ok.headers.get_list("set-cookie")
        assert cookies and all(SECURE.search(c) for c in cookies)


def _dlq_ends(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "dlq-ends"})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), 10)[1] for p in partitions
        }
    finally:
        consumer.close()


def test_dead_letters_are_projected_once_bounded_and_paged_newest_first(
    stack: Stack, database_url: str
) -> None:
    tag = uuid.uuid4().hex[:10]
    source = f"hostile-source-{tag}"
    huge = b"\xff\xfe<script>alert(1)</script>" + bytes(range(256)) * 1200  # ~300 KB
    hostile = dlq.dead_letter(
        f'<script>alert("dl")</script> \x00 marker-{tag}',
        f"HOSTILE_{tag}",
        source,
        0,
        7,
        b"<b>key</b>",
        huge,
        [("h", b"\x00")],
        ms_of(datetime.now(UTC)) or 0,
        run_id=f"<i>run</i>{tag}",
    )
    garbage = b"\x00\xffnot a dead letter <script>" + tag.encode()
    dlq_topic = topic_name(DLQ, stack.prefix)
    producer = Producer({"bootstrap.servers": stack.bootstrap, **client_settings()})
    for _ in range(2):  # written twice, as an adapter that crashed before its commit does
        producer.produce(dlq_topic, key=b"<b>key</b>", value=encode("DeadLetter", hostile))
    producer.produce(dlq_topic, key=None, value=garbage)
    paged = f"PAGED_{tag}"
    for i in range(105):
        record = dlq.dead_letter(
            f"paged {i}", paged, f"paged-{tag}", 0, i, None, b"x", [], 1000 + i
        )
        producer.produce(dlq_topic, value=encode("DeadLetter", record))
    assert producer.flush(30) == 0

    def rows() -> list[tuple[object, ...]]:
        with psycopg.connect(database_url) as conn:
            return conn.execute(
                "SELECT source_offset, reason, error_class, run_id, original_key, key_bytes,"
                " original_value, value_bytes FROM dead_letters WHERE source_topic = %s"
                " OR (source_topic = %s AND original_value = %s) OR error_class = %s",
                (source, dlq_topic, garbage, paged),
            ).fetchall()

    wait_for(lambda: len(rows()) >= 107, 60, "the dead letters in Postgres")
    # a sink that lost its offsets (a new group) reads the whole DLQ again: still one row each
    ends = _dlq_ends(stack.bootstrap, dlq_topic)
    again = f"{stack.prefix}-again"
    with running_sink(stack.bootstrap, database_url, stack.prefix, group_id=again):

        def reread() -> bool:
            with psycopg.connect(database_url) as conn:
                stored = dict(
                    conn.execute(
                        "SELECT partition, next_offset FROM sink_offsets"
                        " WHERE consumer = %s AND topic = %s",
                        (again, dlq_topic),
                    ).fetchall()
                )
            return all(stored.get(p, 0) >= high - 1 for p, high in ends.items() if high)

        wait_for(reread, 60, "a second sink to read the DLQ to its end")
    found = rows()
    assert len(found) == 107
    mine = [r for r in found if r[2] == f"HOSTILE_{tag}"]
    assert len(mine) == 1
    offset, reason, _, run_id, key, key_bytes, value, value_bytes = mine[0]
    assert offset == 7 and "\x00" not in str(reason) and f"marker-{tag}" in str(reason)
    assert run_id == f"<i>run</i>{tag}" and key == b"<b>key</b>" and key_bytes == 10
    assert value == huge[:STORED_BYTES] and value_bytes == len(huge)
    undecodable = [r for r in found if str(r[1]).startswith(UNDECODABLE)]
    assert len(undecodable) == 1 and undecodable[0][6] == garbage

    with logged_in(stack, OPERATOR_TOKEN) as console:
        html = console.get("/ui/dead-letters", params={"reason": f"marker-{tag}"}).text
        assert html.count("<tr>") == 2  # the header and the one dead letter
        assert "<script>alert" not in html and "<b>key" not in html and "<i>run" not in html
        assert "&lt;script&gt;alert(&#34;dl&#34;)" in html and f"{len(huge)} bytes" in html
        assert "ff fe 3c 73 63 72 69 70 74 3e" in html and "\x00" not in html
        by_class = console.get("/ui/dead-letters", params={"reason": f"HOSTILE_{tag}"}).text
        assert f"marker-{tag}" in by_class
        first = console.get("/ui/dead-letters", params={"reason": paged}).text
        shown = re.findall(r"paged (\d+)<", first)
        assert shown == [str(i) for i in range(104, 4, -1)]  # newest first, 100 a page
        older = re.search(r'href="([^"]+)" id="older"', first)
        assert older is not None
        rest = console.get("/ui/dead-letters" + older.group(1).replace("&amp;", "&")).text
        assert re.findall(r"paged (\d+)<", rest) == ["4", "3", "2", "1", "0"]
        assert 'id="older"' not in rest
        forged = console.get("/ui/dead-letters", params={"cursor": "forged"})
        assert forged.status_code == 400


def test_a_run_page_lists_the_context_output_and_results_of_its_newest_steps(
    stack: Stack, database_url: str
) -> None:
    run_id = stack.submit(f"console-steps-{uuid.uuid4().hex}")
    stack.wait_status(run_id, "SUCCEEDED")
    with logged_in(stack) as console:
        html = console.get(f"/ui/runs/{run_id}").text
        table = html.split('id="steps"')[1].split("</table>")[0]
        contexts = re.findall(r'href="/ui/artifacts/(sha256:[0-9a-f]{64})">context<', table)
        assert len(contexts) == stack.run(run_id)["step"] >= 2
        for ref in contexts:
            assert (
                f"&#34;run_id&#34;: &#34;{run_id}&#34;" in console.get(f"/ui/artifacts/{ref}").text
            )
        assert "model output" in table and 'id="older-steps"' not in html
        # each model answer's row in the timeline shows the tokens it used
        with psycopg.connect(database_url) as conn:
            usages = [
                row[0]
                for row in conn.execute(
                    "SELECT payload -> 'usage' FROM events"
                    " WHERE run_id = %s AND type = 'ModelCallCompleted' ORDER BY seq",
                    (run_id,),
                )
            ]
        timeline = html.split('id="timeline"')[1].split("</table>")[0]
        cells = re.findall(r'<td class="tokens">([^<]*)</td>', timeline)
        shown = [c for c in cells if c]
        assert shown == [f"{u['input_tokens']} in · {u['output_tokens']} out" for u in usages]
        assert len(usages) >= 2 and len(cells) > len(shown)  # other events show none

        # a chain longer than the page shows: the newest MAX_STEPS steps and a note
        with psycopg.connect(database_url) as conn:
            previous = None
            for step in range(1, MAX_STEPS + 6):
                result = StoredArtifact.of(json.dumps({"output": f"result {step}"}))
                context = StoredArtifact.of(
                    json.dumps(
                        {
                            "run_id": run_id,
                            "step": step,
                            "previous_context": previous,
                            "previous_candidate": None,
                            "inputs": [result.ref],
                        }
                    )
                )
                for a in (result, context):
                    conn.execute(
                        "INSERT INTO artifacts (ref, media_type, size_bytes, content)"
                        " VALUES (%s, %s, %s, %s) ON CONFLICT (ref) DO NOTHING",
                        (a.ref, a.media_type, len(a.content), a.content.encode()),
                    )
                previous = context.ref
            row = conn.execute(
                "SELECT state, last_seq FROM runs WHERE run_id = %s", (run_id,)
            ).fetchone()
            assert row is not None and previous is not None
            long_id = f"{run_id}-long"
            state = RunState.model_validate_json(row[0]).model_copy(
                update={"run_id": long_id, "context_ref": previous, "step": MAX_STEPS + 5}
            )
            values = run_row(state, int(row[1]))
            marks = ", ".join(["%s"] * len(values))
            conn.execute(
                f"INSERT INTO runs ({', '.join(values)}) VALUES ({marks})", list(values.values())
            )
        html = console.get(f"/ui/runs/{long_id}").text
        table = html.split('id="steps"')[1].split("</table>")[0]
        steps = re.findall(r"<tr><td>(\d+)</td>", table)
        assert steps == [str(s) for s in range(MAX_STEPS + 5, 5, -1)]
        assert table.count(">result 1<") >= MAX_STEPS - 1  # each older step's tool result
        assert "step 5 and before" in html


def test_a_transcript_shows_each_step_of_a_run_as_text(stack: Stack, database_url: str) -> None:
    """The transcript lists every step of a finished run: the goal the model saw (as text),
    each answer with its tokens, each tool call of the operations table, budgets so far."""
    run_id = stack.submit(f"console-transcript-{uuid.uuid4().hex}", goal=f"find {HOSTILE}")
    stack.wait_status(run_id, "SUCCEEDED")
    with psycopg.connect(database_url) as conn:
        answers = conn.execute(
            "SELECT step, payload -> 'usage' FROM events"
            " WHERE run_id = %s AND type = 'ModelCallCompleted' AND disposition = 'APPLIED'"
            " ORDER BY seq",
            (run_id,),
        ).fetchall()
        tools = conn.execute(
            "SELECT step, tool FROM operations WHERE run_id = %s ORDER BY seq", (run_id,)
        ).fetchall()
        last_step = conn.execute(
            "SELECT max(step) FROM events WHERE run_id = %s", (run_id,)
        ).fetchone()
    assert last_step is not None and len(answers) >= 2 and tools
    with logged_in(stack) as console:
        page = console.get(f"/ui/runs/{run_id}")
        assert f'href="/ui/runs/{run_id}/transcript"' in page.text
        r = console.get(f"/ui/runs/{run_id}/transcript")
        assert r.status_code == 200
        html = r.text
        assert "<script>alert" not in html and "<img src=x" not in html
        shown = re.findall(r'<section class="step[^"]*" id="step-(\d+)"', html)
        assert shown == [str(n) for n in range(1, int(last_step[0]) + 1)]
        first = html.split('id="step-1"')[1].split("</section>")[0]
        assert "The model saw" in first and "&lt;script&gt;alert(" in first
        assert html.count("The model answered") == int(last_step[0])
        for step, tool in tools:
            section = html.split(f'id="step-{step}"')[1].split("</section>")[0]
            assert f"<code>{tool}</code>" in section
        total = sum(int(u["input_tokens"]) + int(u["output_tokens"]) for _, u in answers)
        assert f"{total} tokens, {len(tools)} tool calls so far" in html
        assert console.get("/ui/runs/no-such-run/transcript").status_code == 404


def test_step_latency_is_per_minute_from_the_events_of_each_step(
    stack: Stack, database_url: str
) -> None:
    # a time of its own, far from every other test's events
    now = datetime(2001, 1, 1, tzinfo=UTC) + timedelta(minutes=random.randrange(500_000))
    run_id = f"latency-{uuid.uuid4().hex}"
    start = now - timedelta(minutes=30, seconds=30)
    # (step, seconds after start): step 1 takes 1 s, 2 takes 3 s, 3 takes 6 s, 4 is 90 min
    # after the end of 3 (a step whose predecessor ended before the window is left out)
    events = [(1, 0), (1, 1), (2, 2), (2, 4), (3, 10)]
    with psycopg.connect(database_url) as conn:
        for seq, (step, seconds) in enumerate(events, 1):
            conn.execute(
                "INSERT INTO events (run_id, seq, event_id, type, step, attempt, trace_id, at,"
                " disposition, status, payload) VALUES"
                " (%s, %s, %s, 'ToolCallSucceeded', %s, 1, 't', %s, 'APPLIED', 'READY', '{}')",
                (run_id, seq, f"e{seq}", step, start + timedelta(seconds=seconds)),
            )
        old = f"{run_id}-old"
        for seq, (step, at) in enumerate([(3, now - timedelta(minutes=150)), (4, now)], 1):
            conn.execute(
                "INSERT INTO events (run_id, seq, event_id, type, step, attempt, trace_id, at,"
                " disposition, status, payload) VALUES"
                " (%s, %s, %s, 'ToolCallSucceeded', %s, 1, 't', %s, 'APPLIED', 'READY', '{}')",
                (old, seq, f"e{seq}", step, at),
            )
        per_minute = step_latency(conn, ms_of(now) or 0)
    assert [(slot, n) for slot, _, _, n in per_minute] == [(29, 3)]
    _, p50, p95, _ = per_minute[0]
    assert (round(p50, 3), round(p95, 3)) == (3000, 5700)  # of 1 s, 3 s and 6 s
    with logged_in(stack, OPERATOR_TOKEN) as console:
        stack.wait_status(stack.submit(f"console-latency-{uuid.uuid4().hex}"), "SUCCEEDED")
        deadline = time.monotonic() + CHARTS_TTL_MS / 1000 + 10  # charts made a moment ago
        while True:
            page = console.get("/ui/runs").text
            chart = page.split('id="step-latency"')[1].split("</svg>")[0]
            if ('class="dot p50"' in chart and 'class="dot p95"' in chart) or (
                time.monotonic() > deadline
            ):
                break
            time.sleep(1.0)
        assert 'class="dot p50"' in chart and 'class="dot p95"' in chart

"""The example tool server over real loopback HTTP (no broker needed)."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentruns.connectors.dev.servers import tool_server
from agentruns.connectors.dev.servers.httpserver import ServerHandle
from agentruns.connectors.dev.servers.latency import LatencyParams
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    handle = tool_server.serve("127.0.0.1", 0, report_delay_ms=50)
    yield handle
    handle.close()


@pytest.fixture
def client(server: ServerHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=5.0) as c:
        c.post("/reset").raise_for_status()
        yield c


def call(
    client: httpx.Client,
    tool: str,
    args: dict[str, Any],
    key: str,
    fault: str | None = None,
    **headers: str,
) -> httpx.Response:
    h = {"Idempotency-Key": key, **headers}
    if fault:
        h["X-Fault"] = fault
    return client.post(f"/tools/{tool}", json=args, headers=h)


def executions(client: httpx.Client, key: str) -> int:
    count = client.get(f"/executions/{key}").json()["count"]
    assert isinstance(count, int)
    return count


TICKET = {"title": "Printer offline", "priority": "high"}


def test_registry_matches_the_server() -> None:
    registry = json.loads((tool_server.DEFAULT_REGISTRY).read_text())
    assert registry["version"]
    names = {t["name"] for t in registry["tools"]}
    assert {"create_ticket", "update_record", "send_email", "search_docs", "run_report"} <= names
    for tool in registry["tools"]:
        assert tool["endpoint"] == f"/tools/{tool['name']}" and tool["method"] == "POST"
        assert tool["idempotent"] is True and tool["permission"] in ("read", "write", "admin")
        assert tool["status_url_template"] == "/operations/{key}"
        assert tool["parameters"]["type"] == "object" and tool["timeout_ms"] > 0
        assert bool(tool["cancel_url_template"]) == tool["async"]


def test_same_key_executes_once(client: httpx.Client) -> None:
    first = call(client, "send_email", {"to": "a@example.com", "subject": "s", "body": "b"}, "k1")
    second = call(client, "send_email", {"to": "a@example.com", "subject": "s", "body": "b"}, "k1")
    assert first.status_code == second.status_code == 200
    assert first.json() == second.json()
    assert first.json()["result"]["message_id"].startswith("M-")
    assert "idempotency-replayed" not in first.headers
    assert second.headers["idempotency-replayed"] == "true"
    assert executions(client, "k1") == 1
    stats = client.get("/stats").json()
    assert stats["executions"] == {"k1": 1} and stats["calls"] == {"k1": 2}
    assert stats["outbox"] == 1 and stats["duplicates"] == 1


def test_concurrent_calls_with_one_key_execute_once(server: ServerHandle) -> None:
    with httpx.Client(base_url=server.url) as c:
        c.post("/reset")
    results: list[int] = []

    def worker() -> None:
        with httpx.Client(base_url=server.url) as c:
            results.append(call(c, "create_ticket", TICKET, "same").status_code)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 8
    with httpx.Client(base_url=server.url) as c:
        assert executions(c, "same") == 1
        assert c.get("/stats").json()["tickets"] == 1


def test_key_reused_with_other_arguments_is_refused(client: httpx.Client) -> None:
    assert call(client, "create_ticket", TICKET, "k").status_code == 200
    r = call(client, "create_ticket", {**TICKET, "title": "other"}, "k")
    assert r.status_code == 422 and r.json()["error"] == "idempotency_key_reused"
    assert executions(client, "k") == 1


def test_bad_requests(client: httpx.Client) -> None:
    assert client.post("/tools/create_ticket", json=TICKET).status_code == 400  # no key
    assert call(client, "no_such_tool", {}, "k").status_code == 404
    r = call(client, "create_ticket", {"title": 3}, "k")
    assert r.status_code == 422 and r.json()["error"] == "invalid_arguments"
    assert executions(client, "k") == 0


def test_late_answer_executes_once_although_the_client_timed_out(client: httpx.Client) -> None:
    with pytest.raises(httpx.ReadTimeout):
        client.post(
            "/tools/create_ticket",
            json=TICKET,
            headers={"Idempotency-Key": "late-1", "X-Fault": "late; delay_ms=1000"},
            timeout=0.2,
        )
    wait_for(lambda: executions(client, "late-1") == 1)
    looked_up = client.get("/operations/late-1")
    assert looked_up.status_code == 200 and looked_up.json()["status"] == "succeeded"
    resent = call(client, "create_ticket", TICKET, "late-1")
    assert resent.status_code == 200 and resent.headers["idempotency-replayed"] == "true"
    assert resent.json()["result"] == looked_up.json()["result"]
    assert executions(client, "late-1") == 1


def test_drop_closes_without_executing(client: httpx.Client) -> None:
    with pytest.raises(httpx.RemoteProtocolError):
        call(client, "create_ticket", TICKET, "drop-1", fault="drop")
    assert client.get("/operations/drop-1").status_code == 404  # confirmed not executed
    assert call(client, "create_ticket", TICKET, "drop-1").status_code == 200  # safe to resend
    assert executions(client, "drop-1") == 1


def test_drop_after_executes_but_loses_the_answer(client: httpx.Client) -> None:
    with pytest.raises(httpx.RemoteProtocolError):
        call(client, "create_ticket", TICKET, "drop-2", fault="drop_after")
    assert client.get("/operations/drop-2").json()["status"] == "succeeded"
    assert executions(client, "drop-2") == 1


def test_status_lookup_not_found_found_and_cannot_tell(client: httpx.Client) -> None:
    missing = client.get("/operations/op-1")
    assert missing.status_code == 404 and missing.json()["executed"] is False
    call(client, "create_ticket", TICKET, "op-1")
    found = client.get("/operations/op-1")
    assert found.status_code == 200
    assert found.json()["status"] == "succeeded" and found.json()["result"]["ticket_id"]
    assert found.json()["executions"] == 1
    r = client.get("/operations/op-1", headers={"X-Fault": "unknown"})
    assert r.status_code == 503 and r.json()["status"] == "unknown"
    # a rule makes the look-up undeterminable for callers that cannot send headers
    client.post("/faults", json={"target": "operations", "kind": "unknown", "key": "op-1"})
    assert client.get("/operations/op-1").status_code == 503
    assert client.get("/operations/op-1").status_code == 200  # times=1 by default


def test_keys_with_reserved_characters(client: httpx.Client) -> None:
    key = "run-7:3/a b"
    assert call(client, "create_ticket", TICKET, key).status_code == 200
    assert client.get("/operations/run-7%3A3%2Fa%20b").json()["key"] == key


@pytest.mark.parametrize(
    ("fault", "status", "error"),
    [
        ("403", 403, "permission_denied"),
        ("409", 409, "stale_version"),
        ("429; retry_after=3", 429, "rate_limited"),
        ("300", 300, "ambiguous"),
        ("500", 500, "internal"),
    ],
)
def test_status_faults_execute_nothing(
    client: httpx.Client, fault: str, status: int, error: str
) -> None:
    r = call(client, "create_ticket", TICKET, "f-1", fault=fault)
    assert r.status_code == status and r.json()["error"] == error
    if status == 429:
        assert r.headers["retry-after"] == "3"
    if status == 300:
        assert len(r.json()["candidates"]) == 2
    assert executions(client, "f-1") == 0
    assert client.get("/operations/f-1").status_code == 404
    assert call(client, "create_ticket", TICKET, "f-1").status_code == 200


def test_real_conflict_and_ambiguity(client: httpx.Client) -> None:
    ok = call(
        client,
        "update_record",
        {"record_id": "R-1", "fields": {"a": 1}, "expected_version": 1},
        "u1",
    )
    assert ok.status_code == 200 and ok.json()["result"]["version"] == 2
    stale = call(
        client,
        "update_record",
        {"record_id": "R-1", "fields": {"a": 2}, "expected_version": 1},
        "u2",
    )
    assert stale.status_code == 409
    assert stale.json()["current_version"] == 2
    ambiguous = call(
        client, "update_record", {"name": "acme", "fields": {}, "expected_version": 1}, "u3"
    )
    assert ambiguous.status_code == 300
    assert {c["record_id"] for c in ambiguous.json()["candidates"]} == {"R-1", "R-2"}
    one = call(
        client, "update_record", {"name": "globex", "fields": {}, "expected_version": 1}, "u4"
    )
    assert one.status_code == 200 and one.json()["result"]["record_id"] == "R-3"
    assert client.get("/records/R-1").json()["fields"] == {"tier": "gold", "a": 1}
    assert client.get("/stats").json()["executions"] == {"u1": 1, "u4": 1}


def test_fault_rule_per_tool(client: httpx.Client) -> None:
    rule = {"target": "send_email", "kind": "429", "retry_after": 0.5, "times": 1}
    assert client.post("/faults", json=rule).status_code == 200
    email = {"to": "x@example.com", "subject": "s", "body": "b"}
    assert call(client, "create_ticket", TICKET, "t").status_code == 200
    limited = call(client, "send_email", email, "e")
    assert limited.status_code == 429 and limited.headers["retry-after"] == "0.5"
    assert call(client, "send_email", email, "e").status_code == 200
    assert client.get("/stats").json()["faults"] == {"429": 1}


def test_slow(client: httpx.Client) -> None:
    started = time.monotonic()
    assert call(
        client, "search_docs", {"query": "refund"}, "s", fault="slow; delay_ms=100"
    ).is_success
    assert time.monotonic() - started >= 0.1


def test_deep_answers_a_result_nested_depth_deep_without_executing(
    client: httpx.Client,
) -> None:
    r = call(client, "create_ticket", TICKET, "deep", fault="deep; depth=1000")
    assert r.status_code == 200 and r.content.count(b"[") == 1000
    assert executions(client, "deep") == 0


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
def test_huge_answers_size_bytes_of_json_in_each_framing(
    client: httpx.Client, framing: str
) -> None:
    fault = f"huge; size=300000; framing={framing}"
    r = call(client, "create_ticket", TICKET, f"huge-{framing}", fault=fault)
    assert r.status_code == 200 and len(r.content) == 300_000
    assert len(r.json()["result"]["content"]) > 299_000
    chunked = r.headers.get("transfer-encoding") == "chunked"
    assert chunked == (framing == "chunked")
    assert ("content-length" in r.headers) == (framing == "length")


def test_drip_executes_then_answers_byte_by_byte(client: httpx.Client) -> None:
    r = call(client, "create_ticket", TICKET, "drip", fault="drip; delay_ms=0.1")
    assert r.status_code == 200 and r.json()["result"]["ticket_id"].startswith("T-")
    assert executions(client, "drip") == 1


@pytest.mark.parametrize("value", ["inf", "1e300", "-1", "NaN", "garbage"])
def test_retry_after_text_is_sent_verbatim(client: httpx.Client, value: str) -> None:
    rule = {"target": "create_ticket", "kind": "429", "retry_after": value}
    client.post("/faults", json=rule).raise_for_status()
    r = call(client, "create_ticket", TICKET, f"ra-{value}")
    assert r.status_code == 429 and r.headers["retry-after"] == value


def test_search_docs_large_output(client: httpx.Client) -> None:
    r = call(client, "search_docs", {"query": "refund policy", "size": 100_000}, "big")
    result = r.json()["result"]
    assert result["hits"][0]["doc_id"] == "doc-refund"
    assert len(result["content"]) == 100_000


def test_async_job_completes_by_poll(client: httpx.Client) -> None:
    r = call(client, "run_report", {"report": "sales", "duration_ms": 100}, "job-1")
    assert r.status_code == 202 and r.json()["status"] == "accepted"
    status_url = r.json()["status_url"]
    assert r.headers["location"] == status_url == "/operations/job-1"
    assert client.get(status_url).json()["status"] == "running"
    wait_for(lambda: client.get(status_url).json()["status"] == "succeeded")
    assert client.get(status_url).json()["result"]["report"] == "sales"
    again = call(client, "run_report", {"report": "sales", "duration_ms": 100}, "job-1")
    assert again.status_code == 202 and again.headers["idempotency-replayed"] == "true"
    assert executions(client, "job-1") == 1


class _Receiver(BaseHTTPRequestHandler):
    received: list[tuple[str | None, dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.headers.get("Idempotency-Key"), json.loads(body)))
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_async_job_completes_by_callback(client: httpx.Client) -> None:
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=receiver.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    _Receiver.received = []
    try:
        url = f"http://127.0.0.1:{receiver.server_address[1]}/callbacks/job-2"
        r = call(client, "run_report", {"report": "sales"}, "job-2", **{"X-Callback-URL": url})
        assert r.status_code == 202
        wait_for(lambda: len(_Receiver.received) == 1)
        key, payload = _Receiver.received[0]
        assert key == "job-2"
        assert payload["key"] == "job-2" and payload["status"] == "succeeded"
        assert payload["result"]["report"] == "sales"
        wait_for(lambda: client.get("/operations/job-2").json()["callback"].get("delivered"))
    finally:
        receiver.shutdown()
        receiver.server_close()


def test_async_job_failure_and_cancel(client: httpx.Client) -> None:
    call(client, "run_report", {"report": "broken", "fail": True, "duration_ms": 0}, "job-3")
    wait_for(lambda: client.get("/operations/job-3").json()["status"] == "failed")
    assert client.post("/operations/job-3/cancel").status_code == 409  # already finished
    call(client, "run_report", {"report": "long", "duration_ms": 60_000}, "job-4")
    r = client.post("/operations/job-4/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert client.get("/operations/job-4").json()["status"] == "cancelled"
    assert client.post("/operations/job-4/cancel").status_code == 200  # idempotent
    assert client.post("/operations/never/cancel").status_code == 404
    client.post("/faults", json={"target": "cancel", "kind": "unknown"})
    call(client, "run_report", {"report": "long", "duration_ms": 60_000}, "job-5")
    assert client.post("/operations/job-5/cancel").status_code == 503  # cannot confirm


def test_reset_clears_everything(client: httpx.Client) -> None:
    call(client, "create_ticket", TICKET, "r")
    client.post("/faults", json={"target": "*", "kind": "500", "times": None})
    client.post("/reset")
    stats = client.get("/stats").json()
    assert stats["executions_total"] == 0 and stats["tickets"] == 0
    assert client.get("/faults").json() == {"rules": []}
    assert call(client, "create_ticket", TICKET, "r").status_code == 200


# --- latency: a drawn answer time per call, accounted per run -------------------------------


def timed_call(client: httpx.Client, key: str, fault: str = "", **headers: str) -> float:
    started = time.monotonic()
    r = call(client, "search_docs", {"query": "refund"}, key, fault=fault or None, **headers)
    assert r.status_code == 200, r.text
    return time.monotonic() - started


def test_latency_executes_then_answers_after_the_drawn_time(client: httpx.Client) -> None:
    run = {"X-Agentruns-Run-Id": "run-1"}
    elapsed = timed_call(client, "l1", "latency; min_ms=200; max_ms=200", **run)
    assert 0.2 <= elapsed < 0.2 + 3.0
    assert executions(client, "l1") == 1
    timed_call(client, "l1", "latency; min_ms=100; max_ms=100", **run)  # a replay waits too
    assert executions(client, "l1") == 1
    timed_call(client, "l2", "latency; min_ms=50; max_ms=50")  # no run id: under its key
    assert client.get("/latency").json() == {
        "runs": {"run-1": {"calls": 2, "ms": 300.0}, "l2": {"calls": 1, "ms": 50.0}}
    }
    client.post("/reset")
    assert client.get("/latency").json() == {"runs": {}}


def test_latency_draw_is_deterministic_per_seed_key_and_call(client: httpx.Client) -> None:
    for key, fault in (("d1", ""), ("d1", ""), ("d2", ""), ("d3", "; median_ms=100; seed=3")):
        timed_call(client, key, "latency" + fault)
    default = LatencyParams()  # log-uniform, 50 ms to 2 s
    lognormal = LatencyParams(median_ms=100, seed=3)
    expected = {
        "d1": default.draw_ms("d1", 0) + default.draw_ms("d1", 1),
        "d2": default.draw_ms("d2", 0),
        "d3": lognormal.draw_ms("d3", 0),
    }
    seen = {k: v["ms"] for k, v in client.get("/latency").json()["runs"].items()}
    assert seen == pytest.approx(expected, abs=0.001)
    assert all(50 <= default.draw_ms("k", i) <= 2000 for i in range(100))


def test_latency_rule_for_one_tool_until_cleared(client: httpx.Client) -> None:
    rule = {"target": "search_docs", "kind": "latency", "times": None, "min_ms": 150}
    assert client.post("/faults", json={**rule, "max_ms": 150}).status_code == 200
    assert timed_call(client, "r1") >= 0.15
    assert timed_call(client, "r2") >= 0.15
    assert call(client, "create_ticket", TICKET, "r3").status_code == 200  # other tool: none
    runs = client.get("/latency").json()["runs"]
    assert runs == {"r1": {"calls": 1, "ms": 150.0}, "r2": {"calls": 1, "ms": 150.0}}
    client.delete("/faults")
    assert timed_call(client, "r4") < 0.15


@pytest.mark.parametrize(
    "params",
    [
        {"min_ms": -1},
        {"min_ms": 0},
        {"max_ms": 1e12},
        {"median_ms": -1},
        {"sigma": 1e9},
        {"min_ms": 500, "max_ms": 100},
        {"max_ms": 10},  # below the default min_ms (50)
        {"min_ms": "NaN"},
    ],
)
def test_hostile_latency_parameters_are_refused(
    client: httpx.Client, params: dict[str, Any]
) -> None:
    r = client.post("/faults", json={"target": "*", "kind": "latency", "times": None, **params})
    assert r.status_code == 422, r.text
    assert client.get("/faults").json() == {"rules": []}
    header = "latency; " + "; ".join(f"{k}={v}" for k, v in params.items())
    r = call(client, "create_ticket", TICKET, "h1", fault=header)
    assert r.status_code == 400, r.text
    assert executions(client, "h1") == 0


def test_many_concurrent_latency_calls_overlap(server: ServerHandle) -> None:
    """200 calls of 500 ms each: together about as long as one, far below one after another."""
    httpx.post(f"{server.url}/reset")
    body = json.dumps({"query": "refund"}).encode()

    def one(i: int) -> int:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        try:
            headers = {
                "Content-Type": "application/json",
                "Idempotency-Key": f"c-{i}",
                "X-Fault": "latency; min_ms=500; max_ms=500",
            }
            conn.request("POST", "/tools/search_docs", body=body, headers=headers)
            response = conn.getresponse()
            response.read()
            return response.status
        finally:
            conn.close()

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=200) as pool:
        statuses = list(pool.map(one, range(200)))
    elapsed = time.monotonic() - started
    assert statuses == [200] * 200
    assert 0.5 <= elapsed < 10.0
    assert len(httpx.get(f"{server.url}/latency").json()["runs"]) == 200


def test_main_serves_until_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentruns.connectors.dev.servers.tool_server", "--port", "0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split(" on ", 1)[1].split()[0]
        assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

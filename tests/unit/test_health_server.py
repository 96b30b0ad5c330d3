"""The health endpoint server: routes, addresses, and clients that misbehave."""

from __future__ import annotations

import argparse
import json
import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from agentruns.connectors import health
from agentruns.connectors.health import Health, HealthServer


@pytest.fixture
def server() -> Iterator[HealthServer]:
    status = Health("test", bootstrap=None)
    served = HealthServer(("127.0.0.1", 0), status)
    try:
        yield served
    finally:
        served.close()


def _url(server: HealthServer, path: str) -> str:
    host, port = server.address
    return f"http://{host}:{port}{path}"


def _raw(server: HealthServer, data: bytes, timeout: float = 5.0) -> bytes:
    """What the server answers to ``data`` sent as is, until it closes the connection."""
    with socket.create_connection(server.address, timeout=timeout) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)  # all of the request is sent
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_metrics_healthz_livez_and_404(server: HealthServer) -> None:
    metrics = httpx.get(_url(server, "/metrics"))
    assert metrics.status_code == 200
    assert "python_info" in metrics.text
    assert re.search(
        r'^agentruns_build_info\{python="[0-9.]+",version="[^"A-Z]+"\} 1\.0$',
        metrics.text,
        re.MULTILINE,
    ), metrics.text
    assert metrics.headers["content-type"].startswith("text/plain")
    ready = httpx.get(_url(server, "/healthz?verbose=1"))
    assert ready.status_code == 200
    assert ready.json() == {"checks": {}, "component": "test", "status": "ready"}
    assert httpx.get(_url(server, "/livez")).json()["status"] == "starting"
    readyz = httpx.get(_url(server, "/readyz"))
    assert (readyz.status_code, readyz.json()) == (200, ready.json())
    missing = httpx.get(_url(server, "/nope"))
    assert missing.status_code == 404
    assert httpx.head(_url(server, "/metrics")).status_code == 200
    assert httpx.post(_url(server, "/metrics")).status_code == 501


def test_readiness_waits_for_the_consumer_and_liveness_ends_with_the_loop() -> None:
    status = Health("test", bootstrap=None).expect_consumer()
    served = HealthServer(("127.0.0.1", 0), status)
    try:
        starting = httpx.get(_url(served, "/healthz"))
        assert starting.status_code == 503
        assert httpx.get(_url(served, "/readyz")).json() == starting.json()
        assert starting.json() == {
            "checks": {"consumer": "starting"},
            "component": "test",
            "reason": "starting",
            "status": "not ready",
        }
        stop = threading.Event()
        status.watch_loop(stop, threading.current_thread())
        assert httpx.get(_url(served, "/livez")).json()["status"] == "running"
        stop.set()
        stopped = httpx.get(_url(served, "/livez"))
        assert (stopped.status_code, stopped.json()["status"]) == (503, "stopping")
        time.sleep(health.REPORT_TTL_S)  # the cached report expires
        assert httpx.get(_url(served, "/healthz")).json()["reason"] == "stopping"
        assert status.ready()[1]["reason"] == "loop: stopping"  # the details, for the log
    finally:
        served.close()


def test_a_slow_client_does_not_hold_up_the_others(server: HealthServer) -> None:
    with socket.create_connection(server.address) as slow:
        slow.sendall(b"GET /metr")  # and nothing more
        started = time.monotonic()
        assert httpx.get(_url(server, "/livez"), timeout=5).status_code == 200
        assert time.monotonic() - started < 2


def test_a_client_dripping_bytes_is_cut_at_the_deadline(
    server: HealthServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(health, "DEADLINE_S", 2.0)
    with socket.create_connection(server.address, timeout=30) as sock:
        started = time.monotonic()
        closed = False
        for _ in range(int(health.DEADLINE_S * 3)):
            try:
                sock.sendall(b"X")  # one byte every half second: no read ever times out
                if sock.recv(1, socket.MSG_DONTWAIT) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            except OSError:
                closed = True
                break
            time.sleep(0.5)
        assert closed
        assert time.monotonic() - started < health.DEADLINE_S + 3


def test_a_flood_of_idle_connections_is_bounded(server: HealthServer) -> None:
    idle = [socket.create_connection(server.address) for _ in range(health.MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)  # every idle one holds a slot
        try:
            extra = _raw(server, b"GET /livez HTTP/1.0\r\n\r\n")
        except OSError:  # closed before the request was all sent: a reset, not an answer
            extra = b""
        assert extra == b""  # closed at once, not queued behind the idle ones
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.3)  # their threads see the closes and free the slots
    assert httpx.get(_url(server, "/livez"), timeout=5).status_code == 200


def test_junk_and_oversized_requests_are_refused(server: HealthServer) -> None:
    long_line = b"GET /" + b"a" * (health.MAX_LINE + 10) + b" HTTP/1.0\r\n\r\n"
    assert _raw(server, long_line).startswith(b"HTTP/1.0 414")
    assert _raw(server, b"\x00\xff\xfe garbage\r\n\r\n").startswith(b"HTTP/1.0 400")
    assert _raw(server, b"GET /healthz HTTP/9.9\r\n\r\n").split(b" ")[1] in (b"400", b"505")
    many = b"GET /livez HTTP/1.0\r\n" + b"X-A: b\r\n" * 200 + b"\r\n"
    assert _raw(server, many).split(b" ")[1] == b"431"
    assert _raw(server, b"") == b""  # a connection closed without a request
    # and the server still answers
    body = json.loads(_raw(server, b"GET /livez HTTP/1.0\r\n\r\n").split(b"\r\n\r\n", 1)[1])
    assert body["component"] == "test"


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("127.0.0.1:9100", ("127.0.0.1", 9100)),
        (":9100", ("0.0.0.0", 9100)),
        ("[::1]:9100", ("::1", 9100)),
        ("metrics.local:80", ("metrics.local", 80)),
    ],
)
def test_parse_address(text: str, address: tuple[str, int]) -> None:
    assert health.parse_address(text) == address


@pytest.mark.parametrize("text", ["9100", "host:", "host:port", "host:70000"])
def test_parse_address_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        health.parse_address(text)


def test_the_flag_then_the_alias_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    health.add_arguments(parser)
    monkeypatch.delenv(health.ADDRESS_ENV, raising=False)
    assert health.address_of(parser.parse_args([])) is None
    monkeypatch.setenv(health.ADDRESS_ENV, "0.0.0.0:9300")
    assert health.address_of(parser.parse_args([])) == ("0.0.0.0", 9300)
    assert health.address_of(parser.parse_args(["--metrics-port", "9200"])) == (
        "127.0.0.1",
        9200,
    )
    flagged = parser.parse_args(["--metrics-address", "10.0.0.1:9100", "--metrics-port", "1"])
    assert health.address_of(flagged) == ("10.0.0.1", 9100)

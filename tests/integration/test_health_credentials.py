"""A service's `/healthz` tells anyone the status and each check's code; the checks' details
(error text naming hosts, ports and user names) only an admin credential of the API's
credentials reads. Real Kafka and Postgres, reached with a wrong user and at a closed port."""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

from agentruns.connectors import health
from agentruns.connectors.api.credentials import MAX_TOKEN_CHARS, token_digest
from agentruns.connectors.health import Health, HealthServer

ADMIN = "adm_" + secrets.token_urlsafe(32)
READER = "rdr_" + secrets.token_urlsafe(32)
USER = "healthprobe_user"
PASSWORD = "pw-" + secrets.token_hex(8)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wrong_user(database_url: str) -> str:
    """``database_url`` with a user (and password) the server refuses."""
    parts = urlsplit(database_url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{USER}:{PASSWORD}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


@pytest.fixture
def credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API's settings: an operator token (admin) and a file credential that only reads."""
    path = tmp_path / "credentials"
    path.write_text(f"reader default read {token_digest(READER)}\n")
    monkeypatch.setenv("AGENTRUNS_API_OPERATOR_TOKENS", f"ops:{ADMIN}")
    monkeypatch.setenv("AGENTRUNS_API_CREDENTIALS", str(path))
    monkeypatch.delenv("AGENTRUNS_API_TOKEN", raising=False)


@contextlib.contextmanager
def _serving(status: Health, *, configured: bool = True) -> Iterator[str]:
    server = HealthServer(
        ("127.0.0.1", 0), status, health.configured_credentials() if configured else None
    )
    try:
        yield "http://{}:{}".format(*server.address)
    finally:
        server.close()


def _get(base: str, path: str, token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.get(base + path, headers=headers, timeout=15)


def _raw(base: str, data: bytes) -> bytes:
    host, port = urlsplit(base).hostname, urlsplit(base).port
    assert host is not None and port is not None
    with socket.create_connection((host, port), timeout=15) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.usefixtures("credentials")
def test_details_of_unreachable_kafka_and_postgres_go_to_an_admin_only(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    kafka_port = _closed_port()
    wrong = _wrong_user(database_url)
    pg_port = str(urlsplit(wrong).port or 5432)
    status = Health("test", bootstrap=f"127.0.0.1:{kafka_port}", database_url=wrong)
    with _serving(status) as base:
        anon = _get(base, "/healthz")
        assert anon.status_code == 503
        assert anon.json() == {
            "checks": {"kafka": "kafka_unreachable", "postgres": "postgres_unreachable"},
            "component": "test",
            "reason": "kafka_unreachable,postgres_unreachable",
            "status": "not ready",
        }
        for secret in (USER, PASSWORD, "127.0.0.1", str(kafka_port), pg_port, "does not"):
            assert secret not in anon.text, secret

        # an admin reads the details: the user the server refused, never its password
        admin = _get(base, "/healthz", ADMIN)
        assert admin.status_code == 503
        checks = admin.json()["checks"]
        assert checks["kafka"]["detail"].startswith("Kafka does not answer")
        assert checks["postgres"]["detail"].startswith("Postgres does not answer")
        assert USER in checks["postgres"]["detail"] and PASSWORD not in admin.text
        assert checks["postgres"]["code"] == "postgres_unreachable"

        # the probes' path, a credential without the admin role: the codes, as without one
        assert _get(base, "/readyz", ADMIN).json() == anon.json()
        assert _get(base, "/healthz", READER).json() == anon.json()

        # a credential that is none of them is refused, whatever its length or scheme
        for wrong_token in ("x" + ADMIN[1:], "g" * 40, "a" * (MAX_TOKEN_CHARS + 1)):
            refused = _get(base, "/healthz", wrong_token)
            assert refused.status_code == 401, wrong_token[:10]
            assert refused.headers["www-authenticate"].startswith("Bearer")
            assert refused.json()["error"] == "unauthorized" and USER not in refused.text
        basic = httpx.get(base + "/healthz", auth=("ops", ADMIN), timeout=15)
        assert basic.status_code == 401
    # the details are in the service's log (each time the reason changes)
    logged = [r.getMessage() for r in caplog.records if r.name == "agentruns.health"]
    assert any("not ready" in m for m in logged), logged
    assert any(USER in m for m in logged) and not any(PASSWORD in m for m in logged)


def test_with_no_credential_configured_no_details_are_served(
    kafka_bootstrap: str, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AGENTRUNS_API_TOKEN", "AGENTRUNS_API_OPERATOR_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("AGENTRUNS_API_CREDENTIALS", raising=False)
    assert health.configured_credentials() is None
    status = Health("test", bootstrap=kafka_bootstrap, database_url=database_url)
    with _serving(status) as base:
        anon = _get(base, "/healthz")
        assert (anon.status_code, anon.json()["checks"]) == (
            200,
            {"kafka": "ok", "postgres": "ok"},
        )
        assert _get(base, "/healthz", ADMIN).status_code == 401


@pytest.mark.usefixtures("credentials")
def test_an_admin_reads_a_ready_service_details(kafka_bootstrap: str, database_url: str) -> None:
    status = Health("test", bootstrap=kafka_bootstrap, database_url=database_url)
    with _serving(status) as base:
        body = _get(base, "/healthz", ADMIN).json()
        assert body["status"] == "ready"
        assert body["checks"]["kafka"]["detail"].endswith("brokers")
        assert body["checks"]["postgres"] == {"ok": True, "detail": "answers", "code": "ok"}


@pytest.mark.usefixtures("credentials")
def test_a_huge_authorization_header_is_refused_and_the_server_goes_on() -> None:
    status = Health("test", bootstrap=None)
    with _serving(status) as base:
        huge = b"GET /healthz HTTP/1.0\r\nAuthorization: Bearer " + b"a" * (1 << 20) + b"\r\n\r\n"
        answers: list[bytes] = []
        senders = [threading.Thread(target=lambda: answers.append(_raw(base, huge)))]
        senders += [threading.Thread(target=lambda: answers.append(_raw(base, huge)))]
        started = time.monotonic()
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(30)
        assert len(answers) == 2
        assert all(a.startswith(b"HTTP/1.0 431") for a in answers), [a[:40] for a in answers]
        assert time.monotonic() - started < health.DEADLINE_S
        # many headers that add up past the bound: refused the same way
        pad = b"X-Pad: " + b"p" * 4000 + b"\r\n"
        many = b"GET /healthz HTTP/1.0\r\n" + pad * 5 + b"\r\n"
        assert _raw(base, many).startswith(b"HTTP/1.0 431")
        # and it still answers, the admin too
        assert _get(base, "/livez").status_code == 200
        assert _get(base, "/healthz", ADMIN).json() == {
            "checks": {},
            "component": "test",
            "status": "ready",
        }

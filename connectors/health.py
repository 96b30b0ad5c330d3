"""`/metrics`, `/readyz` (and `/healthz`) and `/livez` of a service process (docs/metrics.md).

Every long-running service serves them on ``--metrics-address HOST:PORT`` (or
``$AGENTRUNS_METRICS_ADDRESS``; ``--metrics-port N`` is ``127.0.0.1:N``); off when none is
given. The API serves the same routes from its own app (`connectors/api/http.py`) with
the same `Health` checks.

- ``/metrics``: the process's Prometheus registry (text exposition);
- ``/readyz``: readiness (``/healthz`` answers the same, for the probes that already use it).
  200 when the service's Kafka answers, its Postgres answers (when it uses one) and its consumer
  has partitions (or its group's assignment gave it none: the body says which), else 503; the
  body is JSON with each check's code (`public_report`: ``kafka_unreachable``, ...);
- ``/healthz`` with an admin credential (``Authorization: Bearer``, the API's credentials:
  `agentruns.connectors.api.credentials.configured_store`): the same with each check's detail,
  whose error text names hosts, ports and user names; a credential that is not one is a 401,
  one without the admin role gets the codes only, as the API's ``/healthz`` answers. Without
  any credential configured the details are only logged;
- ``/livez``: 200 while the service loop runs, 503 once it stopped or is stopping.

The server is for scrapers and probes on an untrusted network: one thread per connection, at
most `MAX_CONNECTIONS` at a time (more are closed at once), each connection closed after
`DEADLINE_S` whatever it sends (a client dripping bytes cannot hold a slot), request lines over
`MAX_LINE` bytes refused (414), headers over `MAX_HEAD` bytes in all refused (431), unknown
paths 404, methods other than GET/HEAD 501.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from agentruns.connectors import build
from agentruns.connectors.api.credentials import CredentialsError, CredentialStore, configured_store
from agentruns.connectors.api.tokens import OperatorTokensError
from agentruns.connectors.postgres.dsn import scrub_dsn
from agentruns.connectors.settings import current
from agentruns.streams.kafka_defaults import client_settings
from agentruns.streams.membership import Membership

log = logging.getLogger("agentruns.health")

ADDRESS_ENV = "AGENTRUNS_METRICS_ADDRESS"
MAX_CONNECTIONS = 16
DEADLINE_S = 10.0
MAX_LINE = 8192
#: The most bytes of headers a request may carry (a probe's are a few hundred; an
#: Authorization header holds a token of at most `credentials.MAX_TOKEN_CHARS`).
MAX_HEAD = 16384
#: How much of a refused request is read and dropped before the connection is closed, so the
#: client reads the refusal instead of a reset (the watchdog's deadline bounds it too).
MAX_DRAIN = 4 << 20
#: How long one check may wait for Kafka or Postgres.
CHECK_TIMEOUT_S = 3.0
#: A readiness report is reused this long: probes in a burst cost one round of checks.
REPORT_TTL_S = 1.0


# --------------------------------------------------------------------------- the address


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--metrics-address`` and its older alias ``--metrics-port``."""
    parser.add_argument(
        "--metrics-address",
        default=None,
        metavar="HOST:PORT",
        help=f"serve /metrics, /readyz, /healthz and /livez there (default ${ADDRESS_ENV};"
        " off without)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="the same as --metrics-address 127.0.0.1:PORT",
    )


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[v6]:PORT`` or ``:PORT`` (every interface) as (host, port)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"not HOST:PORT: {text!r}")
    host = host.removeprefix("[").removesuffix("]")
    return host or "0.0.0.0", int(port)


def address_of(args: argparse.Namespace) -> tuple[str, int] | None:
    """Where this process serves its health endpoints: the flag, the alias, then the
    environment; None: not at all."""
    if getattr(args, "metrics_address", None):
        return parse_address(args.metrics_address)
    if getattr(args, "metrics_port", None) is not None:
        return "127.0.0.1", int(args.metrics_port)
    configured = (current().metrics_address or "").strip()
    return parse_address(configured) if configured else None


# --------------------------------------------------------------------------- the checks


#: The code of a check that passes (one that passes with a remark has its own:
#: ``no_partitions``).
OK = "ok"


@dataclass(frozen=True)
class Check:
    ok: bool
    #: What an admin reads: error text that may name hosts, ports and user names.
    detail: str
    #: What anyone reads: a fixed word (`OK`, ``kafka_unreachable``, ...) that names nothing
    #: of the deployment.
    code: str = OK


def kafka_check(admin: AdminClient, timeout: float = CHECK_TIMEOUT_S) -> Check:
    try:
        brokers = admin.list_topics(timeout=timeout).brokers
    except KafkaException as exc:
        return Check(False, f"Kafka does not answer: {exc.args[0]}", "kafka_unreachable")
    return Check(True, f"{len(brokers)} brokers")


def postgres_check(database_url: str, timeout: float = CHECK_TIMEOUT_S) -> Check:
    try:
        with psycopg.connect(database_url, connect_timeout=max(1, int(timeout))) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        first = scrub_dsn((str(exc).strip().splitlines() or [type(exc).__name__])[0], database_url)
        return Check(False, f"Postgres does not answer: {first}", "postgres_unreachable")
    return Check(True, "answers")


def consumer_check(membership: Membership, group: str) -> Check:
    """This member's partitions as its rebalance callbacks reported them: some, or none in an
    assignment that arrived (more members than partitions: ready too, and said so); not ready
    while the processing of one of them stopped (a newer version's run, with the reason)."""
    settled, partitions = membership.state
    stopped = membership.stopped_partitions
    if stopped:
        reasons = "; ".join(f"partition {p}: {why}" for p, why in sorted(stopped.items()))
        return Check(
            False,
            f"{len(stopped)} of {partitions} partitions stopped: {reasons}",
            "partitions_stopped",
        )
    if not settled:
        return Check(
            False,
            f"waiting for partitions: no assignment from group {group} yet",
            "waiting_for_partitions",
        )
    if partitions:
        return Check(True, f"{partitions} partitions assigned")
    return Check(
        True, f"no partitions for this member: group {group} assigned it none", "no_partitions"
    )


def public_report(report: dict[str, Any]) -> dict[str, Any]:
    """What anyone is told of a readiness report: the component, the status and each check's
    code (``reason``: the failing checks' codes), never a check's detail."""
    checks = report.get("checks", {})
    out: dict[str, Any] = {
        "component": report.get("component"),
        "status": report.get("status"),
        "checks": {name: check.get("code", OK) for name, check in checks.items()},
    }
    failing = [check.get("code", "") for check in checks.values() if not check.get("ok")]
    if failing:
        out["reason"] = ",".join(failing)
    return out


class Health:
    """A service's readiness and liveness, as `/healthz` and `/livez` report them.

    Built before the service's clients exist (the endpoints answer 503 "starting" meanwhile);
    the service then hands over its consumer (`watch_consumer`) and its loop (`watch_loop`).
    """

    def __init__(
        self, component: str, *, bootstrap: str | None, database_url: str | None = None
    ) -> None:
        self.component = component
        self._database_url = database_url
        self._admin = (
            AdminClient({"bootstrap.servers": bootstrap, **client_settings(), "log_level": 3})
            if bootstrap
            else None
        )
        self._consumer: tuple[Membership, str] | None = None
        self._loop: tuple[threading.Event, threading.Thread | None] | None = None
        self._lock = threading.Lock()
        self._report: tuple[float, bool, dict[str, Any]] | None = None
        self._logged: str | None = None  # the last readiness logged: "" ready, else the reason
        self._expects_consumer = False

    def expect_consumer(self) -> Health:
        """Not ready before `watch_consumer` is called."""
        self._expects_consumer = True
        return self

    def watch_consumer(self, membership: Membership, group: str) -> None:
        self._consumer = (membership, group)

    def watch_loop(self, stop: threading.Event, thread: threading.Thread | None = None) -> None:
        """The service runs until ``stop`` is set (and while ``thread``, its loop, is alive)."""
        self._loop = (stop, thread)

    def _stopping(self) -> bool:
        if self._loop is None:
            return False
        stop, thread = self._loop
        return stop.is_set() or (thread is not None and not thread.is_alive())

    def live(self) -> tuple[bool, dict[str, Any]]:
        if self._loop is None:
            return True, {"component": self.component, "status": "starting"}
        if self._stopping():
            return False, {"component": self.component, "status": "stopping"}
        return True, {"component": self.component, "status": "running"}

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """The checks, run at most once per `REPORT_TTL_S` (one caller at a time)."""
        with self._lock:
            now = time.monotonic()
            if self._report is not None and now - self._report[0] < REPORT_TTL_S:
                return self._report[1], self._report[2]
            ok, body = self._checks()
            self._report = (time.monotonic(), ok, body)
            self._log(body)
            return ok, body

    def _log(self, body: dict[str, Any]) -> None:
        """Each change of readiness, with the details: where they are read when no credential
        opens them over HTTP."""
        reason = str(body.get("reason", ""))
        if reason == self._logged:
            return
        if reason:
            log.warning("%s not ready: %s", self.component, reason)
        elif self._logged is not None:
            log.info("%s ready again", self.component)
        self._logged = reason

    def _checks(self) -> tuple[bool, dict[str, Any]]:
        checks: dict[str, Check] = {}
        if self._stopping():
            checks["loop"] = Check(False, "stopping", "stopping")
        if self._admin is not None:
            checks["kafka"] = kafka_check(self._admin)
        if self._database_url is not None:
            checks["postgres"] = postgres_check(self._database_url)
        if self._consumer is not None and not self._stopping():
            checks["consumer"] = consumer_check(*self._consumer)
        elif self._expects_consumer and "loop" not in checks:
            checks["consumer"] = Check(False, "starting: no consumer yet", "starting")
        ok = all(c.ok for c in checks.values())
        body: dict[str, Any] = {
            "component": self.component,
            "status": "ready" if ok else "not ready",
            "checks": {
                name: {"ok": c.ok, "detail": c.detail, "code": c.code} for name, c in checks.items()
            },
        }
        if not ok:
            body["reason"] = "; ".join(f"{n}: {c.detail}" for n, c in checks.items() if not c.ok)
        return ok, body


# --------------------------------------------------------------------------- the server


#: The paths that answer readiness: Kubernetes' convention, and the older name kept working.
READY_PATHS = frozenset({"/readyz", "/healthz"})
#: The readiness path that answers the checks' details to an admin credential (the API's app
#: too: `agentruns.connectors.api.http`); ``/readyz``, the probes', answers the codes only.
DETAILED_WITH_CREDENTIAL = frozenset({"/healthz"})
_UNAUTHORIZED = (
    json.dumps({"error": "unauthorized", "detail": "send Authorization: Bearer <credential>"})
    + "\n"
).encode()


def metrics_text() -> bytes:
    assert build.BUILD_INFO is not None  # set when imported: every scrape carries it
    return generate_latest(REGISTRY)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = DEADLINE_S  # per read and write; the server's watchdog bounds the whole exchange
    protocol_version = "HTTP/1.0"  # one request per connection: nothing to keep a slot for
    default_request_version = "HTTP/1.0"  # an unparsable request gets a status line too
    server_version = "agentruns-health"

    def handle_one_request(self) -> None:
        # the standard handler reads up to 64 KiB of request line and of each of 100 header
        # lines; a probe needs far less
        line = self.rfile.readline(MAX_LINE + 1)
        if len(line) > MAX_LINE:
            self._refuse(HTTPStatus.REQUEST_URI_TOO_LONG)
            return
        self.raw_requestline = line
        if not line:
            self.close_connection = True
            return
        head = self._head()
        if head is None:
            self._refuse(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
            return
        socket_file, self.rfile = self.rfile, io.BytesIO(head)  # parse_request reads them
        try:
            parsed = self.parse_request()
        finally:
            self.rfile = socket_file
        if not parsed:
            return
        method = getattr(self, f"do_{self.command}", None)
        if method is None:
            self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"unsupported method {self.command!r}")
            return
        method()
        self.wfile.flush()

    def _head(self) -> bytes | None:
        """The header lines up to the blank line, or None past `MAX_HEAD` bytes."""
        lines = []
        size = 0
        while True:
            line = self.rfile.readline(MAX_HEAD + 1 - size)
            size += len(line)
            if size > MAX_HEAD:
                return None
            lines.append(line)
            if line in (b"\r\n", b"\n", b""):
                return b"".join(lines)

    def _refuse(self, status: HTTPStatus) -> None:
        """Answer ``status`` to a request too large to read, then read and drop what the
        client still sends (up to `MAX_DRAIN`): closing with unread bytes would reset the
        connection, and the client would see the reset instead of the answer."""
        self.requestline = ""
        self.request_version = "HTTP/1.0"
        self.command = ""
        self.send_error(status)
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            dropped = 0
            while dropped < MAX_DRAIN and (chunk := self.rfile.read1(65536)):
                dropped += len(chunk)

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, *, body: bool) -> None:
        path = self.path.split("?", 1)[0]
        health = self.server.health
        if path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, metrics_text(), body)
        elif path in READY_PATHS:
            detailed = self._detailed(path)
            if detailed is None:
                self._send(401, "application/json", _UNAUTHORIZED, body, authenticate=True)
                return
            ok, report = health.ready()
            shown = report if detailed else public_report(report)
            payload = json.dumps(shown, sort_keys=True).encode() + b"\n"
            self._send(200 if ok else 503, "application/json", payload, body)
        elif path == "/livez":
            ok, report = health.live()
            payload = json.dumps(report, sort_keys=True).encode() + b"\n"
            self._send(200 if ok else 503, "application/json", payload, body)
        else:
            self._send(404, "application/json", b'{"error": "not found"}\n', body)

    def _detailed(self, path: str) -> bool | None:
        """Whether the request sees the checks' details: True for an admin credential on a
        path of DETAILED_WITH_CREDENTIAL, False without a credential (or on another path, or
        for a credential without the admin role), None (a 401) for one that is no credential
        held here (none held: every one)."""
        if path not in DETAILED_WITH_CREDENTIAL:
            return False
        given = self.headers.get_all("Authorization") or []
        if not given:
            return False
        scheme, _, presented = given[0].partition(" ")
        credentials = self.server.credentials
        if len(given) > 1 or scheme != "Bearer" or credentials is None:
            return None
        credential = credentials.lookup(presented)  # by the token's hash: no early exit
        if credential is None:
            log.debug("health: wrong credential from %s", self.address_string())
            return None
        return credential.admin

    def _send(
        self,
        status: int,
        content_type: str,
        payload: bytes,
        body: bool,
        *,
        authenticate: bool = False,
    ) -> None:
        self.send_response(status)
        if authenticate:
            self.send_header("WWW-Authenticate", 'Bearer realm="agentruns"')
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Connection", "close")
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(
        self, address: tuple[str, int], health: Health, credentials: CredentialStore | None
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _Handler)
        self.health = health
        self.credentials = credentials
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._open: dict[socket.socket, float] = {}
        self._open_lock = threading.Lock()
        self._closed = threading.Event()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: a probe retries, a flood gets nothing
            return
        with self._open_lock:
            self._open[request] = time.monotonic() + DEADLINE_S
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request: socket.socket) -> None:
        with self._open_lock:
            if self._open.pop(request, None) is None:
                return
        self._slots.release()

    def watchdog(self) -> None:
        """Cut connections past their deadline (their thread then ends and frees the slot)."""
        while not self._closed.wait(0.5):
            now = time.monotonic()
            with self._open_lock:
                late = [s for s, deadline in self._open.items() if deadline < now]
            for sock in late:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client gone mid-answer (a probe's own timeout): not the service's problem
        log.debug("health request from %s failed", client_address, exc_info=True)

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()


def configured_credentials() -> CredentialStore | None:
    """The credentials whose admins read the checks' details on `/healthz`: the API's
    (`configured_store`); None, with an error in the log, when they do not parse."""
    try:
        return configured_store(current(), lambda: int(time.time() * 1000))
    except (CredentialsError, OperatorTokensError) as exc:
        log.error("health: no credentials, /healthz shows no details: %s", exc)
        return None


class HealthServer:
    """The endpoints of one process, served from daemon threads. ``credentials``: whose
    admins read the checks' details (None: nobody, over HTTP)."""

    def __init__(
        self,
        address: tuple[str, int],
        health: Health,
        credentials: CredentialStore | None = None,
    ) -> None:
        self.health = health
        self._server = _Server(address, health, credentials)
        host, port = self._server.server_address[:2]
        self.address = (str(host), int(port))
        self._threads = [
            threading.Thread(target=self._server.serve_forever, name="health", daemon=True),
            threading.Thread(target=self._server.watchdog, name="health-watchdog", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        log.info("serving /metrics, /readyz, /healthz and /livez on %s:%d", *self.address)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextlib.contextmanager
def serving(
    args: argparse.Namespace,
    component: str,
    *,
    bootstrap: str | None,
    database_url: str | None = None,
    consumer: bool = True,
) -> Iterator[Health]:
    """The service's `Health`, served where ``args`` say (or nowhere) while in the block."""
    health = Health(component, bootstrap=bootstrap, database_url=database_url)
    if consumer:
        health.expect_consumer()
    address = address_of(args)
    server = (
        HealthServer(address, health, configured_credentials()) if address is not None else None
    )
    try:
        yield health
    finally:
        if server is not None:
            server.close()


__all__ = [
    "ADDRESS_ENV",
    "DETAILED_WITH_CREDENTIAL",
    "READY_PATHS",
    "Check",
    "Health",
    "HealthServer",
    "add_arguments",
    "address_of",
    "configured_credentials",
    "consumer_check",
    "kafka_check",
    "metrics_text",
    "parse_address",
    "postgres_check",
    "public_report",
    "serving",
]

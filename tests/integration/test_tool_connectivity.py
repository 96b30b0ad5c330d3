"""Tools as companies run them: auth, a proxy, TLS with a private CA, against the real broker.

The example tool server runs three times: behind a bearer token, behind an API key, and on
TLS asking for a client certificate (mTLS), all signed by a CA made here. An HTTP CONNECT
proxy in a thread (``HTTPS_PROXY``) counts the tunnels it opens. One tool executor serves a
registry whose tools name those servers, each with its own auth, TLS and proxy settings.
"""

from __future__ import annotations

import json
import os
import select
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import psycopg
import pytest

from agentruns.connectors.dev.servers import tool_server
from agentruns.connectors.dev.servers.httpserver import ServerHandle
from agentruns.connectors.dev.servers.tool_server import ServerAuth, server_tls
from agentruns.connectors.executors.tool import ToolExecutor
from agentruns.processors.events import ToolCallFailed, ToolCallSucceeded
from agentruns.processors.state import ErrorClass
from agentruns.streams.topics import DLQ, topic_name
from tests.support.certs import TestCA
from tests.support.executors import TICKET, Harness, ids_for, make_harness
from tests.support.pipeline import read_all
from tests.support.waiting import wait_for

TOKEN = "tok-3f9a1c0d7e5b42a8"
WRONG_TOKEN = "tok-not-the-right-one-0000"
API_KEY = "key-a83b7c5d0e1f2a3b"
TOKEN_ENV = "AGENTRUNS_TEST_TOOL_TOKEN"


class ConnectProxy:
    """A forwarding proxy that speaks only ``CONNECT`` (what https through a proxy uses); it
    records every tunnel's target and the bytes it carried."""

    def __init__(self) -> None:
        self.tunnels: list[str] = []
        self.bytes = 0
        lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                client: socket.socket = self.request
                head = b""
                while b"\r\n\r\n" not in head:
                    data = client.recv(4096)
                    if not data:
                        return
                    head += data
                method, target, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
                if method != "CONNECT":
                    client.sendall(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
                    return
                host, _, port = target.rpartition(":")
                try:
                    upstream = socket.create_connection((host, int(port)), timeout=5)
                except OSError:
                    client.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
                    return
                with lock:
                    proxy.tunnels.append(target)
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                sockets = [client, upstream]
                try:
                    while True:
                        ready, _, _ = select.select(sockets, [], [], 30)
                        if not ready:
                            return
                        for sock in ready:
                            data = sock.recv(65536)
                            if not data:
                                return
                            (upstream if sock is client else client).sendall(data)
                            with lock:
                                proxy.bytes += len(data)
                finally:
                    upstream.close()

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Env:
    harness: Harness
    bearer: ServerHandle
    keyed: ServerHandle
    tls: ServerHandle
    proxy: ConnectProxy
    tls_port: int

    def executions(self, server: ServerHandle, key: str) -> int:
        app = server.app
        assert isinstance(app, tool_server.ToolServerApp)
        with app.lock:
            return int(app.executions[key])

    def unauthorized(self, server: ServerHandle) -> int:
        app = server.app
        assert isinstance(app, tool_server.ToolServerApp)
        with app.lock:
            return int(app.counters["unauthorized"])


def _registry(tmp: Path, env: dict[str, Any]) -> Path:
    base = json.loads(tool_server.DEFAULT_REGISTRY.read_text())
    ticket = next(t for t in base["tools"] if t["name"] == "create_ticket")

    def tool(name: str, url: str, **settings: Any) -> dict[str, Any]:
        return {
            **ticket,
            "name": name,
            "endpoint": f"{url}/tools/create_ticket",
            "status_url_template": f"{url}/operations/{{key}}",
            "timeout_ms": 3000,
            **settings,
        }

    wrong = tmp / "wrong-token"
    wrong.write_text(WRONG_TOKEN + "\n")
    key_file = tmp / "api-key"
    key_file.write_text(API_KEY)
    mtls = {"type": "mtls", **env["client"]}
    https_ip = f"https://127.0.0.1:{env['tls_port']}"
    https_name = f"https://localhost:{env['tls_port']}"
    tools = [
        tool("ticket_bearer", env["bearer"], auth={"type": "bearer", "token_env": TOKEN_ENV}),
        tool(
            "ticket_wrong_token", env["bearer"], auth={"type": "bearer", "token_file": str(wrong)}
        ),
        tool(
            "ticket_api_key",
            env["keyed"],
            auth={"type": "api_key", "header": "X-Tool-Key", "key_file": str(key_file)},
        ),
        tool("ticket_no_key", env["keyed"]),
        tool("ticket_mtls_proxied", https_ip, auth=mtls),
        tool("ticket_mtls_no_proxy", https_name, auth=mtls),
        tool("ticket_mtls_override", https_name, auth=mtls, proxy=env["proxy"]),
        tool("ticket_bad_ca", https_name, auth=mtls, tls={"ca_file": env["other_ca"]}),
    ]
    registry = {
        "version": "connectivity-1",
        "base_url": env["bearer"],
        "tls": {"ca_file": env["ca"]},  # every tool's default
        "tools": tools,
    }
    path = tmp / "tools.json"
    path.write_text(json.dumps(registry))
    return path


@pytest.fixture(scope="module")
def env(
    kafka_bootstrap: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("connectivity")
    ca, other = TestCA(tmp, "tools"), TestCA(tmp, "other")
    server_pair, client_pair = (
        ca.issue("tool-server", server=True),
        ca.issue("executor", server=False),
    )
    bearer = tool_server.serve(auth=ServerAuth(bearer_token=TOKEN))
    keyed = tool_server.serve(auth=ServerAuth(api_key=API_KEY, api_key_header="X-Tool-Key"))
    context = server_tls(server_pair.cert_file, server_pair.key_file, client_ca=ca.ca_file)
    tls = tool_server.serve(tls=context)
    proxy = ConnectProxy()
    settings = {
        "bearer": bearer.url,
        "keyed": keyed.url,
        "tls_port": tls.port,
        "proxy": proxy.url,
        "ca": ca.ca_file,
        "other_ca": other.ca_file,
        "client": {"cert_file": client_pair.cert_file, "key_file": client_pair.key_file},
    }
    registry = _registry(tmp, settings)
    prefix = f"t-tool-conn-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    harness = make_harness(kafka_bootstrap, database_url, prefix, "tool")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TOKEN_ENV, TOKEN)
        for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY"):
            patch.delenv(name, raising=False)
        patch.setenv("https_proxy", proxy.url)
        patch.setenv("no_proxy", "localhost")
        executor = ToolExecutor(harness.config("tool"), registry)
    harness.start(executor)
    try:
        yield Env(harness, bearer, keyed, tls, proxy, tls.port)
    finally:
        harness.close()
        for server in (bearer, keyed, tls):
            server.close()
        proxy.close()


def test_a_bearer_token_from_the_environment_opens_the_tool(
    env: Env, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    call = ids.call("ticket_bearer", TICKET)
    env.harness.effects.send(call)
    env.harness.inbox.typed(call, ToolCallSucceeded)
    assert env.executions(env.bearer, call.operation.key) == 1


def test_a_wrong_token_fails_the_call_with_the_tools_401(
    env: Env, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    call = ids.call("ticket_wrong_token", TICKET)
    before = env.unauthorized(env.bearer)
    env.harness.effects.send(call)
    failed = env.harness.inbox.typed(call, ToolCallFailed)
    assert (failed.error_class, failed.error_code) == (ErrorClass.PERMISSION_DENIED, "unauthorized")
    assert "missing or wrong credential" in (failed.message or "")
    assert env.unauthorized(env.bearer) == before + 1
    assert env.executions(env.bearer, call.operation.key) == 0


def test_an_api_key_goes_in_its_configured_header_and_none_is_refused(
    env: Env, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    good, bare = ids.call("ticket_api_key", TICKET), ids.call("ticket_no_key", TICKET)
    env.harness.effects.send(good, bare)
    env.harness.inbox.typed(good, ToolCallSucceeded)
    refused = env.harness.inbox.typed(bare, ToolCallFailed)
    assert refused.error_class is ErrorClass.PERMISSION_DENIED
    assert env.executions(env.keyed, good.operation.key) == 1
    assert env.executions(env.keyed, bare.operation.key) == 0


def test_mtls_with_the_private_ca_goes_through_the_proxy_by_connect(
    env: Env, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    call = ids.call("ticket_mtls_proxied", TICKET)
    tunnels = len(env.proxy.tunnels)
    env.harness.effects.send(call)
    env.harness.inbox.typed(call, ToolCallSucceeded)
    assert env.executions(env.tls, call.operation.key) == 1
    assert env.proxy.tunnels[tunnels:] == [f"127.0.0.1:{env.tls_port}"]
    assert env.proxy.bytes > 0


def test_no_proxy_and_a_per_tool_proxy_decide_the_route(
    env: Env, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    direct = ids.call("ticket_mtls_no_proxy", TICKET)
    env.harness.effects.send(direct)
    env.harness.inbox.typed(direct, ToolCallSucceeded)
    assert f"localhost:{env.tls_port}" not in env.proxy.tunnels  # NO_PROXY=localhost
    override = ids.call("ticket_mtls_override", TICKET)
    env.harness.effects.send(override)
    env.harness.inbox.typed(override, ToolCallSucceeded)
    assert f"localhost:{env.tls_port}" in env.proxy.tunnels  # the tool's own proxy


def test_a_server_certificate_from_another_ca_is_a_clear_tls_failure(
    env: Env, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    call = ids.call("ticket_bad_ca", TICKET)
    env.harness.effects.send(call)
    failed = env.harness.inbox.typed(call, ToolCallFailed)
    assert (failed.error_class, failed.error_code) == (ErrorClass.UNKNOWN, "tls_failed")
    assert "CERTIFICATE_VERIFY_FAILED" in (failed.message or "")
    assert env.executions(env.tls, call.operation.key) == 0


def test_no_secret_reaches_an_event_a_record_an_artifact_a_log_or_a_dead_letter(
    env: Env, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG", logger="agentruns")
    ids = ids_for(request)
    calls = [
        ids.call("ticket_bearer", TICKET),
        ids.call("ticket_wrong_token", TICKET),
        ids.call("ticket_api_key", TICKET),
    ]
    letter = ids.call("ticket_bearer", TICKET)
    letter = msgspec.structs.replace(letter, idempotency_key=letter.idempotency_key + "\x00")
    env.harness.effects.send(*calls, letter)
    events = [env.harness.inbox.event(call) for call in calls]
    succeeded = [e for e in events if isinstance(e, ToolCallSucceeded)]
    assert len(succeeded) == 2
    dlq = topic_name(DLQ, env.harness.prefix)

    def letters() -> list[str]:
        return [
            json.dumps(r.value, default=str)
            for r in read_all(env.harness.bootstrap, dlq, "DeadLetter")
        ]

    wait_for(lambda: any(ids.run_id in text for text in letters()), 20, "the dead letter")
    with psycopg.connect(env.harness.database_url) as conn:
        rows = conn.execute(
            "SELECT * FROM executed_actions WHERE idempotency_key = ANY(%s)",
            ([c.idempotency_key for c in calls],),
        ).fetchall()
        artifacts = conn.execute("SELECT * FROM artifacts").fetchall()
    assert len(rows) == len(calls)
    written = [
        *(repr(e) for e in events),
        *(repr(row) for row in rows),
        *(repr(row) for row in artifacts),
        *(json.dumps(env.harness.artifact(e.result_ref)) for e in succeeded),
        *letters(),
        caplog.text,
    ]
    for secret in (TOKEN, WRONG_TOKEN, API_KEY):
        assert not [text for text in written if secret in text]

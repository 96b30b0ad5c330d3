"""The executors' HTTP client refuses a header name or value holding CR, LF or NUL (and a
method or target that would break the request line) before anything is sent: against a real
local HTTP server counting the requests it received, a hostile ``If-Match`` never splits the
call into a second request carrying the tool's Authorization header."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agentruns.connectors.executors.http import Connectivity, KeepAliveHTTP, Secret

TOOL_SECRET = "tool-secret-" + "s" * 32


class Counting(BaseHTTPRequestHandler):
    """Answers every request 200 and records its request line and Authorization header."""

    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str | None]] = []

    def _any(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        type(self).seen.append((self.requestline, self.headers.get("Authorization")))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST = do_PUT = _any

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[Counting]]]:
    handler = type("Handler", (Counting,), {"seen": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()


def _send(url: str, headers: dict[str, str], method: str = "POST") -> object:
    conn = Connectivity(
        auth_header=("Authorization", Secret(f"Bearer {TOOL_SECRET}", "$TOOL_TOKEN")),
        secrets=(Secret(TOOL_SECRET, "$TOOL_TOKEN"),),
    )

    async def go() -> object:
        client = KeepAliveHTTP(5.0)
        try:
            auth = {conn.auth_header[0]: conn.auth_header[1].reveal()} if conn.auth_header else {}
            return await client.send(
                method, url, timeout_s=5, headers={**headers, **auth}, body=b"{}", conn=conn
            )
        finally:
            client.close()

    return asyncio.run(go())


SMUGGLED = "v1\r\nContent-Length: 0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\nX-A: b"


@pytest.mark.parametrize(
    ("headers", "method", "path"),
    [
        ({"If-Match": SMUGGLED}, "POST", "/call"),
        ({"If-Match": "v1\nX-Evil: 1"}, "POST", "/call"),
        ({"If-Match": "v1\rX-Evil: 1"}, "POST", "/call"),
        ({"If-Match": "v1\x00"}, "POST", "/call"),
        ({"X-Evil\r\nX-Other": "1"}, "POST", "/call"),
        ({"Bad Name": "1"}, "POST", "/call"),
        ({}, "POST /smuggled HTTP/1.1\r\nX:", "/call"),
        ({}, "POST", "/call\r\nX-Evil: 1"),
    ],
)
def test_a_header_with_cr_lf_or_nul_is_refused_and_nothing_is_sent(
    server: tuple[str, type[Counting]], headers: dict[str, str], method: str, path: str
) -> None:
    url, handler = server
    answer = _send(url + path, headers, method)
    assert getattr(answer, "failure") == "invalid_request", answer  # noqa: B009
    detail = str(getattr(answer, "detail"))  # noqa: B009
    assert TOOL_SECRET not in detail and "\r" not in detail and "\n" not in detail
    assert handler.seen == []
    good = _send(url + "/call", {"If-Match": "v1"})
    assert getattr(good, "status") == 200  # noqa: B009
    assert handler.seen == [("POST /call HTTP/1.1", f"Bearer {TOOL_SECRET}")]

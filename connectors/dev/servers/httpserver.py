"""Shared scaffolding of the dev/test HTTP servers (scripted model server, example tool server).

Standard library only: a ``ThreadingHTTPServer`` speaking keep-alive HTTP/1.1, a JSON handler
base class, a background-thread server handle, fault-header parsing and a foreground runner
that stops on SIGTERM/SIGINT. Nothing here is used by the production pipeline.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import json
import resource
import signal
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType, TracebackType
from typing import Any
from urllib.parse import unquote

JSON_HEADERS = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class FaultRequest:
    """One fault as selected by an ``X-Fault`` header or a fault rule.

    Header syntax: ``kind[; name=value]...`` e.g. ``429; retry_after=2`` or
    ``disconnect; after_chunks=3``. Parameters stay strings until asked for.
    """

    kind: str
    params: Mapping[str, str] = field(default_factory=dict)

    def number(self, name: str, default: float) -> float:
        raw = self.params.get(name)
        if raw is None:
            return default
        try:
            return float(raw)
        except ValueError:
            return default

    def integer(self, name: str, default: int) -> int:
        return int(self.number(name, default))


def param_text(value: float | str) -> str:
    """A fault parameter as a header parameter: numbers as ``%g``, text verbatim (so a rule
    can ask for ``Retry-After: inf`` or an HTTP date as well as for ``2.5``)."""
    return f"{value:g}" if isinstance(value, int | float) else value


def parse_fault_header(value: str | None) -> FaultRequest | None:
    """Parse an ``X-Fault`` header value; ``None`` or blank means no fault."""
    if value is None or not value.strip():
        return None
    parts = [p.strip() for p in value.split(";") if p.strip()]
    kind = parts[0].lower()
    params: dict[str, str] = {}
    for part in parts[1:]:
        name, sep, raw = part.partition("=")
        params[name.strip().lower()] = raw.strip() if sep else "true"
    return FaultRequest(kind=kind, params=params)


Frames = list[tuple[float, bytes]]  # (due, by ``time.monotonic()``; bytes), in order


class _Paced:
    """One connection's frames while the pacer sends them."""

    def __init__(self, sock: socket.socket, frames: Frames) -> None:
        self.sock = sock
        self.frames = frames
        self.next = 0
        self.failed = False
        self.done = threading.Event()

    def send_next(self) -> bool:
        """Send the next frame without blocking; True when this stream needs no more turns
        (all sent, the connection failed, or the client reads too slowly to keep up)."""
        due, data = self.frames[self.next]
        try:
            sent = self.sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.failed = True
            return True
        if sent < len(data):  # the socket buffer is full: its handler thread takes over
            self.frames[self.next] = (due, data[sent:])
            return True
        self.next += 1
        return self.next == len(self.frames)


class Pacer:
    """Sends the frames of every paced stream (a ``latency`` fault) from one thread.

    A thread per stream waking for each chunk costs ~50 us of CPU a chunk once hundreds of
    streams are open (GIL hand-offs); one thread popping due frames off a heap and sending
    them without blocking costs a fraction of that. The handler thread waits once for its
    stream to end. Sends never block the pacer: a client too slow to keep up gets its stream
    back to finish on its own thread.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Paced]] = []
        self._order = itertools.count()
        self._closed = False
        self._thread: threading.Thread | None = None

    def send(self, sock: socket.socket, frames: Frames) -> Frames | None:
        """Send each frame when due; returns the frames left to the caller (none unless the
        client reads too slowly), or None when the connection failed or the server closed."""
        if not frames:
            return []
        stream = _Paced(sock, list(frames))
        with self._cond:
            if self._closed:
                return None
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pacer", daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (frames[0][0], next(self._order), stream))
            self._cond.notify()
        stream.done.wait()
        return None if stream.failed else stream.frames[stream.next :]

    def close(self) -> None:
        """End every paced stream now (as failed) and stop the thread."""
        with self._cond:
            self._closed = True
            for _, _, stream in self._heap:
                stream.failed = True
                stream.done.set()
            self._heap.clear()
            self._cond.notify()

    def _due(self) -> list[_Paced] | None:
        """Wait for the next due frames: their streams, or None once closed."""
        with self._cond:
            while not self._closed:
                if self._heap and (wait := self._heap[0][0] - time.monotonic()) <= 0:
                    now, due = time.monotonic(), []
                    while self._heap and self._heap[0][0] <= now:
                        due.append(heapq.heappop(self._heap)[2])
                    return due
                self._cond.wait(wait if self._heap else None)
        return None

    def _run(self) -> None:
        while (due := self._due()) is not None:
            again = []
            for stream in due:
                if stream.send_next():
                    stream.done.set()
                else:
                    again.append(stream)
            with self._cond:
                for stream in again:
                    if self._closed:
                        stream.failed = True
                        stream.done.set()
                    else:
                        entry = (stream.frames[stream.next][0], next(self._order), stream)
                        heapq.heappush(self._heap, entry)


class DevHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server that tracks its connections so ``close()`` really ends them."""

    daemon_threads = True
    allow_reuse_address = True
    # the listen backlog: a benchmark opens ~1,000 connections at once (the kernel caps it at
    # net.core.somaxconn)
    request_queue_size = 1024

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        app: object,
    ) -> None:
        self.app = app
        self.closing = threading.Event()
        self._conn_lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self.accepted = 0
        # the `traceparent` of the latest requests that had one (tests check propagation)
        self.traceparents: collections.deque[str] = collections.deque(maxlen=1000)
        self.pacer = Pacer()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conn_lock:
            self._conns.add(request)
            self.accepted += 1
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conn_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with self._conn_lock:
            conns = list(self._conns)
            self._conns.clear()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def sleep(self, seconds: float) -> bool:
        """Sleep unless the server is closing; returns False if interrupted by ``close()``."""
        if seconds <= 0:
            return True
        return not self.closing.wait(seconds)


class ServerHandle:
    """A server running in a background thread. ``url`` has no trailing slash."""

    def __init__(self, server: DevHTTPServer, app: object) -> None:
        self._server = server
        self.app = app
        self.traceparents = server.traceparents
        host, port = server.server_address[:2]
        self.host = str(host)
        self.port = int(port)
        scheme = "https" if isinstance(server.socket, ssl.SSLSocket) else "http"
        self.url = f"{scheme}://{self.host}:{self.port}"
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"devserver-{self.port}",
            daemon=True,
        )
        self._closed = False

    @property
    def connections_accepted(self) -> int:
        """TCP connections accepted so far (shows whether clients keep theirs alive)."""
        return self._server.accepted

    def start(self) -> ServerHandle:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.closing.set()
        self._server.pacer.close()
        app_close = getattr(self.app, "close", None)
        if callable(app_close):
            app_close()
        self._server.shutdown()
        self._server.close_connections()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def start_server(
    host: str,
    port: int,
    handler: type[BaseHTTPRequestHandler],
    app: object,
    tls: ssl.SSLContext | None = None,
) -> ServerHandle:
    """Serve in a background thread; over TLS when ``tls`` (a server-side context) is given
    (a client whose handshake fails is dropped at accept)."""
    server = DevHTTPServer((host, port), handler, app)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    return ServerHandle(server, app).start()


class JSONHandler(BaseHTTPRequestHandler):
    """Keep-alive HTTP/1.1 handler with JSON helpers and no per-request logging.

    ``handle_one_request`` is replaced by a lean parser (the standard one builds an
    ``email.message.Message`` per request, which halves the throughput); request headers are
    in ``req_headers`` (lower-case names) and read with ``header(name)``. Responses go out in
    one ``write`` (status line, headers and body together).
    """

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server_version = "agentruns-dev/1"
    sys_version = ""
    server: DevHTTPServer
    req_headers: dict[str, str]

    def log_message(self, format: str, *args: Any) -> None:
        """Silenced: logging (and its reverse DNS) would cost more than the request."""

    def handle_one_request(self) -> None:
        try:
            line = self.rfile.readline(65537)
        except OSError:
            self.close_connection = True
            return
        if not line or len(line) > 65536:
            self.close_connection = True
            return
        self.raw_requestline = line
        self.requestline = line.decode("latin-1").rstrip("\r\n")
        parts = self.requestline.split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            self.close_connection = True
            self.send_json(400, {"error": "bad_request_line"})
            return
        self.command, self.path, self.request_version = parts
        headers: dict[str, str] = {}
        while True:
            raw = self.rfile.readline(65537)
            if raw in (b"\r\n", b"\n", b""):
                break
            name, _, value = raw.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        self.req_headers = headers
        if "traceparent" in headers:
            self.server.traceparents.append(headers["traceparent"])
        connection = headers.get("connection", "").lower()
        self.close_connection = connection == "close" or (
            self.request_version != "HTTP/1.1" and connection != "keep-alive"
        )
        method = getattr(self, "do_" + self.command, None)
        if method is None:
            self.send_json(405, {"error": "method_not_allowed", "method": self.command})
            return
        method()
        with contextlib.suppress(OSError):
            self.wfile.flush()

    def header(self, name: str) -> str | None:
        return self.req_headers.get(name.lower())

    def path_parts(self) -> list[str]:
        path = self.path.split("?", 1)[0]
        return [unquote(p) for p in path.split("/") if p]

    def read_body(self) -> bytes:
        length = int(self.header("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def read_json(self) -> Any:
        """The JSON body, or raises ``ValueError`` (``json.JSONDecodeError`` is one)."""
        body = self.read_body()
        if not body:
            return {}
        return json.loads(body)

    def send_json(
        self, status: int, payload: object, headers: Mapping[str, str] | None = None
    ) -> None:
        body = json.dumps(payload, separators=(",", ":")).encode()
        self.send_bytes(status, body, {**JSON_HEADERS, **(headers or {})})

    def head_bytes(self, status: int, headers: Mapping[str, str]) -> bytes:
        reason = self.responses.get(status, ("",))[0]
        lines = [f"HTTP/1.1 {status} {reason}", f"Server: {self.server_version}"]
        lines.append(f"Date: {self.date_time_string()}")
        lines.extend(f"{name}: {value}" for name, value in headers.items())
        if self.close_connection:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def send_bytes(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        head = self.head_bytes(status, {**headers, "Content-Length": str(len(body))})
        try:
            self.wfile.write(head + body)
        except OSError:  # the client went away (e.g. it timed out first): nothing to answer
            self.close_connection = True

    def drop_connection(self) -> None:
        """Close the socket without sending anything (or anything more)."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.flush()
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)


def raise_open_files_limit() -> int:
    """Lift this process's soft limit on open files to the hard one (a socket per connection:
    a common soft limit of 1,024 would cap the concurrent slow streams); returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    return soft


def run_until_signal(handle: ServerHandle, banner: str, print_fn: Callable[[str], None]) -> int:
    """Serve in the foreground until SIGTERM or SIGINT, then close the server."""
    raise_open_files_limit()
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        print_fn(banner)
        while not stop.wait(0.5):
            pass
    finally:
        handle.close()
        for sig, old in previous.items():
            signal.signal(sig, old)
    return 0

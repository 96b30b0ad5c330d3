"""How the tool executor reaches a tool backend: auth, proxy, TLS and the pooled HTTP client.

A tool's connection settings come from the registry (docs/executors.md, "Auth, proxy and TLS"):

- ``auth``: ``{"type": "bearer", "token_env" | "token_file": ...}``, ``{"type": "api_key",
  "header": "X-API-Key", "key_env" | "key_file": ...}`` or ``{"type": "mtls", "cert_file":
  ..., "key_file": ...}``. The secret itself is never in the registry: it is read from the
  environment or a file when the registry is loaded (a missing one is an error then, naming
  the variable or file, never a value), held in a :class:`Secret` whose ``repr`` is masked,
  and scrubbed from every message the executor writes (:meth:`Connectivity.redact`).
- ``proxy``: a proxy URL, or ``""`` for none; without it ``HTTPS_PROXY``/``HTTP_PROXY``/
  ``NO_PROXY`` apply (https goes through the proxy with ``CONNECT``).
- ``tls``: ``{"ca_file": ..., "verify": true}``; verification is on unless ``verify`` is
  false; ``ca_file`` null means the system's CAs. A registry-wide ``tls``/``proxy`` is the
  default of every tool.

:class:`KeepAliveHTTP` carries them with the executor's limits: an exchange is over
``timeout_s`` after it starts (every read waits only until that deadline, so a backend
dripping bytes cannot extend it), a body over ``max_body_bytes`` or a head over
``MAX_HEAD_LINES`` is not read, nothing is retried or redirected (the core decides, R11, R12).
"""

from __future__ import annotations

import base64
import contextlib
import math
import os
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from agentruns.connectors.executors.base import ExecutorError

# A tool answer's body is read up to this size; a larger one fails the call (it could not be
# stored: an artifact holds at most MAX_ARTIFACT_BYTES, arguments and metadata included).
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# Response head lines (status + headers) a backend may send before the body.
MAX_HEAD_LINES = 256


@dataclass(frozen=True)
class Answer:
    """One HTTP answer, or how the exchange failed before there was one."""

    status: int = 0
    headers: Mapping[str, str] | None = None
    body: bytes = b""
    # "not_sent" | "tls" (nothing reached the tool) | "no_answer" | "too_large"
    failure: str | None = None
    detail: str = ""

    def header(self, name: str) -> str | None:
        return None if self.headers is None else self.headers.get(name.lower())


class Secret:
    """A credential read from the environment or a file; its ``repr`` and ``str`` are masked
    so it cannot reach a log line or an error by accident."""

    __slots__ = ("_value", "source")

    def __init__(self, value: str, source: str) -> None:
        self._value = value
        self.source = source

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return f"Secret(from {self.source})"

    __str__ = __repr__


def _read_secret(spec: Mapping[str, Any], stem: str, where: str) -> Secret:
    """The secret ``<stem>_env`` or ``<stem>_file`` of ``spec`` names (exactly one)."""
    env, path = spec.get(f"{stem}_env"), spec.get(f"{stem}_file")
    if (env is None) == (path is None):
        raise ExecutorError(f"{where}: give exactly one of {stem}_env and {stem}_file")
    if env is not None:
        value = os.environ.get(str(env), "")
        if not value:
            raise ExecutorError(f"{where}: the environment variable {env} is not set or empty")
        return Secret(value.strip(), f"${env}")
    try:
        value = Path(str(path)).read_text().strip()
    except OSError as exc:
        raise ExecutorError(f"{where}: cannot read {stem}_file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ExecutorError(f"{where}: {stem}_file {path} is not UTF-8 text") from None
    if not value:
        raise ExecutorError(f"{where}: {stem}_file {path} is empty")
    return Secret(value, str(path))


def _readable(path: Any, what: str, where: str) -> str:
    if not isinstance(path, str) or not path:
        raise ExecutorError(f"{where}: {what} must be a file path")
    if not os.access(path, os.R_OK):
        raise ExecutorError(f"{where}: {what} {path} does not exist or is not readable")
    return path


@dataclass(frozen=True)
class Connectivity:
    """How one tool is reached: headers its auth adds, the proxy, the TLS settings."""

    auth_header: tuple[str, Secret] | None = None
    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    verify: bool = True
    proxy: str | None = None  # None: from the environment; "": none; else the proxy URL
    secrets: tuple[Secret, ...] = field(default=(), repr=False)

    @classmethod
    def parse(
        cls, spec: Mapping[str, Any], where: str, defaults: Connectivity | None = None
    ) -> Connectivity:
        """The ``auth``/``tls``/``proxy`` of a registry entry (``defaults``: the registry's)."""
        base = defaults or Connectivity()
        auth, tls = spec.get("auth"), spec.get("tls")
        header: tuple[str, Secret] | None = base.auth_header
        cert_file, key_file = base.cert_file, base.key_file
        secrets = list(base.secrets)
        if auth is not None:
            if not isinstance(auth, Mapping):
                raise ExecutorError(f"{where}: auth must be an object")
            kind = auth.get("type")
            if kind == "bearer":
                secret = _read_secret(auth, "token", f"{where} auth")
                header = ("Authorization", Secret(f"Bearer {secret.reveal()}", secret.source))
                secrets.append(secret)
            elif kind == "api_key":
                name = auth.get("header", "X-API-Key")
                if not isinstance(name, str) or not name.isascii() or not name.strip():
                    raise ExecutorError(f"{where} auth: header must be a header name")
                secret = _read_secret(auth, "key", f"{where} auth")
                header = (name.strip(), secret)
                secrets.append(secret)
            elif kind == "mtls":
                cert_file = _readable(auth.get("cert_file"), "cert_file", f"{where} auth")
                key_file = _readable(auth.get("key_file"), "key_file", f"{where} auth")
            else:
                raise ExecutorError(
                    f"{where} auth: type must be bearer, api_key or mtls, not {kind!r}"
                )
        ca_file, verify = base.ca_file, base.verify
        if tls is not None:
            if not isinstance(tls, Mapping):
                raise ExecutorError(f"{where}: tls must be an object")
            if "ca_file" in tls:  # null: the system's CAs, whatever the registry's default
                ca = tls["ca_file"]
                ca_file = None if ca is None else _readable(ca, "ca_file", f"{where} tls")
            verify = bool(tls.get("verify", True))
        proxy = spec.get("proxy", base.proxy)
        if proxy is not None and not isinstance(proxy, str):
            raise ExecutorError(f"{where}: proxy must be a URL or an empty string")
        if proxy and urlsplit(proxy).scheme not in ("http", "https"):
            raise ExecutorError(f"{where}: proxy must be an http:// or https:// URL")
        return cls(header, cert_file, key_file, ca_file, verify, proxy, tuple(secrets))

    def redact(self, text: str) -> str:
        """``text`` without any of this tool's secrets (an error, a body the tool echoed)."""
        for secret in self.secrets:
            value = secret.reveal()
            if value and value in text:
                text = text.replace(value, "[redacted]")
        return text


DIRECT = Connectivity()


def environment_proxy(url: str, proxies: Mapping[str, str] | None = None) -> str | None:
    """The proxy ``HTTPS_PROXY``/``HTTP_PROXY`` name for ``url``, unless ``NO_PROXY`` covers
    its host (the standard library's reading of them, lower or upper case; ``proxies``: that
    reading done once)."""
    parts = urlsplit(url)
    if proxies is None:
        proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(parts.scheme)
    if not proxy:
        return None
    # not in the stubs, but the function urllib itself applies NO_PROXY with
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
    if bypass(parts.netloc or "", proxies):
        return None
    return proxy


def ssl_context(conn: Connectivity) -> ssl.SSLContext:
    """TLS for one tool: the system's CAs or ``ca_file``, hostname checked unless ``verify``
    is false, the client certificate when the tool uses mTLS."""
    context = ssl.create_default_context(cafile=conn.ca_file)
    if not conn.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if conn.cert_file is not None:
        context.load_cert_chain(conn.cert_file, conn.key_file)
    return context


class HTTPWireError(Exception):
    """The peer broke the HTTP/1.1 framing (or closed the connection) mid-response."""


class BodyTooLargeError(HTTPWireError):
    """The response body is over the client's limit: it was not read (the connection is
    closed, never reused)."""

    def __init__(self, status: int, size: int, limit: int) -> None:
        super().__init__(f"HTTP {status} body of {size}+ bytes, over the limit of {limit}")
        self.status = status


class _Connection:
    """One keep-alive socket and its read buffer. ``deadline`` (monotonic) and ``limit``
    (body bytes) are set per exchange: every read waits only until the deadline, so a
    backend dripping bytes cannot extend it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.deadline = math.inf
        self.limit = DEFAULT_MAX_BODY_BYTES

    def _fill(self) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("no complete answer within the deadline")
        self.sock.settimeout(min(remaining, 3600.0))
        data = self.sock.recv(65536)
        if not data:
            raise HTTPWireError("connection closed by the server")
        self.buffer += data

    def read_until(self, separator: bytes, limit: int = 65536) -> bytes:
        while True:
            index = self.buffer.find(separator)
            if index >= 0:
                line = bytes(self.buffer[:index])
                del self.buffer[: index + len(separator)]
                return line
            if len(self.buffer) > limit:
                raise HTTPWireError("response head too long")
            self._fill()

    def read_exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            self._fill()
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    def read_to_close(self, status: int) -> bytes:
        with contextlib.suppress(HTTPWireError):
            while len(self.buffer) <= self.limit:
                self._fill()
        if len(self.buffer) > self.limit:
            raise BodyTooLargeError(status, len(self.buffer), self.limit)
        data = bytes(self.buffer)
        self.buffer.clear()
        return data

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class KeepAliveHTTP:
    """Minimal blocking HTTP/1.1 client: one keep-alive connection per (thread, origin, tool
    settings), through a proxy and over TLS as each tool's :class:`Connectivity` says.

    Why not a library: on the executor bench (docs/benchmarks.md, "Tool executor HTTP
    client") urllib3 and httpcore cost the executor several times this client's CPU per call.
    This client writes each request with one ``sendall`` and parses only what a JSON tool API
    needs (status, headers, Content-Length or chunked bodies).

    Failures are split where idempotency needs it: a connection (or proxy tunnel) that could
    not be opened means nothing was sent (``not_sent``; ``tls`` when the TLS handshake or the
    tool's certificates failed); any failure after the request started means the backend may
    have executed it (``no_answer``). A failed connection is closed and never reused, and
    nothing is retried here: the core decides (R11, R12).
    """

    def __init__(
        self, connect_timeout_s: float, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_body_bytes = max_body_bytes
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: set[_Connection] = set()
        self._contexts: dict[Connectivity, ssl.SSLContext] = {}
        # the environment's proxies, read once: a process's environment does not change
        self._env_proxies = urllib.request.getproxies_environment()
        self._proxy_of: dict[tuple[str, str], str] = {}

    def proxy_for(self, url: str, conn: Connectivity) -> str:
        """The proxy URL a request to ``url`` goes through, "" for none."""
        if conn.proxy is not None:
            return conn.proxy
        parts = urlsplit(url)
        origin = (parts.scheme, parts.netloc)
        proxy = self._proxy_of.get(origin)
        if proxy is None:
            proxy = environment_proxy(url, self._env_proxies) or ""
            self._proxy_of[origin] = proxy
        return proxy

    def _context(self, conn: Connectivity) -> ssl.SSLContext:
        context = self._contexts.get(conn)
        if context is None:
            context = ssl_context(conn)
            with self._lock:
                self._contexts[conn] = context
        return context

    def _pool(self) -> dict[_Origin, _Connection]:
        pool: dict[_Origin, _Connection] | None = getattr(self._local, "pool", None)
        if pool is None:
            pool = {}
            self._local.pool = pool
        return pool

    def _open(self, origin: _Origin, deadline: float) -> _Connection:
        """A connection to the tool: direct or through the proxy (``CONNECT`` for https),
        TLS as the tool's settings say. Raises OSError (ssl.SSLError for TLS) before any
        byte of the request is sent."""
        scheme, host, port, proxy, conn = origin
        timeout_s = max(0.001, min(self.connect_timeout_s, deadline - time.monotonic()))
        if proxy:
            proxy_parts = urlsplit(proxy)
            if proxy_parts.scheme != "http":
                raise OSError(f"only http:// proxies are supported, not {proxy_parts.scheme}")
            address = (proxy_parts.hostname or "", proxy_parts.port or 80)
        else:
            address = (host, port)
        sock = socket.create_connection(address, timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if proxy and scheme == "https":
                _tunnel(sock, host, port, _proxy_authorization(proxy), deadline)
            if scheme == "https":
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock = self._context(conn).wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
        connection = _Connection(sock)
        with self._lock:
            self._all.add(connection)
        return connection

    def _discard(self, pool: dict[_Origin, _Connection], origin: _Origin) -> None:
        conn = pool.pop(origin, None)
        if conn is not None:
            conn.close()
            with self._lock:
                self._all.discard(conn)

    def send(
        self,
        method: str,
        url: str,
        *,
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
        conn: Connectivity = DIRECT,
    ) -> Answer:
        """One exchange, over by ``timeout_s`` after it starts (connect, send, the whole
        answer): a timeout is ``no_answer``; a body over ``max_body_bytes`` is ``too_large``."""
        deadline = time.monotonic() + timeout_s
        parts = urlsplit(url)
        https = parts.scheme == "https"
        host = parts.hostname or ""
        proxy = self.proxy_for(url, conn)
        origin = (parts.scheme, host, parts.port or (443 if https else 80), proxy, conn)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}"]
        if proxy and not https:  # plain HTTP through a proxy: absolute-form, proxy's auth
            lines[0] = f"{method} {parts.scheme}://{parts.netloc}{target} HTTP/1.1"
            authorization = _proxy_authorization(proxy)
            if authorization:
                lines.append(f"Proxy-Authorization: {authorization}")
        pool = self._pool()
        connection = pool.get(origin)
        if connection is None:
            try:
                connection = self._open(origin, deadline)
            except (ssl.SSLError, ssl.CertificateError, ValueError) as exc:
                return Answer(failure="tls", detail=f"{type(exc).__name__}: {exc}")
            except OSError as exc:
                return Answer(failure="not_sent", detail=f"{type(exc).__name__}: {exc}")
            pool[origin] = connection
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")
        connection.deadline, connection.limit = deadline, self.max_body_bytes
        try:
            connection.sock.settimeout(max(0.001, deadline - time.monotonic()))
            connection.sock.sendall(request)
            status, answer_headers, data, close = _read_response(connection, method)
        except BodyTooLargeError as exc:
            self._discard(pool, origin)
            return Answer(exc.status, failure="too_large", detail=str(exc))
        except (OSError, HTTPWireError, ValueError) as exc:
            self._discard(pool, origin)
            return Answer(failure="no_answer", detail=f"{type(exc).__name__}: {exc}")
        if close:
            self._discard(pool, origin)
        return Answer(status, answer_headers, data)

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()


# (scheme, host, port, proxy URL or "", the tool's settings): what a kept connection serves
_Origin = tuple[str, str, int, str, Connectivity]


def _proxy_authorization(proxy: str) -> str | None:
    """``Basic`` credentials of a proxy URL's user-info (``http://user:pass@proxy:3128``)."""
    parts = urlsplit(proxy)
    if parts.username is None:
        return None
    pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
    return "Basic " + base64.b64encode(pair.encode()).decode()


def _tunnel(sock: socket.socket, host: str, port: int, auth: str | None, deadline: float) -> None:
    """Ask the proxy on ``sock`` for a tunnel to ``host:port`` (``CONNECT``); raises OSError
    when it refuses (the tool has seen nothing)."""
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
    if auth:
        lines.append(f"Proxy-Authorization: {auth}")
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    reader = _Connection(sock)
    reader.deadline = deadline
    try:
        status_line = reader.read_until(b"\r\n").decode("latin-1")
        for _ in range(MAX_HEAD_LINES):
            if not reader.read_until(b"\r\n"):
                break
        else:
            raise HTTPWireError("proxy answer head has too many lines")
    except (HTTPWireError, TimeoutError) as exc:
        raise OSError(f"proxy tunnel to {authority} failed: {exc}") from exc
    _, _, rest = status_line.partition(" ")
    if not rest.startswith("200"):
        raise OSError(f"proxy refused the tunnel to {authority}: {rest[:80]}")
    if reader.buffer:  # bytes after the proxy's answer: nothing a tunnel may carry yet
        raise OSError(f"proxy sent data before the tunnel to {authority} opened")


def _read_response(conn: _Connection, method: str) -> tuple[int, dict[str, str], bytes, bool]:
    """(status, lower-cased headers, body, connection must close) of one HTTP/1.x response."""
    lines = 0
    while True:
        status_line = conn.read_until(b"\r\n").decode("latin-1")
        version, _, rest = status_line.partition(" ")
        if not version.startswith("HTTP/1."):
            raise HTTPWireError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        status = int(rest[:3])
        headers: dict[str, str] = {}
        while True:
            line = conn.read_until(b"\r\n").decode("latin-1")
            if not line:
                break
            lines += 1
            if lines > MAX_HEAD_LINES:
                raise HTTPWireError("response head has too many lines")
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if not 100 <= status < 200:
            break
    connection = headers.get("connection", "").lower()
    close = connection == "close" or (version == "HTTP/1.0" and connection != "keep-alive")
    if method == "HEAD" or status in (204, 304):
        return status, headers, b"", close
    if "chunked" in headers.get("transfer-encoding", "").lower():
        chunks = []
        total = 0
        while True:
            size = int(conn.read_until(b"\r\n").split(b";")[0], 16)
            if size < 0:
                raise HTTPWireError(f"negative chunk size {size}")
            total += size
            if total > conn.limit:
                raise BodyTooLargeError(status, total, conn.limit)
            if size == 0:
                while conn.read_until(b"\r\n"):  # trailers
                    pass
                break
            chunks.append(conn.read_exactly(size))
            conn.read_until(b"\r\n")
        return status, headers, b"".join(chunks), close
    if "content-length" in headers:
        length = int(headers["content-length"])
        if length > conn.limit:
            raise BodyTooLargeError(status, length, conn.limit)
        if length < 0:
            raise HTTPWireError(f"negative Content-Length {length}")
        return status, headers, conn.read_exactly(length), close
    return status, headers, conn.read_to_close(status), True


# --------------------------------------------------------------------------- handler


__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DIRECT",
    "Answer",
    "BodyTooLargeError",
    "Connectivity",
    "HTTPWireError",
    "KeepAliveHTTP",
    "Secret",
    "environment_proxy",
    "ssl_context",
]

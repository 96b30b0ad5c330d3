"""How the executors reach a backend (a tool, a model route): the pooled HTTP client, its
auth, proxy and TLS settings.

The client is asynchronous: an executor carries hundreds of calls at once on one event loop
(docs/benchmarks.md, "Calls in flight": at 500 streamed calls in flight a thread per call cost
2.2 times the CPU per call and 8 times the memory).

The tool executor sends whole exchanges (:meth:`KeepAliveHTTP.send`); the model executor reads a
streamed body as it arrives (:meth:`KeepAliveHTTP.stream`). A backend's connection settings
(:class:`Connectivity`: docs/executors.md, "Auth, proxy and TLS") are read from the tool
registry by :mod:`agentruns.connectors.executors.tool_http`; a model route uses the default,
:data:`DIRECT` (the system's CAs, ``HTTPS_PROXY``/``HTTP_PROXY``/``NO_PROXY`` from the
environment; https goes through a proxy with ``CONNECT``). A secret is held in a
:class:`Secret` whose ``repr`` is masked and scrubbed from every message the executor writes
(:meth:`Connectivity.redact`).

:class:`KeepAliveHTTP` carries them with the executor's limits: an exchange is over
``timeout_s`` after it starts (every read waits only until that deadline, so a backend
dripping bytes cannot extend it; a streamed exchange's reads also wait at most
``read_timeout_s`` each), a body over its byte limit, a head over ``MAX_HEAD_LINES`` or a
chunk-size line over ``MAX_CHUNK_LINE_BYTES`` is not read, nothing is retried or redirected
(the core decides, R11, R12). A request that would not be one request on the wire (a header
name that is not a token, a value holding CR, LF or NUL, a method or target that would break
the request line) is refused before a connection is taken: ``invalid_request``, nothing sent.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import re
import ssl
import time
import urllib.request
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from agentruns.connectors.executors import spans
from agentruns.streams import tracing

# A tool answer's body is read up to this size; a larger one fails the call (it could not be
# stored: an artifact holds at most MAX_ARTIFACT_BYTES, arguments and metadata included).
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# Response head lines (status + headers) a backend may send before the body.
MAX_HEAD_LINES = 256
# A chunk-size line (the size in hex and any extensions): real ones are a few bytes.
MAX_CHUNK_LINE_BYTES = 1024


@dataclass(frozen=True)
class Answer:
    """One HTTP answer, or how the exchange failed before there was one."""

    status: int = 0
    headers: Mapping[str, str] | None = None
    body: bytes = b""
    # "not_sent" | "tls" | "invalid_request" (nothing reached the backend) | "no_answer" |
    # "too_large"
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


@dataclass(frozen=True)
class Connectivity:
    """How one backend is reached: headers its auth adds, the proxy, the TLS settings
    (:func:`agentruns.connectors.executors.tool_http.parse_connectivity` reads a tool's)."""

    auth_header: tuple[str, Secret] | None = None
    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    verify: bool = True
    proxy: str | None = None  # None: from the environment; "": none; else the proxy URL
    secrets: tuple[Secret, ...] = field(default=(), repr=False)

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


#: RFC 9110 token: what a method and a header name are made of.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
#: Bytes that end or break a header line (a request with them is two requests, or garbage).
_LINE_BREAKERS = re.compile(r"[\r\n\x00]")
#: Bytes a request target may not hold: whitespace and controls end the request line.
_TARGET_BREAKERS = re.compile(r"[\x00-\x20\x7f]")


def request_problem(method: str, target: str, headers: Mapping[str, str] | None) -> str | None:
    """Why ``method``, ``target`` and ``headers`` would not make one well-formed request (the
    names only, never a value: a value may be a secret); None when they would."""
    if _TOKEN.fullmatch(method) is None:
        return "the method is not an HTTP token"
    if _TARGET_BREAKERS.search(target):
        return "the request target holds whitespace or a control character"
    for name, value in (headers or {}).items():
        if _TOKEN.fullmatch(name) is None:
            return f"header name {name[:64]!r} is not an HTTP token"
        if _LINE_BREAKERS.search(value):
            return f"header {name} holds CR, LF or NUL"
    return None


class HTTPWireError(Exception):
    """The peer broke the HTTP/1.1 framing (or closed the connection) mid-response."""


class ConnectionClosedError(HTTPWireError):
    """The peer closed the connection (the end of a body read to the close, else an error)."""


class DeadlineError(TimeoutError):
    """The exchange's deadline (its total timeout) passed, as opposed to one read's wait."""


class BodyTooLargeError(HTTPWireError):
    """The response body is over the client's limit: it was not read (the connection is
    closed, never reused)."""

    def __init__(self, status: int, size: int, limit: int) -> None:
        super().__init__(f"HTTP {status} body of {size}+ bytes, over the limit of {limit}")
        self.status = status


# A connection stops reading from its socket while this many bytes wait in its buffer
# (asyncio flow control), and reads again below a quarter of it: a backend sending faster than
# the answer is read cannot fill the memory, whatever the body's limit.
BUFFER_HIGH_BYTES = 1024 * 1024
# Idle kept connections per origin; more are closed when they come back.
MAX_IDLE_PER_ORIGIN = 1024


class _Wire(asyncio.Protocol):
    """One connection's bytes as the event loop receives them: a buffer, whether the peer
    closed, and a waiter woken by either."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False
        self._waiter: asyncio.Future[bool] | None = None
        self._paused = False
        self._expires = math.inf  # when the wait in progress ends (the loop's clock)
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > BUFFER_HIGH_BYTES and not self._paused and self.transport:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    def consumed(self) -> None:
        """The reader took bytes from the buffer: read from the socket again if it stopped."""
        if self._paused and len(self.buffer) < BUFFER_HIGH_BYTES // 4 and self.transport:
            self._paused = False
            self.transport.resume_reading()

    async def arrival(self, timeout: float) -> bool:
        """Wait until more bytes arrive or the peer closes: False after ``timeout`` seconds.

        One timer per connection, not one per read: a stream's reads come every few tens of
        milliseconds and each moves its expiry on, so the timer, when it fires, mostly finds
        the expiry moved and sets itself again (a timer per read was a tenth of the model
        executor's CPU at 500 calls in flight)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiter = waiter
        self._expires = loop.time() + timeout
        if self._timer is None or self._timer.when() > self._expires:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(self._expires, self._expire)
        try:
            return await waiter
        finally:
            self._waiter = None

    def _expire(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # not waiting now: the next wait sets a timer again
        loop = waiter.get_loop()
        if loop.time() >= self._expires:
            waiter.set_result(False)
        else:
            self._timer = loop.call_at(self._expires, self._expire)


class _Connection:
    """One keep-alive connection and its read buffer. ``deadline`` (monotonic), ``read_timeout``
    (seconds one read may wait) and ``limit`` (body bytes) are set per exchange: every read
    waits only until the deadline, so a backend dripping bytes cannot extend it."""

    def __init__(self, wire: _Wire) -> None:
        self.wire = wire
        self.buffer = wire.buffer
        self.deadline = math.inf
        self.read_timeout = math.inf
        self.limit = DEFAULT_MAX_BODY_BYTES

    async def _fill(self) -> None:
        if self.wire.closed:
            raise ConnectionClosedError("connection closed by the server")
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineError("no complete answer within the deadline")
        wait = min(remaining, self.read_timeout, 3600.0)
        if not await self.wire.arrival(wait):
            if wait >= remaining:
                raise DeadlineError("no complete answer within the deadline")
            raise TimeoutError(f"nothing received for {wait:g} s")
        if not self.buffer and self.wire.closed:
            raise ConnectionClosedError("connection closed by the server")

    async def read_until(self, separator: bytes, limit: int = 65536) -> bytes:
        start = 0
        while True:
            index = self.buffer.find(separator, start)
            if index >= 0:
                line = bytes(self.buffer[:index])
                del self.buffer[: index + len(separator)]
                self.wire.consumed()
                return line
            if len(self.buffer) > limit:
                raise HTTPWireError(f"a line of the answer over {limit} bytes")
            start = max(0, len(self.buffer) - len(separator) + 1)
            await self._fill()

    async def take(self, size: int) -> bytes:
        """Up to ``size`` bytes, at least one: what the buffer holds, else the next read."""
        if not self.buffer:
            await self._fill()
        data = bytes(self.buffer[:size])
        del self.buffer[: len(data)]
        self.wire.consumed()
        return data

    def write(self, data: bytes) -> None:
        transport = self.wire.transport
        if transport is None or transport.is_closing() or self.wire.closed:
            raise ConnectionClosedError("connection closed before the request was sent")
        transport.write(data)

    def idle(self) -> bool:
        """Whether a pooled connection can carry a request: nothing left in its buffer and the
        peer has not closed it."""
        transport = self.wire.transport
        return (
            not self.buffer
            and not self.wire.closed
            and transport is not None
            and not transport.is_closing()
        )

    def close(self) -> None:
        if self.wire.transport is not None:
            self.wire.transport.close()

    def abort(self) -> None:
        """Close at once: a TLS transport's `close` waits for the peer's close_notify (up to
        30 s), longer than the event loop of an executor that is stopping runs."""
        if self.wire.transport is not None:
            self.wire.transport.abort()


class StreamedAnswer:
    """The head of a streamed answer (or how the exchange failed before there was one: then
    ``failure`` is set as in :class:`Answer`), its body read with :meth:`pieces`."""

    def __init__(
        self,
        status: int = 0,
        headers: Mapping[str, str] | None = None,
        failure: str | None = None,
        detail: str = "",
        *,
        connection: _Connection | None = None,
        head: _Head | None = None,
    ) -> None:
        self.status = status
        self.headers = headers
        self.failure = failure
        self.detail = detail
        self.complete = False  # the body was read to its end
        self._connection = connection
        self._head = head

    def header(self, name: str) -> str | None:
        return None if self.headers is None else self.headers.get(name.lower())

    async def pieces(self, limit: int) -> AsyncGenerator[bytes, None]:
        """The body's bytes as they arrive. Raises :class:`BodyTooLargeError` past ``limit``
        bytes, :class:`DeadlineError` at the exchange's deadline, ``TimeoutError`` when one
        read waits ``read_timeout_s``, :class:`HTTPWireError` or OSError when the framing
        breaks or the connection is lost."""
        connection, head = self._connection, self._head
        if connection is None or head is None:
            return
        connection.limit = limit
        async for piece in _body(connection, head):
            yield piece
        self.complete = True

    def wait_at_most(self, seconds: float) -> None:
        """From now on no read waits longer than ``seconds``."""
        if self._connection is not None:
            self._connection.read_timeout = min(self._connection.read_timeout, seconds)


class KeepAliveHTTP:
    """Minimal asynchronous HTTP/1.1 client: kept connections per (origin,
    :class:`Connectivity`), shared by every call on the event loop, through a proxy and over
    TLS as the settings say. One event loop uses it (the executor's calls thread).

    Why not a library: on the executor bench (docs/benchmarks.md, "Tool executor HTTP
    client") urllib3 and httpcore cost the executor several times this client's CPU per call.
    This client writes each request with one write and parses only what a JSON API or a
    server-sent event stream needs (status, headers, Content-Length, chunked or read-to-close
    bodies).

    Failures are split where idempotency needs it: a connection (or proxy tunnel) that could
    not be opened means nothing was sent (``not_sent``; ``tls`` when the TLS handshake or the
    certificates failed); any failure after the request started means the backend may have
    executed it (``no_answer``). A connection goes back to the pool only after its answer was
    read to the end; a failed, abandoned or cancelled one is closed, and nothing is retried
    here: the core decides (R11, R12).
    """

    def __init__(
        self, connect_timeout_s: float, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_body_bytes = max_body_bytes
        self._idle: dict[_Origin, list[_Connection]] = {}
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
            context = self._contexts[conn] = ssl_context(conn)
        return context

    async def _open(
        self, origin: _Origin, deadline: float, connect_timeout_s: float
    ) -> _Connection:
        """A connection to the backend: direct or through the proxy (``CONNECT`` for https),
        TLS as its settings say. Raises OSError (ssl.SSLError for TLS) before any byte of the
        request is sent."""
        scheme, host, port, proxy, conn = origin
        timeout_s = max(0.001, min(connect_timeout_s, deadline - time.monotonic()))
        if proxy:
            proxy_parts = urlsplit(proxy)
            if proxy_parts.scheme != "http":
                raise OSError(f"only http:// proxies are supported, not {proxy_parts.scheme}")
            address = (proxy_parts.hostname or "", proxy_parts.port or 80)
        else:
            address = (host, port)
        loop = asyncio.get_running_loop()
        direct_tls = scheme == "https" and not proxy
        try:
            async with asyncio.timeout(timeout_s):
                transport, wire = await loop.create_connection(
                    _Wire,
                    *address,
                    ssl=self._context(conn) if direct_tls else None,
                    server_hostname=host if direct_tls else None,
                )
        except TimeoutError:
            raise TimeoutError(f"could not connect within {timeout_s:g} s") from None
        connection = _Connection(wire)
        try:
            if proxy and scheme == "https":
                await _tunnel(connection, host, port, _proxy_authorization(proxy), deadline)
                remaining = max(0.001, deadline - time.monotonic())
                try:
                    async with asyncio.timeout(remaining):
                        tls = await loop.start_tls(
                            transport, wire, self._context(conn), server_hostname=host
                        )
                except TimeoutError:
                    raise TimeoutError("the TLS handshake did not end in time") from None
                assert isinstance(tls, asyncio.Transport)
                wire.transport = tls
        except BaseException:
            transport.close()
            raise
        self._all.add(connection)
        return connection

    def _keep(self, origin: _Origin, connection: _Connection) -> None:
        """Back to the pool, for the next exchange with ``origin``."""
        idle = self._idle.setdefault(origin, [])
        if len(idle) >= MAX_IDLE_PER_ORIGIN:
            self._forget(connection)
        else:
            idle.append(connection)

    def _forget(self, connection: _Connection) -> None:
        connection.close()
        self._all.discard(connection)

    def _pooled(self, origin: _Origin) -> _Connection | None:
        """An idle kept connection to ``origin`` that can carry a request (closing the ones
        the backend closed meanwhile, or that hold bytes nobody asked for)."""
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if connection.idle():
                return connection
            self._forget(connection)
        return None

    async def _start(
        self,
        method: str,
        url: str,
        timeout_s: float,
        read_timeout_s: float,
        connect_timeout_s: float | None,
        headers: Mapping[str, str] | None,
        body: bytes | None,
        conn: Connectivity,
    ) -> tuple[_Origin, _Connection] | Answer:
        """Send the request on a pooled connection or a new one: the connection (out of the
        pool while the exchange lasts), or the failure."""
        deadline = time.monotonic() + timeout_s
        parts = urlsplit(url)
        https = parts.scheme == "https"
        host = parts.hostname or ""
        proxy = self.proxy_for(url, conn)
        origin = (parts.scheme, host, parts.port or (443 if https else 80), proxy, conn)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        problem = request_problem(method, target, headers) or request_problem(
            "GET", "/", {"Host": parts.netloc}
        )
        if problem is not None:  # header splitting: refused before anything is sent
            return Answer(failure="invalid_request", detail=f"request not sent: {problem}")
        lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}"]
        if proxy and not https:  # plain HTTP through a proxy: absolute-form, proxy's auth
            lines[0] = f"{method} {parts.scheme}://{parts.netloc}{target} HTTP/1.1"
            authorization = _proxy_authorization(proxy)
            if authorization:
                lines.append(f"Proxy-Authorization: {authorization}")
        connection = self._pooled(origin)
        if connection is None:
            try:
                connect_s = (
                    self.connect_timeout_s if connect_timeout_s is None else connect_timeout_s
                )
                connection = await self._open(origin, deadline, connect_s)
            except (ssl.SSLError, ssl.CertificateError, ValueError) as exc:
                return Answer(failure="tls", detail=f"{type(exc).__name__}: {exc}")
            except OSError as exc:
                return Answer(failure="not_sent", detail=f"{type(exc).__name__}: {exc}")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")
        connection.deadline, connection.read_timeout = deadline, read_timeout_s
        connection.limit = self.max_body_bytes
        try:
            connection.write(request)
        except (OSError, HTTPWireError) as exc:
            self._forget(connection)
            return Answer(failure="no_answer", detail=f"{type(exc).__name__}: {exc}")
        return origin, connection

    async def send(
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
        answer): a timeout is ``no_answer``; a body over ``max_body_bytes`` is ``too_large``.
        With tracing on, a CLIENT span whose context the backend receives."""
        if not tracing.enabled():
            return await self._send(method, url, timeout_s, headers, body, conn)
        span = spans.http_span(method, url, tracing.OUTGOING.get())
        headers = {**(headers or {}), tracing.HEADER: tracing.traceparent_of(span)}
        answer = Answer(failure="no_answer", detail="cancelled")
        try:
            answer = await self._send(method, url, timeout_s, headers, body, conn)
            return answer
        finally:
            spans.http_done(span, answer.status, answer.failure)

    async def _send(
        self,
        method: str,
        url: str,
        timeout_s: float,
        headers: Mapping[str, str] | None,
        body: bytes | None,
        conn: Connectivity,
    ) -> Answer:
        started = await self._start(method, url, timeout_s, math.inf, None, headers, body, conn)
        if isinstance(started, Answer):
            return started
        origin, connection = started
        try:
            status, answer_headers, data, close = await _read_response(connection, method)
        except BodyTooLargeError as exc:
            self._forget(connection)
            return Answer(exc.status, failure="too_large", detail=str(exc))
        except (OSError, HTTPWireError, ValueError) as exc:
            self._forget(connection)
            return Answer(failure="no_answer", detail=f"{type(exc).__name__}: {exc}")
        except BaseException:  # cancelled: the connection is in an unknown state
            self._forget(connection)
            raise
        if close:
            self._forget(connection)
        else:
            self._keep(origin, connection)
        return Answer(status, answer_headers, data)

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        url: str,
        *,
        timeout_s: float,
        read_timeout_s: float = math.inf,
        connect_timeout_s: float | None = None,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
        conn: Connectivity = DIRECT,
    ) -> AsyncIterator[StreamedAnswer]:
        """One exchange whose body is read as it arrives (:meth:`StreamedAnswer.pieces`):
        over by ``timeout_s`` after it starts, no read waiting longer than ``read_timeout_s``
        (nor past that deadline). The head's failures are those of :meth:`send`. The
        connection is kept only when the body was read to its end inside the ``with``.
        With tracing on, a CLIENT span whose context the backend receives."""
        if not tracing.enabled():
            async with self._stream(
                method, url, timeout_s, read_timeout_s, connect_timeout_s, headers, body, conn
            ) as answer:
                yield answer
            return
        span = spans.http_span(method, url, tracing.OUTGOING.get())
        headers = {**(headers or {}), tracing.HEADER: tracing.traceparent_of(span)}
        status = 0
        failure: str | None = "no_answer"  # cancelled before an answer's head
        try:
            async with self._stream(
                method, url, timeout_s, read_timeout_s, connect_timeout_s, headers, body, conn
            ) as answer:
                status, failure = answer.status, answer.failure
                yield answer
        finally:
            spans.http_done(span, status, failure)

    @contextlib.asynccontextmanager
    async def _stream(
        self,
        method: str,
        url: str,
        timeout_s: float,
        read_timeout_s: float,
        connect_timeout_s: float | None,
        headers: Mapping[str, str] | None,
        body: bytes | None,
        conn: Connectivity,
    ) -> AsyncIterator[StreamedAnswer]:
        started = await self._start(
            method, url, timeout_s, read_timeout_s, connect_timeout_s, headers, body, conn
        )
        if isinstance(started, Answer):
            yield StreamedAnswer(failure=started.failure, detail=started.detail)
            return
        origin, connection = started
        try:
            head = await _read_head(connection, method)
        except (OSError, HTTPWireError, ValueError) as exc:
            self._forget(connection)
            yield StreamedAnswer(failure="no_answer", detail=f"{type(exc).__name__}: {exc}")
            return
        except BaseException:
            self._forget(connection)
            raise
        answer = StreamedAnswer(head.status, head.headers, connection=connection, head=head)
        try:
            yield answer
        finally:
            if answer.complete and not head.close:
                self._keep(origin, connection)
            else:
                self._forget(connection)

    def close(self) -> None:
        """Close every connection at once (in the event loop's thread)."""
        for connection in self._all:
            connection.abort()
        self._all.clear()
        self._idle.clear()

    @property
    def connections(self) -> int:
        """Connections open now, kept or in an exchange."""
        return len(self._all)


# (scheme, host, port, proxy URL or "", the backend's settings): what a kept connection serves
_Origin = tuple[str, str, int, str, Connectivity]


def _proxy_authorization(proxy: str) -> str | None:
    """``Basic`` credentials of a proxy URL's user-info (``http://user:pass@proxy:3128``)."""
    parts = urlsplit(proxy)
    if parts.username is None:
        return None
    pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
    return "Basic " + base64.b64encode(pair.encode()).decode()


async def _tunnel(
    connection: _Connection, host: str, port: int, auth: str | None, deadline: float
) -> None:
    """Ask the proxy on ``connection`` for a tunnel to ``host:port`` (``CONNECT``); raises
    OSError when it refuses (the backend has seen nothing)."""
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
    if auth:
        lines.append(f"Proxy-Authorization: {auth}")
    connection.deadline = deadline
    try:
        connection.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        status_line = (await connection.read_until(b"\r\n")).decode("latin-1")
        for _ in range(MAX_HEAD_LINES):
            if not await connection.read_until(b"\r\n"):
                break
        else:
            raise HTTPWireError("proxy answer head has too many lines")
    except (HTTPWireError, TimeoutError) as exc:
        raise OSError(f"proxy tunnel to {authority} failed: {exc}") from exc
    _, _, rest = status_line.partition(" ")
    if not rest.startswith("200"):
        raise OSError(f"proxy refused the tunnel to {authority}: {rest[:80]}")
    if connection.buffer:  # bytes after the proxy's answer: nothing a tunnel may carry yet
        raise OSError(f"proxy sent data before the tunnel to {authority} opened")


# how a body is framed, besides a Content-Length (>= 0)
_CHUNKED = -1
_TO_CLOSE = -2


@dataclass(frozen=True)
class _Head:
    status: int
    headers: dict[str, str]
    close: bool  # the connection cannot carry another exchange
    framing: int  # the Content-Length, _CHUNKED or _TO_CLOSE (0: no body)


async def _read_head(conn: _Connection, method: str) -> _Head:
    """The status and lower-cased headers of one HTTP/1.x response (interim 1xx skipped), and
    how its body is framed."""
    lines = 0
    while True:
        status_line = (await conn.read_until(b"\r\n")).decode("latin-1")
        version, _, rest = status_line.partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or not (code.isascii() and code.isdigit()):
            raise HTTPWireError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        status = int(code)
        headers: dict[str, str] = {}
        while True:
            line = (await conn.read_until(b"\r\n")).decode("latin-1")
            if not line:
                break
            lines += 1
            if lines > MAX_HEAD_LINES:
                raise HTTPWireError("response head has too many lines")
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if not 100 <= status < 200:
            break
        lines += 1  # an endless run of interim answers is a head too long
    connection = headers.get("connection", "").lower()
    close = connection == "close" or (version == "HTTP/1.0" and connection != "keep-alive")
    if method == "HEAD" or status in (204, 304):
        return _Head(status, headers, close, 0)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return _Head(status, headers, close, _CHUNKED)
    if "content-length" in headers:
        raw = headers["content-length"]
        try:
            length = int(raw)
        except ValueError:
            raise HTTPWireError(f"invalid Content-Length {raw[:40]!r}") from None
        if length < 0:
            raise HTTPWireError(f"negative Content-Length {length}")
        return _Head(status, headers, close, length)
    return _Head(status, headers, True, _TO_CLOSE)


def _chunk_size(line: bytes) -> int:
    field = line.split(b";", 1)[0].strip()
    if not field or len(field) > 16 or field.strip(b"0123456789abcdefABCDEF"):
        raise HTTPWireError(f"invalid chunk size line {line[:40]!r}")
    return int(field, 16)


async def _body(conn: _Connection, head: _Head) -> AsyncGenerator[bytes, None]:
    """The body's bytes as they arrive (chunked, Content-Length or read to the close), at
    most ``conn.limit`` of them (:class:`BodyTooLargeError`). Ends normally only at the
    body's end."""
    limit = conn.limit
    if head.framing == _TO_CLOSE:
        total = 0
        while True:
            try:
                piece = await conn.take(limit + 1)
            except ConnectionClosedError:
                return
            total += len(piece)
            if total > limit:
                raise BodyTooLargeError(head.status, total, limit)
            yield piece
    if head.framing == _CHUNKED:
        total = 0
        while True:
            size = _chunk_size(await conn.read_until(b"\r\n", MAX_CHUNK_LINE_BYTES))
            total += size
            if total > limit:
                raise BodyTooLargeError(head.status, total, limit)
            if size == 0:
                break
            while size:
                piece = await conn.take(size)
                size -= len(piece)
                yield piece
            if await conn.read_until(b"\r\n", MAX_CHUNK_LINE_BYTES):
                raise HTTPWireError("a chunk longer than its size")
        for _ in range(MAX_HEAD_LINES):  # trailers, up to the empty line
            if not await conn.read_until(b"\r\n"):
                return
        raise HTTPWireError("response trailers have too many lines")
    remaining = head.framing
    if remaining > limit:
        raise BodyTooLargeError(head.status, remaining, limit)
    while remaining:
        piece = await conn.take(remaining)
        remaining -= len(piece)
        yield piece


async def _read_response(conn: _Connection, method: str) -> tuple[int, dict[str, str], bytes, bool]:
    """(status, lower-cased headers, body, connection must close) of one HTTP/1.x response."""
    head = await _read_head(conn, method)
    body = bytearray()
    async for piece in _body(conn, head):
        body += piece
    return head.status, head.headers, bytes(body), head.close


__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DIRECT",
    "MAX_CHUNK_LINE_BYTES",
    "MAX_HEAD_LINES",
    "Answer",
    "BodyTooLargeError",
    "ConnectionClosedError",
    "Connectivity",
    "DeadlineError",
    "HTTPWireError",
    "KeepAliveHTTP",
    "Secret",
    "StreamedAnswer",
    "environment_proxy",
    "ssl_context",
]

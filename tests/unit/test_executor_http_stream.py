"""The executors' asynchronous keep-alive client reading a streamed body, against a real local
socket server: piece by piece, within its per-read and total bounds, which connections it keeps,
and how it holds back a backend that sends faster than it reads."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from agentruns.connectors.executors.http import (
    BUFFER_HIGH_BYTES,
    BodyTooLargeError,
    DeadlineError,
    HTTPWireError,
    KeepAliveHTTP,
    StreamedAnswer,
)
from agentruns.connectors.executors.model import Assembled, ModelHandler, RouteConfig, Routes
from agentruns.processors.events import ModelOutcome

T = TypeVar("T")
CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Backend:
    """A tiny HTTP/1.1 server: every request on every connection is answered by ``answer``
    (which writes raw bytes); counts the connections opened and those the client closed."""

    def __init__(self, answer: Callable[[socket.socket, threading.Event], None]) -> None:
        self.answer = answer
        self.stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1/chat/completions"
        self.opened = 0
        self.closed_by_client = 0
        self.requests: list[bytes] = []
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.opened += 1
                self._socks.append(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        buffer = b""
        with contextlib.suppress(OSError):
            while not self.stop.is_set():
                while b"\r\n\r\n" not in buffer:
                    data = sock.recv(65536)
                    if not data:
                        with self._lock:
                            self.closed_by_client += 1
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buffer) < length:
                    buffer += sock.recv(65536)
                with self._lock:
                    self.requests.append(head + b"\r\n\r\n" + buffer[:length])
                buffer = buffer[length:]
                self.answer(sock, self.stop)

    def wait_for(self, condition: Callable[[], bool]) -> bool:
        until = time.monotonic() + 10
        while not condition() and time.monotonic() < until:
            time.sleep(0.01)
        return condition()

    def close(self) -> None:
        self.stop.set()
        self.listener.close()
        with self._lock:
            for sock in self._socks:
                sock.close()


@contextlib.contextmanager
def backend(answer: Callable[[socket.socket, threading.Event], None]) -> Iterator[Backend]:
    server = Backend(answer)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def client() -> KeepAliveHTTP:
    return KeepAliveHTTP(connect_timeout_s=5.0)


def run(http: KeepAliveHTTP, body: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``body`` on an event loop of its own, the client's connections closed in it after."""

    async def main() -> T:
        try:
            return await body()
        finally:
            http.close()

    return asyncio.run(main())


def stream(
    http: KeepAliveHTTP, url: str, timeout_s: float = 30.0, read_timeout_s: float = 30.0
) -> contextlib.AbstractAsyncContextManager[StreamedAnswer]:
    return http.stream(
        "POST", url, timeout_s=timeout_s, read_timeout_s=read_timeout_s, body=b'{"a": 1}'
    )


async def everything(pieces: AsyncIterator[bytes]) -> list[bytes]:
    return [piece async for piece in pieces]


def whole_sse(sock: socket.socket, stop: threading.Event) -> None:
    sock.sendall(CHUNKED_HEAD + chunk(b"data: 1\n\n") + chunk(b"data: 2\n\n") + b"0\r\n\r\n")


def test_a_chunked_stream_is_read_piece_by_piece(client: KeepAliveHTTP) -> None:
    first_read = threading.Event()
    second_sent_after_first_read: list[bool] = []

    def answer(sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(CHUNKED_HEAD + chunk(b"data: 1\n\n"))
        # the second piece only once the client has the first: a client waiting for the
        # whole body would see it only after this wait ran out
        second_sent_after_first_read.append(first_read.wait(10))
        sock.sendall(chunk(b"data: 2\n\n") + b"0\r\n\r\n")

    async def body() -> None:
        async with stream(client, server.url) as answer_:
            assert (answer_.failure, answer_.status) == (None, 200)
            assert answer_.header("Content-Type") == "text/event-stream"
            pieces = []
            async for piece in answer_.pieces(1000):
                pieces.append(piece)
                first_read.set()
            assert pieces == [b"data: 1\n\n", b"data: 2\n\n"]
            assert answer_.complete

    with backend(answer) as server:
        run(client, body)
    assert second_sent_after_first_read == [True]
    assert server.requests[0].endswith(b'\r\n\r\n{"a": 1}')
    assert b"Content-Length: 8\r\n" in server.requests[0]


def test_a_stalled_stream_ends_at_the_read_bound_not_the_total_deadline(
    client: KeepAliveHTTP,
) -> None:
    def answer(sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(CHUNKED_HEAD + chunk(b"data: 1\n\n"))
        stop.wait(60)

    async def body() -> None:
        async with stream(client, server.url, 60.0, 0.2) as answer_:
            pieces = answer_.pieces(1000)
            assert await anext(pieces) == b"data: 1\n\n"
            with pytest.raises(TimeoutError) as raised:
                await anext(pieces)
            assert not isinstance(raised.value, DeadlineError)

    started = time.monotonic()
    with backend(answer) as server:
        run(client, body)
    assert time.monotonic() - started < 60  # the total deadline never came into it


def test_a_backend_dripping_bytes_cannot_extend_the_total_deadline(
    client: KeepAliveHTTP,
) -> None:
    def answer(sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(CHUNKED_HEAD + b"10000\r\n")
        while not stop.wait(0.02):
            sock.sendall(b":")  # every read gets a byte, well within the read bound

    async def body() -> None:
        async with stream(client, server.url, 0.5, 60.0) as answer_:
            with pytest.raises(DeadlineError):
                async for piece in answer_.pieces(1 << 20):
                    assert piece == b":" * len(piece)

    started = time.monotonic()
    with backend(answer) as server:
        run(client, body)
    assert time.monotonic() - started < 60


@pytest.mark.parametrize(
    "raw",
    [
        b"1" * 5000,  # a chunk-size line that never ends
        b"zz\r\n",
        b"-1\r\n",
        b"1_0\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n",
        b"0x10\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n",
        b"3\r\nabcdef\r\n0\r\n\r\n",  # a chunk longer than its size
        b"0\r\n" + b"X-Trailer: 1\r\n" * 300 + b"\r\n",
    ],
)
def test_a_broken_chunked_body_is_a_wire_error(client: KeepAliveHTTP, raw: bytes) -> None:
    def answer(sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(CHUNKED_HEAD + raw)
        stop.wait(60)

    async def body() -> None:
        async with stream(client, server.url) as answer_:
            with pytest.raises(HTTPWireError):
                await everything(answer_.pieces(1 << 20))
            assert not answer_.complete

    with backend(answer) as server:
        run(client, body)


@pytest.mark.parametrize(
    ("raw", "failure"),
    [
        (b"garbage\r\n\r\n", "no_answer"),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "no_answer"),
        (b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 300 + b"\r\n", "no_answer"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: nope\r\n\r\n", "no_answer"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "no_answer"),
        (b"HTTP/1.1 100 Continue\r\n\r\n" * 300, "no_answer"),
        (b"", "no_answer"),  # closed with no answer
    ],
)
def test_a_broken_head_is_no_answer(client: KeepAliveHTTP, raw: bytes, failure: str) -> None:
    def answer(sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)

    async def body() -> None:
        async with stream(client, server.url) as answer_:
            assert answer_.failure == failure
            assert await everything(answer_.pieces(100)) == []

    with backend(answer) as server:
        run(client, body)


def test_a_connection_that_cannot_be_opened_is_not_sent(client: KeepAliveHTTP) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()

    async def body() -> None:
        async with stream(client, f"http://127.0.0.1:{port}/v1/chat/completions") as answer_:
            assert answer_.failure == "not_sent"

    run(client, body)


def test_a_body_over_the_limit_is_not_read(client: KeepAliveHTTP) -> None:
    def answer(sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(CHUNKED_HEAD + chunk(b"x" * 8) + chunk(b"y" * 8) + b"0\r\n\r\n")

    async def body() -> None:
        async with stream(client, server.url) as answer_:
            pieces = answer_.pieces(10)
            assert await anext(pieces) == b"x" * 8
            with pytest.raises(BodyTooLargeError):
                await anext(pieces)
        async with stream(client, server.url) as answer_:
            assert b"".join(await everything(answer_.pieces(16))) == b"x" * 8 + b"y" * 8

    with backend(answer) as server:
        run(client, body)
        assert server.opened == 2  # the one over the limit was closed


def test_content_length_and_read_to_close_bodies_stream_to_their_end(
    client: KeepAliveHTTP,
) -> None:
    def sized(sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello")
        sock.sendall(b" world")

    def to_close(sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\n\r\nhello")
        sock.sendall(b" world")
        sock.shutdown(socket.SHUT_RDWR)

    async def twice() -> None:
        for _ in range(2):
            async with stream(client, server.url) as answer_:
                assert b"".join(await everything(answer_.pieces(100))) == b"hello world"

    async def over() -> None:
        async with stream(client, server.url) as answer_:
            with pytest.raises(BodyTooLargeError):
                await everything(answer_.pieces(5))

    for answer, connections in ((sized, 1), (to_close, 2)):
        with backend(answer) as server:
            run(client, twice)
            assert server.opened == connections
        with backend(answer) as server:
            run(client, over)


def test_a_stream_abandoned_early_closes_its_connection(client: KeepAliveHTTP) -> None:
    async def body() -> None:
        async with stream(client, server.url) as answer_:
            pieces = answer_.pieces(1000)
            assert await anext(pieces) == b"data: 1\n\n"
            await pieces.aclose()
        assert await asyncio.to_thread(server.wait_for, lambda: server.closed_by_client == 1)
        async with stream(client, server.url) as answer_:
            assert await everything(answer_.pieces(1000)) == [b"data: 1\n\n", b"data: 2\n\n"]

    with backend(whole_sse) as server:
        run(client, body)
        assert server.opened == 2


def test_a_stream_read_to_its_end_keeps_its_connection(client: KeepAliveHTTP) -> None:
    async def body() -> None:
        for _ in range(3):
            async with stream(client, server.url) as answer_:
                got = await everything(answer_.pieces(1000))
                assert got == [b"data: 1\n\n", b"data: 2\n\n"]
        assert server.closed_by_client == 0  # (the client closes it when it is closed)

    with backend(whole_sse) as server:
        run(client, body)
        assert (server.opened, len(server.requests)) == (1, 3)


def test_a_kept_connection_the_backend_closed_is_not_reused(client: KeepAliveHTTP) -> None:
    def answer_then_close(sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        sock.shutdown(socket.SHUT_RDWR)

    async def body() -> None:
        assert (await client.send("GET", server.url, timeout_s=30)).body == b"ok"
        assert await asyncio.to_thread(server.wait_for, lambda: server.closed_by_client == 1)
        await asyncio.sleep(0.05)  # the event loop learns the connection was closed
        async with stream(client, server.url) as answer_:
            assert b"".join(await everything(answer_.pieces(10))) == b"ok"

    with backend(answer_then_close) as server:
        run(client, body)
        assert server.opened == 2


def test_calls_in_flight_share_the_kept_connections_of_their_origin(
    client: KeepAliveHTTP,
) -> None:
    """Twenty calls at once open twenty connections; twenty more after them reuse them all."""
    opened_before = []

    async def body() -> None:
        async def one() -> bytes:
            async with stream(client, server.url) as answer_:
                return b"".join(await everything(answer_.pieces(1000)))

        assert await asyncio.gather(*(one() for _ in range(20))) == [b"data: 1\n\ndata: 2\n\n"] * 20
        opened_before.append(server.opened)
        await asyncio.gather(*(one() for _ in range(20)))

    with backend(whole_sse) as server:
        run(client, body)
        assert opened_before == [20] and server.opened == 20


def test_a_backend_sending_faster_than_it_is_read_is_held_back(client: KeepAliveHTTP) -> None:
    """A body sent as fast as the socket takes it while the reader waits: the connection stops
    reading at the buffer's high mark instead of taking it all into memory."""
    sent = []

    def flood(sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 67108864\r\n\r\n")
        piece, total = b"x" * 65536, 0
        with contextlib.suppress(OSError):
            sock.settimeout(2.0)
            while total < 64 * 1024 * 1024 and not stop.is_set():
                total += sock.send(piece)
        sent.append(total)

    async def body() -> None:
        async with stream(client, server.url) as answer_:
            pieces = answer_.pieces(1 << 30)
            await anext(pieces)
            await asyncio.sleep(3.0)  # the backend stops: the socket buffers are full
            buffered = len(answer_._connection.buffer) if answer_._connection else 0
            assert buffered <= BUFFER_HIGH_BYTES + (1 << 20)
            await pieces.aclose()

    with backend(flood) as server:
        run(client, body)
    assert sent and sent[0] < 64 * 1024 * 1024


# --------------------------------------------------------------------------- the model route


def completion(sock: socket.socket, stop: threading.Event, tail: bytes = b"0\r\n\r\n") -> None:
    events = [
        b'data: {"id": "c1", "choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n',
        b'data: {"id": "c1", "choices": [{"index": 0, "finish_reason": "stop", "delta": {}}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    sock.sendall(CHUNKED_HEAD + b"".join(chunk(e) for e in events) + tail)


def model_calls(url: str, count: int = 1, **route: Any) -> list[Assembled]:
    """``count`` calls of one model route in a row, by one handler on one event loop."""
    config = RouteConfig(base_url=url.removesuffix("/chat/completions"), **route)
    handler = ModelHandler("postgresql://unused", Routes({}, config))
    payload = {"model": "m", "messages": [], "stream": True}

    async def calls() -> list[Assembled]:
        try:
            return [await handler.stream(config, payload) for _ in range(count)]
        finally:
            handler.close()

    return asyncio.run(calls())


def test_a_model_route_keeps_its_connection_after_a_whole_stream() -> None:
    with backend(completion) as server:
        first, second = model_calls(server.url, 2)
        assert (first.outcome, first.content) == (ModelOutcome.FINISHED, "hi")
        assert second.outcome is ModelOutcome.FINISHED
        assert server.opened == 1
        request = server.requests[0]
        assert b"Content-Type: application/json\r\n" in request
        assert request.endswith(b'{"model":"m","messages":[],"stream":true}')


def test_a_model_stream_going_on_after_done_is_finished_and_its_connection_closed() -> None:
    def goes_on(sock: socket.socket, stop: threading.Event) -> None:
        completion(sock, stop, tail=chunk(b": more\n\n" * 200))  # and no end of the body

    with backend(goes_on) as server:
        first, second = model_calls(server.url, 2)
        assert (first.outcome, second.outcome) == (ModelOutcome.FINISHED, ModelOutcome.FINISHED)
        assert server.opened == 2


def test_a_model_stream_stalled_mid_way_ends_at_the_read_bound() -> None:
    def stalls(sock: socket.socket, stop: threading.Event) -> None:
        first = b'data: {"id": "c1", "choices": [{"index": 0, "delta": {"content": "h"}}]}\n\n'
        sock.sendall(CHUNKED_HEAD + chunk(first))
        stop.wait(60)

    with backend(stalls) as server:
        (assembled,) = model_calls(server.url, read_timeout_s=0.2, total_timeout_s=60.0)
    assert assembled.outcome is ModelOutcome.INCOMPLETE
    assert assembled.detail.startswith("connection lost: TimeoutError")


@pytest.mark.parametrize(
    ("raw", "outcome", "detail"),
    [
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"f" * 5000,
            "transport_error",
            "HTTPWireError",
        ),
        (
            b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbusy",
            "transport_error",
            "HTTP 503: busy",
        ),
        (
            b"HTTP/1.1 429 Slow\r\nRetry-After: 2\r\nContent-Length: 0\r\n\r\n",
            "rate_limited",
            "HTTP 429: ",
        ),
        (
            b"HTTP/1.1 529 Overloaded\r\nRetry-After: 3\r\nContent-Length: 0\r\n\r\n",
            "rate_limited",
            "HTTP 529: ",
        ),
        (
            b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 300 + b"\r\n",
            "transport_error",
            "HTTPWireError",
        ),
    ],
)
def test_a_broken_model_answer_is_classified(raw: bytes, outcome: str, detail: str) -> None:
    def answer(sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(raw)
        stop.wait(60)

    with backend(answer) as server:
        (assembled,) = model_calls(server.url, read_timeout_s=5.0, total_timeout_s=10.0)
    assert assembled.outcome.value == outcome
    assert assembled.detail.startswith(detail)
    if outcome == "rate_limited":
        assert assembled.retry_after_ms == (2000 if b"429" in raw else 3000)

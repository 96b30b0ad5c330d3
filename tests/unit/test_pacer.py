"""The test servers' pacer: one thread sends every paced stream's frames when due."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from agentruns.connectors.dev.servers.httpserver import Frames, Pacer


@pytest.fixture
def pacer() -> Iterator[Pacer]:
    p = Pacer()
    yield p
    p.close()


def test_frames_go_out_in_order_when_due(pacer: Pacer) -> None:
    ours, theirs = socket.socketpair()
    arrivals: list[tuple[float, bytes]] = []

    def read() -> None:
        while data := theirs.recv(1024):
            arrivals.append((time.monotonic(), data))

    reader = threading.Thread(target=read)
    reader.start()
    start = time.monotonic()
    frames: Frames = [(start + 0.05 * i, b"%d;" % i) for i in range(1, 6)]
    assert pacer.send(ours, frames) == []
    ours.close()
    reader.join(timeout=5)
    theirs.close()
    assert b"".join(data for _, data in arrivals) == b"1;2;3;4;5;"
    assert arrivals[0][0] >= start + 0.05
    assert arrivals[-1][0] >= start + 0.25


def test_streams_overlap_on_the_one_thread(pacer: Pacer) -> None:
    pairs = [socket.socketpair() for _ in range(50)]
    start = time.monotonic()
    results: list[Frames | None] = []

    def stream(sock: socket.socket) -> None:
        results.append(pacer.send(sock, [(start + 0.02 * i, b"x") for i in range(1, 11)]))

    threads = [threading.Thread(target=stream, args=(ours,)) for ours, _ in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert results == [[]] * 50
    assert time.monotonic() - start < 5.0  # 50 x 200 ms, side by side
    for ours, theirs in pairs:
        ours.close()
        assert theirs.recv(100) == b"x" * 10
        theirs.close()


def test_a_client_too_slow_to_keep_up_gets_the_rest_back(pacer: Pacer) -> None:
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    now = time.monotonic()
    frames: Frames = [(now, bytes([65 + i]) * 65536) for i in range(8)]
    rest = pacer.send(ours, frames)
    assert rest  # the socket buffer filled: the caller finishes the stream
    theirs.setblocking(False)
    received = b""
    while True:
        try:
            received += theirs.recv(1 << 20)
        except BlockingIOError:
            break
    assert received + b"".join(data for _, data in rest) == b"".join(d for _, d in frames)
    ours.close()
    theirs.close()


def test_a_gone_client_fails_the_stream(pacer: Pacer) -> None:
    ours, theirs = socket.socketpair()
    theirs.close()
    assert pacer.send(ours, [(time.monotonic(), b"x")]) is None
    ours.close()


def test_close_ends_waiting_streams_at_once() -> None:
    pacer = Pacer()
    ours, theirs = socket.socketpair()
    result: list[Frames | None] = []
    far = time.monotonic() + 60
    thread = threading.Thread(target=lambda: result.append(pacer.send(ours, [(far, b"x")])))
    thread.start()
    time.sleep(0.1)
    started = time.monotonic()
    pacer.close()
    thread.join(timeout=5)
    assert result == [None] and time.monotonic() - started < 1.0
    assert pacer.send(ours, [(time.monotonic(), b"x")]) is None  # closed for good
    ours.close()
    theirs.close()

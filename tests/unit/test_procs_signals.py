"""stop_on_signals: SIGTERM and SIGINT set the returned event instead of killing the process."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from agentruns.connectors.lifecycle import stop_on_signals


@pytest.fixture
def restored_handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_sets_the_stop_event(restored_handlers: None, signum: int) -> None:
    stop = stop_on_signals()
    assert not stop.is_set()
    os.kill(os.getpid(), signum)  # delivered to the main thread before kill returns here
    assert stop.wait(5)

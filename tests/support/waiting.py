"""Waiting for a condition that other threads, processes or the broker make true."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T | None],
    timeout: float = 20.0,
    what: str = "condition",
    *,
    every: float = 0.05,
) -> T:
    """Call `condition` every `every` seconds until it returns a truthy value, and return that
    value; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)

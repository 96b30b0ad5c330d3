"""The wall clock in epoch milliseconds, the unit of every `at` and deadline in the records.

Time enters the core only as values in events; this is where the edges (executors, timers, the
API, the clients, the benches) read it. It is not in `processors/`, which reads no clock.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime


def now_ms() -> int:
    """Milliseconds since the epoch, now."""
    return int(time.time() * 1000)


def ms_of(value: datetime | None) -> int | None:
    """A database timestamp in epoch milliseconds (None stays None)."""
    return None if value is None else int(value.timestamp() * 1000)


def datetime_of(ms: int) -> datetime:
    """Epoch milliseconds as an aware UTC datetime, for a database parameter."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC)

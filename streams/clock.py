"""The wall clock in epoch milliseconds, the unit of every `at` and deadline in the records.

Time enters the core only as values in events; this is where the edges (executors, timers, the
API, the clients, the benches) read it. It is not in `processors/`, which reads no clock.
"""

from __future__ import annotations

import time


def now_ms() -> int:
    """Milliseconds since the epoch, now."""
    return int(time.time() * 1000)

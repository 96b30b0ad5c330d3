"""How a service process ends: SIGTERM and SIGINT ask its loop to finish what it holds."""

from __future__ import annotations

import signal
import threading


def stop_on_signals() -> threading.Event:
    """An event that SIGTERM and SIGINT set, so a service's loop finishes what it holds, closes
    cleanly and exits 0 (call from the main thread)."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    return stop

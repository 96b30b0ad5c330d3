"""librdkafka's log lines through our logging, each kind of line at most once per interval.

librdkafka writes every log line to stderr itself unless the client is given a ``logger``: a
broker that restarts makes every client of the process print "Connection refused" lines by the
hundred. Every client config of ours is made from ``client_settings()``, which carries
``KAFKA_LOGS`` (see ``kafka_defaults``), so those lines reach the ``agentruns.kafka`` logger
instead, rate limited: the first line of a kind is logged, repeats within ``interval_s`` are
counted and the count goes with the next one logged.
A line's kind is its facility and text without the client's name and the numbers that change
from one repeat to the next (durations, counts); broker addresses stay, so two brokers failing
are two kinds.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

#: A number standing alone: "after 12ms", "3 identical error(s)"; not part of an address
#: ("127.0.0.1:9092"), a thread name ("thrd:2") or a client name ("producer-1").
_VARYING = re.compile(r"(?<![\w.:#/\[-])\d+(?:ms|s)?\b")
#: librdkafka's client names in a line: "rdkafka#producer-1", "rdkafka#consumer-12".
_CLIENT = re.compile(r"rdkafka#\w+-\d+")


def line_kind(facility: str, text: str) -> str:
    """What makes two log lines repeats of each other."""
    return facility + " " + _VARYING.sub("N", _CLIENT.sub("rdkafka", text))


class RateLimiter:
    """Admits the first event of each kind, then at most one per ``interval_s``."""

    #: Kinds remembered at most; older ones are forgotten first (their next line is admitted).
    MAX_KINDS = 1000

    def __init__(
        self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._kinds: dict[str, tuple[float, int]] = {}  # kind -> (admitted at, dropped since)
        self._lock = threading.Lock()

    def admit(self, kind: str) -> int | None:
        """None to drop this event; else how many of its kind were dropped since the last one
        admitted."""
        now = self._clock()
        with self._lock:
            held = self._kinds.get(kind)
            if held is not None and now - held[0] < self.interval_s:
                self._kinds[kind] = (held[0], held[1] + 1)
                return None
            self._kinds.pop(kind, None)
            if len(self._kinds) >= self.MAX_KINDS:
                del self._kinds[next(iter(self._kinds))]
            self._kinds[kind] = (now, 0)
            return 0 if held is None else held[1]


class KafkaLog:
    """What confluent-kafka's ``logger`` setting calls: ``log(level, "%s [%s] %s", facility,
    client name, text)``, from the thread that polls the client."""

    def __init__(self, logger: logging.Logger, limiter: RateLimiter) -> None:
        self.logger = logger
        self.limiter = limiter

    def log(self, level: int, msg: str, *args: Any) -> None:
        if not self.logger.isEnabledFor(level):
            return
        facility = str(args[0]) if args else ""
        text = str(args[-1]) if args else msg
        dropped = self.limiter.admit(line_kind(facility, text))
        if dropped is None:
            return
        line = msg % args if args else msg
        if dropped:
            line += f" ({dropped} more like it since the last)"
        self.logger.log(level, "librdkafka %s", line)


#: The one instance every client of the process shares: repeats are counted across clients.
KAFKA_LOG = KafkaLog(logging.getLogger("agentruns.kafka"), RateLimiter())

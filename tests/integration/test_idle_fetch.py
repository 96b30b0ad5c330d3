"""How often our long-lived consumers fetch: rarely when idle (`LONG_POLL_MS`), and the
processor in windows (`fetch_window_ms`) while inputs trickle in.

Every fetch answer costs the broker a request: on our 2-core machines one idle consumer at the
former 10 ms wait took 0.11 of a broker core. Counted from librdkafka's own statistics (request
counters per broker), so a slow machine can only lower the rates, never fail the test.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agentruns.connectors.dev.servers import tool_server
from agentruns.connectors.executors.config import ExecutorConfig
from agentruns.connectors.executors.tool import ToolExecutor
from agentruns.streams.processor import ProcessorConfig
from agentruns.streams.records import input_record
from tests.support.pipeline import Inbox, running_on_thread, running_processor, submitted
from tests.support.runlog import running_sink
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
PARTITIONS = 2
STATS_MS = 500
#: an idle consumer asks ~1000 / LONG_POLL_MS = 10 times a second (~100 at the former 10 ms);
#: room left for a rebalance's extra fetches
MAX_IDLE_FETCHES_PER_S = 30.0


class FetchCounter:
    """librdkafka statistics callback: (timestamp µs, Fetch requests sent so far) per report."""

    def __init__(self) -> None:
        self.samples: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def config(self) -> dict[str, Any]:
        return {"statistics.interval.ms": STATS_MS, "stats_cb": self._on_stats}

    def _on_stats(self, raw: str) -> None:
        stats = json.loads(raw)
        fetches = sum(
            broker["req"].get("Fetch", 0)
            for broker in stats["brokers"].values()
            if broker.get("nodeid", -1) >= 0  # not the bootstrap placeholder
        )
        with self._lock:
            self.samples.append((int(stats["ts"]), fetches))

    def rate_over_last(self, reports: int) -> float:
        """Fetch requests per second between the last `reports` + 1 reports."""
        with self._lock:
            (t0, f0), (t1, f1) = self.samples[-reports - 1], self.samples[-1]
        return (f1 - f0) / ((t1 - t0) / 1e6)

    def reports(self) -> int:
        with self._lock:
            return len(self.samples)

    def wait_settled(self) -> None:
        """Past the assignment and its first fetches (the first reports)."""
        wait_for(lambda: self.reports() >= 6, timeout=60, what="statistics reports")


def _idle_rate(start: Callable[[FetchCounter], Any]) -> float:
    """Fetches/s of a component's consumer once assigned and idle for 3 s."""
    counter = FetchCounter()
    with start(counter):
        counter.wait_settled()
        reports = counter.reports()
        wait_for(lambda: counter.reports() >= reports + 6, timeout=60, what="idle reports")
        return counter.rate_over_last(6)


def test_processor_fetches_trickling_inputs_in_windows(
    kafka_bootstrap: str, database_url: str, prefix: str
) -> None:
    """200 inputs/s, each sent on its own, to a processor fetching in 20 ms windows
    (`--fetch-window-ms 20`; the default, 0, fetches each as it lands): without the window
    each one answers a fetch."""
    counter = FetchCounter()
    config = ProcessorConfig(
        bootstrap=kafka_bootstrap,
        prefix=prefix,
        group_id=f"{prefix}-proc",
        extra_consumer=counter.config(),
        fetch_window_ms=20,
    )
    inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
    try:
        with running_processor(config, database_url):
            counter.wait_settled()
            reports = counter.reports()
            began = time.monotonic()
            for i in range(600):  # 3 s
                while time.monotonic() < began + i / 200:
                    time.sleep(0.001)
                inbox.send(input_record(submitted(f"{prefix}-{i}")))
                inbox.flush()  # on the wire now, as from a producer of its own
            elapsed_reports = counter.reports() - reports
            rate = counter.rate_over_last(max(1, elapsed_reports - 1))
    finally:
        inbox.close()
    # one fetch per window at most, with room for the windows a rebalance or a slow host cuts
    assert rate <= 1.5 * 1000 / config.fetch_window_ms, rate


def test_idle_executor_and_sink_poll_rarely(
    kafka_bootstrap: str, database_url: str, prefix: str
) -> None:

    @contextmanager
    def executor(counter: FetchCounter) -> Iterator[None]:
        config = ExecutorConfig(
            kafka_bootstrap, database_url, "tool", prefix=prefix, extra_consumer=counter.config()
        )
        tools = ToolExecutor(config, tool_server.DEFAULT_REGISTRY)
        with running_on_thread(tools.run, "tool executor"):
            yield

    @contextmanager
    def sink(counter: FetchCounter) -> Iterator[None]:
        with running_sink(kafka_bootstrap, database_url, prefix, extra_consumer=counter.config()):
            yield

    rates = {"executor": _idle_rate(executor), "sink": _idle_rate(sink)}
    assert all(rate <= MAX_IDLE_FETCHES_PER_S for rate in rates.values()), rates
    # and they do fetch: the consumers are assigned and long-polling, not stalled
    assert all(rate > 0 for rate in rates.values()), rates

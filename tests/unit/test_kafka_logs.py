"""librdkafka's log lines: kinds, the rate limit per kind, what reaches our logger."""

from __future__ import annotations

import logging

import pytest

from agentruns.streams.kafka_logs import KafkaLog, RateLimiter, line_kind

REFUSED = (
    "[thrd:127.0.0.1:{port}/bootstrap]: 127.0.0.1:{port}/bootstrap: Connect to "
    "ipv4#127.0.0.1:{port} failed: Connection refused (after {ms}ms in state CONNECT)"
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_repeats_are_one_kind_whatever_their_durations_and_client() -> None:
    first = line_kind("FAIL", REFUSED.format(port=9092, ms=0))
    again = line_kind("FAIL", REFUSED.format(port=9092, ms=1503))
    assert first == again
    assert line_kind("FAIL", "rdkafka#producer-1: x") == line_kind("FAIL", "rdkafka#consumer-7: x")


def test_other_brokers_and_facilities_are_other_kinds() -> None:
    one = line_kind("FAIL", REFUSED.format(port=9092, ms=0))
    assert one != line_kind("FAIL", REFUSED.format(port=9094, ms=0))
    assert one != line_kind("ERROR", REFUSED.format(port=9092, ms=0))


def test_the_limiter_admits_one_per_interval_and_counts_the_rest() -> None:
    clock = Clock()
    limiter = RateLimiter(interval_s=60.0, clock=clock)
    assert limiter.admit("a") == 0
    assert [limiter.admit("a") for _ in range(500)] == [None] * 500
    assert limiter.admit("b") == 0  # another kind has its own budget
    clock.now += 59.0
    assert limiter.admit("a") is None
    clock.now += 1.0
    assert limiter.admit("a") == 501
    assert limiter.admit("a") is None


def test_the_limiter_forgets_the_oldest_kinds_beyond_its_bound() -> None:
    limiter = RateLimiter(interval_s=60.0, clock=Clock())
    for n in range(RateLimiter.MAX_KINDS + 1):
        assert limiter.admit(f"kind {n}") == 0
    assert limiter.admit("kind 0") == 0  # forgotten, so admitted again
    assert limiter.admit(f"kind {RateLimiter.MAX_KINDS}") is None


def test_a_broker_restart_yields_a_line_not_hundreds(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = KafkaLog(logging.getLogger("agentruns.kafka.test"), RateLimiter(60.0, clock))
    with caplog.at_level(logging.INFO, logger="agentruns.kafka.test"):
        for ms in range(580):
            log.log(
                logging.ERROR,
                "%s [%s] %s",
                "FAIL",
                "rdkafka#producer-1",
                REFUSED.format(port=1, ms=ms),
            )
        clock.now += 60.0
        log.log(
            logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-2", REFUSED.format(port=1, ms=3)
        )
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("librdkafka FAIL [rdkafka#producer-1] [thrd:127.0.0.1:1/bootstrap]")
    assert lines[1].endswith("(579 more like it since the last)")
    assert all(r.levelno == logging.ERROR for r in caplog.records)


def test_lines_below_the_loggers_level_are_not_counted(caplog: pytest.LogCaptureFixture) -> None:
    limiter = RateLimiter(60.0, Clock())
    log = KafkaLog(logging.getLogger("agentruns.kafka.quiet"), limiter)
    with caplog.at_level(logging.WARNING, logger="agentruns.kafka.quiet"):
        log.log(logging.DEBUG, "%s [%s] %s", "BROKER", "rdkafka#producer-1", "added")
    assert caplog.records == []
    assert limiter.admit(line_kind("BROKER", "added")) == 0

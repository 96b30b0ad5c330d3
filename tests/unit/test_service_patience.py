"""A long-running service waits for a configured Kafka or Postgres that does not answer yet; a
command run by hand fails at once."""

from __future__ import annotations

import time

import pytest

from agentruns.connectors import endpoints as services
from agentruns.connectors.dev.stack.procs import free_port_block
from agentruns.connectors.errors import ServiceUnreachableError


def test_an_answer_within_the_patience_ends_the_wait() -> None:
    tries: list[float] = []

    def attempt() -> None:
        tries.append(time.monotonic())
        if len(tries) < 3:
            raise ServiceUnreachableError("Kafka at x does not answer")

    services._patiently(attempt, patience_s=30.0)
    assert len(tries) == 3
    assert tries[2] - tries[0] < 10  # tried again every few seconds, not at the deadline


def test_without_patience_the_first_failure_is_the_answer() -> None:
    tries = 0

    def attempt() -> None:
        nonlocal tries
        tries += 1
        raise ServiceUnreachableError("Postgres at x does not answer")

    with pytest.raises(ServiceUnreachableError):
        services._patiently(attempt, patience_s=0.0)
    assert tries == 1


def test_a_broker_that_never_answers_is_given_up_after_the_patience() -> None:
    dead = f"127.0.0.1:{free_port_block(1, start=29600)}"
    began = time.monotonic()
    with pytest.raises(ServiceUnreachableError, match=f"Kafka at {dead} does not answer"):
        services.check_kafka(dead, timeout=0.5, patience_s=2.0)
    assert 2.0 <= time.monotonic() - began < 15

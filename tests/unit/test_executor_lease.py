"""The lease of a start: how long another member leaves a key alone that this one started.

Whatever a registry's timeout says (huge, infinite, negative, not a number), the lease is a
number of seconds the database can subtract from its clock, at most a day."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from agentruns.connectors.dev.servers import tool_server
from agentruns.connectors.executors.config import ExecutorConfig
from agentruns.connectors.executors.loop import LEASE_SLACK_S, MAX_LEASE_S, lease_s
from agentruns.connectors.executors.tool import ToolHandler, ToolRegistry
from tests.support.executors import Ids

CONFIG = ExecutorConfig(bootstrap="unused:9092", database_url="postgresql://unused/x", kind="tool")


def test_a_lease_covers_every_attempt_its_back_offs_and_a_slack() -> None:
    # 3 attempts of 10 s, back-offs of 0.2 and 0.4 s
    assert lease_s(10.0, CONFIG) == 3 * 10.0 + 0.6 + LEASE_SLACK_S


def test_nothing_to_wait_for_has_no_lease() -> None:
    for value in (0.0, -5.0, math.nan):
        assert lease_s(value, CONFIG) == 0.0


@given(
    exclusive=st.floats(allow_nan=True, allow_infinity=True),
    attempts=st.integers(min_value=-5, max_value=10_000),
    backoff_ms=st.integers(min_value=-1000, max_value=10**9),
)
def test_a_lease_is_a_bounded_number_whatever_it_is_made_of(
    exclusive: float, attempts: int, backoff_ms: int
) -> None:
    config = ExecutorConfig(
        bootstrap="unused:9092",
        database_url="postgresql://unused/x",
        kind="tool",
        handler_attempts=attempts,
        handler_backoff_ms=backoff_ms,
    )
    lease = lease_s(exclusive, config)
    assert math.isfinite(lease) and 0.0 <= lease <= MAX_LEASE_S


def test_a_tool_call_has_a_lease_a_look_up_none() -> None:
    registry = ToolRegistry.load(tool_server.DEFAULT_REGISTRY)
    handler = ToolHandler(registry)
    try:
        call = Ids("run-lease").call("create_ticket", {"title": "t"})
        timeout_s = registry.tools["create_ticket"].timeout_ms / 1000
        assert handler.exclusive_s(call) == timeout_s + handler.lookup_timeout_s
        assert handler.exclusive_s(Ids("run-lease").reconcile(call)) == 0.0
    finally:
        handler.close()

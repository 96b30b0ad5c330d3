"""Per-route limits (`agentruns.connectors.executors.limits`) and where they are configured:
model routes (`RouteConfig`) and tools (the registry)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentruns.connectors.executors.base import ExecutorError
from agentruns.connectors.executors.limits import RouteLimiter, RouteLimits
from agentruns.connectors.executors.model import RouteConfig, Routes
from agentruns.connectors.executors.tool import ToolRegistry


def limiter(**limits: Any) -> RouteLimiter:
    return RouteLimiter(lambda route: RouteLimits(**limits) if route == "r" else RouteLimits())


def test_calls_at_once_wait_for_one_to_end_and_other_routes_never_wait() -> None:
    lim = limiter(max_in_flight=2)
    permits = [lim.start("r", 0.0), lim.start("r", 0.0)]
    assert lim.wait_s("r", 0.0) is None  # until a call ends
    assert lim.wait_s("other", 0.0) == 0.0
    lim.end(permits[0], 1.0)
    assert lim.wait_s("r", 1.0) == 0.0


def test_a_request_rate_spreads_a_burst_at_its_rate() -> None:
    lim = limiter(requests_per_minute=120)  # 2 a second; a bucket of one second's worth
    starts = []
    now = 0.0
    while len(starts) < 6:
        wait = lim.wait_s("r", now)
        assert wait is not None
        if wait == 0:
            lim.end(lim.start("r", now), now)
            starts.append(now)
        else:
            now += wait
    assert starts[:2] == [0.0, 0.0]  # the bucket's burst
    assert starts[-1] == pytest.approx(2.0)  # then one every half second


def test_tokens_are_charged_as_used_and_the_estimate_follows_the_calls() -> None:
    lim = limiter(tokens_per_minute=6000, tokens_per_call=100)  # 100 a second
    permit = lim.start("r", 0.0)
    lim.end(permit, 0.0, tokens=400)  # used four times the estimate: the bucket is in debt
    wait = lim.wait_s("r", 0.0)
    assert wait is not None and wait > 0
    assert lim.wait_s("r", 10.0) == 0.0  # the rate paid it back


def test_a_backend_back_off_holds_the_route_until_it_passes() -> None:
    lim = limiter()
    lim.end(lim.start("r", 0.0), 0.0, throttle_s=2.0)
    assert lim.wait_s("r", 1.0) == pytest.approx(1.0)
    assert lim.wait_s("r", 2.0) == 0.0
    assert lim.wait_s("other", 1.0) == 0.0


def test_a_cancelled_start_gives_its_slot_and_request_back() -> None:
    lim = limiter(max_in_flight=1, requests_per_minute=60)
    permit = lim.start("r", 0.0)
    assert lim.wait_s("r", 0.0) is None
    lim.cancel(permit, 0.0)
    assert lim.wait_s("r", 0.0) == 0.0


@given(
    st.lists(st.tuples(st.floats(0, 5), st.integers(0, 3000), st.booleans()), max_size=60),
    st.integers(1, 5),
)
def test_a_route_never_has_more_calls_at_once_than_its_limit(
    steps: list[tuple[float, int, bool]], limit: int
) -> None:
    lim = limiter(max_in_flight=limit, requests_per_minute=600, tokens_per_minute=60_000)
    now, running = 0.0, []
    for gap, tokens, start in steps:
        now += gap
        wait = lim.wait_s("r", now)
        if start and wait == 0:
            running.append(lim.start("r", now))
        elif running:
            lim.end(running.pop(0), now, tokens=tokens)
        assert lim.in_flight("r") == len(running) <= limit
        assert wait is None or (0 <= wait < math.inf)


@pytest.mark.parametrize(
    "limits",
    [
        {"max_in_flight": 0},
        {"max_in_flight": -3},
        {"requests_per_minute": 0},
        {"requests_per_minute": -1.0},
        {"tokens_per_minute": math.inf},
        {"tokens_per_minute": math.nan},
        {"tokens_per_call": 0},
    ],
)
def test_a_limit_that_cannot_be_is_refused(limits: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RouteLimits(**limits)


def test_a_routes_file_with_an_impossible_limit_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "routes.json"
    path.write_text(json.dumps({"gpt": {"model": "gpt-x", "tokens_per_minute": -5}}))
    with pytest.raises(ExecutorError, match="invalid model routes file"):
        Routes.from_env(str(path), "http://127.0.0.1:1/v1")


def test_routes_share_the_limits_of_the_entry_they_are_called_through() -> None:
    routes = Routes(
        {"gpt": RouteConfig(requests_per_minute=60), "*": RouteConfig(max_in_flight=3)},
        RouteConfig(),
    )
    assert routes.name_of("gpt") == "gpt"
    assert routes.name_of("scenario:anything") == routes.name_of("other") == "*"
    assert routes.get(routes.name_of("other")).limits().max_in_flight == 3
    assert Routes({}, RouteConfig()).name_of("x") == ""


@pytest.mark.parametrize(
    "entry",
    [
        {"max_in_flight": "ten"},
        {"max_in_flight": True},
        {"max_in_flight": 0},
        {"requests_per_minute": "fast"},
        {"requests_per_minute": -60},
    ],
)
def test_a_registry_tool_with_an_impossible_limit_is_refused(
    tmp_path: Path, entry: dict[str, Any]
) -> None:
    path = tmp_path / "tools.json"
    tool = {"name": "t", "endpoint": "/t", **entry}
    path.write_text(json.dumps({"base_url": "http://127.0.0.1:1", "tools": [tool]}))
    with pytest.raises(ExecutorError, match="invalid tool registry"):
        ToolRegistry.load(path)


def test_a_registry_tool_carries_its_limits(tmp_path: Path) -> None:
    path = tmp_path / "tools.json"
    tool = {"name": "t", "endpoint": "/t", "max_in_flight": 4, "requests_per_minute": 30}
    path.write_text(json.dumps({"base_url": "http://127.0.0.1:1", "tools": [tool]}))
    limits = ToolRegistry.load(path).tools["t"].limits
    assert (limits.max_in_flight, limits.requests_per_minute) == (4, 30)

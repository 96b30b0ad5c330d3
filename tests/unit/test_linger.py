"""A poll lingers for company only while records come at least one per window."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agentruns.streams.polling import Linger


def test_a_quiet_stream_never_lingers() -> None:
    linger = Linger(0.010)
    assert linger.window(0.0) == 0.0
    for i in range(50):  # 50 records a second, a trickle: a 10 ms window brings half a record
        linger.observe(1, i * 0.02)
    assert linger.window(1.0) == 0.0


def test_a_busy_stream_lingers_and_stops_once_it_quiets() -> None:
    linger = Linger(0.010)
    for i in range(200):  # 200 a second: two records a window
        linger.observe(1, i * 0.005)
    assert linger.window(1.0) == 0.010
    assert linger.window(2.5) == 0.0  # a second and a half of nothing


def test_no_window_never_lingers() -> None:
    linger = Linger(0.0)
    linger.observe(1000, 0.0)
    assert linger.window(0.0) == 0.0


@given(st.lists(st.tuples(st.floats(0, 0.5), st.integers(0, 50)), max_size=60))
def test_the_count_is_what_came_within_the_horizon(polls: list[tuple[float, int]]) -> None:
    linger, now, seen = Linger(0.010), 0.0, []
    for gap, records in polls:
        now += gap
        linger.observe(records, now)
        seen.append((now, records))
    expected = sum(r for t, r in seen if t >= now - Linger.HORIZON_S)
    assert linger.window(now) == (0.010 if expected / Linger.HORIZON_S * 0.010 >= 1 else 0.0)

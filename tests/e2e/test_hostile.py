"""The hostile-world suite: every hostile case of `agentruns.connectors.dev.servers.hostile` goes in
through its door
(inbox, API, effect and event topics, model and tool servers) among good runs, against the real
broker, Postgres and servers, with every component a process of its own and no fault injected.

Every good run ends as it would alone, every hostile input ends as its case says (its run's
terminal reason, its dead letter at its position, or the API's status), no component exits on
its own, and every consumer group has consumed everything (no stalled partition).
"""

from __future__ import annotations

import pytest

from agentruns.connectors.dev.demo.chaos import ok_figures, run_chaos
from agentruns.connectors.dev.servers.hostile import cases


@pytest.mark.timeout(900)
def test_hostile_inputs_through_every_door_end_as_they_must_and_stop_nothing() -> None:
    figures = run_chaos(
        runs=20,
        minutes=8,
        kill_every=0,
        broker_restart=False,
        broker_pause=False,
        seed=24,
        submit_seconds=20,
        hostile=True,
    )
    assert figures["hostile_injected"] >= len(cases(api=True)) >= 25, figures
    assert figures["hostile_misses"] == {}, figures["hostile_misses"]
    assert figures["crashes"] == 0, figures
    assert figures["stalls"] == {}, figures
    assert figures["unexpected_statuses"] == {}, figures
    assert figures["lost"] == 0 and figures["terminal_twice"] == 0, figures
    assert figures["dlq_unexpected"] == [], figures
    assert figures["audit_differences"] == 0, figures["audit_first"]
    assert ok_figures(figures)

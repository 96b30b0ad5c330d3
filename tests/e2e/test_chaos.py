"""The bounded chaos run inside `make test` (the long form is `agentruns chaos --minutes N`).

Mixed runs while random components are killed -9 and restarted, or paused past their session
timeout and resumed (zombies), and the broker restarts once and stands still once:
every run ends exactly once, no tool key executes twice, the audit finds the log, snapshots
and Postgres in agreement, and the DLQ holds exactly the injected bad inputs.
"""

from __future__ import annotations

import pytest

from agentruns.connectors.dev.demo.chaos import ok_figures, run_chaos


@pytest.mark.timeout(900)
def test_chaos_kills_lose_and_repeat_nothing() -> None:
    figures = run_chaos(
        runs=30,
        minutes=8,
        kill_every=3.0,
        broker_restart=True,
        seed=11,
        submit_seconds=45,
        pause_share=0.3,
    )
    assert figures["kills"] >= 3 and figures["pauses"] >= 1, figures
    # The broker is restarted only when it is ours (not one given by KAFKA_BOOTSTRAP_SERVERS).
    assert figures["broker_restarts"] == int(figures["broker_restartable"]), figures
    assert figures["broker_pauses"] == int(figures["broker_restartable"]), figures
    assert figures["lost"] == 0, figures
    assert figures["terminal_twice"] == 0, figures
    assert figures["duplicate_tool_executions"] == 0, figures
    assert figures["audit_differences"] == 0, figures["audit_first"]
    assert figures["dlq"] == figures["dlq_injected"], figures
    assert ok_figures(figures)

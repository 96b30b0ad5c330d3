"""The bounded cluster chaos run inside `make test` (the long form is `agentruns chaos --brokers 3
--minutes 10`).

A local cluster of three brokers (every topic 3 replicas, `min.insync.replicas=2`, producers
with acks=all) while components are killed -9 or paused and, one fault in three, the broker
leading the most inbox partitions, the processor's transaction coordinator, the active
controller, or two brokers at once (below `min.insync.replicas`) are killed -9 and started
again: every run ends exactly once, no tool key executes twice, the audit agrees, every input
the brokers acknowledged is in the inbox and was consumed, and each fault's stall is measured.
"""

from __future__ import annotations

import pytest
from agentruns.connectors.demo.chaos import ok_figures, run_chaos
from agentruns.connectors.demo.cluster_faults import CLUSTER_FAULTS


@pytest.mark.timeout(600)
def test_cluster_faults_lose_and_repeat_nothing() -> None:
    figures = run_chaos(
        runs=20,
        minutes=5,
        kill_every=3.0,
        broker_restart=False,
        broker_pause=False,
        seed=5,
        submit_seconds=40,
        pause_share=0.2,
        brokers=3,
    )
    kinds = {f["fault"] for f in figures["cluster_faults"]}
    assert kinds == set(CLUSTER_FAULTS), figures
    assert all(f["stall_s"] is not None for f in figures["cluster_faults"]), figures
    assert set(figures["fault_stall_s"]) == set(CLUSTER_FAULTS), figures
    assert figures["acknowledged"] >= figures["runs"], figures
    assert figures["acknowledged_lost"] == 0, figures
    assert figures["acknowledged_unconsumed"] == 0, figures
    assert figures["lost"] == 0, figures
    assert figures["terminal_twice"] == 0, figures
    assert figures["duplicate_tool_executions"] == 0, figures
    assert figures["audit_differences"] == 0, figures["audit_first"]
    assert figures["dlq"] == figures["dlq_injected"], figures
    assert ok_figures(figures), figures

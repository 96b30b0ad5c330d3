"""The bounded cluster chaos run inside `make test` (the long form is `agentruns chaos --brokers 3
--minutes 10`).

A local cluster of three brokers (every topic 3 replicas, `min.insync.replicas=2`, producers
with acks=all) while components are killed -9 or paused and, one fault in three, the broker
leading the most inbox partitions, the processor's transaction coordinator, the active
controller, or two brokers at once (below `min.insync.replicas`) are killed -9 and started
again; and, each broker in a network namespace of its own, the leading broker is cut off from
the other two, and every client from the transaction coordinator, for a while. Every run ends
exactly once, no tool key executes twice, the audit agrees, every input the brokers
acknowledged is in the inbox and was consumed, and each fault's stall is measured.
"""

from __future__ import annotations

import pytest

from agentruns.connectors.dev.demo.chaos import ok_figures, run_chaos
from agentruns.connectors.dev.demo.cluster_faults import CLUSTER_FAULTS, PARTITION_FAULTS


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
    assert figures["partition_faults"] == "made", figures
    every = set(CLUSTER_FAULTS + PARTITION_FAULTS)
    kinds = {f["fault"] for f in figures["cluster_faults"]}
    assert kinds == every, figures
    assert all(f["stall_s"] is not None for f in figures["cluster_faults"]), figures
    assert set(figures["fault_stall_s"]) == every, figures
    assert figures["acknowledged"] >= figures["runs"], figures
    assert figures["acknowledged_lost"] == 0, figures
    assert figures["acknowledged_unconsumed"] == 0, figures
    assert figures["lost"] == 0, figures
    assert figures["terminal_twice"] == 0, figures
    assert figures["duplicate_tool_executions"] == 0, figures
    assert figures["audit_differences"] == 0, figures["audit_first"]
    assert figures["dlq"] == figures["dlq_injected"], figures
    assert ok_figures(figures), figures

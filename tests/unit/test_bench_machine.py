"""`agentruns.bench.machine`: whose CPU a bench phase used, by process group."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from agentruns.bench.machine import GROUPS, MachineCpu, group_of, inherited


def test_processes_are_grouped_by_label_then_by_what_they_run() -> None:
    labels = {4242: "processor"}
    assert (
        group_of(4242, "python", "python -m agentruns.connectors.runtime.processor", labels)
        == "processor"
    )
    assert group_of(os.getpid(), "python", "pytest", labels) == "bench"
    assert group_of(7, "java", "java -Xmx768m -cp x kafka.Kafka server.properties", {}) == "broker"
    assert group_of(8, "postgres", "/usr/lib/postgresql/15/bin/postgres -D d", {}) == "postgres"
    assert group_of(9, "postgres: 15/main: checkpointer", "", {}) == "postgres"
    assert group_of(10, "kworker/0:1", "", {}) == "other"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="Linux /proc only")
def test_a_busy_labelled_process_shows_in_its_own_group() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        machine = MachineCpu.start({busy.pid: "busy"})
        time.sleep(1.0)
        figures = machine.stop()
    finally:
        busy.kill()
        busy.wait()
    cores = figures["cores_by_process"]
    assert list(cores) == ["busy", *GROUPS]
    # a busy loop gets a good part of a core even on a shared two-core machine
    assert cores["busy"] > 0.1
    assert all(v >= 0 for v in cores.values())
    assert sum(cores.values()) <= (os.cpu_count() or 1) + 0.5


def test_a_label_holds_for_the_descendants_of_the_labelled_process() -> None:
    # 10 postmaster, 11 and 12 its backends, 13 a backend's child; 20 somebody else's
    parents = {10: 1, 11: 10, 12: 10, 13: 12, 20: 1, 1: 0}
    labels = inherited({10: "postgres", 30: "processor"}, parents)
    assert labels == {
        10: "postgres",
        11: "postgres",
        12: "postgres",
        13: "postgres",
        30: "processor",
    }


def test_a_labelled_group_leaves_other_tenants_services_out() -> None:
    broker = "java -cp x kafka.Kafka server.properties"
    ours = {7: "broker", 8: "postgres"}
    assert group_of(7, "java", broker, ours) == "broker"
    assert group_of(17, "java", broker, ours) == "other"  # another tenant's broker
    assert group_of(18, "postgres", "/usr/lib/postgresql/15/bin/postgres", ours) == "other"
    assert group_of(17, "java", broker, {}) == "broker"

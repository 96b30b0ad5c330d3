"""librdkafka's log lines reach our logger, rate limited: clients pointed at a port where no
broker listens log a few lines in a process, not one per reconnection attempt."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from agentruns.connectors.dev.stack.procs import free_port_block

CLIENTS = """
    import time
    from agentruns.streams.kafka_defaults import KAFKA_LOGS
    from confluent_kafka import Consumer, Producer

    settings = {{"bootstrap.servers": "127.0.0.1:{port}", "reconnect.backoff.max.ms": 100}}
    if {routed}:
        settings.update(KAFKA_LOGS)
    producer = Producer(settings)
    consumer = Consumer({{**settings, "group.id": "g"}})
    consumer.subscribe(["t"])
    began = time.monotonic()
    while time.monotonic() - began < 8:
        producer.poll(0.1)
        consumer.poll(0.1)
    print("done")
"""


def stderr_of_clients(*, routed: bool) -> list[str]:
    port = free_port_block(1, start=29600)
    script = textwrap.dedent(CLIENTS).format(port=port, routed=routed)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0 and result.stdout == "done\n", result.stderr
    return result.stderr.splitlines()


def test_clients_at_a_dead_port_log_a_few_lines_not_hundreds() -> None:
    raw = stderr_of_clients(routed=False)
    assert len(raw) > 20  # librdkafka's own: a line per reconnection attempt and client
    lines = stderr_of_clients(routed=True)
    assert 1 <= len(lines) <= 4, "\n".join(lines)
    assert all(line.startswith("librdkafka ") for line in lines), "\n".join(lines)
    assert any("Connection refused" in line for line in lines), "\n".join(lines)

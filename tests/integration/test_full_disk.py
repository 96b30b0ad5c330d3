"""One broker of a 3-broker cluster on a disk that fills: its log directory on a small
loop-mounted filesystem (`smalldisk`), the other two on the machine's.

An acks=all producer writes until that disk is full: the broker takes its log directory offline
and, its only one, stops; the two others go on (replication factor 3, `min.insync.replicas=2`),
so writes go on being acknowledged. When space is freed and the broker started again it
catches up, and every acknowledged record is in the log.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agentruns.connectors.dev.stack.local_kafka import LocalKafka
from agentruns.connectors.dev.stack.procs import free_port_block
from agentruns.connectors.dev.stack.smalldisk import SmallDisk
from tests.support.cluster import PARTITIONS, Writer, create_topic, missing_from_log

FULL = 3  # the broker whose disk fills


@pytest.mark.timeout(600)
def test_a_full_disk_stops_one_broker_and_loses_no_acknowledged_record(tmp_path: Path) -> None:
    directory = tmp_path / "kafka"
    with SmallDisk(directory / f"node-{FULL}", 160) as disk:
        disk.take(96)  # given back once the broker stopped, for it to start again
        kafka = LocalKafka(directory, port=free_port_block(6), brokers=3)
        try:
            kafka.start(timeout=180)
            create_topic(kafka.bootstrap_servers)
            writer = Writer(kafka.bootstrap_servers, value_bytes=32 << 10)
            writer.write_for(240.0, until=lambda: not kafka.node_running(FULL))
            assert not kafka.node_running(FULL), (
                f"broker {FULL} still runs, {disk.free_bytes()} bytes free on its disk"
            )
            stopped = time.monotonic()
            writer.write_for(5.0)
            assert writer.producer.flush(120) == 0, "records left unacknowledged"
            # the two others went on acknowledging without it
            assert (
                sum(writer.acked_between(p, stopped, time.monotonic()) for p in range(PARTITIONS))
                > 0
            )
            disk.give_back()
            kafka.start_node(FULL, timeout=180)
            writer.write_for(5.0)
            assert writer.producer.flush(120) == 0, "records left unacknowledged"
            assert not writer.failed, writer.failed[:5]
            assert len(writer.acked) == writer.sent
            assert missing_from_log(writer, kafka.bootstrap_servers) == 0
        finally:
            kafka.kill()

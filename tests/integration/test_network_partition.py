"""Network partitions of a 3-broker cluster: each broker in a network namespace of its own, the
test's producer in the machine's, packets dropped between chosen pairs (`netlab`).

A broker cut off from the other two while an acks=all producer writes to every partition: the
other two go on without it (its partitions move to them) and every acknowledged record is in the
log afterwards. Then the producer cut off from one broker but not the others: the partitions
that broker leads wait, the others go on, and when the link is back everything is delivered and
nothing acknowledged is missing.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from agentruns.connectors.dev.stack.local_kafka import LocalKafka
from agentruns.connectors.dev.stack.netlab import HOST, NetLab
from agentruns.connectors.dev.stack.procs import free_port_block
from tests.support.cluster import PARTITIONS, TOPIC, Writer, create_topic, missing_from_log

CUT_S = 15.0


def _leaders(admin: AdminClient) -> dict[int, int]:
    meta = admin.list_topics(TOPIC, timeout=30).topics[TOPIC]
    return {p: info.leader for p, info in meta.partitions.items()}


@pytest.mark.timeout(600)
def test_partitions_of_a_broker_and_of_a_client_lose_no_acknowledged_record(
    tmp_path: Path,
) -> None:
    brokers = ["b1", "b2", "b3"]
    with NetLab(brokers) as lab:
        kafka = LocalKafka(
            tmp_path / "kafka",
            port=free_port_block(6),
            brokers=3,
            placed=[(lab.members[b].address, lab.members[b].command([])) for b in brokers],
        )
        try:
            kafka.start(timeout=180)
            admin = create_topic(kafka.bootstrap_servers)
            writer = Writer(kafka.bootstrap_servers)
            writer.write_for(3.0)
            assert writer.producer.flush(60) == 0

            # one broker cut off from the other two; the client still reaches all three
            lab.partition("b1", "b2")
            lab.partition("b1", "b3")
            began = time.monotonic()
            writer.write_for(CUT_S)
            ended = time.monotonic()
            lab.heal()
            # the two that still form a quorum and an ISR went on writing
            assert sum(writer.acked_between(p, began, ended) for p in range(PARTITIONS)) > 0
            writer.write_for(10.0)  # b1 catches up and rejoins
            assert writer.producer.flush(120) == 0, "records left unacknowledged after healing"

            # the client cut off from one broker, the brokers still reach each other
            leaders = _leaders(admin)
            cut = leaders[0]
            lab.partition(HOST, brokers[cut - 1])
            began = time.monotonic()
            writer.write_for(CUT_S)
            ended = time.monotonic()
            lab.heal()
            others = [p for p, b in leaders.items() if b != cut]
            if others:  # partitions led elsewhere went on
                assert sum(writer.acked_between(p, began, ended) for p in others) > 0
            assert writer.producer.flush(120) == 0, "records left unacknowledged after healing"

            assert not writer.failed, writer.failed[:5]
            assert len(writer.acked) == writer.sent
            assert missing_from_log(writer, kafka.bootstrap_servers) == 0
        finally:
            kafka.kill()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert lab.router not in left and not any(
        m.netns and m.netns in left for m in lab.members.values()
    ), left

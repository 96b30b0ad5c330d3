"""Where a hostile input landed is known even when the broker acknowledged it without an offset
(a retried produce answered as a duplicate of one that timed out)."""

from __future__ import annotations

from agentruns.connectors.dev.servers.hostile import Doors, Injected
from agentruns.streams.topics import INBOX, topic_name

PARTITIONS = 2


def test_a_record_delivered_without_an_offset_is_found_in_its_partition(
    kafka_bootstrap: str, prefix: str
) -> None:
    doors = Doors(kafka_bootstrap, prefix, PARTITIONS, "http://unused", "http://unused", ())
    inbox = topic_name(INBOX, prefix)
    same = (b"run-1", b"same bytes")
    first, second, other = Injected("first"), Injected("second"), Injected("other")
    try:
        doors.produce(first, inbox, same[1], key=same[0], partition=1)
        doors.produce(second, inbox, same[1], key=same[0], partition=1)
        doors.produce(other, inbox, b"other bytes", key=b"run-2", partition=1)
        assert doors.flush(30) == 0
        offsets = [first.position, second.position, other.position]
        assert offsets == [(inbox, 1, 0), (inbox, 1, 1), (inbox, 1, 2)]
        # As the delivery callback records a report that came without an offset:
        lost_first, lost_other = Injected("first"), Injected("other")
        doors._placed.discard((inbox, 1, 0))
        doors._unplaced.append((lost_first, inbox, 1, same[0], same[1]))
        doors._unplaced.append((lost_other, inbox, 1, b"run-2", b"other bytes"))
        assert doors.flush(30) == 0
        # the identical record at offset 1 is held by another injection: the free one is taken
        assert lost_first.position == (inbox, 1, 0)
        assert lost_other.position is None and lost_other.error is not None
    finally:
        doors.close()

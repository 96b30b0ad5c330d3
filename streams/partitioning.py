"""Record keys and the run_id → partition function shared by inbox, events and state.

``partition_for`` is Kafka's default partitioner for a non-null key: ``toPositive(murmur2(key))
% partitions`` over the UTF-8 bytes of run_id, bit for bit as the Java client's
``Utils.murmur2``. So a record produced with key=run_id by the Java client (or by librdkafka /
confluent-kafka with ``partitioner=murmur2_random``) lands on the same partition as the events
and state records the processor writes with an explicit partition.

Note: librdkafka's own default partitioner is ``consistent_random`` (CRC32), which does NOT
agree; Python producers must set ``partitioner=murmur2_random`` or pass
``partition=partition_for(run_id, n)`` explicitly.
"""

from __future__ import annotations

__all__ = [
    "SEQ_WIDTH",
    "event_key",
    "murmur2",
    "parse_event_key",
    "partition_for",
    "run_key",
    "to_positive",
]

_M = 0x5BD1E995
_SEED = 0x9747B28C
_MASK = 0xFFFFFFFF

#: Width of the zero-padded seq in event keys: enough for every non-negative Avro long, so
#: the byte order of keys is the numeric order of seqs.
SEQ_WIDTH = 20


def murmur2(data: bytes) -> int:
    """Kafka's 32-bit murmur2 (``org.apache.kafka.common.utils.Utils.murmur2``), as a signed int."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    n4 = length & ~3
    for i in range(0, n4, 4):
        k = data[i] | (data[i + 1] << 8) | (data[i + 2] << 16) | (data[i + 3] << 24)
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = (h * _M) & _MASK
        h ^= k
    rest = length & 3
    if rest == 3:
        h ^= data[n4 + 2] << 16
    if rest >= 2:
        h ^= data[n4 + 1] << 8
    if rest >= 1:
        h ^= data[n4]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def to_positive(h: int) -> int:
    """Kafka's ``Utils.toPositive``: clear the sign bit (not abs)."""
    return h & 0x7FFFFFFF


def partition_for(run_id: str, partitions: int) -> int:
    """The partition of every inbox, events and state record of ``run_id``."""
    if partitions <= 0:
        raise ValueError(f"partitions must be positive, got {partitions}")
    return to_positive(murmur2(run_id.encode("utf-8"))) % partitions


def run_key(run_id: str) -> bytes:
    """Record key of inbox, state, results and effect records: the UTF-8 run_id."""
    return run_id.encode("utf-8")


def event_key(run_id: str, seq: int) -> bytes:
    """Record key of an events record: ``run_id + ":" + seq`` zero-padded to 20 digits.

    Unique per event, so compaction of agentruns.events only collapses exact re-writes.
    """
    if seq < 0:
        raise ValueError(f"seq must be non-negative, got {seq}")
    return f"{run_id}:{seq:0{SEQ_WIDTH}d}".encode()


def parse_event_key(key: bytes) -> tuple[str, int]:
    """Inverse of :func:`event_key`. Raises ValueError on a malformed key."""
    text = key.decode("utf-8")
    run_id, sep, seq = text.rpartition(":")
    if not sep or not run_id or len(seq) != SEQ_WIDTH or not seq.isdigit():
        raise ValueError(f"not an event key: {key!r}")
    return run_id, int(seq)

"""Build DeadLetter records (R30): the reason, the original bytes and where they came from.

Pure: the caller supplies the time (``at``) and the original record's fields; the result is a
dict ready for ``codec.encode(DEAD_LETTER_RECORD, ...)``. The DLQ record's key should be the
original key (so a run's dead letters stay together).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from streams.codec import CodecError

__all__ = [
    "CONFLICTING_DUPLICATE",
    "DEAD_LETTER_RECORD",
    "INVALID_EVENT",
    "Header",
    "dead_letter",
    "dead_letter_for_error",
]

DEAD_LETTER_RECORD = "DeadLetter"

#: error_class values for rejections that are not codec errors (the codec's own are the
#: ``error_class`` attributes of the classes in :mod:`streams.codec`).
INVALID_EVENT = "INVALID_EVENT"  # the envelope decodes but its body fails validation
CONFLICTING_DUPLICATE = "CONFLICTING_DUPLICATE"  # same producer seq, other content (R5)

#: A Kafka header as confluent-kafka returns it: (key, value or None).
Header = tuple[str, bytes | None]


def _bytes(value: bytes | bytearray | memoryview | str | None) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode("utf-8")
    return bytes(value)


def dead_letter(
    reason: str,
    error_class: str,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    headers: Iterable[tuple[str, bytes | bytearray | memoryview | str | None]] | None,
    at: int,
    *,
    original_timestamp: int | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """A DeadLetter record dict for one rejected Kafka record.

    ``headers`` is what ``confluent_kafka.Message.headers()`` returns (a list of
    ``(key, value)`` or None); str values are stored UTF-8 encoded. Order and duplicates are
    kept.
    """
    original_headers: Sequence[dict[str, Any]] = [
        {"key": str(k), "value": _bytes(v)} for k, v in (headers or ())
    ]
    return {
        "reason": reason,
        "error_class": error_class,
        "source_topic": topic,
        "source_partition": partition,
        "source_offset": offset,
        "original_key": _bytes(key),
        "original_value": _bytes(value),
        "original_headers": list(original_headers),
        "original_timestamp": original_timestamp,
        "run_id": run_id,
        "at": at,
    }


def dead_letter_for_error(
    error: CodecError,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    headers: Iterable[tuple[str, bytes | bytearray | memoryview | str | None]] | None,
    at: int,
    *,
    original_timestamp: int | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """:func:`dead_letter` with reason and error_class taken from a codec error."""
    return dead_letter(
        str(error),
        error.error_class,
        topic,
        partition,
        offset,
        key,
        value,
        headers,
        at,
        original_timestamp=original_timestamp,
        run_id=run_id,
    )

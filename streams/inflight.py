"""The offsets a consumer may commit while it answers records out of order: per partition, the
low-water mark of the records it took and has not answered yet.

An executor carries many effects at once and answers each as soon as it is done, so a record
read late may be answered before one read early. A partition's committed offset must never pass
a record that is not answered: after a crash, everything from the committed offset on is read
again, and a record below it would be lost. So the offset to commit is the lowest offset still
open (or, with none open, one past the highest taken), and it only moves forward.

A record taken again below that mark (a redelivery after the consumer re-fetched) is answered
again, but it does not move the mark back: it is not tracked.

Records answered above the mark are read again by whoever reads the partition from the
committed offset. A member that hands a partition over commits, with its last offset, a note of
the offsets above it it has answered (`answered_note`, in the offset's metadata, in the same
transaction as the answers or after them); the next owner reads it (`parse_answered_note`) and
does not answer those records a second time.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class _Partition:
    """One partition's open offsets (a set, and a heap of them with lazy deletion), the next
    offset to be taken, and the last mark given out."""

    __slots__ = ("done", "heap", "mark", "next", "open")

    def __init__(self, first: int) -> None:
        self.open: set[int] = set()
        self.heap: list[int] = []  # every open offset, and answered ones not popped yet
        self.done: list[int] = []  # answered offsets (a heap), popped once the mark passes them
        self.next = first  # one past the highest offset taken
        self.mark = first  # the last low-water mark given out: never goes back

    def low_water(self) -> int:
        heap, open_ = self.heap, self.open
        while heap and heap[0] not in open_:
            heapq.heappop(heap)
        self.mark = max(self.mark, heap[0] if heap else self.next)
        done = self.done
        while done and done[0] < self.mark:
            heapq.heappop(done)
        return self.mark


class OffsetTracker:
    """Open offsets per partition. Not thread-safe: its owner holds a lock around it."""

    def __init__(self) -> None:
        self._partitions: dict[int, _Partition] = {}
        self._open = 0

    def take(self, partition: int, offset: int) -> bool:
        """A record was read. True if it is tracked (it holds the mark back until `answer`).
        False for an offset below the next one expected: one already open, or a redelivery of
        an answered record (answered again, its first answer already handed over)."""
        state = self._partitions.get(partition)
        if state is None:
            state = self._partitions[partition] = _Partition(offset)
        if offset < state.next:
            return False
        state.open.add(offset)
        heapq.heappush(state.heap, offset)
        state.next = offset + 1
        self._open += 1
        return True

    def answer(self, partition: int, offset: int) -> None:
        """A tracked record is answered (handed over with its answer): the mark may pass it."""
        state = self._partitions.get(partition)
        if state is not None and offset in state.open:
            state.open.discard(offset)
            heapq.heappush(state.done, offset)
            self._open -= 1

    def answered_above(self, partition: int) -> list[int]:
        """The answered offsets of ``partition`` at or above its mark, ascending: the records
        a reader from the committed offset would answer again."""
        state = self._partitions.get(partition)
        if state is None:
            return []
        state.low_water()
        return sorted(state.done)

    def low_water(self, partition: int) -> int | None:
        """The next offset to commit for ``partition`` (None: nothing taken from it)."""
        state = self._partitions.get(partition)
        return None if state is None else state.low_water()

    def positions(self, partitions: Iterable[int] | None = None) -> dict[int, int]:
        """partition -> next offset to commit, for ``partitions`` (default: every one taken
        from)."""
        wanted = list(self._partitions) if partitions is None else partitions
        out: dict[int, int] = {}
        for partition in wanted:
            low = self.low_water(partition)
            if low is not None:
                out[partition] = low
        return out

    def open_in(self, partition: int) -> int:
        """How many records of ``partition`` are taken and not answered."""
        state = self._partitions.get(partition)
        return 0 if state is None else len(state.open)

    def forget(self, partitions: Iterable[int]) -> None:
        """The partitions went to another consumer: their open records are its to answer."""
        for partition in partitions:
            state = self._partitions.pop(partition, None)
            if state is not None:
                self._open -= len(state.open)

    @property
    def open(self) -> int:
        """Records taken and not answered, over every partition."""
        return self._open


#: The prefix of an answered-offsets note (the version of its format).
NOTE_PREFIX = "agentruns-answered:1:"
#: A note's length at most: the broker refuses offset metadata over ``offset.metadata.max.bytes``
#: (4096 by default) and fails the whole transaction; what does not fit is left out (those
#: records are answered again: a byte-identical copy the processor drops).
MAX_NOTE_CHARS = 3000
#: At most this many offsets are read from one note: a larger one is not ours, and is ignored.
MAX_NOTED_OFFSETS = 100_000


def answered_note(mark: int, answered: list[int]) -> str:
    """The offset metadata for ``answered`` (ascending, each >= ``mark``): their distances from
    the mark, consecutive ones as ranges (``0,3-7``); "" for none."""
    parts: list[str] = []
    size = len(NOTE_PREFIX)
    i = 0
    while i < len(answered):
        j = i
        while j + 1 < len(answered) and answered[j + 1] == answered[j] + 1:
            j += 1
        first, last = answered[i] - mark, answered[j] - mark
        part = str(first) if first == last else f"{first}-{last}"
        if first < 0 or size + len(part) + 1 > MAX_NOTE_CHARS:
            break
        parts.append(part)
        size += len(part) + 1
        i = j + 1
    return NOTE_PREFIX + ",".join(parts) if parts else ""


def parse_answered_note(note: str | None, mark: int) -> set[int]:
    """The offsets a note committed with ``mark`` names; an empty set for no note, another
    program's metadata or anything malformed (the records are then answered again)."""
    if not note or not note.startswith(NOTE_PREFIX) or len(note) > 2 * MAX_NOTE_CHARS:
        return set()
    out: set[int] = set()
    try:
        for part in note[len(NOTE_PREFIX) :].split(","):
            first_s, _, last_s = part.partition("-")
            first = int(first_s)
            last = int(last_s) if last_s else first
            if first < 0 or last < first or len(out) + last - first + 1 > MAX_NOTED_OFFSETS:
                return set()
            out.update(range(mark + first, mark + last + 1))
    except ValueError:
        return set()
    return out


__all__ = [
    "MAX_NOTE_CHARS",
    "NOTE_PREFIX",
    "OffsetTracker",
    "answered_note",
    "parse_answered_note",
]

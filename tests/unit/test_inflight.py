"""The low-water mark of records answered out of order (`agentruns.streams.inflight`)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agentruns.streams.inflight import (
    MAX_NOTE_CHARS,
    NOTE_PREFIX,
    OffsetTracker,
    answered_note,
    parse_answered_note,
)


def test_the_mark_waits_for_the_lowest_open_record() -> None:
    tracker = OffsetTracker()
    for offset in (10, 11, 12):
        assert tracker.take(0, offset)
    assert tracker.low_water(0) == 10
    tracker.answer(0, 12)
    tracker.answer(0, 11)
    assert tracker.low_water(0) == 10 and tracker.open == 1
    tracker.answer(0, 10)
    assert tracker.low_water(0) == 13 and tracker.open == 0


def test_gaps_between_offsets_are_passed_once_everything_is_answered() -> None:
    tracker = OffsetTracker()
    tracker.take(3, 5)
    tracker.take(3, 9)  # 6-8: transaction markers, never delivered
    tracker.answer(3, 5)
    assert tracker.low_water(3) == 9
    tracker.answer(3, 9)
    assert tracker.positions() == {3: 10}


def test_a_redelivered_record_is_not_tracked_and_never_moves_the_mark_back() -> None:
    tracker = OffsetTracker()
    tracker.take(0, 1)
    tracker.take(0, 2)
    tracker.answer(0, 2)
    assert not tracker.take(0, 2)  # answered, read again: answered again, not tracked
    assert not tracker.take(0, 1)  # already open
    tracker.answer(0, 1)
    assert tracker.low_water(0) == 3
    assert not tracker.take(0, 0)
    assert tracker.low_water(0) == 3 and tracker.open == 0


def test_forgotten_partitions_leave_the_others_as_they_were() -> None:
    tracker = OffsetTracker()
    tracker.take(0, 1)
    tracker.take(1, 7)
    tracker.forget([0])
    assert tracker.positions() == {1: 7}
    assert tracker.open == 1 and tracker.open_in(0) == 0 and tracker.low_water(0) is None
    tracker.answer(0, 1)  # an answer for a forgotten partition changes nothing
    assert tracker.open == 1


@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 3), st.booleans(), st.integers(0, 50)),
        max_size=200,
    )
)
def test_the_mark_never_passes_an_open_record_and_never_goes_back(
    steps: list[tuple[int, int, bool, int]],
) -> None:
    tracker = OffsetTracker()
    next_offset = {p: 0 for p in range(3)}
    open_: dict[int, set[int]] = {p: set() for p in range(3)}
    marks: dict[int, int] = {}
    for partition, gap, take, pick in steps:
        if take or not open_[partition]:
            offset = next_offset[partition] + gap - 1
            next_offset[partition] = offset + 1
            assert tracker.take(partition, offset)
            open_[partition].add(offset)
        else:
            offset = sorted(open_[partition])[pick % len(open_[partition])]
            tracker.answer(partition, offset)
            open_[partition].discard(offset)
        mark = tracker.low_water(partition)
        assert mark is not None
        expected = min(open_[partition]) if open_[partition] else next_offset[partition]
        assert mark == expected
        assert mark >= marks.get(partition, mark)
        marks[partition] = mark
    assert tracker.open == sum(len(v) for v in open_.values())


def test_the_records_answered_above_the_mark_are_named_until_the_mark_passes_them() -> None:
    tracker = OffsetTracker()
    for offset in range(10, 16):
        tracker.take(0, offset)
    for offset in (12, 13, 15):
        tracker.answer(0, offset)
    assert tracker.low_water(0) == 10
    assert tracker.answered_above(0) == [12, 13, 15]
    tracker.answer(0, 10)
    tracker.answer(0, 11)
    assert tracker.low_water(0) == 14
    assert tracker.answered_above(0) == [15]
    assert tracker.answered_above(1) == []


def test_a_note_names_its_offsets_by_their_distance_from_the_mark() -> None:
    note = answered_note(100, [100, 102, 103, 104, 110])
    assert note == NOTE_PREFIX + "0,2-4,10"
    assert parse_answered_note(note, 100) == {100, 102, 103, 104, 110}
    assert answered_note(100, []) == ""


def test_a_note_that_would_pass_the_brokers_limit_leaves_out_what_does_not_fit() -> None:
    answered = list(range(0, 20_000, 2))  # no two consecutive: one entry each
    note = answered_note(0, answered)
    assert len(note) <= MAX_NOTE_CHARS
    named = parse_answered_note(note, 0)
    assert named and named == set(answered[: len(named)])


def test_metadata_that_is_not_a_note_of_ours_names_nothing() -> None:
    for metadata in (
        None,
        "",
        "some other tool's metadata",
        NOTE_PREFIX + "x",
        NOTE_PREFIX + "3-1",
        NOTE_PREFIX + "-5",
        NOTE_PREFIX + "0-99999999",
        NOTE_PREFIX + "1," * 5000,
    ):
        assert parse_answered_note(metadata, 7) == set(), metadata


@given(st.sets(st.integers(min_value=0, max_value=500)), st.integers(0, 10**12))
def test_a_note_read_back_names_exactly_what_it_was_given(offsets: set[int], mark: int) -> None:
    answered = sorted(mark + o for o in offsets)
    assert parse_answered_note(answered_note(mark, answered), mark) == set(answered)

"""The `slow` tier (tests/conftest.py, SLOW) names tests that exist, so a renamed test cannot
slip into `make check` unnoticed; the heavy ones are part of it."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import HEAVY, SLOW

ROOT = Path(__file__).resolve().parents[2]


def test_every_slow_entry_names_a_test_file_or_a_test_in_it() -> None:
    for entry in sorted(SLOW):
        path, _, name = entry.partition("::")
        source = ROOT / path
        assert source.is_file(), f"{entry}: no such file"
        if name:
            assert f"def {name}(" in source.read_text(encoding="utf-8"), f"{entry}: no such test"


def test_the_heavy_tests_are_slow() -> None:
    assert HEAVY <= SLOW

"""Free port blocks for the local stack and the benches: a start too near the end of the
range is a clear error, never an arithmetic one."""

from __future__ import annotations

import pytest

from agentruns.connectors.dev.stack.procs import PortInUseError, free_port_block


def test_a_block_is_found_and_lies_within_the_range() -> None:
    first = free_port_block(3, start=30000, end=30100)
    assert first >= 30000 and first + 3 <= 30100


@pytest.mark.parametrize(("start", "end"), [(32767, 32768), (32768, 32768), (32800, 32768)])
def test_a_range_smaller_than_the_block_is_refused(start: int, end: int) -> None:
    with pytest.raises(PortInUseError, match="no block of 5 ports"):
        free_port_block(5, start=start, end=end)

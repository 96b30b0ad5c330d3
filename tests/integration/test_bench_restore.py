"""The restore bench's measurement at a small scale: ended runs are evicted and not restored."""

from __future__ import annotations

import pytest

from agentruns.bench.processor import restore_figures

PARTITIONS = 3


@pytest.mark.parametrize(("retention_ms", "restored"), [(0, 0), (None, 40)])
def test_a_restore_after_many_ended_runs_reads_only_the_runs_still_held(
    kafka_bootstrap: str,
    database_url: str,
    prefix: str,
    retention_ms: int | None,
    restored: int,
) -> None:
    figures = restore_figures(
        kafka_bootstrap,
        database_url,
        prefix,
        runs=40,
        partitions=PARTITIONS,
        retention_ms=retention_ms,
        timeout_s=120,
    )
    assert figures["restored_runs"] == restored
    assert figures["processor_rss_mib_after_restore"] > 0

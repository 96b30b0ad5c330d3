"""The fallback scanner (R26): runs without progress are found and diagnosed; overdue timers
are re-driven when the timer service is down."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from agentruns.connectors.runtime.scanner import scan
from agentruns.processors.state import Budgets
from agentruns.streams.processor import ProcessorConfig
from agentruns.streams.topics import RESULTS, topic_name
from tests.support.pipeline import (
    Inbox,
    input_record,
    now_ms,
    read_all,
    running_processor,
    submitted,
)
from tests.support.runlog import running_sink
from tests.support.waiting import wait_for

PARTITIONS = 3


@pytest.fixture
def pipeline(kafka_bootstrap: str, database_url: str, prefix: str) -> Iterator[str]:
    """Processor and sink running; no executor and no timer service (they are 'down')."""
    config = ProcessorConfig(bootstrap=kafka_bootstrap, prefix=prefix, group_id=f"{prefix}-p")
    with (
        running_processor(config, database_url),
        running_sink(kafka_bootstrap, database_url, prefix),
    ):
        yield prefix


def _status(database_url: str, run_id: str) -> str | None:
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT status FROM runs WHERE run_id = %s", (run_id,)).fetchone()
    return None if row is None else str(row[0])


def test_a_run_whose_executor_is_down_is_found(
    kafka_bootstrap: str, database_url: str, pipeline: str
) -> None:
    inbox = Inbox(kafka_bootstrap, pipeline, PARTITIONS)
    inbox.send(input_record(submitted("stuck-1")))
    inbox.flush()
    wait_for(
        lambda: _status(database_url, "stuck-1") == "MODEL_RUNNING", timeout=30, what="projection"
    )
    found = {
        d.run_id: d for d in scan(kafka_bootstrap, database_url, prefix=pipeline, stale_after_s=0)
    }
    assert found["stuck-1"].waiting_on == "model executor"
    assert "no model executor" in found["stuck-1"].detail
    assert not scan(kafka_bootstrap, database_url, prefix=pipeline, stale_after_s=3600)


def test_overdue_timers_are_redriven_when_the_timer_service_is_down(
    kafka_bootstrap: str, database_url: str, pipeline: str
) -> None:
    inbox = Inbox(kafka_bootstrap, pipeline, PARTITIONS)
    event = submitted("stuck-2").model_copy(update={"budgets": Budgets(deadline_at=now_ms() + 500)})
    inbox.send(input_record(event))
    inbox.flush()
    wait_for(
        lambda: _status(database_url, "stuck-2") == "MODEL_RUNNING", timeout=30, what="projection"
    )
    wait_for(
        lambda: any(
            d.run_id == "stuck-2" and d.waiting_on == "timer"
            for d in scan(kafka_bootstrap, database_url, prefix=pipeline, stale_after_s=0)
        ),
        timeout=30,
        what="the deadline to be overdue",
    )
    found = scan(kafka_bootstrap, database_url, prefix=pipeline, stale_after_s=0, redrive=True)
    assert [d.redriven for d in found if d.run_id == "stuck-2"] == [1]
    results = topic_name(RESULTS, pipeline)
    wait_for(
        lambda: len(read_all(kafka_bootstrap, results, "Result")) == 1, timeout=30, what="expiry"
    )
    assert read_all(kafka_bootstrap, results, "Result")[0].value["status"] == "EXPIRED"

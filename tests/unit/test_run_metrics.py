"""What the sink measures of runs: the terminal status and reason class a run ends with, and
the time of each step, from the states before and after each event."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import REGISTRY

from agentruns.connectors.projection.run_metrics import (
    REASON_CLASSES,
    RunMeter,
    reason_class,
)
from agentruns.processors.state import RunState, RunStatus
from tests.unit._core_support import Driver


def _submitted() -> RunState:
    driver = Driver()
    driver.submit()
    assert driver.state is not None
    return driver.state


BASE = _submitted()


def _state(status: RunStatus, step: int, outcome: str | None = None, run: str = "r-1") -> RunState:
    return msgspec.structs.replace(BASE, run_id=run, status=status, step=step, outcome=outcome)


@pytest.mark.parametrize(
    ("status", "outcome", "expected"),
    [
        (RunStatus.SUCCEEDED, "Budget: the answer is 42", "answer"),
        (RunStatus.BUDGET_EXHAUSTED, "budget:max_steps", "budget"),
        (RunStatus.EXPIRED, "deadline", "deadline"),
        (RunStatus.FAILED, "loop:repeated_error:X", "loop"),
        (RunStatus.FAILED, "invalid_input:tool_schema: bad", "invalid_input"),
        (RunStatus.FAILED, "MODEL:retries_exhausted:x", "model"),
        (RunStatus.CANCELLED, "resolved:by an operator", "resolved"),
        (RunStatus.FAILED, "a free text an operator wrote", "other"),
        (RunStatus.FAILED, "x" * 10_000 + ":y", "other"),
        (RunStatus.FAILED, None, "other"),
        (RunStatus.FAILED, "", "other"),
    ],
)
def test_the_reason_class_is_the_first_word_of_the_outcome(
    status: RunStatus, outcome: str | None, expected: str
) -> None:
    assert reason_class(status, outcome) == expected
    assert expected in REASON_CLASSES


def test_a_run_counts_once_when_it_enters_a_terminal_status_with_its_last_step() -> None:
    meter = RunMeter()
    started = _state(RunStatus.READY, 1)
    at0 = started.time.started_at
    assert meter.fold(None, started, at0) == (None, None)
    step2 = _state(RunStatus.READY, 2)
    assert meter.fold(started, step2, at0 + 1500) == (None, 1.5)
    running = _state(RunStatus.MODEL_RUNNING, 2)
    assert meter.fold(step2, running, at0 + 1600) == (None, None)
    done = _state(RunStatus.SUCCEEDED, 2, "the answer")
    assert meter.fold(running, done, at0 + 4000) == (("succeeded", "answer"), 2.5)
    late = _state(RunStatus.SUCCEEDED, 2, "the answer")
    assert meter.fold(done, late, at0 + 5000) == (None, None)  # already ended: not again


def test_a_sink_that_restarted_measures_step_one_from_the_runs_start_and_skips_others() -> None:
    meter = RunMeter()
    first = _state(RunStatus.MODEL_RUNNING, 1)
    at0 = first.time.started_at
    assert meter.fold(first, _state(RunStatus.READY, 2), at0 + 700) == (None, 0.7)
    other = _state(RunStatus.MODEL_RUNNING, 5, run="r-2")
    assert meter.fold(other, _state(RunStatus.READY, 6, run="r-2"), at0 + 900) == (None, None)


def test_the_steps_remembered_are_bounded() -> None:
    meter = RunMeter(max_runs=3)
    for n in range(10):
        meter.fold(None, _state(RunStatus.READY, 1, run=f"r-{n}"), 1000 + n)
    assert list(meter._step_started) == ["r-7", "r-8", "r-9"]


def test_a_committed_batch_reaches_prometheus_in_lower_case() -> None:
    def ended() -> float:
        value = REGISTRY.get_sample_value(
            "agentruns_runs_ended_total", {"status": "budget_exhausted", "reason": "budget"}
        )
        return value or 0.0

    def steps() -> float:
        return REGISTRY.get_sample_value("agentruns_run_step_seconds_count") or 0.0

    before, before_steps = ended(), steps()
    meter = RunMeter()
    budget = _state(RunStatus.BUDGET_EXHAUSTED, 3, "budget:max_steps")
    status, step_s = meter.fold(_state(RunStatus.READY, 3), budget, 10_000)
    assert status == ("budget_exhausted", "budget") and step_s is None
    RunMeter.committed([status], [0.25, 1.0])
    assert (ended(), steps()) == (before + 1, before_steps + 2)

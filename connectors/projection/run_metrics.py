"""Runs ended by terminal status and reason class, and step latency: measured by the sink.

The sink is where these are counted because it sees every event of every run exactly once in
order (each committed event is projected once: one already projected is skipped), with the
state before and after it, and it already exports metrics; the processor's per-input path is
kept free of labelled Prometheus calls (`streams.metrics.ProcessorStats`). A run is counted when
an event takes it from a non-terminal status to a terminal one (a reopened run that ends again
is counted again), after the batch holding that event is committed to Postgres.

- ``agentruns_runs_ended_total{status, reason}``: status is the terminal status in lower case
  (succeeded, failed, cancelled, expired, budget_exhausted, cancel_unknown); reason its class,
  the first word of the run's outcome (`reason_class`);
- ``agentruns_run_step_seconds``: from the first event of a step to the first event of the next
  one, or to the run's end, by the events' own times (``at``, the processor's clock). A step the
  sink saw begin before it restarted is measured from the run's start when it is step 1, and
  not measured otherwise.
"""

from __future__ import annotations

from collections import OrderedDict

from prometheus_client import Counter, Histogram

from agentruns.processors.state import TERMINAL, RunState, RunStatus

RUNS_ENDED = Counter(
    "agentruns_runs_ended_total",
    "Runs that reached a terminal status, by status and reason class (lower case)",
    ["status", "reason"],
)
STEP_SECONDS = Histogram(
    "agentruns_run_step_seconds",
    "Time of one step of a run, from its first event to the first event of the next step or"
    " the run's end (the events' times)",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600),
)

#: The reason classes: the first word of a terminal run's outcome (``budget:max_steps`` ->
#: budget). A SUCCEEDED run's outcome is its answer, so its class is ``answer``; an outcome
#: whose first word is none of these (a resolution's free text) is ``other``.
REASON_CLASSES = frozenset(
    {
        "answer",
        "budget",
        "cancel",
        "deadline",
        "finalize",
        "invalid_input",
        "loop",
        "model",
        "resolved",
        "seq_gap",
        "superseded",
        "tool",
        "user_reply_expired",
        "validation",
        "other",
    }
)
#: Steps whose start the sink remembers at most (runs in flight); the oldest go first.
MAX_TRACKED_RUNS = 100_000


def reason_class(status: RunStatus | str, outcome: str | None) -> str:
    """The `reason` label of a run that ended with ``status`` and ``outcome``."""
    if str(status) == RunStatus.SUCCEEDED:
        return "answer"
    word = (outcome or "").split(":", 1)[0].strip().lower()
    return word if word in REASON_CLASSES else "other"


class RunMeter:
    """What one sink measures of runs, held until the batch that saw it commits."""

    def __init__(self, max_runs: int = MAX_TRACKED_RUNS) -> None:
        self._max_runs = max_runs
        self._step_started: OrderedDict[str, tuple[int, int]] = OrderedDict()  # run -> step, at

    def fold(
        self, before: RunState | None, after: RunState, at_ms: int
    ) -> tuple[tuple[str, str] | None, float | None]:
        """One event at ``at_ms`` took a run from ``before`` to ``after``: the (status, reason)
        it ended with, if it ended, and the seconds of the step it closed, if it closed one."""
        run_id = after.run_id
        was_terminal = before is not None and before.status in TERMINAL
        ended = None
        if after.status in TERMINAL and not was_terminal:
            status = str(after.status).lower()
            ended = (status, reason_class(after.status, after.outcome))
        closed = None
        if before is None or was_terminal:  # a new run, or a reopened one: a step begins
            if after.status not in TERMINAL:
                self._begin(run_id, after.step, at_ms)
        elif after.step != before.step or ended is not None:
            started = self._step_started.get(run_id)
            if started is None and before.step == 1:
                started = (1, before.time.started_at)
            if started is not None and started[0] == before.step:
                closed = max(0, at_ms - started[1]) / 1000
            if ended is None:
                self._begin(run_id, after.step, at_ms)
        if ended is not None:
            self._step_started.pop(run_id, None)
        return ended, closed

    def _begin(self, run_id: str, step: int, at_ms: int) -> None:
        self._step_started[run_id] = (step, at_ms)
        self._step_started.move_to_end(run_id)
        while len(self._step_started) > self._max_runs:
            self._step_started.popitem(last=False)

    @staticmethod
    def committed(ended: list[tuple[str, str]], steps: list[float]) -> None:
        """A batch committed: what it measured goes to Prometheus."""
        for status, reason in ended:
            RUNS_ENDED.labels(status, reason).inc()
        for seconds in steps:
            STEP_SECONDS.observe(seconds)


__all__ = [
    "MAX_TRACKED_RUNS",
    "REASON_CLASSES",
    "RUNS_ENDED",
    "STEP_SECONDS",
    "RunMeter",
    "reason_class",
]

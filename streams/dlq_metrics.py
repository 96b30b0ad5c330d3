"""`agentruns_dlq_records_total`: the dead letters of every component, by reason.

Apart from the processor's metrics (`streams.metrics`) so that a process without a processor
(an executor, the sink) does not expose the processor's series.
"""

from __future__ import annotations

import re

from prometheus_client import Counter

DLQ_RECORDS = Counter(
    "agentruns_dlq_records_total",
    "Dead letters produced, by component and reason (the dead letter's error_class, lower case)",
    ["component", "reason"],
)
# an error_class is one of the code's constants (agentruns.streams.dlq, the codec's errors);
# anything else is counted as "other", so the label stays bounded whatever a caller passes
_REASON = re.compile(r"[a-z][a-z0-9_]{0,63}")


def dead_lettered(component: str, error_class: str) -> None:
    """One dead letter of ``component`` (processor, model_executor, tool_executor, timer,
    sink) produced, for ``error_class``."""
    reason = error_class.lower()
    DLQ_RECORDS.labels(component, reason if _REASON.fullmatch(reason) else "other").inc()


__all__ = ["DLQ_RECORDS", "dead_lettered"]

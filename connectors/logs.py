"""Structured logs: one JSON object per line, with run/step/attempt/trace ids when known (R4).

Call sites pass identity through `extra={"run_id": ..., "seq": ..., "trace_id": ...}`; the
formatter copies every such field it knows into the line.
"""

from __future__ import annotations

import json
import logging
import sys
import time

IDENTITY_FIELDS = ("run_id", "seq", "step", "attempt", "trace_id", "idempotency_key")


class JsonFormatter(logging.Formatter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "component": self.component,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in IDENTITY_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup_logging(level: str = "INFO", *, component: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(component))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

"""A newer agentruns, simulated inside this one, for tests of rolling deploys and rollbacks.

``python -m tests.support.newer processor|model|tool [args]`` runs that command's ``main``
(`agentruns processor`, `agentruns executor model|tool`) in a process that behaves like the
next version:

- every body it writes carries one field this version does not know (`NEWER_FIELD`): the
  bodies of Input, Event and Effect records and the state of Snapshot records;
- it has a rules version 2 (the same rules as version 1 under a new number).

It changes nothing else, so the records it writes are what this version would write plus the
new field, and the runs it advances are the runs this version would advance.
"""

from __future__ import annotations

import json
import sys
from importlib import import_module
from typing import Any

from agentruns.processors import versions
from agentruns.processors.transition import transition
from agentruns.streams.codec import Codec

NEWER_FIELD = "newer_field"
NEWER_VALUE: dict[str, Any] = {"since": "next", "items": [1, "two", None]}
_ADDED = "," + json.dumps(NEWER_FIELD) + ":" + json.dumps(NEWER_VALUE, separators=(",", ":")) + "}"

# which field of each record holds the JSON a newer version adds to
_BODY_FIELD = {"Input": "body", "Event": "body", "Effect": "body", "Snapshot": "state"}

COMMANDS = {
    "processor": "agentruns.connectors.runtime.processor",
    "model": "agentruns.connectors.executors.model",
    "tool": "agentruns.connectors.executors.tool",
}


def with_newer_field(text: str) -> str:
    if not text.startswith("{") or f'"{NEWER_FIELD}":' in text:
        return text
    return text[:-1] + _ADDED if text != "{}" else "{" + _ADDED[1:]


def install() -> None:
    versions.RULES[2] = transition
    original = Codec.encode

    def encode(
        self: Codec, name: str, record: dict[str, Any], *, version: int | None = None
    ) -> bytes:
        field = _BODY_FIELD.get(name)
        if field is not None and isinstance(record.get(field), str):
            record = {**record, field: with_newer_field(record[field])}
        return original(self, name, record, version=version)

    Codec.encode = encode  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    from agentruns.connectors.lifecycle import run_command

    install()
    command = import_module(COMMANDS[argv[0]])
    code: int = run_command(command.main, argv[1:])
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

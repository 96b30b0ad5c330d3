"""Golden event logs (tests/golden/*.jsonl) replayed and compared with their recorded outcome.

Regenerate deliberately (after a reviewed behaviour change) with
``python -m tests.unit.test_core_golden``.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from agentruns.connectors.dev.servers.workload import simulate
from agentruns.processors.events import Event, parse_event
from agentruns.processors.state import RunState
from agentruns.processors.transition import transition

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
CASES = {
    "happy_path": {"seed": 11, "steps": 4, "chaos": 0.0, "faults": 0.0},
    "faults": {"seed": 5, "steps": 6, "chaos": 0.0, "faults": 0.3},
    "chaos": {"seed": 3, "steps": 5, "chaos": 0.3, "faults": 0.25},
}


def replay(events: list[Event]) -> dict[str, object]:
    state: RunState | None = None
    digest = hashlib.sha256()
    dispositions = []
    for event in events:
        result = transition(state, event)
        state = result.state
        dispositions.append(result.disposition.value)
        for effect in result.effects:
            digest.update(effect.model_dump_json().encode())
    assert state is not None
    return {
        "events": len(events),
        "status": state.status.value,
        "outcome": state.outcome,
        "dispositions": dispositions,
        "state_sha256": hashlib.sha256(state.to_json().encode()).hexdigest(),
        "effects_sha256": digest.hexdigest(),
    }


def load(name: str) -> list[Event]:
    lines = (GOLDEN / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    return [parse_event(line) for line in lines if line]


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_log_replays_to_recorded_outcome(name: str) -> None:
    expected = json.loads((GOLDEN / f"{name}.expected.json").read_text(encoding="utf-8"))
    assert replay(load(name)) == expected


def regenerate() -> None:
    GOLDEN.mkdir(exist_ok=True)
    for name, case in CASES.items():
        events = simulate(
            random.Random(case["seed"]),
            f"golden-{name}",
            steps=int(case["steps"]),
            chaos=case["chaos"],
            faults=case["faults"],
            max_events=200,
        )
        text = "\n".join(e.model_dump_json() for e in events) + "\n"
        (GOLDEN / f"{name}.jsonl").write_text(text, encoding="utf-8")
        summary = json.dumps(replay(events), indent=1, sort_keys=True) + "\n"
        (GOLDEN / f"{name}.expected.json").write_text(summary, encoding="utf-8")


if __name__ == "__main__":
    regenerate()

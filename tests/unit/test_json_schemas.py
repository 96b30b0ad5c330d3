"""The JSON Schemas of the message bodies: committed as generated, and true of the core's JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from agentruns.connectors.json_schemas import DIRECTORY, documents, file_text
from agentruns.processors.effects import PublishResult
from agentruns.processors.state import RunState
from agentruns.processors.transition import transition
from tests.unit.test_core_golden import CASES, load

ROOT = Path(__file__).resolve().parents[2]
REWRITE = "python -m agentruns.connectors.json_schemas --write"


def validator(file_name: str) -> Draft202012Validator:
    schema = json.loads((DIRECTORY / file_name).read_text(encoding="utf-8"))
    return Draft202012Validator(schema)


def test_the_committed_schemas_are_the_generated_ones() -> None:
    generated = documents()
    committed = sorted(p.name for p in DIRECTORY.glob("*.schema.json"))
    assert committed == sorted(generated), f"schemas/json is out of date: run `{REWRITE}`"
    for file_name, document in generated.items():
        text = (DIRECTORY / file_name).read_text(encoding="utf-8")
        assert text == file_text(document), f"{file_name} is out of date: run `{REWRITE}`"


@pytest.mark.parametrize("file_name", sorted(documents()))
def test_each_schema_is_valid_json_schema(file_name: str) -> None:
    Draft202012Validator.check_schema(documents()[file_name])


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "tasks").glob("*.json")), ids=str)
def test_the_example_tasks_are_valid_tasks(path: Path) -> None:
    validator("task.schema.json").validate(json.loads(path.read_text(encoding="utf-8")))


@pytest.mark.parametrize(
    "task",
    [
        {},  # no goal
        {"goal": "g", "run_id": "run-1"},  # the submitter derives the ids
        {"goal": "g", "tools": [{"name": "search", "params": {}}]},  # unknown field
        {"goal": "g", "budgets": {"max_steps": -1}},  # under its bound
        {"goal": "g", "messages": [{"role": "robot", "content": "hi"}]},  # not a role
    ],
)
def test_the_task_schema_refuses_what_the_core_refuses(task: dict[str, Any]) -> None:
    assert not validator("task.schema.json").is_valid(task)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_body_of_a_golden_run_is_valid(name: str) -> None:
    events, effects, results = (
        validator(f) for f in ("event.schema.json", "effect.schema.json", "result.schema.json")
    )
    state: RunState | None = None
    counted = {"events": 0, "effects": 0, "results": 0}
    for event in load(name):
        events.validate(json.loads(event.model_dump_json()))
        counted["events"] += 1
        result = transition(state, event)
        state = result.state
        for effect in result.effects:
            body = json.loads(effect.model_dump_json())
            if isinstance(effect, PublishResult):
                results.validate(body)
                counted["results"] += 1
            else:
                effects.validate(body)
                counted["effects"] += 1
    assert counted["events"] > 0
    assert counted["effects"] > 0
    assert counted["results"] == 1

"""JSON Schemas of the JSON bodies the Avro envelopes carry, generated from the core's types.

The envelopes (``*.avsc``) type the identity and routing fields; the domain payload is the
core's JSON in a string field (``body``). These schemas describe that JSON for producers and
consumers in other languages, and the API's OpenAPI document uses the task schema. They are
derived from the msgspec Structs with :func:`msgspec.json.schema_components`, so they say what
the core decodes: field names, types, bounds, defaults, and no unknown fields.

``python -m agentruns.connectors.json_schemas --write`` rewrites the committed files
(``schemas/json/*.schema.json``, package data of ``agentruns.schemas``); a unit test fails while
they differ from :func:`documents`. The generator lives here, not in ``agentruns.schemas``,
because it reads the core's types and ``agentruns.schemas`` imports nothing of the layers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

import agentruns.schemas
from agentruns.processors.effects import Effect, PublishResult
from agentruns.processors.events import Event, RunSubmitted

__all__ = [
    "DIRECTORY",
    "DRAFT",
    "TASK_DERIVED_FIELDS",
    "documents",
    "file_text",
    "main",
    "task_schema_components",
]

DRAFT = "https://json-schema.org/draft/2020-12/schema"
#: Where the generated files live, beside the Avro schemas (package data).
DIRECTORY = Path(agentruns.schemas.__file__).resolve().parent / "json"
#: RunSubmitted fields a task leaves out: the submitter derives them (the run id from the
#: idempotency key, the event id from the run id, the time when it is submitted), or the
#: processor does (the rules version the run is submitted under, its tool catalog check).
TASK_DERIVED_FIELDS = ("type", "run_id", "event_id", "at", "rules_version", "catalog", "parent")

_TASK_DESCRIPTION = (
    "A task: the body of POST /runs and of RunsProducer.submit. The fields of the RunSubmitted"
    " event but the ones the submitter derives (type, run_id, event_id, at); trace_id is"
    " optional (by default it derives from the run id)."
)
_BODIES: dict[str, tuple[Any, str]] = {
    "event": (
        Event,
        "The body of an Event record (<prefix>.events) and of an Input record"
        " (<prefix>.inbox): one run event as JSON, told apart by its `type`.",
    ),
    "effect": (
        Effect,
        "The body of an Effect record (<prefix>.effects.model, .tool, .timer): one effect as"
        " JSON, told apart by its `type`.",
    ),
    "result": (
        PublishResult,
        "The body of a Result record (<prefix>.results): the terminal outcome of a run.",
    ),
}


#: What each field of a Result's body means: a consumer in another language reads them by these.
_RESULT_FIELDS: dict[str, str] = {
    "type": "Always PublishResult.",
    "idempotency_key": (
        "The key of this publication, not the submitter's idempotency key: the lowercase hex"
        " sha256 of the UTF-8 string 'effect', 'publish', run_id, step, attempt, resolution and"
        " status joined by U+001F. The same for every copy of one outcome (a consumer that"
        " meets it twice has the same result twice); a later resolution of the run has another."
        " The submitter's key is not carried: run_id derives from it (docs/contract.md, Run ids)."
    ),
    "run_id": (
        "The run: 'run-' + the uuid5 of the submitter's idempotency key (docs/contract.md, Run"
        " ids). Also the record's Kafka key and the envelope's run_id."
    ),
    "step": "The run's step counter when it ended (the first step is 1).",
    "attempt": "The attempt of that step when the run ended (the first is 1).",
    "trace_id": "The run's trace id: the task's, else the one derived from the run id.",
    "status": "The terminal status the run ended in (the envelope's status).",
    "resolution": (
        "Which outcome of the run this is: 0 for the first; an operator's RunResolved or a"
        " RunReopened that ends again publishes the next (the envelope's version)."
    ),
    "result_ref": (
        "The result document: 'sha256:' + the hex sha256 of its canonical JSON"
        " (docs/contract.md, Canonical JSON), an artifact the API serves."
    ),
    "summary": "'<status>: <reason>', at most 300 characters (the envelope's summary).",
    "tenant": (
        "The tenant the run belongs to (docs/security.md, Tenants); absent for the default"
        " tenant, 'default'."
    ),
}


def _described(schema: dict[str, Any], fields: dict[str, str]) -> dict[str, Any]:
    """`schema` with a description on each property `fields` names (the core's types carry
    none); every property must have one, so a new field cannot go out undescribed."""
    properties = schema["properties"]
    missing = sorted(set(properties) - set(fields))
    if missing:
        raise ValueError(f"result fields without a description: {missing}")
    for name, prop in properties.items():
        properties[name] = {"description": fields[name], **prop}
    return schema


def _task(task: dict[str, Any]) -> dict[str, Any]:
    """The task's schema, made from a fresh copy of RunSubmitted's (changed in place)."""
    for name in TASK_DERIVED_FIELDS:
        task["properties"].pop(name)
    # trace_id stays, optional: by default it derives from the run id
    task["required"] = [f for f in task["required"] if f not in (*TASK_DERIVED_FIELDS, "trace_id")]
    return _titled("Task", _TASK_DESCRIPTION, task)


def _titled(title: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    rest = {k: v for k, v in schema.items() if k not in ("title", "description")}
    return {"title": title, "description": description, **rest}


def task_schema_components(ref_template: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the task's schema, the schemas it refers to by ``ref_template``), e.g. for an OpenAPI
    document's ``components``: ``"#/components/schemas/{name}"``."""
    (root,), components = _components(RunSubmitted, ref_template)
    name = root["$ref"].rsplit("/", 1)[-1]
    task = _task(components.pop(name))
    return task, _referenced(task, components, ref_template)


def _referenced(
    root: dict[str, Any], components: dict[str, Any], ref_template: str
) -> dict[str, Any]:
    """The components `root` refers to, directly or through one another (a derived field's
    type, left out of the task, is not among them)."""
    prefix = ref_template.split("{name}")[0]
    kept: dict[str, Any] = {}
    pending = [root]
    while pending:
        text = json.dumps(pending.pop())
        for part in text.split(f'"$ref": "{prefix}')[1:]:
            ref = part.split('"', 1)[0]
            if ref not in kept and ref in components:
                kept[ref] = components[ref]
                pending.append(components[ref])
    return {k: v for k, v in components.items() if k in kept}


def _components(kind: Any, ref_template: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """msgspec's schemas as JSON would carry them (its defaults hold tuples)."""
    found = msgspec.json.schema_components([kind], ref_template=ref_template)
    roots, components = msgspec.json.decode(msgspec.json.encode(found))
    return tuple(roots), components


def _document(root: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    return {"$schema": DRAFT, **root, "$defs": defs}


def documents() -> dict[str, dict[str, Any]]:
    """Every schema document by file name (``task.schema.json``, ...), as generated now."""
    template = "#/$defs/{name}"
    task, task_defs = task_schema_components(template)
    out = {"task.schema.json": _document(task, task_defs)}
    for name, (kind, description) in _BODIES.items():
        (root,), defs = _components(kind, template)
        if "$ref" in root:  # a single struct: its schema at the top, not behind a reference
            root = defs.pop(root["$ref"].rsplit("/", 1)[-1])
        if name == "result":
            root = _described(root, _RESULT_FIELDS)
        root = _titled(root.get("title", name.capitalize()), description, root)
        out[f"{name}.schema.json"] = _document(root, defs)
    return out


def file_text(document: dict[str, Any]) -> str:
    """A document as it is committed: two-space indent, keys in generation order."""
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agentruns.connectors.json_schemas",
        description="Generate the JSON Schemas of the message bodies from the core's types.",
    )
    parser.add_argument(
        "--write", action="store_true", help=f"write them to {DIRECTORY} (else print the names)"
    )
    args = parser.parse_args(argv)
    docs = documents()
    if args.write:
        DIRECTORY.mkdir(exist_ok=True)
        for stale in DIRECTORY.glob("*.schema.json"):
            if stale.name not in docs:
                stale.unlink()
        for file_name, document in docs.items():
            (DIRECTORY / file_name).write_text(file_text(document), encoding="utf-8")
    for file_name in docs:
        print(DIRECTORY / file_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())

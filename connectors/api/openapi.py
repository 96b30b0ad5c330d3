"""`OPENAPI`: the OpenAPI 3.1 document of the API, served at /openapi.json.

Hand-written but for the task: its schema, and the schemas of the core's types it refers to,
are generated from the core's types (`agentruns.connectors.json_schemas`, the same schema as
schemas/json/task.schema.json).
"""

from __future__ import annotations

from typing import Any

import msgspec

from agentruns.connectors.api.operator import RedriveBody, ReopenBody, ResolveBody
from agentruns.connectors.json_schemas import task_schema_components

_TASK, _TASK_PARTS = task_schema_components("#/components/schemas/{name}")
(_RESOLVE, _REOPEN, _REDRIVE), _OPERATOR_BODIES = msgspec.json.schema_components(
    (ResolveBody, ReopenBody, RedriveBody), ref_template="#/components/schemas/{name}"
)
_ERROR = {"$ref": "#/components/schemas/Error"}


def _resp(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description}
    if schema is not None:
        out["content"] = {"application/json": {"schema": schema}}
    return out


def _query(
    name: str, description: str, enum: list[str] | None = None, kind: str = "string"
) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": kind}
    if enum is not None:
        schema["enum"] = enum
    return {"name": name, "in": "query", "description": description, "schema": schema}


_RUN_ID = {"name": "run_id", "in": "path", "required": True, "schema": {"type": "string"}}
_ERRS = {
    "400": _resp("a header or the query string is not UTF-8 or holds a control character", _ERROR),
    "401": _resp("missing or wrong bearer token", _ERROR),
    "503": _resp("Kafka or Postgres unavailable; retry", _ERROR),
}
_IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "description": "at most 200 chars; without it, one operator action per run version",
    "schema": {"type": "string", "maxLength": 200},
}
_IF_MATCH = {
    "name": "If-Match",
    "in": "header",
    "description": 'the run version the action was decided on (`7` or `"7"`); the run at '
    "another version is a 412",
    "schema": {"type": "string", "maxLength": 20},
}


def _operator(summary: str, description: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "description": description + " Needs the `admin` role; the credential is "
            "recorded as the input's `actor` in the run's log.",
            "parameters": [_RUN_ID, _IDEMPOTENCY_KEY, _IF_MATCH],
            "requestBody": {"content": {"application/json": {"schema": body}}},
            "responses": {
                "202": _resp("the action's input was produced", {"$ref": _ACTED}),
                "400": _resp("an If-Match that is not a version", _ERROR),
                "412": _resp("the run is at another version than If-Match (`version`)", _ERROR),
                "200": _resp("a repeat: the first outcome", {"$ref": _ACTED}),
                "403": _resp("the credential has no admin role", _ERROR),
                "404": _resp("unknown run", _ERROR),
                "409": _resp(
                    "the run's status does not allow it (`run_status`), or another action was"
                    " sent for the same run version",
                    _ERROR,
                ),
                "422": _resp("malformed body (unknown field, bounds)", _ERROR),
                **_TOO_LARGE,
                **_ERRS,
            },
        }
    }


_ACTED = "#/components/schemas/OperatorAction"
_FORKED = "#/components/schemas/Fork"


#: Budgets a fork or a resume raises (never lowers: a lower one is a 409).
_RAISED_BUDGETS: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "description": "the fork's budgets, each at least the source's",
    "properties": {
        name: {"type": "integer", "minimum": 0}
        for name in ("max_steps", "max_tokens", "max_cost_micros", "max_tool_calls", "deadline_at")
    },
}


def _fork(summary: str, description: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary + " (role submit)",
            "description": description,
            "parameters": [_RUN_ID, _IDEMPOTENCY_KEY],
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "201": _resp("the fork's first record was produced", {"$ref": _FORKED}),
                "200": _resp("a repeat: the same fork", {"$ref": _FORKED}),
                "403": _resp("the credential has no submit role", _ERROR),
                "404": _resp("unknown run, or a run of another tenant", _ERROR),
                "409": _resp("the fork cannot be made (a seq outside the log...)", _ERROR),
                "422": _resp("invalid body", _ERROR),
                **_TOO_LARGE,
                **_ERRS,
            },
        }
    }


_TOO_LARGE = {
    "413": _resp("body over max_body_bytes, or its input record over max_record_bytes", _ERROR)
}

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "agentruns API",
        "version": "1",
        "description": "Durable LLM-agent runs on Kafka: submit, read, reply, cancel, and "
        "the operator actions resolve, reopen and re-drive. "
        "Every endpoint but /readyz, /healthz, /livez, /metrics and /openapi.json needs "
        "`Authorization: Bearer <credential>`; a credential has a tenant, whose runs alone it"
        " sees (another tenant's run is a 404), and roles (submit, read, reply, cancel,"
        " admin): a route without its role is a 403 (docs/security.md).",
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        # the task's parts first: a hand-written schema of the same name would replace one
        "schemas": {
            "Task": _TASK,
            **_TASK_PARTS,
            "Error": {
                "type": "object",
                "required": ["error", "detail"],
                "properties": {
                    "error": {"type": "string"},
                    "detail": {"type": "string"},
                    "reason": {
                        "type": "string",
                        "description": "invalid_input:<what>: ... when the input is refused",
                    },
                },
            },
            **_OPERATOR_BODIES,
            "OperatorAction": {
                "type": "object",
                "properties": {
                    "run_id": {"type": "string"},
                    "action": {"enum": ["resolve", "reopen", "redrive"]},
                    "input_id": {"type": "string"},
                    "created": {"type": "boolean"},
                    "actor": {"type": "string"},
                    "status": {"type": "string", "description": "the status it acted on"},
                    "version": {"type": "integer", "description": "the version it acted on"},
                },
            },
            "Fork": {
                "type": "object",
                "properties": {
                    "run_id": {"type": "string", "description": "the fork"},
                    "source_run_id": {"type": "string"},
                    "source_seq": {"type": "integer"},
                    "edits": {"type": "object"},
                    "status": {"type": "string", "description": "the fork's status at start"},
                    "step": {"type": "integer"},
                    "action": {"enum": ["fork", "resume"]},
                    "created": {"type": "boolean"},
                    "actor": {"type": "string"},
                    "idempotency_key": {"type": "string"},
                    "input_id": {"type": "string"},
                    "trace_id": {"type": "string"},
                },
            },
            "Submitted": {
                "type": "object",
                "properties": {
                    "run_id": {"type": "string"},
                    "trace_id": {"type": "string"},
                    "created": {"type": "boolean"},
                    "status": {"type": "string"},
                },
            },
            "Run": {
                "type": "object",
                "description": "The committed projection of a run. `result` is set only "
                "when `terminal`; `question` (with `resume_token`) only in WAITING_USER. A run "
                "not projected yet is PENDING, with `dead_letters`: its refused inputs.",
                "properties": {
                    "run_id": {"type": "string"},
                    "tenant": {
                        "type": ["string", "null"],
                        "description": "the tenant the run belongs to (null: a refused"
                        " submission that named none)",
                    },
                    "status": {"type": "string"},
                    "terminal": {"type": "boolean"},
                    "waits": {
                        "type": "object",
                        "properties": {
                            "system_ms": {"type": "integer"},
                            "tool_wait_ms": {"type": "integer"},
                            "user_wait_ms": {"type": "integer"},
                        },
                    },
                    "operations": {"type": "array", "items": {"type": "object"}},
                    "question": {"type": ["object", "null"]},
                    "result": {"type": ["object", "null"]},
                    "dead_letters": {
                        "type": "array",
                        "description": "PENDING only: the run's refused inputs, newest first "
                        "(at most 10)",
                        "items": {
                            "type": "object",
                            "properties": {
                                "reason": {"type": "string"},
                                "error_class": {"type": "string"},
                                "at": {"type": "integer"},
                                "source_topic": {"type": "string"},
                                "source_partition": {"type": "integer"},
                                "source_offset": {"type": "integer"},
                            },
                        },
                    },
                },
            },
            "RunList": {
                "type": "object",
                "required": ["runs", "next_cursor", "counts"],
                "properties": {
                    "runs": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "run_id": {"type": "string"},
                                "tenant": {"type": "string"},
                                "status": {"type": "string"},
                                "goal": {"type": "string", "description": "first 200 chars"},
                                "step": {"type": "integer"},
                                "attempt": {"type": "integer"},
                                "trace_id": {"type": "string"},
                                "started_at": {"type": "integer"},
                                "last_event_at": {"type": "integer"},
                                "ended_at": {"type": ["integer", "null"]},
                                "last_seq": {"type": "integer"},
                                "last_event": {"type": ["string", "null"]},
                                "waits": {"type": "object"},
                            },
                        },
                    },
                    "next_cursor": {"type": ["string", "null"]},
                    "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
                },
            },
            "Reply": {
                "type": "object",
                "required": ["resume_token", "response"],
                "properties": {
                    "resume_token": {"type": "string"},
                    "response": {"type": "object"},
                },
            },
            "Callback": {
                "type": "object",
                "required": ["status"],
                "properties": {
                    "status": {"enum": ["succeeded", "failed", "cancelled", "running", "accepted"]},
                    "result": {},
                    "error_class": {"type": "string"},
                    "error_code": {"type": "string"},
                    "message": {"type": "string"},
                    "retry_after_ms": {"type": "integer"},
                },
            },
        },
    },
    "security": [{"bearer": []}],
    "paths": {
        "/runs": {
            "get": {
                "summary": "The run list, newest first (by started_at, run_id), with counts",
                "description": "Filters combine with AND. `counts` are per status over every "
                "filter but `status`. Pass `next_cursor` back as `cursor` for the next page.",
                "parameters": [
                    _query("status", "comma-separated statuses, e.g. WAITING_USER,PAUSED"),
                    _query("waiting", "user (WAITING_USER, PAUSED) or tool", ["user", "tool"]),
                    _query(
                        "stuck_minutes",
                        "no progress for this many minutes (the rule of `agentruns scan`)",
                        kind="number",
                    ),
                    _query("since", "started at or after (ms since epoch)", kind="integer"),
                    _query("until", "started before (ms since epoch)", kind="integer"),
                    _query("q", "a run id, an idempotency key or a trace id"),
                    _query(
                        "tenant",
                        "this tenant's runs (an admin's; anyone else sees its own tenant's)",
                    ),
                    _query("limit", "1 to 200, default 50", kind="integer"),
                    _query("cursor", "next_cursor of the previous page"),
                ],
                "responses": {
                    "200": _resp("a page of runs", {"$ref": "#/components/schemas/RunList"}),
                    **_ERRS,
                },
            },
            "post": {
                "summary": "Submit a task (idempotent by Idempotency-Key)",
                "parameters": [
                    {
                        "name": "Idempotency-Key",
                        "in": "header",
                        "required": True,
                        "schema": {"type": "string", "maxLength": 200},
                    },
                    {"name": "X-Trace-Id", "in": "header", "schema": {"type": "string"}},
                ],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Task"}}
                    },
                },
                "responses": {
                    "202": _resp("submitted", {"$ref": "#/components/schemas/Submitted"}),
                    "200": _resp(
                        "a repeat: the same run", {"$ref": "#/components/schemas/Submitted"}
                    ),
                    "400": _resp("no Idempotency-Key or not JSON", _ERROR),
                    "422": _resp(
                        "invalid task (with its invalid_input reason), or the key was used for"
                        " another task",
                        _ERROR,
                    ),
                    **_TOO_LARGE,
                    **_ERRS,
                },
            },
        },
        "/runs/{run_id}": {
            "get": {
                "summary": "The run as committed: state, waits, operations, question, result",
                "parameters": [_RUN_ID],
                "responses": {
                    "200": _resp("the run", {"$ref": "#/components/schemas/Run"}),
                    "404": _resp(
                        "no run, no submission through this API and no dead letter of it", _ERROR
                    ),
                    **_ERRS,
                },
            }
        },
        "/runs/{run_id}/events": {
            "get": {
                "summary": "The run's event log (projected), in seq order",
                "parameters": [
                    _RUN_ID,
                    {"name": "after_seq", "in": "query", "schema": {"type": "integer"}},
                    {"name": "limit", "in": "query", "schema": {"type": "integer"}},
                ],
                "responses": {"200": _resp("events"), "404": _resp("unknown run", _ERROR)},
            }
        },
        "/credentials": {
            "get": {
                "summary": "The credentials the API holds (admin): id, tenant, roles, where"
                " each was read and when this process last took a request with it",
                "responses": {
                    "200": _resp("the credentials, never their hashes"),
                    "403": _resp("the credential has no admin role", _ERROR),
                },
            }
        },
        "/runs/{run_id}/replies": {
            "post": {
                "summary": "Answer the open question with its resume token (single use)",
                "parameters": [_RUN_ID],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Reply"}}
                    },
                },
                "responses": {
                    "202": _resp("accepted; the core applies it"),
                    "409": _resp("token forged, expired, stale or already used", _ERROR),
                    "422": _resp(
                        "response does not match the expected schema, or nests too deep", _ERROR
                    ),
                    **_TOO_LARGE,
                    **_ERRS,
                },
            }
        },
        "/runs/{run_id}/resolve": _operator(
            "Resolve a PAUSED run: continue, fail, succeed, or reconcile a tool call",
            "`continue` reopens a run paused for lack of progress to READY; `fail` and "
            "`succeed` end it (also a correction of an ended run's status); `reconcile` gives "
            "the verdict on a tool call whose outcome no look-up could tell: `found_succeeded` "
            "(optionally with its `result`) or `not_executed` (sent again with the same key).",
            _RESOLVE,
        ),
        "/runs/{run_id}/reopen": _operator(
            "Reopen an ended run to READY (a new resolution, optionally a new goal)",
            "Only a terminal run; a PAUSED one is resolved with `continue`.",
            _REOPEN,
        ),
        "/runs/{run_id}/redrive": _operator(
            "Drive a run waiting for a model or tool answer that is not coming",
            "READY, MODEL_RUNNING, TOOL_RUNNING or WAITING_TOOL with no pending timer but the "
            "deadline: the model is called again as a new attempt, a tool call is looked up.",
            _REDRIVE,
        ),
        "/runs/{run_id}/fork": _fork(
            "Start a new run from this run's state after its record `at`",
            "The fork's log begins with a ForkedFrom record naming this run and the seq; its "
            "state is this run's at that seq (effects completed before it are not run again), "
            "with `model_route` as an edit. The fork's id derives from the Idempotency-Key "
            "(without one: from the run, the seq and the edits): the same key, the same fork. "
            "This run is never changed. Read from the projection: a seq it has not projected "
            "yet is refused.",
            {
                "type": "object",
                "required": ["at"],
                "additionalProperties": False,
                "properties": {
                    "at": {"type": "integer", "minimum": 1},
                    "model_route": {"type": "string", "minLength": 1, "maxLength": 512},
                    "messages": {
                        "type": "array",
                        "description": "added where the fork asks the model",
                        "items": {"type": "object", "required": ["role", "content"]},
                    },
                    "replace_inputs": {
                        "type": "array",
                        "description": "records at or before `at` replaced by other events",
                        "items": {"type": "object", "required": ["seq", "event"]},
                    },
                    "budgets": _RAISED_BUDGETS,
                },
            },
        ),
        "/runs/{run_id}/resume": _fork(
            "Resume a failed run after a fix: a fork before its failure",
            "A FAILED, EXPIRED or BUDGET_EXHAUSTED run is forked at the last step before the "
            "first failure of the call that ended it, so that call runs again (under the "
            "fork's keys) and nothing before it does; from `from_seq` instead (at or before "
            "that point); a CANCELLED run with `cancelled`. What the run spent carries over: "
            "after a budget stop or an expired deadline, raise `budgets`.",
            {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "from_seq": {"type": "integer", "minimum": 1},
                    "cancelled": {"type": "boolean"},
                    "budgets": _RAISED_BUDGETS,
                },
            },
        ),
        "/runs/{run_id}/cancel": {
            "post": {
                "summary": "Request cancellation (handled at the run's next transition)",
                "parameters": [_RUN_ID],
                "responses": {
                    "202": _resp("cancel requested"),
                    "404": _resp("unknown run", _ERROR),
                    "409": _resp("the run is already terminal", _ERROR),
                    **_TOO_LARGE,
                    **_ERRS,
                },
            }
        },
        "/operations/{key}/callback": {
            "post": {
                "summary": "Completion of an async tool operation (bearer token or"
                " X-Callback-Signature)",
                "parameters": [
                    {"name": "key", "in": "path", "required": True, "schema": {"type": "string"}},
                    {
                        "name": "X-Callback-Signature",
                        "in": "header",
                        "schema": {"type": "string", "maxLength": 128},
                    },
                ],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Callback"}}
                    },
                },
                "responses": {
                    "202": _resp("accepted; the core applies it"),
                    "200": _resp("nothing to do (already settled, or still running)"),
                    "403": _resp("signed for another dispatch of the operation", _ERROR),
                    "404": _resp("unknown operation", _ERROR),
                    "422": _resp("unknown status", _ERROR),
                    **_TOO_LARGE,
                    **_ERRS,
                },
            }
        },
        "/readyz": {
            "get": {
                "summary": "Readiness: Kafka and Postgres answer (the status, each check's code)",
                "security": [],
                "responses": {"200": {}, "503": {}},
            }
        },
        "/healthz": {
            "get": {
                "summary": "Readiness, the same as /readyz; with an admin credential, each"
                " check's detail too",
                "security": [{}, {"bearer": []}],
                "responses": {"200": {}, "401": _resp("not a credential", _ERROR), "503": {}},
            }
        },
        "/livez": {
            "get": {
                "summary": "Liveness: the app serves",
                "security": [],
                "responses": {"200": {}, "503": {}},
            }
        },
        "/metrics": {
            "get": {"summary": "Prometheus metrics", "security": [], "responses": {"200": {}}}
        },
        "/openapi.json": {
            "get": {"summary": "This document", "security": [], "responses": {"200": {}}}
        },
    },
}

"""The operator's tool catalog: a task may only narrow it.

Every widening (a tool the catalog lacks, a wider or different permission, another schema, a
flipped idempotent or is_async, an approval the catalog requires left out) is refused with
the tool and the field named; narrowing is accepted. The processor stamps the check on the
submission it applies (a producer's stamp is overwritten), the core fails a refused run with
the reason and records the catalog version, the doors fill omitted fields and refuse, and the
tool executor refuses an unapproved call of a tool now under approval.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentruns.connectors import cli
from agentruns.connectors.api.inputs import InvalidInputError, submitted_task
from agentruns.connectors.catalog import catalog_of
from agentruns.connectors.dev.servers import tool_server
from agentruns.connectors.executors.base import NOTHING_AHEAD
from agentruns.connectors.executors.tool import ToolHandler, ToolRegistry
from agentruns.processors import catalog as catalog_module
from agentruns.processors.catalog import (
    PERMISSION_RANK,
    Catalog,
    CatalogTool,
    catalog_problem,
    with_catalog_fields,
)
from agentruns.processors.effects import CallTool, OperationSpec
from agentruns.processors.events import CatalogCheck, RunSubmitted, ToolCallFailed
from agentruns.processors.state import ErrorClass, Policy, RunStatus, ToolSpec
from agentruns.processors.transition import transition
from agentruns.streams.codec import decode, encode
from agentruns.streams.inputs import Batch, Inbound, InputPath, PathSettings, RecordLimits
from agentruns.streams.metrics import ProcessorStats
from agentruns.streams.records import input_record
from agentruns.streams.topics import TopicNames

AT = 1_700_000_000_000
LOOKUP = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
DELETE = {"type": "object", "properties": {"id": {"type": "string"}}, "additionalProperties": False}
CATALOG = Catalog.of(
    "test-1",
    {
        "lookup": CatalogTool(parameters=LOOKUP, permission="read"),
        "update": CatalogTool(parameters={"type": "object"}, permission="write", idempotent=False),
        "report": CatalogTool(parameters={"type": "object"}, permission="read", is_async=True),
        "delete_record": CatalogTool(parameters=DELETE, permission="write", approval_required=True),
        "special": CatalogTool(parameters={"type": "object"}, permission="billing"),
    },
)
POLICY = Policy(allowed_permissions=("read", "write", "admin"), approval_required=("write",))


def declared(name: str, **changes: Any) -> ToolSpec:
    """The tool as the catalog declares it, with `changes`."""
    tool = CATALOG.tools[name]
    fields = {
        "parameters": tool.parameters,
        "permission": tool.permission,
        "idempotent": tool.idempotent,
        "is_async": tool.is_async,
    }
    return ToolSpec(name=name, **{**fields, **changes})


names = st.lists(st.sampled_from(sorted(CATALOG.tools)), unique=True, max_size=5)


# --------------------------------------------------------------------------- narrowing


@given(
    chosen=names,
    stricter=st.booleans(),
    extra_approvals=st.lists(st.sampled_from(["read", "admin"])),
)
def test_a_task_that_narrows_the_catalog_is_accepted(
    chosen: list[str], stricter: bool, extra_approvals: list[str]
) -> None:
    tools = []
    for name in chosen:
        spec = declared(name)
        rank = PERMISSION_RANK.get(spec.permission)
        if stricter and rank is not None and rank < 2:  # a stricter permission is narrower
            spec = declared(name, permission="admin")
        tools.append(spec)
    # a stricter approval list: every permission of a catalog-approved tool, and more
    approvals = {t.permission for t in tools if CATALOG.tools[t.name].approval_required}
    policy = Policy(approval_required=tuple(sorted(approvals | set(extra_approvals))))
    assert catalog_problem(tuple(tools), policy, CATALOG) is None


def test_a_task_without_tools_is_within_any_catalog() -> None:
    assert catalog_problem((), Policy(), CATALOG) is None
    assert catalog_problem((), Policy(), Catalog.of("empty", {})) is None


# --------------------------------------------------------------------------- widening


def test_a_tool_the_catalog_lacks_is_refused_by_name() -> None:
    tools = (declared("lookup"), ToolSpec(name="drop_table"))
    assert (
        catalog_problem(tools, POLICY, CATALOG) == "invalid_input:tool_not_in_catalog: drop_table"
    )


@pytest.mark.parametrize(
    ("name", "change", "detail"),
    [
        ("update", {"permission": "read"}, "permission read is wider than the catalog's write"),
        ("special", {"permission": "admin"}, "permission admin differs from the catalog's billing"),
        ("lookup", {"permission": "root"}, "permission root differs from the catalog's read"),
        (
            "lookup",
            {"parameters": {"type": "object"}},
            "parameters differ from the catalog's schema",
        ),
        ("update", {"idempotent": True}, "idempotent true differs from the catalog's false"),
        ("report", {"is_async": False}, "is_async false differs from the catalog's true"),
    ],
)
def test_each_widening_names_the_tool_and_the_field(
    name: str, change: dict[str, Any], detail: str
) -> None:
    problem = catalog_problem((declared(name, **change),), POLICY, CATALOG)
    assert problem == f"invalid_input:tool_differs_from_catalog: {name}: {detail}"


@given(
    schema=st.dictionaries(
        st.sampled_from(["type", "required", "minProperties", "title"]),
        st.one_of(st.just("object"), st.integers(0, 3), st.lists(st.just("q"), max_size=1)),
        max_size=3,
    )
)
def test_any_schema_but_the_catalogs_is_refused(schema: dict[str, Any]) -> None:
    problem = catalog_problem((declared("lookup", parameters=schema),), POLICY, CATALOG)
    if json.dumps(schema, sort_keys=True) == json.dumps(LOOKUP, sort_keys=True):
        assert problem is None
    else:
        assert problem == (
            "invalid_input:tool_differs_from_catalog: lookup: parameters differ from the "
            "catalog's schema"
        )


def test_the_same_schema_written_in_another_key_order_is_the_catalogs() -> None:
    reordered = {"required": ["q"], "properties": {"q": {"type": "string"}}, "type": "object"}
    assert catalog_problem((declared("lookup", parameters=reordered),), POLICY, CATALOG) is None


@given(approvals=st.lists(st.sampled_from(["read", "admin", "billing"]), unique=True))
def test_a_tool_the_catalog_puts_under_approval_needs_it_in_the_policy(
    approvals: list[str],
) -> None:
    policy = Policy(approval_required=tuple(approvals))
    problem = catalog_problem((declared("delete_record"),), policy, CATALOG)
    assert problem == (
        "invalid_input:tool_differs_from_catalog: delete_record: approval_required: the catalog "
        "requires a person's approval of every call; policy.approval_required must list its "
        "permission write"
    )
    # declared stricter, it is approved under its declared permission
    admin = declared("delete_record", permission="admin")
    assert catalog_problem((admin,), Policy(approval_required=("admin",)), CATALOG) is None


def test_the_first_problem_in_the_tasks_order_is_the_reason_and_it_is_bounded() -> None:
    long_name = "x" * 500
    tools = (declared("update", idempotent=True), ToolSpec(name=long_name))
    assert "update: idempotent" in (catalog_problem(tools, POLICY, CATALOG) or "")
    problem = catalog_problem((ToolSpec(name=long_name),), POLICY, CATALOG)
    assert problem is not None and len(problem) == 300


# --------------------------------------------------------------------------- versions


def test_the_version_is_the_label_and_a_hash_of_the_content() -> None:
    same = Catalog.of("test-1", dict(reversed(CATALOG.tools.items())))
    assert same.version == CATALOG.version and CATALOG.version.startswith("test-1+")
    edited = dict(CATALOG.tools)
    edited["lookup"] = CatalogTool(parameters=LOOKUP, permission="write")
    assert Catalog.of("test-1", edited).version != CATALOG.version


def test_the_catalog_of_a_registry_is_its_tools_as_declared(tmp_path: Path) -> None:
    registry = ToolRegistry.load(tool_server.DEFAULT_REGISTRY)
    catalog = catalog_of(registry)
    assert catalog.version.startswith(registry.version + "+")
    assert set(catalog.tools) == set(registry.tools)
    report = catalog.tools["run_report"]
    assert report.is_async and report.permission == "read" and not report.approval_required
    data = json.loads(tool_server.DEFAULT_REGISTRY.read_text())
    data["tools"][0]["approval_required"] = True  # edited, its version not bumped
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(data))
    edited = catalog_of(ToolRegistry.load(path))
    assert edited.version != catalog.version and edited.version.startswith(registry.version)
    assert edited.tools[data["tools"][0]["name"]].approval_required


# --------------------------------------------------------------------------- the core


def submission(tools: tuple[ToolSpec, ...], **fields: Any) -> RunSubmitted:
    return RunSubmitted(
        run_id="r1", event_id="r1:submit", at=AT, trace_id="t", goal="g", tools=tools, **fields
    )


def test_the_stamp_is_the_processors_whatever_the_producer_wrote() -> None:
    forged = CatalogCheck(version="forged", problem=None)
    widened = submission((declared("special", permission="write"),), policy=POLICY, catalog=forged)
    stamped = catalog_module.stamped(widened, CATALOG)
    assert stamped.catalog == CatalogCheck(
        version=CATALOG.version,
        problem="invalid_input:tool_differs_from_catalog: special: permission write differs "
        "from the catalog's billing",
    )
    assert catalog_module.stamped(widened, None).catalog is msgspec.UNSET
    fine = submission((declared("lookup"),))
    assert catalog_module.stamped(fine, CATALOG).catalog == CatalogCheck(version=CATALOG.version)


def test_the_core_fails_a_run_the_catalog_refused_and_records_the_version() -> None:
    widened = submission((declared("special", permission="write"),), policy=POLICY)
    result = transition(None, catalog_module.stamped(widened, CATALOG))
    assert result.state is not None and result.state.status is RunStatus.FAILED
    assert result.state.outcome == (
        "invalid_input:tool_differs_from_catalog: special: permission write differs from the "
        "catalog's billing"
    )
    assert result.state.catalog_version == CATALOG.version
    assert result.state.config.tools == ()
    assert any(e.type == "PublishResult" for e in result.effects)
    allowed = transition(None, catalog_module.stamped(submission((declared("lookup"),)), CATALOG))
    assert allowed.state is not None and allowed.state.status is RunStatus.MODEL_RUNNING
    assert allowed.state.catalog_version == CATALOG.version


def test_a_record_that_names_its_tools_only_gets_the_catalogs_declarations() -> None:
    bare = submission(tuple(ToolSpec(name=n) for n in ("lookup", "update", "report")))
    stamped = catalog_module.stamped(bare, CATALOG)
    assert stamped.catalog == CatalogCheck(version=CATALOG.version)
    assert stamped.tools == (declared("lookup"), declared("update"), declared("report"))
    # what differs from a default is the task's own, and checked
    narrower = submission((declared("lookup", permission="write"),))
    assert catalog_module.stamped(narrower, CATALOG).tools == narrower.tools


def test_a_run_submitted_without_a_catalog_is_the_bytes_it_was() -> None:
    state = transition(None, submission((ToolSpec(name="anything"),))).state
    assert state is not None and state.catalog_version is msgspec.UNSET
    assert "catalog" not in state.to_json()
    assert "catalog" not in submission(()).model_dump_json()


TOPICS = TopicNames.for_prefix("t")


def test_the_processor_fails_a_raw_submission_that_widens_its_catalog() -> None:
    path = InputPath(
        TOPICS,
        PathSettings(catalog=CATALOG),
        ProcessorStats(),
        limits=RecordLimits(default=1 << 20),
        clock=lambda: AT / 1000,
    )
    batch = Batch()
    forged = CatalogCheck(version="forged")
    event = submission((ToolSpec(name="delete_record"),), catalog=forged)
    value = encode("Input", input_record(event))
    path.handle(Inbound("t.inbox", 0, 0, b"r1", value, [], AT), batch)
    (logged,) = [decode(r[2], "Event").record for r in batch.records if r[0] == TOPICS.events]
    body = json.loads(logged["body"])
    # the fields a record cannot tell from omitted are the catalog's; its approval is missing
    reason = (
        "invalid_input:tool_differs_from_catalog: delete_record: approval_required: the catalog "
        "requires a person's approval of every call; policy.approval_required must list its "
        "permission write"
    )
    assert body["catalog"] == {"version": CATALOG.version, "problem": reason}
    (tool,) = body["tools"]
    assert (tool["parameters"], tool["permission"]) == (DELETE, "write")
    (result,) = [decode(r[2], "Result").record for r in batch.records if r[0] == TOPICS.results]
    assert result["status"] == "FAILED" and reason in result["summary"]
    state = path.slots[0]["r1"].state
    assert state is not None and state.catalog_version == CATALOG.version


# --------------------------------------------------------------------------- the doors

IDS = {"run_id": "r1", "event_id": "r1:submit", "at": AT, "trace_id": "t"}


def test_a_door_fills_the_fields_a_submitter_left_out_from_the_catalog() -> None:
    task = {"goal": "g", "tools": [{"name": "update"}, {"name": "lookup", "permission": "admin"}]}
    event = submitted_task(task, catalog=CATALOG, **IDS)
    update, lookup = event.tools
    assert update.permission == "write" and not update.idempotent
    assert lookup.permission == "admin" and lookup.parameters == LOOKUP
    assert with_catalog_fields("not a tool", CATALOG) == "not a tool"
    assert with_catalog_fields({"name": "unknown"}, CATALOG) == {"name": "unknown"}


@pytest.mark.parametrize(
    ("tool", "reason"),
    [
        ({"name": "drop_table"}, "invalid_input:tool_not_in_catalog: drop_table"),
        (
            {"name": "update", "permission": "read"},
            "invalid_input:tool_differs_from_catalog: update: permission read is wider",
        ),
        (
            {"name": "lookup", "parameters": {}},
            "invalid_input:tool_differs_from_catalog: lookup: parameters differ",
        ),
    ],
)
def test_a_door_refuses_a_task_that_widens_the_catalog(tool: dict[str, Any], reason: str) -> None:
    with pytest.raises(InvalidInputError) as refused:
        submitted_task({"goal": "g", "tools": [tool]}, catalog=CATALOG, **IDS)
    assert refused.value.reason.startswith(reason)
    # without a catalog the task declares its own tools
    submitted_task({"goal": "g", "tools": [tool]}, **IDS)


ROUTED = Catalog.of("test-1", CATALOG.tools, ("gpt", "claude"))


@given(route=st.text(min_size=1, max_size=40))
def test_a_task_may_name_only_a_configured_model_route(route: str) -> None:
    event = submission((), model_route=route)
    problem = catalog_module.submission_problem(event, ROUTED)
    if route in ("gpt", "claude"):
        assert problem is None
    else:
        assert problem == f"invalid_input:model_route_not_configured: {route}"[:300]
    # no routes file: any route; a "*" route: any route
    assert catalog_module.submission_problem(event, CATALOG) is None
    star = Catalog.of("test-1", CATALOG.tools, ("gpt", "*"))
    assert catalog_module.submission_problem(event, star) is None


def test_routes_are_part_of_the_version_and_refused_at_every_door() -> None:
    assert ROUTED.version != CATALOG.version
    assert Catalog.of("test-1", CATALOG.tools, ("claude", "gpt")).version == ROUTED.version
    with pytest.raises(InvalidInputError, match="model_route_not_configured: mine"):
        submitted_task({"goal": "g", "model_route": "mine"}, catalog=ROUTED, **IDS)
    stamped = catalog_module.stamped(submission((), model_route="mine"), ROUTED)
    result = transition(None, stamped)
    assert result.state is not None and result.state.status is RunStatus.FAILED
    assert result.state.outcome == "invalid_input:model_route_not_configured: mine"


def test_a_task_cannot_carry_the_processors_stamp() -> None:
    with pytest.raises(InvalidInputError, match="`catalog` is not a task field"):
        submitted_task({"goal": "g", "catalog": {"version": "mine"}}, catalog=CATALOG, **IDS)


def test_tools_list_prints_the_catalog_version_and_tools(
    capsys: pytest.CaptureFixture[str],
) -> None:
    registry = str(tool_server.DEFAULT_REGISTRY)
    assert cli.main(["tools", "list", "--registry", registry, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["version"] == catalog_of(ToolRegistry.load(registry)).version
    report = next(t for t in listed["tools"] if t["name"] == "run_report")
    assert report["is_async"] and report["backend"] == "POST /tools/run_report"
    assert cli.main(["tools", "list", "--registry", registry]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"tool catalog {listed['version']} (6 tools)")
    assert "delete_record  admin" in text


# --------------------------------------------------------------------------- the executor


def test_the_executor_refuses_an_unapproved_call_of_a_tool_now_under_approval(
    tmp_path: Path,
) -> None:
    data = json.loads(tool_server.DEFAULT_REGISTRY.read_text())
    for tool in data["tools"]:
        tool["approval_required"] = tool["name"] == "send_email"
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(data))
    # nothing listens there: a refused call never reaches the network
    handler = ToolHandler(ToolRegistry.load(path), base_url="http://127.0.0.1:9")

    def call(tool: str, decision: str) -> Any:
        effect = CallTool(
            idempotency_key="k",
            run_id="r1",
            step=1,
            attempt=1,
            trace_id="t",
            operation=OperationSpec(
                key="op-1",
                tool=tool,
                arguments_json='{"to": "a@b", "subject": "s", "body": "b"}',
                expected_version=None,
                policy_decision=decision,
                dispatch=1,
            ),
        )
        return asyncio.run(handler.execute(effect, None, NOTHING_AHEAD)).event

    try:
        refused = call("send_email", "allow")
        assert isinstance(refused, ToolCallFailed)
        assert refused.error_class is ErrorClass.PERMISSION_DENIED
        assert refused.error_code == "not_approved" and "send_email" in (refused.message or "")
        unknown = call("dropped_tool", "approved")
        assert isinstance(unknown, ToolCallFailed) and unknown.error_code == "unknown_tool"
        # an approved call goes on to the backend (here: nothing listens, nothing was sent)
        approved = call("send_email", "approved")
        assert isinstance(approved, ToolCallFailed) and approved.error_code == "connect_failed"
    finally:
        handler.close()

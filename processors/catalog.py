"""The operator's tool catalog: what a task may declare about a tool (pure, no I/O).

A task carries its own tool list (`ToolSpec`) and policy. With a catalog configured, a task may
only narrow what the catalog allows (docs/tools.md, "Tool catalog"):

- every tool it declares is in the catalog (``tool_not_in_catalog``);
- a tool's ``permission`` is the catalog's or a stricter one (read < write < admin); a
  permission outside that ranking must equal the catalog's;
- its ``parameters`` schema is the catalog's, canonical JSON equal (a task cannot loosen a
  schema, and telling a stricter one from a looser one is not decidable in general);
- ``idempotent`` and ``is_async`` are the catalog's (they decide resends and polling);
- a tool the catalog marks ``approval_required`` is under approval in the task's policy: its
  declared permission is in ``policy.approval_required``. A task that leaves it out is refused
  rather than widened, so what a run does follows from its task and the stamped check alone.

The doors that can see what a submitter omitted (the API's JSON, the client's dicts) first fill
an omitted tool field from the catalog (`with_catalog_fields`). A record straight on Kafka
cannot tell an omitted field from one written with `ToolSpec`'s default, so the processor takes
the catalog's value for every field of `FILLED_FIELDS` that holds the default
(`with_catalog_defaults`: the catalog's is never wider) and logs the submission with the tools
it checked. `catalog_problem` never raises.

The catalog may change after a run was checked (the components refresh it): the tool executor
holds each call to the catalog as it is then (`call_refusal`: a tool now under approval, or now
ranked stricter than the permission the run declared, is not called).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from agentruns.processors.events import CatalogCheck, RunSubmitted
from agentruns.processors.ids import canonical_json
from agentruns.processors.limits import Id
from agentruns.processors.state import Frozen, Policy, ToolSpec

#: Permission names by strictness: a tool declared with a higher rank is narrower.
PERMISSION_RANK: dict[str, int] = {"read": 0, "write": 1, "admin": 2}
#: The ToolSpec fields a door fills from the catalog when the submitter left them out.
FILLED_FIELDS = ("parameters", "permission", "idempotent", "is_async", "kind")
# Reasons are capped like the core's other invalid_input reasons.
_MAX_REASON = 300
# The registry's own label is cut to this before the content hash is added (an id's bound).
_MAX_LABEL = 200


class CatalogTool(Frozen, frozen=True, kw_only=True, gc=False):
    """What the operator allows of one tool."""

    parameters: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "object"})
    permission: Id = "read"
    approval_required: bool = False
    idempotent: bool = True
    is_async: bool = False
    #: "run": a call starts a child run (agentruns.processors.children); UNSET (not written):
    #: an ordinary tool, so the catalogs without one keep their versions.
    kind: Literal["tool", "run"] | msgspec.UnsetType = msgspec.UNSET


class Catalog(Frozen, frozen=True, kw_only=True, gc=False):
    """The tools a task may use, by name, under a version that changes with any of them."""

    version: Id
    tools: dict[str, CatalogTool]
    # the model routes a task may name (the model executor's routes file; "*" admits any);
    # None: any route
    routes: tuple[Id, ...] | None = None

    @classmethod
    def of(
        cls,
        label: str,
        tools: Mapping[str, CatalogTool],
        routes: tuple[str, ...] | None = None,
    ) -> Catalog:
        """A catalog whose version is ``label`` plus a short hash of its content, so an edited
        registry whose own version was not bumped is still a new catalog version."""
        described: dict[str, Any] = {name: tools[name].model_dump() for name in sorted(tools)}
        if routes is not None:  # a catalog without routes keeps the version it had
            described = {"tools": described, "routes": sorted(routes)}
        digest = hashlib.sha256(canonical_json(described).encode()).hexdigest()[:12]
        return cls(
            version=f"{label[:_MAX_LABEL]}+{digest}",
            tools=dict(tools),
            routes=None if routes is None else tuple(sorted(routes)),
        )


def route_problem(route: str, catalog: Catalog) -> str | None:
    """Why a task may not name ``route`` (a model route the configuration lacks), or None."""
    if catalog.routes is None or route in catalog.routes or "*" in catalog.routes:
        return None
    return _reason(f"invalid_input:model_route_not_configured: {route}")


def submission_problem(event: RunSubmitted, catalog: Catalog) -> str | None:
    """Why ``catalog`` refuses a submission: its model route, then its tools."""
    return route_problem(event.model_route, catalog) or catalog_problem(
        event.tools, event.policy, catalog
    )


def catalog_problem(tools: tuple[ToolSpec, ...], policy: Policy, catalog: Catalog) -> str | None:
    """Why a task's tools and policy widen what ``catalog`` allows
    (``invalid_input:<what>: <tool>: <field> ...``), or None. The first problem, in the
    task's tool order."""
    for spec in tools:
        allowed = catalog.tools.get(spec.name)
        if allowed is None:
            return _reason(f"invalid_input:tool_not_in_catalog: {spec.name}")
        problem = _tool_problem(spec, allowed, policy)
        if problem is not None:
            return _reason(f"invalid_input:tool_differs_from_catalog: {spec.name}: {problem}")
    return None


def _tool_problem(spec: ToolSpec, allowed: CatalogTool, policy: Policy) -> str | None:
    if spec.permission != allowed.permission:
        mine, theirs = PERMISSION_RANK.get(spec.permission), PERMISSION_RANK.get(allowed.permission)
        if mine is None or theirs is None:
            return f"permission {spec.permission} differs from the catalog's {allowed.permission}"
        if mine < theirs:
            return f"permission {spec.permission} is wider than the catalog's {allowed.permission}"
    if canonical_json(spec.parameters) != canonical_json(allowed.parameters):
        return "parameters differ from the catalog's schema"
    if _kind(spec.kind) != _kind(allowed.kind):
        return f"kind {_kind(spec.kind)} differs from the catalog's {_kind(allowed.kind)}"
    for name in ("idempotent", "is_async"):
        mine_flag, theirs_flag = getattr(spec, name), getattr(allowed, name)
        if mine_flag != theirs_flag:
            return f"{name} {_flag(mine_flag)} differs from the catalog's {_flag(theirs_flag)}"
    if allowed.approval_required and spec.permission not in policy.approval_required:
        return (
            "approval_required: the catalog requires a person's approval of every call; "
            f"policy.approval_required must list its permission {spec.permission}"
        )
    return None


def _kind(value: str | msgspec.UnsetType) -> str:
    return "tool" if isinstance(value, msgspec.UnsetType) else value


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _reason(text: str) -> str:
    return text[:_MAX_REASON]


_DEFAULTS = ToolSpec(name="-")


def with_catalog_defaults(tools: tuple[ToolSpec, ...], catalog: Catalog) -> tuple[ToolSpec, ...]:
    """``tools`` with each `FILLED_FIELDS` field that holds `ToolSpec`'s default (omitted, as
    far as a decoded record can tell) taken from the catalog; tools it lacks as they are."""
    out: list[ToolSpec] = []
    for spec in tools:
        allowed = catalog.tools.get(spec.name)
        update = {}
        if allowed is not None:
            for name in FILLED_FIELDS:
                mine, default = getattr(spec, name), getattr(_DEFAULTS, name)
                if mine == default and getattr(allowed, name) != default:
                    update[name] = getattr(allowed, name)
        out.append(msgspec.structs.replace(spec, **update) if update else spec)
    return tuple(out)


def check(event: RunSubmitted, catalog: Catalog) -> CatalogCheck:
    """The submission held against ``catalog``: its version and its refusal, if any."""
    try:
        problem = submission_problem(event, catalog)
    except Exception as exc:  # a schema canonical JSON cannot write (never in a decoded task)
        problem = _reason(f"invalid_input:tool_schema: {type(exc).__name__}")
    return CatalogCheck(version=catalog.version, problem=problem)


def stamped(event: RunSubmitted, catalog: Catalog | None) -> RunSubmitted:
    """The submission as the processor applies and logs it: its tools with the catalog's
    defaults and the check against its catalog, whatever the producer wrote; without a check
    when it has no catalog."""
    if catalog is None:
        if isinstance(event.catalog, msgspec.UnsetType):
            return event
        return event.model_copy(update={"catalog": msgspec.UNSET})
    tools = with_catalog_defaults(event.tools, catalog)
    if tools != event.tools:
        event = event.model_copy(update={"tools": tools})
    value = check(event, catalog)
    if event.catalog == value:
        return event
    return event.model_copy(update={"catalog": value})


def refusal(event: RunSubmitted) -> str | None:
    """The catalog's refusal the processor stamped on a submission, or None."""
    stamp = event.catalog
    return None if isinstance(stamp, msgspec.UnsetType) else stamp.problem


def with_catalog_fields(tool: Any, catalog: Catalog) -> Any:
    """A task's tool as a door received it (a parsed JSON object), with each field of
    `FILLED_FIELDS` the submitter left out taken from the catalog; anything else (not an
    object, a name the catalog lacks) is returned as it came, for the checks to refuse."""
    if not isinstance(tool, Mapping):
        return tool
    name = tool.get("name")
    allowed = catalog.tools.get(name) if isinstance(name, str) else None
    if allowed is None:
        return tool
    declared = allowed.model_dump()
    return {**{f: declared[f] for f in FILLED_FIELDS if f not in tool and f in declared}, **tool}


def call_refusal(
    tool: str,
    declared: str | None,
    policy_decision: str,
    *,
    permission: str,
    approval_required: bool,
    version: str,
) -> tuple[str, str] | None:
    """Why the tool executor refuses a call the catalog ``version`` no longer allows, as
    ``(error_code, message)``, or None. The catalog may have changed since the run was
    submitted: a tool it now puts under approval is not called on a decision no person made
    (``not_approved``), nor one it now ranks stricter than the permission the run declared,
    ``declared`` (``permission_stricter``: the run's approval followed from its own
    permission). ``declared`` None (an effect that does not carry it): not checked."""
    if approval_required and policy_decision != "approved":
        return "not_approved", _reason(
            f"{tool} requires a person's approval in tool catalog {version}; "
            "this call was not approved"
        )
    if declared is None or declared == permission:
        return None
    mine, theirs = PERMISSION_RANK.get(declared), PERMISSION_RANK.get(permission)
    if mine is None or theirs is None or theirs > mine:
        return "permission_stricter", _reason(
            f"{tool} has permission {permission} in tool catalog {version}, stricter than "
            f"the {declared} the run was submitted with; this call is not made"
        )
    return None

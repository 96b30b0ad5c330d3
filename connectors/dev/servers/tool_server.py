"""Example tool server: a few real tools with idempotency by key, a status endpoint, an async job,
and fault injection. Used by the demo, the executor tests and the benchmarks.

Every call is ``POST /tools/{name}`` with JSON arguments and an ``Idempotency-Key`` header. An
executed operation is stored under its key: a repeat with the same key answers the stored result
(header ``Idempotency-Replayed: true``) and does not execute again; per-key execution counters
are readable at ``GET /stats`` and ``GET /executions/{key}``. Rejections (validation, 409, 300,
injected faults) execute nothing and store nothing. Results are deterministic: ids derive from
the idempotency key. See ``docs/servers.md``.

    python -m agentruns.connectors.dev.servers.tool_server --port 8701
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import ssl
import sys
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import quote

from jsonschema import validators
from jsonschema.protocols import Validator
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from agentruns.connectors.dev.servers.httpserver import (
    FaultRequest,
    JSONHandler,
    ServerHandle,
    param_text,
    parse_fault_header,
    run_until_signal,
    start_server,
)
from agentruns.connectors.dev.servers.latency import LatencyParams

DEFAULT_REGISTRY = Path(__file__).with_name("tools.example.json")
DEFAULT_PORT = 8701
LATE_MARGIN_MS = 1000.0  # "late" answers this long after the tool's registry timeout
DEFAULT_SLOW_MS = 200.0
RUN_ID_HEADER = "X-Agentruns-Run-Id"  # whose run a call is, for the `latency` accounting

FaultKind = Literal[
    "late",
    "drop",
    "drop_after",
    "slow",
    "403",
    "409",
    "429",
    "300",
    "500",
    "503",
    "unknown",
    "deep",
    "huge",
    "drip",
    "latency",
]
FAULT_KINDS: frozenset[str] = frozenset(get_args(FaultKind))
# Defaults of the hostile kinds' parameters: `deep` nesting, `huge` body bytes, `drip` pace.
DEEP_DEPTH = 1000
HUGE_BYTES = 16 * 1024 * 1024
DRIP_MS = 1000.0
STATUS_FAULTS = {"403": 403, "409": 409, "429": 429, "300": 300, "500": 500, "503": 503}
FAULT_BODIES: dict[str, dict[str, Any]] = {
    "403": {"error": "permission_denied", "message": "caller may not use this tool (injected)"},
    "409": {"error": "stale_version", "message": "expected_version is stale (injected)"},
    "429": {"error": "rate_limited", "message": "too many requests (injected)"},
    "300": {
        "error": "ambiguous",
        "message": "several objects match (injected)",
        "candidates": [{"record_id": "R-1"}, {"record_id": "R-2"}],
    },
    "500": {"error": "internal", "message": "server error (injected)"},
    "503": {"error": "unavailable", "message": "service unavailable (injected)"},
}


class FaultRule(BaseModel):
    """A fault posted to ``/faults``. ``target``: a tool name, ``*`` (every tool),
    ``operations`` (the status look-up) or ``cancel``; ``times: null`` = until cleared."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target: str = "*"
    kind: FaultKind
    key: str | None = None
    times: int | None = 1
    delay_ms: float | None = None
    retry_after: float | str = 1.0
    depth: int | None = None
    size: int | None = None
    framing: Literal["length", "chunked", "close"] | None = None
    # `latency`: log-uniform in [min_ms, max_ms], or log-normal around median_ms (see
    # LatencyParams); checked when posted, so a bad rule is refused
    min_ms: float | None = None
    max_ms: float | None = None
    median_ms: float | None = None
    sigma: float | None = None
    seed: int | None = None

    @model_validator(mode="after")
    def _latency_in_bounds(self) -> FaultRule:
        if self.kind == "latency":
            try:
                LatencyParams.model_validate(self.latency_params())
            except ValidationError as exc:
                raise ValueError(f"invalid latency parameters: {exc}") from None
        return self

    def latency_params(self) -> dict[str, str]:
        """The latency parameters given, as fault parameters (exact: ``str``, not ``%g``)."""
        values = {name: getattr(self, name) for name in LatencyParams.model_fields}
        return {name: str(v) for name, v in values.items() if v is not None}


class ToolRejectedError(Exception):
    """A tool refused the call without executing anything (nothing is stored)."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body.get("error", status))
        self.status = status
        self.body = body


@dataclass(frozen=True)
class ToolDef:
    name: str
    permission: str
    is_async: bool
    timeout_ms: float
    validator: Validator


@dataclass
class Operation:
    key: str
    tool: str
    args_hash: str
    status: str  # running | succeeded | failed | cancelled
    http_status: int
    result: Any
    callback_url: str | None = None
    callback: dict[str, Any] = field(default_factory=dict)
    #: The caller's X-Callback-Signature, sent back with the callback.
    callback_signature: str | None = None
    timer: threading.Timer | None = None

    def view(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "tool": self.tool, "status": self.status}
        out["result"] = self.result
        if self.callback_url:
            out["callback"] = {"url": self.callback_url, **self.callback}
        return out


def canonical(args: Any) -> str:
    return json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def short_hash(text: str, n: int = 10) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def status_path(key: str) -> str:
    return f"/operations/{quote(key, safe='')}"


def load_registry(path: Path | str = DEFAULT_REGISTRY) -> dict[str, ToolDef]:
    data = json.loads(Path(path).read_text())
    tools: dict[str, ToolDef] = {}
    for spec in data["tools"]:
        schema = spec.get("parameters") or {"type": "object"}
        cls = validators.validator_for(schema)
        cls.check_schema(schema)
        tools[spec["name"]] = ToolDef(
            name=spec["name"],
            permission=str(spec.get("permission", "write")),
            is_async=bool(spec.get("async", False)),
            timeout_ms=float(spec.get("timeout_ms", 5000)),
            validator=cls(schema),
        )
    return tools


DOCS = [
    ("doc-escalation", "Escalation policy", "Escalate outages to priority high within 1 hour."),
    ("doc-printer", "Printer maintenance", "Printers are serviced by facilities every month."),
    ("doc-refund", "Refund policy", "Refunds within 30 days need a ticket and a manager's OK."),
    ("doc-orders", "Order status", "Order status is visible in the portal; order 42 shipped."),
    ("doc-records", "Duplicate customer records", "Duplicates are merged, then deleted by admins."),
    ("doc-reports", "Reports", "Monthly sales reports run asynchronously and take minutes."),
]


def seed_records() -> dict[str, dict[str, Any]]:
    return {
        "R-1": {"record_id": "R-1", "name": "Acme Corp", "version": 1, "fields": {"tier": "gold"}},
        "R-2": {"record_id": "R-2", "name": "Acme Inc", "version": 1, "fields": {"tier": "silver"}},
        "R-3": {"record_id": "R-3", "name": "Globex", "version": 1, "fields": {"tier": "bronze"}},
    }


@dataclass(frozen=True)
class ServerAuth:
    """What the tool API (``/tools/*``, ``/operations/*``) asks of a client: a bearer token,
    an API key in a header, or nothing. The test routes (stats, faults, executions) ask
    nothing, so a test can look behind the door."""

    bearer_token: str | None = None
    api_key: str | None = None
    api_key_header: str = "X-API-Key"

    def allows(self, header: Callable[[str], str | None]) -> bool:
        if self.bearer_token is not None:
            given = header("Authorization") or ""
            if not hmac.compare_digest(given.encode(), f"Bearer {self.bearer_token}".encode()):
                return False
        if self.api_key is not None:
            given = header(self.api_key_header) or ""
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                return False
        return True


class ToolServerApp:
    """All state behind one lock: operations by key, counters, records, tickets, outbox."""

    def __init__(
        self,
        registry: Mapping[str, ToolDef],
        report_delay_ms: float = 1000.0,
        auth: ServerAuth | None = None,
    ) -> None:
        self.auth = auth or ServerAuth()
        self.registry = dict(registry)
        self.report_delay_ms = report_delay_ms
        self.lock = threading.Lock()
        self._closed = False
        self._closing = threading.Event()
        self._reset_state()
        self._tools: dict[str, Callable[[str, dict[str, Any]], Any]] = {
            "search_docs": self._search_docs,
            "create_ticket": self._create_ticket,
            "update_record": self._update_record,
            "send_email": self._send_email,
            "delete_record": self._delete_record,
        }

    def implements(self, tool: ToolDef) -> bool:
        return tool.is_async or tool.name in self._tools

    def _reset_state(self) -> None:
        self.operations: dict[str, Operation] = {}
        self.executions: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.by_tool: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.counters: Counter[str] = Counter()
        self.rules: list[tuple[FaultRule, list[int]]] = []
        self.latency: dict[str, list[float]] = {}  # run (or key) -> [calls, ms]
        self.records = seed_records()
        self.tickets: dict[str, dict[str, Any]] = {}
        self.outbox: list[dict[str, Any]] = []

    def reset(self) -> None:
        with self.lock:
            self._cancel_timers()
            self._reset_state()

    def close(self) -> None:
        self._closing.set()
        with self.lock:
            self._closed = True
            self._cancel_timers()

    def _wait_closing(self, seconds: float) -> bool:
        return self._closing.wait(seconds)

    def _cancel_timers(self) -> None:
        for op in self.operations.values():
            if op.timer is not None:
                op.timer.cancel()

    # --- faults -------------------------------------------------------------------------

    def add_rule(self, rule: FaultRule) -> None:
        with self.lock:
            self.rules.append((rule, [0]))

    def rule_views(self) -> list[dict[str, Any]]:
        with self.lock:
            return [{**r.model_dump(), "used": used[0]} for r, used in self.rules]

    def clear_rules(self) -> None:
        with self.lock:
            self.rules.clear()

    def match_fault(self, target: str, key: str | None) -> FaultRequest | None:
        with self.lock:
            for rule, used in self.rules:
                if rule.target not in ("*", target) or (rule.target == "*" and target in _META):
                    continue
                if rule.key is not None and rule.key != key:
                    continue
                if rule.times is not None and used[0] >= rule.times:
                    continue
                used[0] += 1
                if rule.kind == "latency":
                    return FaultRequest(kind=rule.kind, params=rule.latency_params())
                values = {
                    "retry_after": rule.retry_after,
                    "delay_ms": rule.delay_ms,
                    "depth": rule.depth,
                    "size": rule.size,
                    "framing": rule.framing,
                }
                params = {k: param_text(v) for k, v in values.items() if v is not None}
                return FaultRequest(kind=rule.kind, params=params)
        return None

    def count_fault(self, kind: str) -> None:
        with self.lock:
            self.faults[kind] += 1

    def record_latency(self, run: str, ms: float) -> None:
        """Account a ``latency`` call's drawn time to its run."""
        with self.lock:
            calls_ms = self.latency.setdefault(run, [0, 0.0])
            calls_ms[0] += 1
            calls_ms[1] += ms

    def latency_view(self) -> dict[str, Any]:
        with self.lock:
            runs = {k: {"calls": int(n), "ms": round(ms, 3)} for k, (n, ms) in self.latency.items()}
        return {"runs": runs}

    # --- execution ----------------------------------------------------------------------

    def call(
        self,
        tool: ToolDef,
        key: str,
        args: dict[str, Any],
        callback_url: str | None,
        callback_signature: str | None = None,
    ) -> tuple[int, dict[str, Any], bool]:
        """Execute once per key. Returns (HTTP status, body, replayed)."""
        args_hash = short_hash(canonical(args), 32)
        with self.lock:
            op = self.operations.get(key)
            if op is not None:
                if op.tool != tool.name or op.args_hash != args_hash:
                    body = {
                        "error": "idempotency_key_reused",
                        "message": "this key was used with another tool or other arguments",
                    }
                    return 422, body, False
                self.counters["duplicates"] += 1
                return op.http_status, self._response(op), True
            if tool.is_async:
                op = self._start_job(key, args, args_hash, callback_url)
                op.callback_signature = callback_signature
            else:
                try:
                    result = self._tools[tool.name](key, args)
                except ToolRejectedError as exc:
                    self.counters["rejected"] += 1
                    return exc.status, exc.body, False
                op = Operation(key, tool.name, args_hash, "succeeded", 200, result)
            self.operations[key] = op
            self.executions[key] += 1
            self.by_tool[tool.name] += 1
            return op.http_status, self._response(op), False

    def _response(self, op: Operation) -> dict[str, Any]:
        if op.http_status == 202:
            path = status_path(op.key)
            return {
                "key": op.key,
                "status": "accepted",
                "status_url": path,
                "cancel_url": f"{path}/cancel",
            }
        return {"key": op.key, "status": op.status, "result": op.result}

    def _start_job(
        self, key: str, args: dict[str, Any], args_hash: str, callback_url: str | None
    ) -> Operation:
        op = Operation(key, "run_report", args_hash, "running", 202, None, callback_url)
        delay = float(args.get("duration_ms", self.report_delay_ms)) / 1000
        if not self._closed:
            op.timer = threading.Timer(delay, self._finish_job, args=(key, args))
            op.timer.daemon = True
            op.timer.start()
        return op

    def _finish_job(self, key: str, args: dict[str, Any]) -> None:
        with self.lock:
            op = self.operations.get(key)
            if op is None or op.status != "running" or self._closed:
                return
            op.timer = None
            if args.get("fail"):
                op.status = "failed"
                op.result = {"error": "report_failed", "report": args["report"]}
            else:
                op.status = "succeeded"
                op.result = {
                    "report_id": f"RPT-{short_hash(key)}",
                    "report": args["report"],
                    "params": args.get("params", {}),
                    "rows": 3,
                    "summary": f"{args['report']}: 3 rows",
                }
            payload = op.view()
            payload.pop("callback", None)
            url, signature = op.callback_url, op.callback_signature
        if url:
            self._deliver_callback(key, url, payload, signature)

    def _deliver_callback(
        self, key: str, url: str, payload: dict[str, Any], signature: str | None = None
    ) -> None:
        """POST the outcome to the caller's callback URL, with the caller's callback signature
        (X-Callback-Signature) when it sent one; three attempts, short backoff."""
        attempts, delivered, error = 0, False, ""
        data = json.dumps(payload, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json", "Idempotency-Key": key}
        if signature:
            headers["X-Callback-Signature"] = signature
        for backoff in (0.0, 0.1, 0.5):
            if backoff and self._wait_closing(backoff):
                break
            attempts += 1
            request = urllib.request.Request(url, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=5.0) as response:
                    response.read()
                delivered = True
                break
            except urllib.error.HTTPError as exc:
                error = f"HTTP {exc.code}"
            except (OSError, ValueError) as exc:
                error = repr(exc)
        with self.lock:
            op = self.operations.get(key)
            if op is not None:
                op.callback = {"delivered": delivered, "attempts": attempts}
                if not delivered:
                    op.callback["error"] = error
            self.counters["callbacks_delivered" if delivered else "callbacks_failed"] += 1

    def lookup(self, key: str) -> dict[str, Any] | None:
        with self.lock:
            op = self.operations.get(key)
            if op is None:
                return None
            return {**op.view(), "executions": self.executions[key]}

    def cancel(self, key: str) -> tuple[int, dict[str, Any]]:
        with self.lock:
            op = self.operations.get(key)
            if op is None:
                return 404, {"key": key, "status": "not_found", "executed": False}
            if op.status in ("running", "cancelled"):
                if op.timer is not None:
                    op.timer.cancel()
                    op.timer = None
                op.status = "cancelled"
                return 200, {"key": key, "status": "cancelled"}
            return 409, {"key": key, "status": op.status, "error": "not_cancellable"}

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "requests": self.counters["requests"],
                "tool_calls": self.counters["tool_calls"],
                "executions_total": sum(self.executions.values()),
                "duplicates": self.counters["duplicates"],
                "rejected": self.counters["rejected"],
                "executions": dict(self.executions),
                "calls": dict(self.calls),
                "by_tool": dict(self.by_tool),
                "faults_served": sum(self.faults.values()),
                "faults": dict(self.faults),
                "callbacks": {
                    "delivered": self.counters["callbacks_delivered"],
                    "failed": self.counters["callbacks_failed"],
                },
                "tickets": len(self.tickets),
                "outbox": len(self.outbox),
            }

    # --- the tools (called under the lock; deterministic) ---------------------------------

    def _search_docs(self, key: str, args: dict[str, Any]) -> Any:
        words = [w for w in str(args["query"]).lower().split() if w]
        hits: list[dict[str, Any]] = []
        for doc_id, title, text in DOCS:
            haystack = f"{title} {text}".lower()
            score = sum(haystack.count(w) for w in words)
            if score:
                hits.append({"doc_id": doc_id, "title": title, "snippet": text, "score": score})
        hits.sort(key=lambda h: (-h["score"], h["doc_id"]))
        result: dict[str, Any] = {"query": args["query"], "hits": hits[: args.get("limit", 5)]}
        size = args.get("size") or (200_000 if args.get("large") else 0)
        if size:
            line = f"{args['query']} | " + " ".join(d[2] for d in DOCS) + "\n"
            result["content"] = (line * (size // len(line) + 1))[:size]
        return result

    def _create_ticket(self, key: str, args: dict[str, Any]) -> Any:
        ticket = {
            "ticket_id": f"T-{short_hash(key)}",
            "title": args["title"],
            "priority": args.get("priority", "normal"),
            "status": "open",
        }
        self.tickets[ticket["ticket_id"]] = ticket
        return ticket

    def _find_record(self, args: dict[str, Any]) -> dict[str, Any]:
        if "record_id" in args:
            record = self.records.get(args["record_id"])
            if record is None:
                raise ToolRejectedError(404, {"error": "not_found", "record_id": args["record_id"]})
            return record
        name = str(args.get("name", "")).lower()
        found = [r for r in self.records.values() if name and name in r["name"].lower()]
        if not found:
            raise ToolRejectedError(404, {"error": "not_found", "name": args.get("name")})
        if len(found) > 1:
            candidates = [{"record_id": r["record_id"], "name": r["name"]} for r in found]
            raise ToolRejectedError(300, {"error": "ambiguous", "candidates": candidates})
        return found[0]

    def _update_record(self, key: str, args: dict[str, Any]) -> Any:
        record = self._find_record(args)
        if args["expected_version"] != record["version"]:
            raise ToolRejectedError(
                409,
                {
                    "error": "stale_version",
                    "record_id": record["record_id"],
                    "expected_version": args["expected_version"],
                    "current_version": record["version"],
                },
            )
        record["fields"] = {**record["fields"], **args["fields"]}
        record["version"] += 1
        return json.loads(json.dumps(record))

    def _send_email(self, key: str, args: dict[str, Any]) -> Any:
        message = {"message_id": f"M-{short_hash(key)}", "to": args["to"], "status": "sent"}
        self.outbox.append({**message, "subject": args["subject"], "body": args["body"]})
        return message

    def _delete_record(self, key: str, args: dict[str, Any]) -> Any:
        record = self._find_record(args)
        del self.records[record["record_id"]]
        return {"record_id": record["record_id"], "deleted": True}


_META = ("operations", "cancel")


class ToolHandler(JSONHandler):
    @property
    def app(self) -> ToolServerApp:
        app = self.server.app
        assert isinstance(app, ToolServerApp)
        return app

    def _fault(self, target: str, key: str | None) -> FaultRequest | None:
        fault = parse_fault_header(self.header("X-Fault"))
        if fault is None:
            fault = self.app.match_fault(target, key)
        if fault is not None and fault.kind in FAULT_KINDS:
            self.app.count_fault(fault.kind)
        return fault

    def _count(self, name: str) -> None:
        with self.app.lock:
            self.app.counters[name] += 1

    def _authorized(self) -> bool:
        """The tool API's door: False (401 sent) when the request lacks the credential."""
        if self.app.auth.allows(self.header):
            return True
        self._count("unauthorized")
        self.send_json(401, {"error": "unauthorized", "message": "missing or wrong credential"})
        return False

    def do_GET(self) -> None:
        self._count("requests")
        parts = self.path_parts()
        app = self.app
        match parts:
            case ["stats"]:
                self.send_json(200, app.stats())
            case ["healthz"]:
                self.send_json(200, {"status": "ok"})
            case ["executions", key]:
                with app.lock:
                    body = {"key": key, "count": app.executions[key], "calls": app.calls[key]}
                self.send_json(200, body)
            case ["operations", key]:
                if not self._authorized():
                    return
                fault = self._fault("operations", key)
                if fault is not None and fault.kind in ("unknown", "503", "500"):
                    status = 500 if fault.kind == "500" else 503
                    self.send_json(
                        status, {"key": key, "status": "unknown", "error": "cannot_tell"}
                    )
                    return
                found = app.lookup(key)
                if found is None:
                    self.send_json(404, {"key": key, "status": "not_found", "executed": False})
                else:
                    self.send_json(200, found)
            case ["records", record_id]:
                with app.lock:
                    record = json.loads(json.dumps(app.records.get(record_id)))
                if record is None:
                    self.send_json(404, {"error": "not_found", "record_id": record_id})
                else:
                    self.send_json(200, record)
            case ["outbox"]:
                with app.lock:
                    outbox = list(app.outbox)
                self.send_json(200, {"messages": outbox})
            case ["faults"]:
                self.send_json(200, {"rules": app.rule_views()})
            case ["latency"]:
                self.send_json(200, app.latency_view())
            case _:
                self.send_json(404, {"error": "no_route", "path": self.path})

    def do_DELETE(self) -> None:
        self._count("requests")
        if self.path_parts() == ["faults"]:
            self.app.clear_rules()
            self.send_json(200, {"rules": []})
        else:
            self.send_json(404, {"error": "no_route", "path": self.path})

    def do_POST(self) -> None:
        self._count("requests")
        parts = self.path_parts()
        try:
            body = self.read_json()
        except ValueError:
            self.send_json(400, {"error": "invalid_json"})
            return
        if parts[:1] in (["tools"], ["operations"]) and not self._authorized():
            return
        match parts:
            case ["tools", name]:
                self.tool_call(name, body)
            case ["operations", key, "cancel"]:
                fault = self._fault("cancel", key)
                if fault is not None:
                    self.send_json(503, {"key": key, "status": "unknown", "error": "cannot_tell"})
                    return
                status, payload = self.app.cancel(key)
                self.send_json(status, payload)
            case ["reset"]:
                self.app.reset()
                self.send_json(200, {"reset": True})
            case ["faults"]:
                try:
                    raw = body.get("rules", [body]) if isinstance(body, dict) else body
                    rules = [FaultRule.model_validate(r) for r in raw]
                except (ValidationError, AttributeError, TypeError) as exc:
                    self.send_json(422, {"error": "invalid_fault_rule", "message": str(exc)})
                    return
                for rule in rules:
                    self.app.add_rule(rule)
                self.send_json(200, {"rules": self.app.rule_views()})
            case ["config"]:
                if isinstance(body, dict) and "report_delay_ms" in body:
                    self.app.report_delay_ms = float(body["report_delay_ms"])
                self.send_json(200, {"report_delay_ms": self.app.report_delay_ms})
            case _:
                self.send_json(404, {"error": "no_route", "path": self.path})

    def tool_call(self, name: str, args: Any) -> None:
        app = self.app
        tool = app.registry.get(name)
        if tool is None or not app.implements(tool):
            self.send_json(404, {"error": "unknown_tool", "tool": name})
            return
        key = self.header("Idempotency-Key")
        if not key:
            self.send_json(400, {"error": "missing_idempotency_key"})
            return
        with app.lock:
            app.counters["tool_calls"] += 1
            app.calls[key] += 1
            attempt = app.calls[key] - 1
        fault = self._fault(name, key)
        kind = fault.kind if fault else None
        if kind is not None and kind not in FAULT_KINDS:
            self.send_json(400, {"error": "unknown_fault", "fault": kind})
            return
        latency: LatencyParams | None = None
        if fault is not None and kind == "latency":
            try:
                latency = LatencyParams.model_validate(fault.params)
            except ValidationError as exc:
                self.send_json(400, {"error": "invalid_latency", "message": str(exc)})
                return
        if fault is not None and kind == "drop":
            self.drop_connection()
            return
        if fault is not None and kind in STATUS_FAULTS:
            headers = {}
            if kind == "429":  # verbatim: `inf`, `-1`, an HTTP date or garbage as given
                headers["Retry-After"] = fault.params.get("retry_after", "1")
            self.send_json(STATUS_FAULTS[kind], {"key": key, **FAULT_BODIES[kind]}, headers)
            return
        if fault is not None and kind in ("deep", "huge"):
            self.hostile_body(key, fault)
            return
        slow = fault.number("delay_ms", DEFAULT_SLOW_MS) / 1000 if fault and kind == "slow" else 0
        if slow and not self.server.sleep(slow):
            self.drop_connection()
            return
        if not isinstance(args, dict):
            self.send_json(422, {"error": "invalid_arguments", "message": "not an object"})
            return
        errors = sorted(tool.validator.iter_errors(args), key=lambda e: list(e.path))
        if errors:
            messages = [f"{'/'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in errors]
            self.send_json(422, {"error": "invalid_arguments", "messages": messages})
            return
        status, payload, replayed = app.call(
            tool, key, args, self.header("X-Callback-URL"), self.header("X-Callback-Signature")
        )
        if fault is not None and kind == "drop_after":
            self.drop_connection()  # executed, but the answer is lost
            return
        # "late": executed; answer only after the client's timeout (or never, if closing)
        late_ms = tool.timeout_ms + LATE_MARGIN_MS
        late = fault.number("delay_ms", late_ms) / 1000 if fault and kind == "late" else 0
        if latency is not None:  # "latency": executed; answers after the drawn time
            ms = latency.draw_ms(key, attempt)
            app.record_latency(self.header(RUN_ID_HEADER) or key, ms)
            late = ms / 1000
        if late and not self.server.sleep(late):
            self.drop_connection()
            return
        headers = {"Idempotency-Replayed": "true"} if replayed else {}
        if status == 202:
            headers["Location"] = payload["status_url"]
        if fault is not None and kind == "drip":
            self.drip(status, payload, headers, fault.number("delay_ms", DRIP_MS) / 1000)
            return
        self.send_json(status, payload, headers)

    def hostile_body(self, key: str, fault: FaultRequest) -> None:
        """``deep``: 200 with a result nested ``depth`` (1000) arrays deep. ``huge``: 200 with
        a valid JSON body of ``size`` (16 MiB) bytes, framed by Content-Length, ``chunked``
        (64 KiB chunks) or ``close`` (no length: the body ends with the connection). Nothing
        is executed."""
        if fault.kind == "deep":
            depth = fault.integer("depth", DEEP_DEPTH)
            body = b'{"key":"%s","status":"succeeded","result":' % key.encode()
            body += b"[" * depth + b"]" * depth + b"}"
            self.send_bytes(200, body, {"Content-Type": "application/json"})
            return
        size = fault.integer("size", HUGE_BYTES)
        head = b'{"status":"succeeded","result":{"content":"'
        body = head + b"x" * max(0, size - len(head) - 3) + b'"}}'
        framing = fault.params.get("framing", "length")
        if framing == "length":
            self.send_bytes(200, body, {"Content-Type": "application/json"})
            return
        headers = {"Content-Type": "application/json"}
        if framing == "chunked":
            headers["Transfer-Encoding"] = "chunked"
        else:
            self.close_connection = True
        try:
            self.wfile.write(self.head_bytes(200, headers))
            for at in range(0, len(body), 65536):
                piece = body[at : at + 65536]
                self.wfile.write(
                    b"%x\r\n%s\r\n" % (len(piece), piece) if framing == "chunked" else piece
                )
            if framing == "chunked":
                self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True
            return
        if framing == "close":
            self.drop_connection()

    def drip(
        self, status: int, payload: dict[str, Any], headers: dict[str, str], delay: float
    ) -> None:
        """The answer (Content-Length framed), one byte every ``delay`` seconds."""
        body = json.dumps(payload, separators=(",", ":")).encode()
        head = {"Content-Type": "application/json", **headers, "Content-Length": str(len(body))}
        try:
            self.wfile.write(self.head_bytes(status, head))
            self.wfile.flush()
            for byte in body:
                if not self.server.sleep(delay):
                    self.drop_connection()
                    return
                self.wfile.write(bytes((byte,)))
                self.wfile.flush()
        except OSError:
            self.close_connection = True


def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    registry: Path | str = DEFAULT_REGISTRY,
    report_delay_ms: float = 1000.0,
    auth: ServerAuth | None = None,
    tls: ssl.SSLContext | None = None,
) -> ServerHandle:
    """Start the tool server in a background thread (port 0 picks a free port). The handle's
    ``app`` is the ``ToolServerApp`` (tests may read its counters directly). ``auth``: the
    credential the tool API asks for; ``tls``: serve HTTPS with this server-side context."""
    app = ToolServerApp(load_registry(registry), report_delay_ms=report_delay_ms, auth=auth)
    return start_server(host, port, ToolHandler, app, tls=tls)


def server_tls(cert_file: str, key_file: str, client_ca: str | None = None) -> ssl.SSLContext:
    """A server-side TLS context; with ``client_ca``, clients must show a certificate it
    signed (mTLS)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    if client_ca is not None:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agentruns dev tool-server",
        description="Example tool server (idempotency keys, status look-up, async job, faults).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--registry", type=Path, default=DEFAULT_REGISTRY)
    parser.add_argument("--report-delay-ms", type=float, default=1000.0)
    parser.add_argument(
        "--bearer-token-env", help="ask for 'Authorization: Bearer $VAR' on the tool API"
    )
    parser.add_argument("--api-key-env", help="ask for the API key $VAR on the tool API")
    parser.add_argument("--api-key-header", default="X-API-Key")
    parser.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--tls-key", help="the certificate's private key (PEM)")
    parser.add_argument("--client-ca", help="ask clients for a certificate this CA signed")
    args = parser.parse_args(argv)
    try:
        auth = ServerAuth(
            bearer_token=os.environ[args.bearer_token_env] if args.bearer_token_env else None,
            api_key=os.environ[args.api_key_env] if args.api_key_env else None,
            api_key_header=args.api_key_header,
        )
        tls = server_tls(args.tls_cert, args.tls_key, args.client_ca) if args.tls_cert else None
        handle = serve(args.host, args.port, args.registry, args.report_delay_ms, auth, tls)
    except KeyError as exc:
        print(f"error: the environment variable {exc} is not set", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # port in use, unreadable or invalid files
        print(f"error: {exc}", file=sys.stderr)
        return 2
    banner = f"tool server listening on {handle.url} (registry: {args.registry})"
    return run_until_signal(handle, banner, lambda s: print(s, flush=True))


if __name__ == "__main__":
    from agentruns.connectors.lifecycle import run_command

    raise SystemExit(run_command(main))

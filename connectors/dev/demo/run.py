"""`agentruns demo` (what `make demo` runs): the whole pipeline on named scenarios.

It resolves Kafka and Postgres (starting local ones when none is configured), starts the
scripted model server and the example tool server, runs the processor, both executors, the
timer service and the sink as separate processes, submits one run per scenario, drives the
scenarios that need a person or a crash, and prints a summary table read back from the topics
and the tool server. Everything it started is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from agentruns.connectors import forks
from agentruns.connectors.dev.servers import mcp_server, model_server, tool_server
from agentruns.connectors.dev.stack.services import ServiceStack
from agentruns.connectors.dev.stack.supervisor import Supervisor
from agentruns.connectors.endpoints import state_dir
from agentruns.connectors.executors.tool import ToolRegistry, tools_of
from agentruns.connectors.postgres.dsn import redact_dsn
from agentruns.connectors.postgres.migrate import migrate
from agentruns.processors.children import CHILD_PARAMETERS, child_run_id
from agentruns.processors.effects import AskUser, CallTool
from agentruns.processors.events import (
    CancelRequested,
    Message,
    ModelCallCompleted,
    RunSubmitted,
    UserReplied,
)
from agentruns.processors.ids import canonicalize_arguments, operation_key
from agentruns.processors.state import (
    Budgets,
    ForkEdits,
    LoopLimits,
    Policy,
    RunState,
    ToolSpec,
)
from agentruns.streams.admin import ensure_topics
from agentruns.streams.clock import now_ms
from agentruns.streams.codec import decode, encode
from agentruns.streams.kafka_defaults import LONG_POLL_MS, client_settings, close_consumer, release
from agentruns.streams.partitioning import partition_for
from agentruns.streams.records import input_record, parse_effect_body, parse_state
from agentruns.streams.topics import INBOX, RESULTS, STATE, effect_suffix, topic_name

PARTITIONS = 3
REGISTRY = tool_server.DEFAULT_REGISTRY
SCENARIOS = model_server.BUILTIN_SCENARIOS
#: The demo's model route on the Anthropic Messages API (the scripted server's Anthropic mode).
ANTHROPIC_ROUTE = "claude"


def registry_tools() -> tuple[ToolSpec, ...]:
    registry = json.loads(REGISTRY.read_text())
    return tuple(
        ToolSpec(
            name=t["name"],
            parameters=t["parameters"],
            permission=t.get("permission", "read"),
            is_async=bool(t.get("async", False)),
            idempotent=bool(t.get("idempotent", True)),
            cancellable=bool(t.get("cancel_url_template")),
        )
        for t in registry["tools"]
    )


#: The demo's tool of kind run: a call hands a question to a specialist agent, a child run on
#: the scripted `specialist` scenario with the caller's search tool (docs/tools.md).
SPECIALIST_TOOL: dict[str, Any] = {
    "name": "ask_specialist",
    "kind": "run",
    "description": "Hand a question to a specialist agent (a child run) and wait for its answer.",
    "permission": "read",
    "parameters": CHILD_PARAMETERS,
    "run": {"model_route": "scenario:specialist", "tools": ["search_docs"]},
}
SPECIALIST_SPEC = ToolSpec(
    name="ask_specialist", parameters=CHILD_PARAMETERS, permission="read", kind="run"
)


def registry_with_shop(registry: Path, shop_url: str) -> Path:
    """Write at ``registry`` the example registry with the example MCP server at ``shop_url``
    as ``shop`` and the demo's tool of kind run."""
    spec = json.loads(REGISTRY.read_text())
    spec["mcp_servers"] = [mcp_server.dev_registry_entry(shop_url)]
    spec["tools"].append(SPECIALIST_TOOL)
    registry.write_text(json.dumps(spec))
    return registry


def _configuration(folder: Path, models_url: str, shop_url: str) -> tuple[Path, Path]:
    """The demo's tool registry (the example registry and the example MCP server) and model
    routes (every route to the scripted server; ``claude`` through its Anthropic mode)."""
    registry = registry_with_shop(folder / "tools.json", shop_url)
    routes = folder / "routes.json"
    anthropic = {"provider": "anthropic", "base_url": models_url, "model": "claude-demo"}
    routes.write_text(json.dumps({ANTHROPIC_ROUTE: {**anthropic, "api_key": "demo-key"}, "*": {}}))
    return registry, routes


def mcp_tool_specs(registry: Path) -> tuple[ToolSpec, ...]:
    """The MCP server's tools as the catalog declares them (listed from the server)."""
    entries = tools_of(ToolRegistry.load(registry))
    return tuple(
        ToolSpec(
            name=e.name,
            parameters=dict(e.parameters),
            permission=e.permission,
            idempotent=e.idempotent,
            is_async=e.is_async,
        )
        for e in entries.values()
        if e.backend == "mcp"
    )


@dataclass
class Scenario:
    name: str
    model_scenario: str
    description: str
    expect: str
    budgets: Budgets = field(default_factory=Budgets)
    policy: Policy = field(default_factory=Policy)
    loop: LoopLimits = field(default_factory=LoopLimits)
    run_id: str = ""
    # Set when the scenario needs the driver: called each tick with the run's latest state.
    drive: Callable[[Demo, Scenario, RunState | None], None] | None = None
    done_driving: bool = False
    note: str = ""
    # the task's model route (default: the scripted scenario's own) and its tools: the example
    # registry's HTTP tools, or the example MCP server's
    route: str = ""
    mcp_tools: bool = False
    # tools the task has beside the registry's (the demo's tool of kind run)
    extra_tools: tuple[ToolSpec, ...] = ()


class Demo:
    def __init__(self, bootstrap: str, prefix: str, supervisor: Supervisor, tools_url: str):
        self.bootstrap = bootstrap
        self.prefix = prefix
        self.supervisor = supervisor
        self.tools_url = tools_url
        self.began = time.monotonic()
        self.producer = Producer(
            {"bootstrap.servers": bootstrap, **client_settings(), "enable.idempotence": True}
        )
        self.inbox = topic_name(INBOX, prefix)
        self.states: dict[str, RunState] = {}
        self.results: dict[str, dict[str, Any]] = {}
        self.questions: dict[str, AskUser] = {}
        self._readers = {
            STATE: self._reader(topic_name(STATE, prefix)),
            RESULTS: self._reader(topic_name(RESULTS, prefix)),
            "timer": self._reader(topic_name(effect_suffix("timer"), prefix)),
            "tool": self._reader(topic_name(effect_suffix("tool"), prefix)),
        }
        self.op_keys: dict[str, set[str]] = {}
        self.mcp_tools: tuple[ToolSpec, ...] = ()

    def _reader(self, topic: str) -> Consumer:
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                **client_settings(),
                "group.id": f"demo-{uuid.uuid4().hex[:8]}",
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": LONG_POLL_MS,
                "log_level": 3,
            }
        )
        consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        return consumer

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.began:6.1f}s] {text}", flush=True)

    def send(self, record: dict[str, Any]) -> None:
        run_id = record["run_id"]
        self.producer.produce(
            self.inbox,
            key=run_id.encode(),
            value=encode("Input", record),
            partition=partition_for(run_id, PARTITIONS),
        )
        self.producer.flush(30)

    def send_event(self, event: Any, *, producer_seq: int | None = None) -> None:
        producer_id = "demo" if producer_seq is not None else None
        self.send(input_record(event, producer_id=producer_id, producer_seq=producer_seq))

    def poll(self) -> None:
        for kind, consumer in self._readers.items():
            for msg in consumer.consume(500, 0.05):
                value = msg.value()
                error = msg.error()
                if error is not None or value is None:
                    if error is not None and error.code() != KafkaError._PARTITION_EOF:
                        self.say(f"read error: {error}")
                    continue
                if kind == STATE:
                    snap = decode(value, "Snapshot").record
                    state = parse_state(snap["state"])
                    if state is not None:
                        self.states[snap["run_id"]] = state
                elif kind == RESULTS:
                    result = decode(value, "Result").record
                    self.results[result["run_id"]] = result
                else:
                    effect = parse_effect_body(decode(value, "Effect").record["body"])
                    if isinstance(effect, AskUser):
                        self.questions[effect.run_id] = effect
                    elif isinstance(effect, CallTool):
                        self.op_keys.setdefault(effect.run_id, set()).add(effect.operation.key)

    def close(self) -> None:
        for consumer in self._readers.values():
            close_consumer(consumer, 10)
        release(self.producer, 10)


def submit(demo: Demo, sc: Scenario, tools: tuple[ToolSpec, ...]) -> None:
    if sc.mcp_tools:
        tools = demo.mcp_tools
    run_id = f"{sc.name}-{uuid.uuid4().hex[:6]}"
    sc.run_id = run_id
    event = RunSubmitted(
        run_id=run_id,
        event_id=f"{run_id}:submit",
        at=now_ms(),
        trace_id=uuid.uuid4().hex,
        goal=sc.description,
        messages=(
            Message(role="system", content=f"scenario:{sc.model_scenario}"),
            Message(role="user", content=f"{sc.description} (run {run_id})"),
        ),
        tools=(*tools, *sc.extra_tools),
        policy=sc.policy,
        model_route=sc.route or f"scenario:{sc.model_scenario}",
        budgets=sc.budgets,
        loop=sc.loop,
    )
    demo.send_event(event, producer_seq=1)


# ---------------------------------------------------------------------------- drivers


def approve_after_delay(demo: Demo, sc: Scenario, state: RunState | None) -> None:
    question = demo.questions.get(sc.run_id)
    if question is None or state is None or state.status != "WAITING_USER":
        return
    if not sc.note:
        sc.note = f"asked at {time.monotonic():.1f}"
        demo.say(f"{sc.name}: the run asks a person to approve; answering in 2 s")
        return
    if time.monotonic() - float(sc.note.split()[-1]) < 2.0:
        return
    reply = UserReplied(
        run_id=sc.run_id,
        event_id=f"{sc.run_id}:reply:{question.question_id}",
        at=now_ms(),
        trace_id=state.trace_id,
        question_id=question.question_id,
        token_id=question.token_id,
        state_version=question.state_version,
        response={"approved": True, "comment": "approved by the demo"},
    )
    demo.send_event(reply, producer_seq=2)
    demo.say(f"{sc.name}: approved")
    sc.done_driving = True


def cancel_while_tool_runs(demo: Demo, sc: Scenario, state: RunState | None) -> None:
    if state is None or state.status != "WAITING_TOOL":
        return
    demo.send_event(
        CancelRequested(
            run_id=sc.run_id,
            event_id=f"{sc.run_id}:cancel",
            at=now_ms(),
            trace_id=state.trace_id,
            reason="the user changed their mind",
        ),
        producer_seq=2,
    )
    demo.say(f"{sc.name}: the async report is running; cancel requested")
    sc.done_driving = True


def kill_processor_mid_run(demo: Demo, sc: Scenario, state: RunState | None) -> None:
    if state is None or state.tool_calls < 2:
        return
    demo.say(f"{sc.name}: kill -9 of the processor after {state.tool_calls} tool calls")
    demo.supervisor.kill("processor")
    demo.supervisor.start("processor")
    demo.say(f"{sc.name}: processor restarted")
    sc.done_driving = True


def _ticket_key(run_id: str) -> str:
    """The operation key of the create_ticket call of a multi_tool run (its step 2)."""
    turn = json.loads((SCENARIOS / "multi_tool.json").read_text())["turns"][1]["tool_calls"][0]
    args = canonicalize_arguments(json.dumps(turn["arguments"]))
    assert args is not None
    return operation_key(run_id, 2, "create_ticket", args)


def _ticket_fault(demo: Demo, run_id: str, kind: str, times: int | None) -> None:
    rule = {"target": "create_ticket", "kind": kind, "key": _ticket_key(run_id), "times": times}
    httpx.post(f"{demo.tools_url}/faults", json=rule, timeout=10).raise_for_status()


def late_ticket(demo: Demo, sc: Scenario) -> None:
    """Make the ticket system answer this run's create_ticket call after the executor gave up
    (it still creates the ticket): the operation goes UNKNOWN, reconciliation finds it."""
    _ticket_fault(demo, sc.run_id, "late", 1)


def ticket_bug(demo: Demo, sc: Scenario) -> None:
    """The ticket system fails this run's create_ticket call with a 500, every time: the run
    fails once its retries are spent. The fix is the fork's own key, which the rule spares."""
    _ticket_fault(demo, sc.run_id, "500", None)


def _forked(demo: Demo, sc: Scenario, fork: forks.Fork, what: str) -> None:
    forks.produce(demo.bootstrap, demo.prefix, fork, producer_id=f"demo-{sc.name}")
    source = sc.run_id
    sc.run_id = fork.record.run_id
    sc.done_driving = True
    demo.say(f"{sc.name}: {what} {source} at seq {fork.record.source_seq}: {sc.run_id}")


def resume_after_fix(demo: Demo, sc: Scenario, state: RunState | None) -> None:
    """Once the run failed on the ticket system's bug: `agentruns resume` (the bug is fixed
    for the fork's call), which asks neither the model nor a tool again before the failure."""
    result = demo.results.get(sc.run_id)
    if result is None or result["status"] != "FAILED":
        return
    log = forks.source_log(demo.bootstrap, demo.prefix, sc.run_id)
    _forked(demo, sc, forks.plan(log, forks.resume_seq(log)), "FAILED as planned; resumed")


def fork_on_another_route(demo: Demo, sc: Scenario, state: RunState | None) -> None:
    """Once the run succeeded: `agentruns fork --at SEQ --route claude` from just before its
    second model answer, so step 2 on runs through the Anthropic Messages API."""
    result = demo.results.get(sc.run_id)
    if result is None or result["status"] != "SUCCEEDED":
        return
    log = forks.source_log(demo.bootstrap, demo.prefix, sc.run_id)
    answers = [f.seq for f in log if isinstance(f.event, ModelCallCompleted)]
    edits = ForkEdits(model_route=ANTHROPIC_ROUTE)
    _forked(demo, sc, forks.plan(log, answers[1] - 1, edits=edits), "succeeded; forked")


def report_children(demo: Demo, sc: Scenario, state: RunState | None) -> None:
    """Say which child run the parent's call started once the parent ended."""
    if state is None or not state.terminal:
        return
    keys = sorted(demo.op_keys.get(sc.run_id, ()))
    children = [r for r in (child_run_id(k) for k in keys) if r in demo.results]
    if not children:  # its result is read from another topic: it comes
        return
    sc.done_driving = True
    for run_id in children:
        child = demo.results[run_id]
        demo.say(f"{sc.name}: child run {run_id} ended {child['status']}")


def scenarios() -> list[Scenario]:
    return [
        Scenario("success", "multi_tool", "open a ticket and notify the customer", "SUCCEEDED"),
        Scenario(
            "tool-timeout-reconciled",
            "multi_tool",
            "open a ticket although the ticket system answers too late",
            "SUCCEEDED",
        ),
        Scenario(
            "approval-answered",
            "approval",
            "delete the duplicate record R-3",
            "SUCCEEDED",
            policy=Policy(
                approval_required=("admin",), allowed_permissions=("read", "write", "admin")
            ),
            drive=approve_after_delay,
        ),
        Scenario(
            "approval-expired",
            "approval",
            "delete the duplicate record R-3 (nobody answers)",
            "EXPIRED",
            policy=Policy(
                approval_required=("admin",),
                allowed_permissions=("read", "write", "admin"),
                user_wait_ms=3000,
            ),
        ),
        Scenario(
            "cancel-async-tool",
            "async_report",
            "build the monthly sales report",
            "CANCELLED",
            drive=cancel_while_tool_runs,
        ),
        Scenario(
            "budget-exhausted",
            "multi_tool",
            "the same work on a 2-step budget",
            "BUDGET_EXHAUSTED",
            budgets=Budgets(max_steps=2),
        ),
        Scenario("loop-detected", "loop_forever", "check the order status", "FAILED"),
        Scenario("stream-broken", "flaky_stream", "open a refund ticket", "SUCCEEDED"),
        Scenario(
            "mcp-tool-approved",
            "mcp_refund",
            "refund order O-42 through the shop's MCP server",
            "SUCCEEDED",
            policy=Policy(approval_required=("write",)),
            drive=approve_after_delay,
            mcp_tools=True,
        ),
        Scenario(
            "anthropic-route",
            "multi_tool",
            "open a ticket and notify the customer, through the Anthropic Messages API",
            "SUCCEEDED",
            route=ANTHROPIC_ROUTE,
        ),
        Scenario(
            "resume-after-fix",
            "multi_tool",
            "open a ticket while the ticket system has a bug, then resume once it is fixed",
            "SUCCEEDED",
            drive=resume_after_fix,
        ),
        Scenario(
            "fork-other-route",
            "multi_tool",
            "open a ticket, then fork the run at step 2 onto the Anthropic route",
            "SUCCEEDED",
            drive=fork_on_another_route,
        ),
        Scenario(
            "child-run",
            "delegate",
            "find the escalation policy through a specialist agent (a child run)",
            "SUCCEEDED",
            extra_tools=(SPECIALIST_SPEC,),
            drive=report_children,
        ),
        Scenario(
            "processor-killed",
            "multi_tool",
            "the same work while the processor is killed -9",
            "SUCCEEDED",
            drive=kill_processor_mid_run,
        ),
    ]


def _duplicates(*servers: str) -> dict[str, int]:
    """The operation keys the tool servers (HTTP and MCP) executed more than once."""
    twice: dict[str, int] = {}
    for url in servers:
        executions: dict[str, int] = httpx.get(f"{url}/stats", timeout=10).json()["executions"]
        twice.update((key, n) for key, n in executions.items() if n > 1)
    return twice


def _table(demo: Demo, items: list[Scenario], duplicates: dict[str, int]) -> list[str]:
    columns = ("scenario", "final state", "expected", "steps", "tools", "dup", "system ms")
    header = "{:26} {:18} {:18} {:>5} {:>5} {:>4} {:>9} {:>12}  {}".format(
        *columns, "user wait ms", "outcome"
    )
    rows = [header, "-" * len(header)]
    for sc in items:
        state = demo.states.get(sc.run_id)
        result = demo.results.get(sc.run_id)
        status = result["status"] if result else (str(state.status) if state else "-")
        if state is None:
            rows.append(f"{sc.name:26} {status:18} {sc.expect:18}")
            continue
        dup = sum(1 for key in demo.op_keys.get(sc.run_id, ()) if key in duplicates)
        rows.append(
            "{:26} {:18} {:18} {:>5} {:>5} {:>4} {:>9} {:>12}  {}".format(
                sc.name,
                status,
                sc.expect,
                state.step,
                state.tool_calls,
                dup,
                state.time.system_ms,
                state.time.user_wait_ms,
                state.outcome or "",
            )
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns demo", description=__doc__)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds for all scenarios")
    parser.add_argument("--only", nargs="*", help="run only these scenarios")
    args = parser.parse_args(list(argv or []))
    prefix = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"agentruns demo: topics prefixed {prefix!r}", flush=True)
    with ServiceStack() as stack:
        assert stack.endpoints is not None
        ep = stack.endpoints
        print(f"  kafka    {ep.kafka_bootstrap}  ({ep.kafka_source})", flush=True)
        print(f"  postgres {redact_dsn(ep.database_url)}  ({ep.postgres_source})", flush=True)
        migrate(ep.database_url)
        ensure_topics(ep.kafka_bootstrap, prefix=prefix, partitions=PARTITIONS)
        with (
            model_server.serve("127.0.0.1", 0) as models,
            tool_server.serve("127.0.0.1", 0, report_delay_ms=60_000) as tools,
            mcp_server.serve("127.0.0.1", 0) as shop,
        ):
            log_dir = state_dir() / "logs" / prefix
            log_dir.mkdir(parents=True, exist_ok=True)
            registry, routes = _configuration(log_dir, models.url, shop.url)
            env = {
                **os.environ,
                "KAFKA_BOOTSTRAP_SERVERS": ep.kafka_bootstrap,
                "DATABASE_URL": ep.database_url,
                "AGENTRUNS_LOG_LEVEL": "WARNING",
            }
            sup = Supervisor(log_dir, env)
            common = ("--prefix", prefix)
            sup.add(
                "processor",
                "agentruns.connectors.runtime.processor",
                *common,
                "--registry",
                str(registry),
            )
            sup.add(
                "model-executor",
                "agentruns.connectors.executors.model",
                *common,
                "--base-url",
                models.url,
                "--routes",
                str(routes),
                "--registry",
                str(registry),
            )
            sup.add(
                "tool-executor",
                "agentruns.connectors.executors.tool",
                *common,
                "--base-url",
                tools.url,
                "--registry",
                str(registry),
            )
            sup.add("timer", "agentruns.connectors.runtime.timers", *common)
            sup.add(
                "sink", "agentruns.connectors.projection.sink", *common, "--log-level", "WARNING"
            )
            sup.start_all()
            demo = Demo(ep.kafka_bootstrap, prefix, sup, tools.url)
            demo.mcp_tools = mcp_tool_specs(registry)
            items = [s for s in scenarios() if not args.only or s.name in args.only]
            try:
                code = _run(demo, items, args.timeout)
                lines = _table(demo, items, _duplicates(tools.url, shop.url))
                print("\n" + "\n".join(lines), flush=True)
                served = httpx.get(f"{models.url}/stats", timeout=10).json()
                shop_calls = httpx.get(f"{shop.url}/stats", timeout=10).json()["calls"]
                print(
                    f"\nmodel server: {served['requests']} requests, "
                    f"{served['anthropic_requests']} of them to the Anthropic Messages API;"
                    f" MCP server: {sum(shop_calls.values())} tool calls",
                    flush=True,
                )
                again = (
                    f"KAFKA_BOOTSTRAP_SERVERS={ep.kafka_bootstrap} "
                    if ep.kafka_source == "env"
                    else "agentruns dev up && "
                )
                print(
                    f"\nlogs: {log_dir}\nreplay a run: {again}agentruns replay --prefix "
                    f"{prefix} {items[0].run_id}",
                    flush=True,
                )
            finally:
                demo.close()
                sup.stop_all()
    return code


def _run(demo: Demo, items: list[Scenario], timeout: float) -> int:
    tools = registry_tools()
    for sc in items:
        submit(demo, sc, tools)
        demo.say(f"submitted {sc.name} ({sc.run_id}): {sc.description}")
        if sc.name == "tool-timeout-reconciled":
            late_ticket(demo, sc)
        elif sc.name == "resume-after-fix":
            ticket_bug(demo, sc)
    deadline = time.monotonic() + timeout
    reported: set[str] = set()
    while time.monotonic() < deadline and len(reported) < len(items):
        demo.poll()
        for sc in items:
            if sc.drive is not None and not sc.done_driving:
                sc.drive(demo, sc, demo.states.get(sc.run_id))
            result = demo.results.get(sc.run_id)
            driven = sc.drive is None or sc.done_driving  # a fork's source ends before it
            if result is not None and sc.run_id not in reported and driven:
                reported.add(sc.run_id)
                mark = "ok" if result["status"] == sc.expect else f"EXPECTED {sc.expect}"
                demo.say(f"{sc.name}: {result['status']} ({mark})")
        for name in demo.supervisor.components:
            if (code := demo.supervisor.exited(name)) is not None:
                tail = demo.supervisor.log_tail(name)
                demo.say(f"{name} exited ({code}); last log lines:\n{tail}")
                demo.supervisor.start(name)
    missing = [sc.name for sc in items if sc.run_id not in reported]
    wrong = [
        sc.name
        for sc in items
        if sc.run_id in demo.results and demo.results[sc.run_id]["status"] != sc.expect
    ]
    if missing:
        demo.say(f"not finished within {timeout:.0f}s: {', '.join(missing)}")
    if wrong:
        demo.say(f"unexpected final state: {', '.join(wrong)}")
    return 1 if missing or wrong else 0


if __name__ == "__main__":
    sys.exit(main())

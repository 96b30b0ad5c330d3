"""`agentruns chaos`: mixed runs while a driver kill -9s and pauses random components.

Starts Kafka and Postgres (local ones when none is configured), the scripted model server and
the example tool server (never killed: they stand for the outside world), and the pipeline as
separate processes: two processors, both executors, the timer service and the sink. It submits
runs of mixed scenarios, injects a few bad inputs, every few seconds kill -9s a random component
and restarts it, or pauses one (SIGSTOP) for 1-15 s and lets it go on (SIGCONT): past its
session timeout (6 s) the group has moved on and it resumes as a zombie, past the transaction
timeout (10 s) the coordinator has aborted its open transaction. When the broker is ours it
restarts it once and pauses it once (SIGSTOP, 5-20 s: every client's requests time out, every
session expires when it goes on). With ``--brokers 3`` (a local cluster, every topic 3 replicas)
one fault in three is a cluster fault (`agentruns.connectors.dev.demo.cluster_faults`): kill -9 of
the leading broker, of a transaction coordinator, of the active controller, of two brokers at
once, and, as root, network partitions. It waits for every run to end, and then checks:

- every run has exactly one terminal result;
- no tool idempotency key was executed twice (the tool server's counters);
- `agentruns audit` finds no difference between the log, the snapshots and Postgres;
- the DLQ holds exactly the injected bad inputs;
- no component exited without being killed (a crash is reported with its exit status and log tail).

It prints runs, kills, restarts, duplicates and lost runs, and one JSON object last. Exit code 0
only when every check holds.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from agentruns.connectors.api.credentials import (
    CANCEL,
    READ,
    REPLY,
    SUBMIT,
    Credential,
    credential_line,
    token_digest,
)
from agentruns.connectors.dev.demo.cluster_faults import (
    PARTITION_FAULTS,
    ClusterFaults,
    FaultRecord,
    ProgressWatch,
    acknowledged_missing,
    percentiles,
)
from agentruns.connectors.dev.demo.run import registry_tools, registry_with_shop
from agentruns.connectors.dev.servers import hostile as hostile_cases
from agentruns.connectors.dev.servers import mcp_server, model_server, tool_server
from agentruns.connectors.dev.stack import netlab
from agentruns.connectors.dev.stack.netlab import NetLab
from agentruns.connectors.dev.stack.procs import free_port_block
from agentruns.connectors.dev.stack.services import ServiceStack
from agentruns.connectors.dev.stack.supervisor import Supervisor
from agentruns.connectors.endpoints import Endpoints, state_dir
from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.lifecycle import RESTART_ME
from agentruns.connectors.postgres.migrate import migrate
from agentruns.connectors.projection.audit import AuditReport, audit
from agentruns.connectors.projection.reading import read_topic
from agentruns.processors.events import Message, RunSubmitted
from agentruns.processors.state import Budgets, Policy, ToolSpec
from agentruns.processors.tenants import DEFAULT_TENANT
from agentruns.streams.admin import ensure_topics
from agentruns.streams.clock import now_ms
from agentruns.streams.codec import encode
from agentruns.streams.kafka_defaults import client_settings, release
from agentruns.streams.partitioning import partition_for
from agentruns.streams.records import input_record
from agentruns.streams.topics import DLQ, EVENTS, INBOX, RESULTS, effect_suffix, topic_name

PARTITIONS = 6
PAUSE_SECONDS = (1.0, 15.0)  # across the session (6 s) and transaction (10 s) timeouts
BROKER_PAUSE_SECONDS = (5.0, 20.0)
# How long a killed broker stays down; two at once stay longer, past the sessions (6 s) and
# transaction timeouts (10 s).
BROKER_DOWN_SECONDS = (2.0, 8.0)
BELOW_MIN_ISR_SECONDS = (10.0, 20.0)
PARTITION_SECONDS = (5.0, 15.0)
WAIT_PROGRESS_S = 15.0  # how often the wait for every run's end says how far it got
# The model route of a hostile run: a stream that never ends is cut after seconds.
HOSTILE_ROUTE = {"total_timeout_s": 6.0, "read_timeout_s": 3.0}
KILLABLE = ("processor-0", "processor-1", "model-executor", "tool-executor", "timer", "sink")


@dataclass(frozen=True)
class Mix:
    model_scenario: str
    budgets: Budgets
    policy: Policy
    ends: str  # the status a run of this mix ends in, whatever the faults


MIXES = (
    Mix("multi_tool", Budgets(), Policy(), "SUCCEEDED"),
    Mix("flaky_stream", Budgets(), Policy(), "SUCCEEDED"),
    Mix("loop_forever", Budgets(), Policy(), "FAILED"),
    Mix("multi_tool", Budgets(max_steps=2), Policy(), "BUDGET_EXHAUSTED"),
    Mix(
        "approval",
        Budgets(),
        Policy(
            approval_required=("admin",),
            allowed_permissions=("read", "write", "admin"),
            user_wait_ms=2000,
        ),
        "EXPIRED",
    ),
)


def _read_results(bootstrap: str, prefix: str) -> dict[str, list[dict[str, Any]]]:
    from agentruns.connectors.projection.reading import read_topic

    out: dict[str, list[dict[str, Any]]] = {}
    for record in read_topic(bootstrap, topic_name(RESULTS, prefix), "Result"):
        out.setdefault(record["run_id"], []).append(record)
    return out


def _dead_letters(bootstrap: str, prefix: str) -> list[dict[str, Any]]:
    return list(read_topic(bootstrap, topic_name(DLQ, prefix), "DeadLetter"))


def consumer_groups(prefix: str) -> dict[str, tuple[str, ...]]:
    """The pipeline's consumer groups and the topics whose offsets they commit to Kafka (the
    sink keeps its offsets in Postgres)."""
    return {
        f"{prefix}-processor": (topic_name(INBOX, prefix),),
        f"{prefix}-executor-model": (topic_name(effect_suffix("model"), prefix),),
        f"{prefix}-executor-tool": (topic_name(effect_suffix("tool"), prefix),),
        f"{prefix}-timer": (topic_name(effect_suffix("timer"), prefix),),
    }


def unconsumed(bootstrap: str, group: str, topics: Sequence[str]) -> int:
    """Committed records of `topics` after `group`'s committed offsets: what it has not
    processed yet (a stalled partition keeps some for good)."""
    reader = Consumer(
        {
            "bootstrap.servers": bootstrap,
            **client_settings(),
            "group.id": group,
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "log_level": 3,
        }
    )
    left = 0
    try:
        wanted = [
            TopicPartition(topic, p)
            for topic in topics
            for p in reader.list_topics(topic, timeout=30).topics[topic].partitions
        ]
        committed = reader.committed(wanted, timeout=30)
        reader.assign(
            [
                TopicPartition(
                    tp.topic, tp.partition, tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
                )
                for tp in committed
            ]
        )
        pending = {(tp.topic, tp.partition) for tp in committed}
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            for message in reader.consume(500, 0.5):
                error = message.error()
                if error is not None and error.code() == KafkaError._PARTITION_EOF:
                    pending.discard((message.topic() or "", message.partition() or 0))
                elif error is None:
                    left += 1
    finally:
        reader.close()
    return left


@dataclass(frozen=True)
class ChaosPlan:
    """What one chaos run does: the arguments of `run_chaos`."""

    runs: int
    minutes: float
    kill_every: float
    broker_restart: bool
    seed: int
    broker_pause: bool
    submit_seconds: float
    pause_share: float
    hostile: bool
    brokers: int


def _fault_seconds(fault: str) -> tuple[float, float]:
    """How long a cluster fault of this kind lasts (the bounds of a uniform draw)."""
    if fault == "below_min_isr":
        return BELOW_MIN_ISR_SECONDS
    if fault in PARTITION_FAULTS:
        return PARTITION_SECONDS
    return BROKER_DOWN_SECONDS


class ChaosRun:
    """One chaos run in phases: set up the stack and the pipeline, submit runs and bad inputs
    while a thread injects faults, wait for every run's end, let the pipeline settle, check, and
    count. The fault thread and the main thread share the counters through the instance."""

    # Set by the set-up phases (`_open_stack`, `_start_pipeline`, `_arm`).
    stack: ServiceStack
    ep: Endpoints
    lab: NetLab | None
    log_dir: Path
    sup: Supervisor
    model_url: str
    tool_url: str
    mcp_url: str | None
    api_url: str | None
    api_token: str | None
    operator_token: str | None
    producer: Producer
    inbox: str
    watch: ProgressWatch
    cluster: ClusterFaults | None
    tool_specs: tuple[ToolSpec, ...]
    doors: hostile_cases.Doors
    bad_inputs: tuple[hostile_cases.Case, ...]
    bad_every: int
    broker_restarts_due: int
    broker_pauses_due: int
    began: float
    deadline: float
    # Set by the settle and check phases (`_settle`, `_check`).
    report: AuditReport
    executions: dict[str, int]
    dead: dict[tuple[str, int, int], list[Any]]
    stalls: dict[str, int]
    lost_inputs: list[tuple[int, int]]
    unconsumed_inputs: list[tuple[int, int]]
    faults: list[FaultRecord]
    cluster_kinds: tuple[str, ...]
    restartable: bool

    def __init__(self, plan: ChaosPlan, say: Callable[[str], object]) -> None:
        self.plan = plan
        self.say = say
        # Two streams, so that the sequence of faults depends on the seed alone, not on how the
        # submitting thread's draws interleave with the killer's.
        self.rng = random.Random(plan.seed)
        self.pacing = random.Random(f"{plan.seed}:pacing")
        self.prefix = f"chaos-{uuid.uuid4().hex[:8]}"
        self.lab_missing = None if plan.brokers < 3 else netlab.usable()
        self.stop_killing = threading.Event()
        # (partition, offset) -> key of every input the brokers acknowledged
        self.acknowledged: dict[tuple[int, int], bytes] = {}
        self.injections: list[tuple[hostile_cases.Case, hostile_cases.Injected]] = []
        self.run_ids: list[str] = []
        self.ends: dict[str, str] = {}
        self.results: dict[str, list[dict[str, Any]]] = {}
        self.kills = self.pauses = self.restarts = 0
        self.broker_restarts = self.broker_pauses = 0
        self.component_faults = 0
        self.injected = 0
        self.crashes = 0  # components that exited without being killed
        self.restarts_asked = 0  # components that stopped for their supervisor to restart them

    def run(self) -> dict[str, Any]:
        with contextlib.ExitStack() as lab_scope:
            self._open_stack(lab_scope)
            with (
                model_server.serve("127.0.0.1", 0) as models,
                tool_server.serve("127.0.0.1", 0, report_delay_ms=500) as tools,
                contextlib.ExitStack() as cleanup,
            ):
                self.model_url, self.tool_url = models.url, tools.url
                # the MCP server of the hostile cases, as the tool executor's `shop`
                self.mcp_url = None
                if self.plan.hostile:
                    self.mcp_url = cleanup.enter_context(mcp_server.serve("127.0.0.1", 0)).url
                self._start_pipeline(cleanup)
                self._arm(cleanup)
                self._submit_and_wait()
                self._settle()
                self._check()
            self.restartable = self.stack.local is not None
        return self._figures()

    # -- set-up --

    def _open_stack(self, scope: contextlib.ExitStack) -> None:
        """Kafka (each broker in a network namespace of its own when the partition faults can
        be made) and Postgres, migrated, with the topics."""
        brokers = self.plan.brokers
        names = [f"broker-{i + 1}" for i in range(brokers)]
        self.lab = (
            scope.enter_context(NetLab(names))
            if brokers >= 3 and self.lab_missing is None
            else None
        )
        members = [] if self.lab is None else [self.lab.members[n] for n in names]
        placed = None if self.lab is None else [(m.address, m.command([])) for m in members]
        self.stack = scope.enter_context(
            ServiceStack(ephemeral=True, brokers=brokers, placed=placed)
        )
        assert self.stack.endpoints is not None
        self.ep = self.stack.endpoints
        migrate(self.ep.database_url)
        ensure_topics(self.ep.kafka_bootstrap, prefix=self.prefix, partitions=PARTITIONS)

    def _start_pipeline(self, cleanup: contextlib.ExitStack) -> None:
        env = {
            **os.environ,
            "KAFKA_BOOTSTRAP_SERVERS": self.ep.kafka_bootstrap,
            "DATABASE_URL": self.ep.database_url,
            "AGENTRUNS_LOG_LEVEL": "WARNING",
        }
        self.log_dir = state_dir() / "logs" / self.prefix
        self.sup = Supervisor(self.log_dir, env)
        self._add_workers()
        self._add_api()
        self.sup.start_all()
        cleanup.callback(self.sup.stop_all)  # whatever fails below, no component outlives us

    def _add_workers(self) -> None:
        sup, common, quiet = self.sup, ("--prefix", self.prefix), ("--log-level", "WARNING")
        registry = ("--registry", str(self._registry()))
        for i in (0, 1):
            processor = "agentruns.connectors.runtime.processor"
            sup.add(f"processor-{i}", processor, *common, "--instance-id", str(i), *quiet)
        model = ("--base-url", self.model_url, *registry, *self._model_routes())
        sup.add("model-executor", "agentruns.connectors.executors.model", *common, *model)
        tool = ("--base-url", self.tool_url, *registry)
        sup.add("tool-executor", "agentruns.connectors.executors.tool", *common, *tool)
        sup.add("timer", "agentruns.connectors.runtime.timers", *common, *quiet)
        sup.add("sink", "agentruns.connectors.projection.sink", *common, *quiet)

    def _registry(self) -> Path:
        """The example registry; with the example MCP server as `shop` when there is one."""
        if self.mcp_url is None:
            return tool_server.DEFAULT_REGISTRY
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return registry_with_shop(self.log_dir / "tools.json", self.mcp_url)

    def _model_routes(self) -> tuple[str, ...]:
        if not self.plan.hostile:
            return ()
        # streams that never end are cut after seconds, not minutes; one route goes to the
        # model server's Anthropic mode
        self.log_dir.mkdir(parents=True, exist_ok=True)
        routes_file = self.log_dir / "routes.json"
        anthropic = {"provider": "anthropic", "base_url": self.model_url, "api_key": "hostile"}
        routes = {"*": HOSTILE_ROUTE, hostile_cases.ANTHROPIC_ROUTE: {**HOSTILE_ROUTE, **anthropic}}
        routes_file.write_text(json.dumps(routes))
        return ("--routes", str(routes_file))

    def _add_api(self) -> None:
        """The API, for the hostile cases that come in through it."""
        self.api_url = self.api_token = self.operator_token = self.scoped_token = None
        if not self.plan.hostile:
            return
        api_port = free_port_block(1, start=29500)
        self.api_url = f"http://127.0.0.1:{api_port}"
        self.sup.env["AGENTRUNS_API_TOKEN"] = self.api_token = uuid.uuid4().hex * 2
        # an upstream system's credential: of the default tenant, without the admin role (the
        # operator routes refuse it)
        self.scoped_token = uuid.uuid4().hex * 2
        scoped = Credential(
            id="chaos-upstream",
            tenant=DEFAULT_TENANT,
            roles=frozenset({SUBMIT, READ, REPLY, CANCEL}),
            digest=token_digest(self.scoped_token),
        )
        self.log_dir.mkdir(parents=True, exist_ok=True)
        credentials = self.log_dir / "credentials"
        credentials.write_text(credential_line(scoped))
        self.sup.env["AGENTRUNS_API_CREDENTIALS"] = str(credentials)
        self.sup.env["AGENTRUNS_API_SECRET"] = uuid.uuid4().hex
        self.operator_token = uuid.uuid4().hex
        self.sup.env["AGENTRUNS_API_OPERATOR_TOKENS"] = f"chaos:{self.operator_token}"
        cli = "agentruns.connectors.cli"
        self.sup.add("api", cli, "api", "--prefix", self.prefix, "--port", str(api_port))

    def _arm(self, cleanup: contextlib.ExitStack) -> None:
        """The producer, the progress watch, the cluster faults, the doors of the bad inputs,
        and the clock."""
        bootstrap = self.ep.kafka_bootstrap
        self.producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                **client_settings(),
                "enable.idempotence": True,
                "acks": "all",
            }
        )
        self.inbox = topic_name(INBOX, self.prefix)
        self.watch = ProgressWatch(bootstrap, topic_name(EVENTS, self.prefix))
        cleanup.callback(self.watch.close)
        self.cluster = self._cluster_faults()
        self.tool_specs = registry_tools()
        self._open_doors(cleanup)
        local = self.stack.local
        # The broker faults, once each when the broker is ours; the runs may end before
        # them, so the run goes on until they happened.
        self.broker_restarts_due = int(self.plan.broker_restart and local is not None)
        self.broker_pauses_due = int(self.plan.broker_pause and local is not None)
        self.began = time.monotonic()
        self.deadline = self.began + self.plan.minutes * 60

    def _cluster_faults(self) -> ClusterFaults | None:
        if self.stack.local is None or self.plan.brokers < 3:
            return None
        return ClusterFaults(
            self.stack.local.kafka,
            self.ep.kafka_bootstrap,
            self.inbox,
            f"{self.prefix}-processor-0-a",
            wait=self.stop_killing.wait,
            say=self.say,
            lab=self.lab,
        )

    def _open_doors(self, cleanup: contextlib.ExitStack) -> None:
        hostile = self.plan.hostile
        self.doors = hostile_cases.Doors(
            bootstrap=self.ep.kafka_bootstrap,
            prefix=self.prefix,
            partitions=PARTITIONS,
            model_url=self.model_url,
            tool_url=self.tool_url,
            tools=self.tool_specs,
            mcp_url=self.mcp_url,
            api_url=self.api_url,
            api_token=self.api_token,
            operator_token=self.operator_token,
            scoped_token=self.scoped_token,
        )
        cleanup.callback(self.doors.close)
        self.bad_inputs = (
            hostile_cases.cases(api=True)
            if hostile
            else tuple(c for c in hostile_cases.CASES if c.name == "inbox_garbage_bytes")
        )
        self.bad_every = max(1, self.plan.runs // len(self.bad_inputs)) if hostile else 50
        if hostile:
            wait_for_api(self.api_url, self.sup)

    # -- the faults (on a thread of their own) --

    def _inject_faults(self) -> None:
        """Every ~`kill_every` s a fault: one in three a cluster fault when there is a cluster,
        else a broker fault while one is due, else a component's kill or pause."""
        if self.plan.kill_every <= 0:
            return
        while not self.stop_killing.wait(self.rng.uniform(0.5, 1.5) * self.plan.kill_every):
            cluster = self.cluster
            if cluster is not None and self.component_faults >= 2 * (len(cluster.done) + 1):
                self._cluster_fault(cluster)
                continue
            self.component_faults += 1
            if not self._broker_fault():
                self._component_fault()

    def _cluster_fault(self, cluster: ClusterFaults) -> None:
        fault = cluster.next_fault()
        try:
            cluster.inject(fault, self.rng.uniform(*_fault_seconds(fault)))
        except Exception as exc:  # the fault is tried again next time
            self.say(f"chaos: {fault} could not be injected: {exc}")

    def _broker_fault(self) -> bool:
        """Restart or pause our broker when one is due; whether it did."""
        local = self.stack.local
        if self.broker_restarts < self.broker_restarts_due and self.kills >= 3:
            self.say("chaos: restarting the Kafka broker")
            assert local is not None
            local.kafka.restart()
            self.broker_restarts += 1
            return True
        if self.broker_pauses < self.broker_pauses_due and self.kills >= 4:
            seconds = self.rng.uniform(*BROKER_PAUSE_SECONDS)
            assert local is not None
            local.kafka.pause()
            self._hold(seconds, local.kafka.resume)
            self.broker_pauses += 1
            self.say(f"chaos: paused the Kafka broker for {seconds:.1f} s")
            return True
        return False

    def _component_fault(self) -> None:
        name = self.rng.choice(KILLABLE)
        if self.rng.random() < self.plan.pause_share:
            seconds = self.rng.uniform(*PAUSE_SECONDS)
            if self.sup.pause(name):
                self._hold(seconds, functools.partial(self.sup.resume, name))
                self.pauses += 1
                self.say(f"chaos: paused {name} for {seconds:.1f} s ({self.pauses} pauses)")
            return
        self.sup.kill(name)
        self.kills += 1
        self.stop_killing.wait(self.rng.uniform(0.0, 2.0))
        self.sup.start(name)
        self.restarts += 1
        self.say(f"chaos: kill -9 {name}, restarted ({self.kills} kills)")

    def _hold(self, seconds: float, resume: Callable[[], object]) -> None:
        """Leave what was paused standing for `seconds` (less once the run ends), then resume
        it, whatever happens."""
        try:
            self.stop_killing.wait(seconds)
        finally:
            resume()

    # -- submitting and waiting --

    def _submit_and_wait(self) -> None:
        killing = threading.Thread(target=self._inject_faults, daemon=True)
        killing.start()
        try:
            self._submit()
            self._wait_for_ends()
        finally:
            self.stop_killing.set()
            killing.join(timeout=120)

    def _submit(self) -> None:
        runs, prefix = self.plan.runs, self.prefix
        for i in range(runs):
            self._submit_run(i)
            if i % self.bad_every == 0:
                case = self.bad_inputs[(i // self.bad_every) % len(self.bad_inputs)]
                self._inject_bad(case, f"{prefix}-bad-{i:04d}")
            self.producer.poll(0)
            time.sleep(self.pacing.uniform(0.0, 2.0) * self.plan.submit_seconds / runs)
        tail = self.bad_inputs[self.injected :] if self.plan.hostile else ()
        for case in tail:  # fewer runs than cases
            self._inject_bad(case, f"{prefix}-bad-{self.injected:04d}-tail")
        # released now: alive, it would reconnect to the stopped broker at the end
        if (left := release(self.producer, 60)) > 0:
            raise RuntimeError(f"{left} submitted inputs were not acknowledged")
        if (left := self.doors.flush(60)) > 0:
            raise RuntimeError(f"{left} bad inputs were not acknowledged")
        self.say(f"chaos: submitted {runs} runs and {self.injected} bad inputs")

    def _submit_run(self, i: int) -> None:
        mix = MIXES[i % len(MIXES)]
        # Unique per chaos run: a configured database keeps the timers, executed actions and
        # runs of earlier ones, keyed by run id.
        run_id = f"{self.prefix}-{i:04d}-{mix.model_scenario}"
        event = RunSubmitted(
            run_id=run_id,
            event_id=f"{run_id}:submit",
            at=now_ms(),
            trace_id=uuid.uuid4().hex,
            goal=f"chaos {mix.model_scenario}",
            messages=(Message(role="user", content=f"scenario:{mix.model_scenario} {run_id}"),),
            tools=self.tool_specs,
            policy=mix.policy,
            model_route=f"scenario:{mix.model_scenario}",
            budgets=mix.budgets,
        )
        self.producer.produce(
            self.inbox,
            key=run_id.encode(),
            value=encode("Input", input_record(event)),
            partition=partition_for(run_id, PARTITIONS),
            on_delivery=self._on_delivery,
        )
        self.run_ids.append(run_id)
        self.ends[run_id] = mix.ends

    def _on_delivery(self, error: KafkaError | None, message: Any) -> None:
        if error is None:
            self.acknowledged[(message.partition(), message.offset())] = message.key()

    def _inject_bad(self, case: hostile_cases.Case, bad_id: str) -> None:
        self.injections.append((case, hostile_cases.inject(case, self.doors, bad_id)))
        self.injected += 1

    def _wait_for_ends(self) -> None:
        """Until every run (and every bad input's run that must end) has its result and every
        due fault happened, or the time is up; restarting what exits on its own meanwhile."""
        # runs of bad inputs whose one allowed ending is a terminal result
        ending_runs = [
            inj.run_id
            for case, inj in self.injections
            if case.ending.status is not None and inj.run_id is not None
        ]
        said = time.monotonic()
        while time.monotonic() < self.deadline:
            self._read_results_again()
            if self._all_done(ending_runs):
                break
            if time.monotonic() - said >= WAIT_PROGRESS_S:
                said = time.monotonic()
                ended = sum(r in self.results for r in self.run_ids)
                left_s = self.deadline - said
                self.say(
                    f"chaos: {ended} of {len(self.run_ids)} runs ended, {left_s:.0f} s left to wait"
                )
            self._tend_components()
            time.sleep(2.0)

    def _read_results_again(self) -> None:
        try:
            self.results = _read_results(self.ep.kafka_bootstrap, self.prefix)
        except AgentrunsError as exc:
            # brokers down (a fault) can hold a read past its bound: the next round reads
            # again, and the reads after the faults must succeed
            self.say(f"chaos: reading the results failed, reading again: {exc}")

    def _all_done(self, ending_runs: Sequence[str]) -> bool:
        cluster = self.cluster
        return (
            all(r in self.results for r in (*self.run_ids, *ending_runs))
            and self.broker_restarts >= self.broker_restarts_due
            and self.broker_pauses >= self.broker_pauses_due
            and (cluster is None or cluster.kinds_done() >= set(cluster.kinds))
        )

    def _tend_components(self) -> None:
        """Start again what stopped: asked to (RESTART_ME), or on its own (a crash)."""
        sup = self.sup
        for name in sup.components:
            code = sup.exited(name)
            if code == RESTART_ME:
                self.say(f"chaos: {name} stopped to be started again: {sup.log_tail(name, 1)}")
                self.restarts_asked += 1
            elif code is not None:
                tail = sup.log_tail(name, 5)
                self.say(f"chaos: {name} exited on its own (exit status {code}): {tail}")
                self.crashes += 1
            if code is not None:
                sup.start(name)

    # -- settling and checking --

    def _settle(self) -> None:
        """Let the sink catch up before the audit compares Postgres with the log."""
        for name in self.sup.components:
            self.sup.start(name)
        bootstrap = self.ep.kafka_bootstrap
        self.results = _read_results(bootstrap, self.prefix)
        for _ in range(30):
            self.report = audit(bootstrap, self.prefix, self.ep.database_url, run_ids=self.run_ids)
            if not self.report.differences:
                break
            time.sleep(2.0)

    def _check(self) -> None:
        bootstrap, sup = self.ep.kafka_bootstrap, self.sup
        stats = httpx.get(f"{self.tool_url}/stats", timeout=10).json()
        self.executions = stats.get("executions", {})
        self.dead = hostile_cases.positions(_dead_letters(bootstrap, self.prefix))
        self.stalls = {
            group: left
            for group, topics in consumer_groups(self.prefix).items()
            if (left := unconsumed(bootstrap, group, topics)) > 0
        }
        if self.report.differences or self.stalls:
            # whatever stands still says what it waits for, before it is stopped
            asked = sup.dump_stacks()
            time.sleep(1.0)
            self.say(f"chaos: thread stacks of {', '.join(asked)} written to their logs")
        self.crashes += sum(1 for n in sup.components if sup.exited(n) not in (None, RESTART_ME))
        self.lost_inputs, self.unconsumed_inputs = acknowledged_missing(
            bootstrap, self.inbox, self.acknowledged, f"{self.prefix}-processor"
        )
        self.faults = list(self.cluster.done) if self.cluster is not None else []
        self.cluster_kinds = self.cluster.kinds if self.cluster is not None else ()
        for f in self.faults:
            f.stall_s = self.watch.stall(f.began, f.ended)

    # -- the figures --

    def _figures(self) -> dict[str, Any]:
        return {**self._run_figures(), **self._input_figures(), **self._fault_figures()}

    def _run_figures(self) -> dict[str, Any]:
        results, differences = self.results, self.report.differences
        versions = {r: {json.dumps(x, sort_keys=True) for x in rs} for r, rs in results.items()}
        return {
            "runs": len(self.run_ids),
            "kills": self.kills,
            "pauses": self.pauses,
            "restarts": self.restarts,
            "broker_restarts": self.broker_restarts,
            "broker_pauses": self.broker_pauses,
            "broker_restartable": self.restartable,
            "lost": sum(1 for r in self.run_ids if r not in results),
            "terminal_twice": sum(1 for v in versions.values() if len(v) > 1),
            "duplicate_tool_executions": sum(1 for n in self.executions.values() if n > 1),
            "audit_differences": len(differences),
            "audit_first": [str(d) for d in differences[:5]],
        }

    def _input_figures(self) -> dict[str, Any]:
        results, dead, injections = self.results, self.dead, self.injections
        misses = {
            case.name: why
            for case, inj in injections
            if (why := hostile_cases.check(case, inj, results, dead)) is not None
        }
        expected_dead = {inj.position for case, inj in injections if case.ending.dlq is not None}
        unexpected_dead = [w for w in dead if w not in expected_dead]
        return {
            "dlq_injected": len(expected_dead),
            "dlq": len(dead),
            "dlq_unexpected": [
                {"source": list(where), "reason": dead[where][0]["reason"][:200]}
                for where in unexpected_dead
            ][:10],
            "hostile_injected": self.injected,
            "hostile_ended": self.injected - len(misses),
            "hostile_misses": misses,
            "stalls": self.stalls,
            "unexpected_statuses": {
                r: results[r][-1]["status"]
                for r in self.run_ids
                if r in results and results[r][-1]["status"] != self.ends[r]
            },
            "crashes": self.crashes,
            "restarts_asked": self.restarts_asked,
            "statuses": _count(r[-1]["status"] for r in results.values()),
            "brokers": self.plan.brokers,
            "acknowledged": len(self.acknowledged),
            "acknowledged_lost": len(self.lost_inputs),
            "acknowledged_unconsumed": len(self.unconsumed_inputs),
        }

    def _fault_figures(self) -> dict[str, Any]:
        faults, kinds, missing = self.faults, self.cluster_kinds, self.lab_missing
        return {
            "cluster_faults": [f.figures(self.began) for f in faults],
            "cluster_faults_missing": sorted(set(kinds) - {f.fault for f in faults}),
            "partition_faults": (
                ""
                if self.plan.brokers < 3
                else "made"
                if missing is None
                else f"not made: {missing}"
            ),
            "fault_stall_s": {
                kind: percentiles(
                    [f.stall_s for f in faults if f.fault == kind and f.stall_s is not None]
                )
                for kind in kinds
                if any(f.fault == kind for f in faults)
            },
            "seconds": round(time.monotonic() - self.began, 1),
            "logs": str(self.log_dir),
        }


def run_chaos(
    *,
    runs: int,
    minutes: float,
    kill_every: float,
    broker_restart: bool,
    seed: int,
    broker_pause: bool = True,
    submit_seconds: float = 60.0,
    pause_share: float = 0.0,
    hostile: bool = False,
    brokers: int = 1,
    say: Any = print,
) -> dict[str, Any]:
    """Submit `runs` runs spread over `submit_seconds` (so faults land while runs are in
    flight); every ~`kill_every` s kill a component (0: never), or with probability
    `pause_share` pause one, until every run is terminal. Bad inputs go in among the runs: a
    garbage record every 50 runs, or with `hostile` every case of
    `agentruns.connectors.dev.servers.hostile`
    through its door (the API then runs too), each checked against its one allowed ending.
    With `brokers` >= 3 (a local cluster), one fault in three is a cluster fault
    (`agentruns.connectors.dev.demo.cluster_faults`), each kind at least once."""
    plan = ChaosPlan(
        runs=runs,
        minutes=minutes,
        kill_every=kill_every,
        broker_restart=broker_restart,
        seed=seed,
        broker_pause=broker_pause,
        submit_seconds=submit_seconds,
        pause_share=pause_share,
        hostile=hostile,
        brokers=brokers,
    )
    return ChaosRun(plan, say).run()


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns chaos", description=__doc__)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--minutes", type=float, default=10.0, help="time limit")
    parser.add_argument("--kill-every", type=float, default=4.0, help="mean seconds between faults")
    parser.add_argument(
        "--pause-share",
        type=float,
        default=0.3,
        help="the share of faults that pause a component (SIGSTOP, 1-15 s) instead of killing it",
    )
    parser.add_argument("--no-broker-restart", action="store_true")
    parser.add_argument("--no-broker-pause", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--brokers",
        type=int,
        default=1,
        help="brokers of the local cluster; with 3, every topic has 3 replicas"
        " (min.insync.replicas=2) and partition leaders, transaction coordinators, the active"
        " controller and two brokers at once are killed too; and, as root, each broker in a"
        " network namespace of its own, the leading broker is cut off from the others and the"
        " clients from a transaction coordinator for a while",
    )
    parser.add_argument(
        "--hostile",
        action="store_true",
        help="inject every hostile case (bad tasks, replies, records, backend answers) among the"
        " runs and check each ends as it must",
    )
    parser.add_argument(
        "--submit-seconds", type=float, default=120.0, help="spread the submissions over this"
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    figures = run_chaos(
        runs=args.runs,
        minutes=args.minutes,
        kill_every=args.kill_every,
        broker_restart=not args.no_broker_restart,
        broker_pause=not args.no_broker_pause,
        seed=args.seed,
        submit_seconds=args.submit_seconds,
        pause_share=args.pause_share,
        hostile=args.hostile,
        brokers=args.brokers,
        say=lambda text: print(text, file=sys.stderr, flush=True),
    )
    ok = ok_figures(figures)
    print(
        f"runs {figures['runs']}, kills {figures['kills']}, pauses {figures['pauses']}, "
        f"restarts {figures['restarts']}, "
        f"broker restarts {figures['broker_restarts']}, broker pauses "
        f"{figures['broker_pauses']}, duplicates "
        f"{figures['duplicate_tool_executions']}, lost {figures['lost']}, audit differences "
        f"{figures['audit_differences']}: {'OK' if ok else 'FAILED'}",
        file=sys.stderr,
    )
    print(json.dumps(figures))
    return 0 if ok else 1


def ok_figures(figures: dict[str, Any]) -> bool:
    return bool(
        figures["lost"] == 0
        and figures["terminal_twice"] == 0
        and figures["duplicate_tool_executions"] == 0
        and figures["audit_differences"] == 0
        and figures["dlq"] == figures["dlq_injected"]
        and not figures["dlq_unexpected"]
        and figures["hostile_ended"] == figures["hostile_injected"]
        and not figures["stalls"]
        and figures["crashes"] == 0
        and figures["acknowledged_lost"] == 0
        and figures["acknowledged_unconsumed"] == 0
        and figures["acknowledged"] >= figures["runs"]
        and not figures["cluster_faults_missing"]
    )


def wait_for_api(url: str | None, sup: Supervisor, timeout_s: float = 90.0) -> None:
    """Wait until the API answers its health check (it starts after its Kafka and Postgres)."""
    assert url is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the API never answered: {sup.log_tail('api')}")


if __name__ == "__main__":
    raise SystemExit(main())

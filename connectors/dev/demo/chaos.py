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
from typing import Any

import httpx
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from agentruns.connectors.dev.demo.cluster_faults import (
    PARTITION_FAULTS,
    ClusterFaults,
    FaultRecord,
    ProgressWatch,
    acknowledged_missing,
    percentiles,
)
from agentruns.connectors.dev.demo.run import registry_tools
from agentruns.connectors.dev.servers import hostile as hostile_cases
from agentruns.connectors.dev.servers import model_server, tool_server
from agentruns.connectors.dev.stack import netlab
from agentruns.connectors.dev.stack.netlab import NetLab
from agentruns.connectors.dev.stack.procs import free_port_block
from agentruns.connectors.dev.stack.services import ServiceStack
from agentruns.connectors.dev.stack.supervisor import Supervisor
from agentruns.connectors.endpoints import state_dir
from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.lifecycle import RESTART_ME
from agentruns.connectors.postgres.migrate import migrate
from agentruns.connectors.projection.audit import audit
from agentruns.connectors.projection.reading import read_topic
from agentruns.processors.events import Message, RunSubmitted
from agentruns.processors.state import Budgets, Policy
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
    # Two streams, so that the sequence of faults depends on the seed alone, not on how the
    # submitting thread's draws interleave with the killer's.
    rng = random.Random(seed)
    pacing = random.Random(f"{seed}:pacing")
    prefix = f"chaos-{uuid.uuid4().hex[:8]}"
    lab_missing = None if brokers < 3 else netlab.usable()
    with contextlib.ExitStack() as lab_scope:
        # each broker in a network namespace of its own, for the partition faults
        lab = (
            lab_scope.enter_context(NetLab([f"broker-{i + 1}" for i in range(brokers)]))
            if brokers >= 3 and lab_missing is None
            else None
        )
        placed = (
            None
            if lab is None
            else [
                (lab.members[f"broker-{i + 1}"].address, lab.members[f"broker-{i + 1}"].command([]))
                for i in range(brokers)
            ]
        )
        stack = lab_scope.enter_context(
            ServiceStack(ephemeral=True, brokers=brokers, placed=placed)
        )
        assert stack.endpoints is not None
        ep = stack.endpoints
        migrate(ep.database_url)
        ensure_topics(ep.kafka_bootstrap, prefix=prefix, partitions=PARTITIONS)
        with (
            model_server.serve("127.0.0.1", 0) as models,
            tool_server.serve("127.0.0.1", 0, report_delay_ms=500) as tools,
            contextlib.ExitStack() as cleanup,
        ):
            env = {
                **os.environ,
                "KAFKA_BOOTSTRAP_SERVERS": ep.kafka_bootstrap,
                "DATABASE_URL": ep.database_url,
                "AGENTRUNS_LOG_LEVEL": "WARNING",
            }
            log_dir = state_dir() / "logs" / prefix
            sup = Supervisor(log_dir, env)
            common = ("--prefix", prefix)
            for i in (0, 1):
                sup.add(
                    f"processor-{i}",
                    "agentruns.connectors.runtime.processor",
                    *common,
                    "--instance-id",
                    str(i),
                    "--log-level",
                    "WARNING",
                )
            routes: tuple[str, ...] = ()
            if hostile:  # streams that never end are cut after seconds, not minutes
                log_dir.mkdir(parents=True, exist_ok=True)
                routes_file = log_dir / "routes.json"
                routes_file.write_text(json.dumps({"*": HOSTILE_ROUTE}))
                routes = ("--routes", str(routes_file))
            sup.add(
                "model-executor",
                "agentruns.connectors.executors.model",
                *common,
                "--base-url",
                models.url,
                "--registry",
                str(tool_server.DEFAULT_REGISTRY),
                *routes,
            )
            sup.add(
                "tool-executor",
                "agentruns.connectors.executors.tool",
                *common,
                "--base-url",
                tools.url,
                "--registry",
                str(tool_server.DEFAULT_REGISTRY),
            )
            sup.add(
                "timer", "agentruns.connectors.runtime.timers", *common, "--log-level", "WARNING"
            )
            sup.add(
                "sink", "agentruns.connectors.projection.sink", *common, "--log-level", "WARNING"
            )
            api_url = None
            if hostile:
                api_port = free_port_block(1, start=29500)
                api_url = f"http://127.0.0.1:{api_port}"
                sup.env["AGENTRUNS_API_TOKEN"] = api_token = uuid.uuid4().hex
                sup.env["AGENTRUNS_API_SECRET"] = uuid.uuid4().hex
                operator_token = uuid.uuid4().hex
                sup.env["AGENTRUNS_API_OPERATOR_TOKENS"] = f"chaos:{operator_token}"
                sup.add("api", "agentruns.connectors.cli", "api", *common, "--port", str(api_port))
            sup.start_all()
            cleanup.callback(sup.stop_all)  # whatever fails below, no component outlives us
            producer = Producer(
                {
                    "bootstrap.servers": ep.kafka_bootstrap,
                    **client_settings(),
                    "enable.idempotence": True,
                    "acks": "all",
                }
            )
            inbox = topic_name(INBOX, prefix)
            # (partition, offset) -> key of every input the brokers acknowledged
            acknowledged: dict[tuple[int, int], bytes] = {}

            def on_delivery(error: KafkaError | None, message: Any) -> None:
                if error is None:
                    acknowledged[(message.partition(), message.offset())] = message.key()

            stop_killing = threading.Event()
            watch = ProgressWatch(ep.kafka_bootstrap, topic_name(EVENTS, prefix))
            cleanup.callback(watch.close)
            cluster = (
                ClusterFaults(
                    stack.local.kafka,
                    ep.kafka_bootstrap,
                    inbox,
                    f"{prefix}-processor-0-a",
                    wait=stop_killing.wait,
                    say=say,
                    lab=lab,
                )
                if stack.local is not None and brokers >= 3
                else None
            )
            tool_specs = registry_tools()
            doors = hostile_cases.Doors(
                bootstrap=ep.kafka_bootstrap,
                prefix=prefix,
                partitions=PARTITIONS,
                model_url=models.url,
                tool_url=tools.url,
                tools=tool_specs,
                api_url=api_url,
                api_token=api_token if hostile else None,
                operator_token=operator_token if hostile else None,
            )
            cleanup.callback(doors.close)
            bad_inputs = (
                hostile_cases.cases(api=True)
                if hostile
                else tuple(c for c in hostile_cases.CASES if c.name == "inbox_garbage_bytes")
            )
            bad_every = max(1, runs // len(bad_inputs)) if hostile else 50
            if hostile:
                wait_for_api(api_url, sup)
            injections: list[tuple[hostile_cases.Case, hostile_cases.Injected]] = []
            run_ids: list[str] = []
            ends: dict[str, str] = {}
            kills = 0
            pauses = 0
            restarts = 0
            broker_restarts = 0
            broker_pauses = 0
            component_faults = 0
            local = stack.local
            # The broker faults, once each when the broker is ours; the runs may end before
            # them, so the run goes on until they happened.
            broker_restarts_due = int(broker_restart and local is not None)
            broker_pauses_due = int(broker_pause and local is not None)
            began = time.monotonic()
            deadline = began + minutes * 60

            def hold(seconds: float, resume: Callable[[], object]) -> None:
                """Leave what was paused standing for `seconds` (less once the run ends), then
                resume it, whatever happens."""
                try:
                    stop_killing.wait(seconds)
                finally:
                    resume()

            def killer() -> None:
                nonlocal kills, pauses, restarts, broker_restarts, broker_pauses
                if kill_every <= 0:
                    return
                nonlocal component_faults
                while not stop_killing.wait(rng.uniform(0.5, 1.5) * kill_every):
                    if cluster is not None and component_faults >= 2 * (len(cluster.done) + 1):
                        fault = cluster.next_fault()
                        try:
                            cluster.inject(
                                fault,
                                rng.uniform(
                                    *(
                                        BELOW_MIN_ISR_SECONDS
                                        if fault == "below_min_isr"
                                        else PARTITION_SECONDS
                                        if fault in PARTITION_FAULTS
                                        else BROKER_DOWN_SECONDS
                                    )
                                ),
                            )
                        except Exception as exc:  # the fault is tried again next time
                            say(f"chaos: {fault} could not be injected: {exc}")
                        continue
                    component_faults += 1
                    if broker_restarts < broker_restarts_due and kills >= 3:
                        say("chaos: restarting the Kafka broker")
                        assert local is not None
                        local.kafka.restart()
                        broker_restarts += 1
                        continue
                    if broker_pauses < broker_pauses_due and kills >= 4:
                        seconds = rng.uniform(*BROKER_PAUSE_SECONDS)
                        assert local is not None
                        local.kafka.pause()
                        hold(seconds, local.kafka.resume)
                        broker_pauses += 1
                        say(f"chaos: paused the Kafka broker for {seconds:.1f} s")
                        continue
                    name = rng.choice(KILLABLE)
                    if rng.random() < pause_share:
                        seconds = rng.uniform(*PAUSE_SECONDS)
                        if sup.pause(name):
                            hold(seconds, functools.partial(sup.resume, name))
                            pauses += 1
                            say(f"chaos: paused {name} for {seconds:.1f} s ({pauses} pauses)")
                        continue
                    sup.kill(name)
                    kills += 1
                    stop_killing.wait(rng.uniform(0.0, 2.0))
                    sup.start(name)
                    restarts += 1
                    say(f"chaos: kill -9 {name}, restarted ({kills} kills)")

            killing = threading.Thread(target=killer, daemon=True)
            killing.start()
            injected = 0
            crashes = 0  # components that exited without being killed
            restarts_asked = 0  # components that stopped for their supervisor to restart them
            try:
                for i in range(runs):
                    mix = MIXES[i % len(MIXES)]
                    # Unique per chaos run: a configured database keeps the timers, executed
                    # actions and runs of earlier ones, keyed by run id.
                    run_id = f"{prefix}-{i:04d}-{mix.model_scenario}"
                    event = RunSubmitted(
                        run_id=run_id,
                        event_id=f"{run_id}:submit",
                        at=now_ms(),
                        trace_id=uuid.uuid4().hex,
                        goal=f"chaos {mix.model_scenario}",
                        messages=(
                            Message(role="user", content=f"scenario:{mix.model_scenario} {run_id}"),
                        ),
                        tools=tool_specs,
                        policy=mix.policy,
                        model_route=f"scenario:{mix.model_scenario}",
                        budgets=mix.budgets,
                    )
                    record = input_record(event)
                    producer.produce(
                        inbox,
                        key=run_id.encode(),
                        value=encode("Input", record),
                        partition=partition_for(run_id, PARTITIONS),
                        on_delivery=on_delivery,
                    )
                    run_ids.append(run_id)
                    ends[run_id] = mix.ends
                    if i % bad_every == 0:
                        case = bad_inputs[(i // bad_every) % len(bad_inputs)]
                        bad_id = f"{prefix}-bad-{i:04d}"
                        injections.append((case, hostile_cases.inject(case, doors, bad_id)))
                        injected += 1
                    producer.poll(0)
                    time.sleep(pacing.uniform(0.0, 2.0) * submit_seconds / runs)
                for case in bad_inputs[injected:] if hostile else ():  # fewer runs than cases
                    bad_id = f"{prefix}-bad-{injected:04d}-tail"
                    injections.append((case, hostile_cases.inject(case, doors, bad_id)))
                    injected += 1
                # released now: alive, it would reconnect to the stopped broker at the end
                if (left := release(producer, 60)) > 0:
                    raise RuntimeError(f"{left} submitted inputs were not acknowledged")
                if (left := doors.flush(60)) > 0:
                    raise RuntimeError(f"{left} bad inputs were not acknowledged")
                say(f"chaos: submitted {runs} runs and {injected} bad inputs")
                # runs of bad inputs whose one allowed ending is a terminal result
                ending_runs = [
                    inj.run_id
                    for case, inj in injections
                    if case.ending.status is not None and inj.run_id is not None
                ]
                results: dict[str, list[dict[str, Any]]] = {}
                said = time.monotonic()
                while time.monotonic() < deadline:
                    try:
                        results = _read_results(ep.kafka_bootstrap, prefix)
                    except AgentrunsError as exc:
                        # brokers down (a fault) can hold a read past its bound: the next
                        # round reads again, and the reads after the faults must succeed
                        say(f"chaos: reading the results failed, reading again: {exc}")
                    if (
                        all(r in results for r in (*run_ids, *ending_runs))
                        and broker_restarts >= broker_restarts_due
                        and broker_pauses >= broker_pauses_due
                        and (cluster is None or cluster.kinds_done() >= set(cluster.kinds))
                    ):
                        break
                    if time.monotonic() - said >= WAIT_PROGRESS_S:
                        said = time.monotonic()
                        ended = sum(r in results for r in run_ids)
                        say(
                            f"chaos: {ended} of {len(run_ids)} runs ended, "
                            f"{deadline - said:.0f} s left to wait"
                        )
                    for name in sup.components:
                        if (code := sup.exited(name)) == RESTART_ME:
                            last = sup.log_tail(name, 1)
                            say(f"chaos: {name} stopped to be started again: {last}")
                            restarts_asked += 1
                            sup.start(name)
                        elif code is not None:
                            say(
                                f"chaos: {name} exited on its own (exit status {code}):"
                                f" {sup.log_tail(name, 5)}"
                            )
                            crashes += 1
                            sup.start(name)
                    time.sleep(2.0)
            finally:
                stop_killing.set()
                killing.join(timeout=120)
            # Let the sink catch up before the audit compares Postgres with the log.
            for name in sup.components:
                sup.start(name)
            results = _read_results(ep.kafka_bootstrap, prefix)
            report = None
            for _ in range(30):
                report = audit(ep.kafka_bootstrap, prefix, ep.database_url, run_ids=run_ids)
                if not report.differences:
                    break
                time.sleep(2.0)
            assert report is not None
            executions = httpx.get(f"{tools.url}/stats", timeout=10).json().get("executions", {})
            dead = hostile_cases.positions(_dead_letters(ep.kafka_bootstrap, prefix))
            stalls = {
                group: left
                for group, topics in consumer_groups(prefix).items()
                if (left := unconsumed(ep.kafka_bootstrap, group, topics)) > 0
            }
            if report.differences or stalls:
                # whatever stands still says what it waits for, before it is stopped
                asked = sup.dump_stacks()
                time.sleep(1.0)
                say(f"chaos: thread stacks of {', '.join(asked)} written to their logs")
            crashes += sum(
                1 for name in sup.components if sup.exited(name) not in (None, RESTART_ME)
            )
            lost_inputs, unconsumed_inputs = acknowledged_missing(
                ep.kafka_bootstrap, inbox, acknowledged, f"{prefix}-processor"
            )
            faults: list[FaultRecord] = list(cluster.done) if cluster is not None else []
            cluster_kinds = cluster.kinds if cluster is not None else ()
            for f in faults:
                f.stall_s = watch.stall(f.began, f.ended)
        restartable = local is not None
    lost = [r for r in run_ids if r not in results]
    terminal_twice = [
        r for r, rs in results.items() if len({json.dumps(x, sort_keys=True) for x in rs}) > 1
    ]
    duplicates = {k: n for k, n in executions.items() if n > 1}
    misses = {
        case.name: why
        for case, inj in injections
        if (why := hostile_cases.check(case, inj, results, dead)) is not None
    }
    expected_dead = {inj.position for case, inj in injections if case.ending.dlq is not None}
    return {
        "runs": len(run_ids),
        "kills": kills,
        "pauses": pauses,
        "restarts": restarts,
        "broker_restarts": broker_restarts,
        "broker_pauses": broker_pauses,
        "broker_restartable": restartable,
        "lost": len(lost),
        "terminal_twice": len(terminal_twice),
        "duplicate_tool_executions": len(duplicates),
        "audit_differences": len(report.differences),
        "audit_first": [str(d) for d in report.differences[:5]],
        "dlq_injected": len(expected_dead),
        "dlq": len(dead),
        "dlq_unexpected": [
            {"source": list(where), "reason": d[0]["reason"][:200]}
            for where, d in dead.items()
            if where not in expected_dead
        ][:10],
        "hostile_injected": injected,
        "hostile_ended": injected - len(misses),
        "hostile_misses": misses,
        "stalls": stalls,
        "unexpected_statuses": {
            r: results[r][-1]["status"]
            for r in run_ids
            if r in results and results[r][-1]["status"] != ends[r]
        },
        "crashes": crashes,
        "restarts_asked": restarts_asked,
        "statuses": _count(r[-1]["status"] for r in results.values()),
        "brokers": brokers,
        "acknowledged": len(acknowledged),
        "acknowledged_lost": len(lost_inputs),
        "acknowledged_unconsumed": len(unconsumed_inputs),
        "cluster_faults": [f.figures(began) for f in faults],
        "cluster_faults_missing": (sorted(set(cluster_kinds) - {f.fault for f in faults})),
        "partition_faults": (
            "" if brokers < 3 else "made" if lab_missing is None else f"not made: {lab_missing}"
        ),
        "fault_stall_s": {
            kind: percentiles(
                [f.stall_s for f in faults if f.fault == kind and f.stall_s is not None]
            )
            for kind in cluster_kinds
            if any(f.fault == kind for f in faults)
        },
        "seconds": round(time.monotonic() - began, 1),
        "logs": str(log_dir),
    }


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

"""Versions of runs in flight, against the real broker and database.

A rolling deploy puts two versions of the processor and the executors in one consumer group
while runs wait for a person; a rollback takes the newer one away again. The newer version is
simulated by `tests.support.newer` (one field this version does not know in every body it
writes, and a rules version 2). Nothing may strand a run, and the audit must find the log,
the snapshots and the rules agree.

A run or snapshot a processor cannot continue (a rules version it does not have, a snapshot
schema it does not ship) stops that partition only, until a processor that can takes it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from confluent_kafka import Producer
from prometheus_client import REGISTRY

from agentruns.connectors.dev.servers import model_server, tool_server
from agentruns.connectors.executors.config import ExecutorConfig
from agentruns.connectors.executors.model import ModelExecutor, RouteConfig, Routes
from agentruns.connectors.executors.tool import ToolExecutor
from agentruns.connectors.projection.audit import audit
from agentruns.processors import versions
from agentruns.processors.events import CancelRequested, Message, RunSubmitted, UserReplied
from agentruns.processors.state import Policy, ToolSpec
from agentruns.processors.transition import transition
from agentruns.streams.admin import ensure_topics
from agentruns.streams.clock import now_ms
from agentruns.streams.kafka_defaults import release
from agentruns.streams.partitioning import partition_for
from agentruns.streams.processor import Processor, ProcessorConfig
from agentruns.streams.records import input_record
from agentruns.streams.topics import STATE, topic_name
from tests.support.executors import fast_registry
from tests.support.newer import NEWER_FIELD
from tests.support.pipeline import Inbox, read_all, running_processor
from tests.support.waiting import wait_for

PARTITIONS = 4
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run_ids(tag: str, per_partition: int) -> list[str]:
    """Run ids spread evenly over the partitions (so each member of the group gets some)."""
    found: dict[int, list[str]] = {p: [] for p in range(PARTITIONS)}
    n = 0
    while any(len(ids) < per_partition for ids in found.values()):
        run_id = f"run-{tag}-{n}"
        ids = found[partition_for(run_id, PARTITIONS)]
        if len(ids) < per_partition:
            ids.append(run_id)
        n += 1
    return [run_id for ids in found.values() for run_id in ids]


class Deployment:
    """One topic prefix, the scripted model and tool servers, and the versions deployed."""

    def __init__(self, bootstrap: str, database_url: str, tmp: Path, cleanup: ExitStack) -> None:
        self.bootstrap, self.database_url = bootstrap, database_url
        self.prefix = f"t-versions-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        ensure_topics(bootstrap, prefix=self.prefix, partitions=PARTITIONS)
        self.models = model_server.serve("127.0.0.1", 0)
        self.tools = tool_server.serve("127.0.0.1", 0)
        cleanup.callback(self.models.close)
        cleanup.callback(self.tools.close)
        self.registry = fast_registry(tmp, self.tools.url)
        spec = json.loads(self.registry.read_text())
        for tool in spec["tools"]:
            tool["timeout_ms"] = 5000
        self.registry.write_text(json.dumps(spec))
        self.tool_specs = tuple(
            ToolSpec(name=t["name"], parameters=t["parameters"], permission=t["permission"])
            for t in spec["tools"]
            if t["name"] in ("search_docs", "delete_record")
        )
        self.inbox = Inbox(bootstrap, self.prefix, PARTITIONS)
        cleanup.callback(self.inbox.close)
        self.logs = tmp

    # ------------------------------------------------------------------ this version

    @contextmanager
    def older(self, instance: str) -> Iterator[Processor]:
        """This version's processor and executors, threads of the test process."""

        def config(kind: str) -> ExecutorConfig:
            return ExecutorConfig(
                self.bootstrap,
                self.database_url,
                kind,
                prefix=self.prefix,
                instance_id=instance,  # its own transactional ids beside the newer ones
                max_in_flight=32,
            )

        routes = Routes({}, RouteConfig(base_url=self.models.url + "/v1"))
        stop = threading.Event()
        workers: list[Any] = [
            ModelExecutor(config("model"), routes, self.registry),
            ToolExecutor(config("tool"), self.registry),
        ]
        threads = [threading.Thread(target=w.run, args=(stop,), daemon=True) for w in workers]
        for thread in threads:
            thread.start()
        processor_config = ProcessorConfig(
            self.bootstrap, prefix=self.prefix, instance_id=instance, commit_interval_ms=20
        )
        try:
            with running_processor(processor_config, self.database_url) as processor:
                yield processor
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)

    # ------------------------------------------------------------------ the newer version

    @contextmanager
    def newer(self, instance: str) -> Iterator[str]:
        """The newer version's processor and executors, as processes (`tests.support.newer`);
        yields the processor's health address. It keeps submitting runs under rules version 1
        while it has 2, as docs/operations.md says a new rule set rolls out: so the rollback
        finds no run it cannot continue."""
        address = f"127.0.0.1:{_free_port()}"
        env = {
            **os.environ,
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "DATABASE_URL": self.database_url,
            "PYTHONPATH": os.pathsep.join([*sys.path, str(REPO)]),
        }
        common = [
            "--bootstrap", self.bootstrap, "--database-url", self.database_url,
            "--instance", instance,
        ]  # fmt: skip
        commands = {
            "processor": [
                "processor", "--prefix", self.prefix, "--instance-id", instance,
                "--rules-version", "1", "--commit-interval-ms", "20",
                "--metrics-address", address, "--log-level", "WARNING",
            ],
            "model": [
                "model", *common, "--prefix", self.prefix, "--base-url",
                self.models.url + "/v1", "--registry", str(self.registry),
            ],
            "tool": ["tool", *common, "--prefix", self.prefix, "--registry", str(self.registry)],
        }  # fmt: skip
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for name, args in commands.items():
                with open(self.logs / f"newer-{name}.log", "ab") as log:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "tests.support.newer", *args],
                            env=env,
                            stdout=subprocess.DEVNULL,
                            stderr=log,
                            cwd=REPO,
                        )
                    )
            yield address
        finally:
            for proc in procs:  # a graceful stop: each leaves its group at once
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)

    # ------------------------------------------------------------------ runs

    def submit(self, run_id: str) -> None:
        self.inbox.send(
            input_record(
                RunSubmitted(
                    run_id=run_id,
                    event_id=f"{run_id}:submit",
                    at=now_ms(),
                    trace_id=f"trace-{run_id}",
                    goal="Find duplicate customer records and delete the duplicate.",
                    messages=(Message(role="user", content="R-3 looks like a copy of R-2."),),
                    tools=self.tool_specs,
                    policy=Policy(
                        allowed_permissions=("read", "write", "admin"),
                        approval_required=("admin",),
                    ),
                    model_route="scenario:approval",
                )
            )
        )
        self.inbox.flush()

    def questions(self, run_ids: list[str], timeout: float = 60) -> dict[str, dict[str, Any]]:
        """The AskUser effect of each run in `run_ids` (the run waits for a person)."""
        wanted = set(run_ids)
        topic = topic_name("effects.timer", self.prefix)

        def asked() -> dict[str, dict[str, Any]] | None:
            found = {}
            for record in read_all(self.bootstrap, topic, "Effect"):
                body = json.loads(record.value["body"])
                if body["type"] == "AskUser" and body["run_id"] in wanted:
                    found[body["run_id"]] = body
            return found if len(found) == len(wanted) else None

        questions: dict[str, dict[str, Any]] = wait_for(asked, timeout, "every question")
        return questions

    def reply(self, questions: dict[str, dict[str, Any]], run_ids: list[str]) -> None:
        for run_id in run_ids:
            q = questions[run_id]
            reply = UserReplied(
                run_id=run_id,
                event_id=f"{run_id}:reply",
                at=now_ms(),
                trace_id=f"trace-{run_id}",
                question_id=q["question_id"],
                token_id=q["token_id"],
                state_version=q["state_version"],
                response={"approved": True},
            )
            self.inbox.send(input_record(reply))
        self.inbox.flush()

    def results(self, run_ids: list[str], timeout: float = 60) -> dict[str, str]:
        wanted = set(run_ids)
        topic = topic_name("results", self.prefix)

        def ended() -> dict[str, str] | None:
            found = {
                r.value["run_id"]: r.value["status"]
                for r in read_all(self.bootstrap, topic, "Result")
                if r.value["run_id"] in wanted
            }
            return found if len(found) == len(wanted) else None

        done: dict[str, str] = wait_for(ended, timeout, "every result")
        return done

    def latest_snapshots(self) -> dict[str, dict[str, Any]]:
        topic = topic_name(STATE, self.prefix)
        return {r.value["run_id"]: r.value for r in read_all(self.bootstrap, topic, "Snapshot")}


def _newer_has_partitions(address: str) -> bool:
    try:
        body = httpx.get(f"http://{address}/healthz", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return False
    # the consumer's code: "ok" with partitions, "no_partitions" without
    return body.get("status") == "ready" and body.get("checks", {}).get("consumer") == "ok"


@pytest.mark.timeout(240)
def test_runs_waiting_for_a_person_survive_a_mixed_version_deploy_and_a_rollback(
    kafka_bootstrap: str, database_url: str, tmp_path: Path
) -> None:
    with ExitStack() as cleanup:
        deploy = Deployment(kafka_bootstrap, database_url, tmp_path, cleanup)
        first, second = _run_ids("first", 1), _run_ids("second", 1)
        with deploy.older("old-0"):
            # 1. this version alone: runs go until they wait for a person
            for run_id in first:
                deploy.submit(run_id)
            asked = deploy.questions(first)
            # 2. the newer version joins the same groups (a rolling deploy half done)
            with deploy.newer("new-1") as address:
                wait_for(lambda: _newer_has_partitions(address), 60, "the newer processor")
                for run_id in second:
                    deploy.submit(run_id)
                deploy.reply(asked, first[:2])
                asked |= deploy.questions(second)
                assert set(deploy.results(first[:2]).values()) == {"SUCCEEDED"}
                written = deploy.latest_snapshots()
                newer_wrote = {
                    r for r, s in written.items() if s["state"] and NEWER_FIELD in s["state"]
                }
                # the newer version held some of these runs: its snapshots carry its field
                assert newer_wrote, "the newer processor advanced none of the runs"
            # 3. rolled back: this version alone again, with what the newer one wrote
            deploy.reply(asked, [*first[2:], *second])
            statuses = deploy.results([*first, *second])
            assert set(statuses.values()) == {"SUCCEEDED"}, statuses
        # the older version applied answers of the newer executors and the newer executors
        # ran effects of the newer processor, each with a field its reader did not know
        answers = read_all(kafka_bootstrap, topic_name("inbox", deploy.prefix), "Input")
        assert any(
            NEWER_FIELD in a.value["body"] for a in answers if a.value["kind"] != "UserReplied"
        )
        calls = read_all(kafka_bootstrap, topic_name("effects.model", deploy.prefix), "Effect")
        assert any(NEWER_FIELD in c.value["body"] for c in calls)
        final = deploy.latest_snapshots()
        # a run the newer version had held kept the newer field through this version's writes
        assert all(NEWER_FIELD in final[r]["state"] for r in newer_wrote)
        report = audit(kafka_bootstrap, deploy.prefix, None, run_ids=[*first, *second])
        assert report.runs == len(first) + len(second)
        assert report.differences == [], [d.line() for d in report.differences]


# --------------------------------------------------------------------------- stopped partitions


def _partition_with(tag: str, partition: int) -> str:
    n = 0
    while partition_for(f"run-{tag}-{n}", PARTITIONS) != partition:
        n += 1
    return f"run-{tag}-{n}"


def _stopped_gauge(partition: int) -> float | None:
    return REGISTRY.get_sample_value("agentruns_stopped_partitions", {"partition": str(partition)})


@pytest.mark.timeout(180)
def test_a_run_or_snapshot_of_a_newer_version_stops_its_partition_only_until_a_newer_processor(
    kafka_bootstrap: str, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = f"t-versions-stop-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    ensure_topics(kafka_bootstrap, prefix=prefix, partitions=PARTITIONS)
    inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
    newer_run, unreadable_run = _partition_with("v2", 1), _partition_with("unreadable", 2)
    other = _partition_with("other", 3)

    def config(instance: str) -> ProcessorConfig:
        return ProcessorConfig(
            kafka_bootstrap, prefix=prefix, instance_id=instance, commit_interval_ms=20
        )

    def submit(run_id: str) -> None:
        inbox.send(input_record(RunSubmitted(run_id=run_id, event_id=f"{run_id}:s", at=now_ms(),
                                             trace_id="t", goal="wait for a model")))  # fmt: skip
        inbox.flush()

    def cancel(run_id: str) -> None:
        inbox.send(input_record(CancelRequested(run_id=run_id, event_id=f"{run_id}:c",
                                                at=now_ms(), trace_id="t")))  # fmt: skip
        inbox.flush()

    def status(run_id: str) -> str | None:
        snapshots = [
            r.value
            for r in read_all(
                kafka_bootstrap,
                topic_name(STATE, prefix),
                "Snapshot",
                partitions=[partition_for(run_id, PARTITIONS)],  # not the unreadable one's
            )
            if r.value["run_id"] == run_id
        ]
        return snapshots[-1]["status"] if snapshots else None

    try:
        # a newer processor (it has rules version 2) submits a run under version 2
        monkeypatch.setitem(versions.RULES, 2, transition)
        with running_processor(config("newer"), database_url):
            submit(newer_run)
            wait_for(lambda: status(newer_run) == "MODEL_RUNNING", 30, "the newer run")
        monkeypatch.delitem(versions.RULES, 2)
        # a snapshot of a schema version this build does not ship (an unknown fingerprint)
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        unknown = b"\xc3\x01" + b"\x07" * 8 + b"\x02"
        producer.produce(topic_name(STATE, prefix), unknown, unreadable_run.encode(), partition=2)
        producer.flush(10)
        release(producer)

        with running_processor(config("older"), database_url) as older:
            wait_for(lambda: older.membership.stopped_partitions.keys() == {1, 2}, 60, "stops")
            reasons = older.membership.stopped_partitions
            assert reasons[1] == (
                "a snapshot this build cannot continue: unknown rules version 2 (this build has 1)"
            )
            assert reasons[2].startswith("a snapshot this build cannot continue:")
            assert _stopped_gauge(1) == 1 and _stopped_gauge(2) == 1
            # the other partitions go on; the stopped one takes nothing (the cancel waits
            # unconsumed, applied below by a processor that has version 2)
            cancel(newer_run)
            submit(other)
            wait_for(lambda: status(other) == "MODEL_RUNNING", 30, "a run elsewhere")
            assert status(newer_run) == "MODEL_RUNNING"
        assert _stopped_gauge(1) is None  # the partitions left with the processor

        # a processor that has version 2 again takes over: the cancel waiting there applies
        monkeypatch.setitem(versions.RULES, 2, transition)
        with running_processor(config("upgraded"), database_url) as upgraded:
            wait_for(lambda: status(newer_run) == "CANCELLED", 30, "the held cancel")
            assert set(upgraded.membership.stopped_partitions) == {2}  # still unreadable there
    finally:
        inbox.close()

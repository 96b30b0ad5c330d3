"""The Faust extra against the real broker: a real Faust worker (examples/faust_app.py) submits
tasks through the pipeline and consumes their results, and never sees an aborted result."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from confluent_kafka import Producer

from agentruns.connectors.keys import processor_tenant_keys, tenant_header_root, tenant_kafka_key
from agentruns.processors.ids import run_id_for_key
from agentruns.streams.codec import encode
from agentruns.streams.kafka_defaults import partition_count
from agentruns.streams.partitioning import partition_for
from agentruns.streams.topics import INBOX, RESULTS, topic_name
from tests.support.api import OPERATOR_TOKEN, SECRET, TENANT_B, Stack, pipeline
from tests.support.pipeline import SEARCH, now_ms, read_all

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "faust_app.py"
TASK = {"goal": "find three documents", "tools": [SEARCH.model_dump(mode="json")]}


# The worker sends what the app prints to its log: `[time] [pid] [WARNING] result ...`.
SAID = re.compile(r"(?:^|\] )((?:submitted|result) .*?)\s*$")


class Worker:
    """`python examples/faust_app.py worker`, its output in a file."""

    def __init__(self, output: Path, process: subprocess.Popen[bytes]) -> None:
        self.output = output
        self.process = process

    def lines(self) -> list[str]:
        """The lines the example printed."""
        found = (SAID.search(line) for line in self.output.read_text().splitlines())
        return [m[1] for m in found if m]

    def wait_for(self, starts: set[str], timeout: float = 120) -> list[str]:
        """The worker's lines once each of `starts` begins one of them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.lines()
            if not missing(starts, lines):
                return lines
            assert self.process.poll() is None, f"the Faust worker exited: {self.log()}"
            time.sleep(0.5)
        raise AssertionError(f"missing {missing(starts, self.lines())}; log: {self.log()}")

    def log(self) -> str:
        return self.output.read_text()[-4000:]


def missing(starts: set[str], lines: list[str]) -> set[str]:
    return {s for s in starts if not any(line.startswith(s) for line in lines)}


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def faust_worker(
    tmp_path: Path,
    bootstrap: str,
    prefix: str,
    tasks: Path,
    extra_env: dict[str, str] | None = None,
) -> Iterator[Worker]:
    output = tmp_path / "worker.out"
    env = {
        **os.environ,
        **(extra_env or {}),
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "AGENTRUNS_TOPIC_PREFIX": prefix,
        "AGENTRUNS_FAUST_APP_ID": f"{prefix}-faust",
        "AGENTRUNS_FAUST_TASKS": str(tasks),
        "AGENTRUNS_FAUST_DATA": str(tmp_path / "faust-data"),
    }
    with output.open("wb") as out:
        process = subprocess.Popen(
            # the worker binds a web port whatever web_enabled says: one of its own, as tests
            # run side by side
            [sys.executable, str(EXAMPLE), "worker", "--loglevel=warn", f"--web-port={_port()}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        yield Worker(output, process)
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def test_tasks_submitted_through_faust_end_with_results_the_faust_agent_consumes(
    stack: Stack, tmp_path: Path
) -> None:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    keys = [f"faust-{uuid.uuid4().hex[:12]}" for _ in range(3)]
    for key in keys:
        (tasks / f"{key}.json").write_text(json.dumps(TASK))
    runs = {key: run_id_for_key(key) for key in keys}
    with faust_worker(tmp_path, stack.bootstrap, stack.prefix, tasks) as worker:
        lines = worker.wait_for(
            {f"submitted {key} {run_id}" for key, run_id in runs.items()}
            | {f"result {run_id} SUCCEEDED v0 " for run_id in runs.values()},
        )
    # what Faust produced is the contract's record, on the run's partition
    inbox = read_all(stack.bootstrap, topic_name(INBOX, stack.prefix), "Input")
    submitted = [
        r for r in inbox if r.value["run_id"] in runs.values() and r.value["kind"] == "RunSubmitted"
    ]
    with Producer({"bootstrap.servers": stack.bootstrap}) as client:
        partitions = partition_count(client, topic_name(INBOX, stack.prefix))
    assert sorted(r.value["run_id"] for r in submitted) == sorted(runs.values())
    for record in submitted:
        run_id = record.value["run_id"]
        assert record.key == run_id.encode()
        assert record.partition == partition_for(run_id, partitions)
        assert record.value["input_id"] == f"{run_id}:submit"
        assert (record.value["producer_id"], record.value["producer_seq"]) == ("faust-example", 1)
    assert len([line for line in lines if line.startswith("result ")]) == len(runs)


def test_a_faust_app_submits_for_its_tenant_in_a_signed_header(
    kafka_bootstrap: str, database_url: str, tmp_path: Path
) -> None:
    """With a tenant and its Kafka key, `submit_task` signs the tenant header, and a processor
    that believes signed headers only puts the run in that tenant."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    key = f"faust-signed-{uuid.uuid4().hex[:12]}"
    (tasks / f"{key}.json").write_text(json.dumps(TASK))
    run_id = run_id_for_key(key)
    signed = {"tenant_header": "signed", "tenant_key": processor_tenant_keys("", SECRET.decode())}
    env = {
        "AGENTRUNS_FAUST_TENANT": TENANT_B,
        "AGENTRUNS_TENANT_KAFKA_KEY": tenant_kafka_key(tenant_header_root(SECRET), TENANT_B).hex(),
    }
    with pipeline(kafka_bootstrap, database_url, processor_options=signed) as stack:
        with faust_worker(tmp_path, stack.bootstrap, stack.prefix, tasks, env) as worker:
            worker.wait_for({f"result {run_id} SUCCEEDED"})
        with stack.client(OPERATOR_TOKEN) as admin:
            assert admin.get(f"/runs/{run_id}").json()["tenant"] == TENANT_B


def result_value(run_id: str, summary: str) -> bytes:
    return encode(
        "Result",
        {
            "run_id": run_id,
            "status": "SUCCEEDED",
            "seq": 3,
            "version": 0,
            "result_ref": None,
            "summary": summary,
            "trace_id": uuid.uuid4().hex,
            "at": now_ms(),
            "body": "{}",
        },
    )


def test_the_faust_agent_never_sees_a_result_of_an_aborted_transaction(
    kafka_bootstrap: str, prefix: str, tmp_path: Path
) -> None:
    topic = topic_name(RESULTS, prefix)
    run_id = run_id_for_key(f"aborted-{uuid.uuid4().hex}")
    producer = Producer(
        {"bootstrap.servers": kafka_bootstrap, "transactional.id": f"{prefix}-tx", "linger.ms": 0}
    )
    producer.init_transactions(30)
    # Same key, same partition: the committed record lies after the aborted one.
    producer.begin_transaction()
    producer.produce(topic, key=run_id.encode(), value=result_value(run_id, "aborted"))
    producer.flush(30)
    producer.abort_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, key=run_id.encode(), value=result_value(run_id, "committed"))
    producer.commit_transaction(30)
    tasks = tmp_path / "no-tasks"
    tasks.mkdir()
    with faust_worker(tmp_path, kafka_bootstrap, prefix, tasks) as worker:
        lines = worker.wait_for({f"result {run_id} SUCCEEDED v0 committed"})
    assert [line for line in lines if line.startswith("result ")] == [
        f"result {run_id} SUCCEEDED v0 committed"
    ]

"""A key is a run, forever: a task submitted again after its run ended, was evicted and the
processor restarted is answered LATE in the run's log, whichever way it arrives (the CLI,
`RunsProducer`, the API, raw Kafka with a fresh `at`, a replay of the whole inbox topic). One
result per run, no seq written twice, the model not called again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
from confluent_kafka import Producer

from agentruns.connectors.api.client import RunsProducer
from agentruns.connectors.api.config import ApiConfig
from agentruns.connectors.api.serve import serving
from agentruns.processors.events import RunSubmitted
from agentruns.streams.admin import ensure_topics
from agentruns.streams.partitioning import partition_for
from agentruns.streams.processor import ProcessorConfig
from agentruns.streams.topics import EVENTS, INBOX, RESULTS, topic_name
from tests.support.api import SECRET, TOKEN
from tests.support.pipeline import (
    ExecutorDouble,
    Inbox,
    input_record,
    now_ms,
    read_all,
    read_raw,
    result_statuses,
    running_processor,
    submitted,
)
from tests.support.runlog import running_sink
from tests.support.waiting import wait_for

PARTITIONS = 3
AGENTRUNS = str(Path(sys.executable).parent / "agentruns")
TASK = {"goal": "find three documents"}


def _cli_submit(bootstrap: str, prefix: str, key: str, task_file: Path) -> str:
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap}
    env.pop("AGENTRUNS_API_URL", None)
    out = subprocess.run(
        [AGENTRUNS, "submit", "--key", key, "--task", str(task_file), "--prefix", prefix],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return str(json.loads(out.stdout)["run_id"])


def _producer_submit(bootstrap: str, prefix: str, key: str) -> str:
    with RunsProducer(
        bootstrap, producer_id=f"upstream-{uuid.uuid4().hex[:6]}", prefix=prefix
    ) as p:
        return p.submit(TASK, idempotency_key=key).run_id


def _api_submit(http: httpx.Client, key: str) -> str:
    r = http.post("/runs", json=TASK, headers={"Idempotency-Key": key})
    assert r.status_code in (200, 202), r.text
    return str(r.json()["run_id"])


def _replay_inbox(bootstrap: str, prefix: str) -> int:
    """Every record of the inbox produced to it again, as it was (a replay by an operator)."""
    records = read_raw(bootstrap, topic_name(INBOX, prefix))
    producer = Producer({"bootstrap.servers": bootstrap, "log_level": 3})
    for r in records:
        producer.produce(topic_name(INBOX, prefix), key=r.key, value=r.value, partition=r.partition)
    producer.flush(30)
    return len(records)


def _on_partition(partition: int, prefix: str) -> str:
    """A run id on `partition` of the inbox."""
    return next(
        run_id
        for i in range(10_000)
        for run_id in [f"{prefix}-{i}"]
        if partition_for(run_id, PARTITIONS) == partition
    )


def _inputs(bootstrap: str, prefix: str) -> dict[str, int]:
    """run_id -> the records on the inbox for it."""
    counts: dict[str, int] = {}
    for r in read_raw(bootstrap, topic_name(INBOX, prefix)):
        run_id = (r.key or b"").decode()
        counts[run_id] = counts.get(run_id, 0) + 1
    return counts


def test_a_key_never_starts_its_run_twice_however_it_arrives_after_a_restart(
    kafka_bootstrap: str, database_url: str, tmp_path: Path
) -> None:
    prefix = f"t-resubmit-{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka_bootstrap, prefix=prefix, partitions=PARTITIONS)
    config = ProcessorConfig(
        bootstrap=kafka_bootstrap,
        prefix=prefix,
        group_id=f"{prefix}-proc",
        terminal_retention_ms=1000,
        store_dir=str(tmp_path / "store"),
    )
    api = ApiConfig(
        bootstrap=kafka_bootstrap,
        database_url=database_url,
        api_token=TOKEN,
        secret=SECRET,
        prefix=prefix,
    )
    task_file = tmp_path / "task.json"
    task_file.write_text(json.dumps(TASK))
    double = ExecutorDouble(kafka_bootstrap, prefix, PARTITIONS, steps=1)
    inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
    raw = submitted(f"raw-{uuid.uuid4().hex[:6]}")
    double.start()
    try:
        with running_sink(kafka_bootstrap, database_url, prefix), serving(api) as url:
            headers = {"Authorization": f"Bearer {TOKEN}"}
            with httpx.Client(base_url=url, headers=headers, timeout=30) as http:

                def submit_every_way() -> dict[str, str]:
                    inbox.send(input_record(RunSubmitted(**{**_fields(raw), "at": now_ms()})))
                    inbox.flush()
                    return {
                        "cli": _cli_submit(kafka_bootstrap, prefix, "by-cli", task_file),
                        "producer": _producer_submit(kafka_bootstrap, prefix, "by-producer"),
                        "api": _api_submit(http, "by-api"),
                        "raw": raw.run_id,
                    }

                with running_processor(config, database_url) as proc:
                    runs = submit_every_way()
                    wait_for(
                        lambda: all(
                            result_statuses(kafka_bootstrap, prefix).get(r) == "SUCCEEDED"
                            for r in runs.values()
                        ),
                        timeout=90,
                        what="the first runs",
                    )
                    time.sleep(1.2)  # event time moves past their ends plus the retention
                    for partition in range(PARTITIONS):  # event time is per partition
                        inbox.send(input_record(submitted(_on_partition(partition, "moves"))))
                    inbox.flush()
                    wait_for(lambda: proc.stats.evicted >= 4, timeout=60, what="the evictions")
                calls = dict(double.answered)
                logs = {way: len(_log(kafka_bootstrap, prefix, r)) for way, r in runs.items()}
                before = _inputs(kafka_bootstrap, prefix)

                with running_processor(config, database_url) as proc:  # a restart
                    wait_for(lambda: bool(proc._assigned), timeout=60, what="the restore")
                    assert submit_every_way() == runs  # the same keys, the same run ids
                    replayed = _replay_inbox(kafka_bootstrap, prefix)
                    inbox.send(input_record(submitted("after-all")))
                    inbox.flush()
                    wait_for(
                        lambda: (
                            result_statuses(kafka_bootstrap, prefix).get("after-all") == "SUCCEEDED"
                        ),
                        timeout=90,
                        what="a run after the resubmissions",
                    )
                    # every input since the evictions is answered, one LATE event each
                    now = _inputs(kafka_bootstrap, prefix)
                    late = {way: now[r] - before.get(r, 0) for way, r in runs.items()}
                    wait_for(
                        lambda: all(
                            len(_log(kafka_bootstrap, prefix, r)) >= logs[w] + late[w]
                            for w, r in runs.items()
                        ),
                        timeout=60,
                        what="the resubmissions and the replay answered",
                    )
    finally:
        double.close()
        inbox.close()
    assert replayed >= 8
    results = read_all(kafka_bootstrap, topic_name(RESULTS, prefix), "Result")
    for way, run_id in runs.items():
        log = _log(kafka_bootstrap, prefix, run_id)
        assert [e["seq"] for e in log] == list(range(1, len(log) + 1)), way  # no seq twice
        after = log[logs[way] :]
        assert len(after) == late[way] >= 2, (way, after)
        assert all(e["disposition"] == "LATE" for e in after), (way, after)
        assert [r.value["status"] for r in results if r.value["run_id"] == run_id] == [
            "SUCCEEDED"
        ], way
    assert {k: n for k, n in double.answered.items() if k in calls} == calls
    assert not [k for k in double.answered if k not in calls and k.startswith(tuple(runs.values()))]


def _log(bootstrap: str, prefix: str, run_id: str) -> list[dict[str, object]]:
    events = read_all(bootstrap, topic_name(EVENTS, prefix), "Event")
    return [r.value for r in events if r.value["run_id"] == run_id]


def _fields(event: RunSubmitted) -> dict[str, object]:
    return {f: getattr(event, f) for f in event.__struct_fields__}

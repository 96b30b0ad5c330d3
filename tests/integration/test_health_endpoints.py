"""Each service process serves /metrics, /healthz and /livez; readiness follows its partitions.

A consumer of the test's own holds every partition of the service's group and stops polling,
so the group cannot finish the rebalance the service's arrival starts: the service is not ready
(503, waiting for partitions) until that consumer leaves, then ready (200). Anyone reads each
check's code; the details only the operator token the service is given (a wrong one: 401).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from confluent_kafka import Consumer

from agentruns.connectors.dev.stack.procs import free_port_block
from agentruns.streams.kafka_defaults import KAFKA_LOGS
from agentruns.streams.topics import (
    EVENTS,
    INBOX,
    RESULTS,
    STATE,
    effect_suffix,
    topic_name,
)
from tests.support.waiting import wait_for

PARTITIONS = 2
OPERATOR = "ops_" + secrets.token_urlsafe(32)
AS_OPERATOR = {"Authorization": f"Bearer {OPERATOR}"}
LOG_INFO = ("--log-level", "INFO")

# service -> (module, the topics its group consumes, the metrics its scrape must carry)
SERVICES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "processor": (
        "agentruns.connectors.runtime.processor",
        (INBOX,),
        ("agentruns_transitions_total", "agentruns_active_runs"),
    ),
    "timer": (
        "agentruns.connectors.runtime.timers",
        (effect_suffix("timer"),),
        ("agentruns_timer_records_total", "agentruns_timers_fired_total"),
    ),
    "executor-model": (
        "agentruns.connectors.executors.model",
        (effect_suffix("model"),),
        ("agentruns_executor_call_seconds", "agentruns_executor_transactions_total"),
    ),
    "sink": (
        "agentruns.connectors.projection.sink",
        (EVENTS, STATE, RESULTS),
        ("agentruns_sink_events_total", "agentruns_sink_batch_seconds"),
    ),
}


def _hold(bootstrap: str, group: str, topics: list[str]) -> Consumer:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            **KAFKA_LOGS,
            "group.id": group,
            "enable.auto.commit": False,
            # the strategy every service's consumer also offers
            "partition.assignment.strategy": "range",
            "max.poll.interval.ms": 120_000,
            "session.timeout.ms": 60_000,
            "log_level": 3,
        }
    )
    consumer.subscribe(topics)
    wait_for(
        lambda: consumer.poll(0.2) is None and len(consumer.assignment()) > 0,
        timeout=60,
        what="the holder's partitions",
    )
    return consumer


def _get(url: str, headers: dict[str, str] | None = None) -> httpx.Response | None:
    try:
        return httpx.get(url, headers=headers, timeout=10)
    except httpx.TransportError:
        return None  # not serving yet


@pytest.mark.timeout(240)
@pytest.mark.parametrize("service", list(SERVICES))
def test_readiness_goes_from_503_to_200_once_partitions_are_assigned(
    service: str, kafka_bootstrap: str, database_url: str, prefix: str
) -> None:
    module, suffixes, metrics = SERVICES[service]
    group = f"{prefix}-{service}"
    topics = [topic_name(s, prefix) for s in suffixes]
    held = _hold(kafka_bootstrap, group, topics)
    port = free_port_block(1, start=29100)
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "DATABASE_URL": database_url}
    env["AGENTRUNS_METRICS_ADDRESS"] = f"127.0.0.1:{port}"
    env["AGENTRUNS_API_OPERATOR_TOKENS"] = f"ops:{OPERATOR}"
    for name in ("AGENTRUNS_API_TOKEN", "AGENTRUNS_API_CREDENTIALS"):
        env.pop(name, None)
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{prefix}-{service}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *("--prefix", prefix, "--group", group), *LOG_INFO],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:
        waiting = wait_for(
            lambda: (
                (r := _get(f"{base}/healthz")) is not None
                and r.status_code == 503
                and r.json()["reason"] == "waiting_for_partitions"
                and r
            ),
            timeout=90,
            what=f"{service} waiting for its partitions",
        )
        assert waiting.json() == {
            "component": service,
            "status": "not ready",
            "checks": {"kafka": "ok", "postgres": "ok", "consumer": "waiting_for_partitions"},
            "reason": "waiting_for_partitions",
        }
        detailed = httpx.get(f"{base}/healthz", headers=AS_OPERATOR, timeout=10).json()
        assert detailed["checks"]["consumer"]["detail"].startswith("waiting for partitions")
        assert group in detailed["checks"]["consumer"]["detail"] and group not in waiting.text
        wrong = {"Authorization": "Bearer " + secrets.token_urlsafe(32)}
        assert httpx.get(f"{base}/healthz", headers=wrong, timeout=10).status_code == 401
        assert httpx.get(f"{base}/livez", timeout=10).json()["status"] == "running"

        held.close()  # leaves the group: the rebalance completes without it
        ready = wait_for(
            lambda: (r := _get(f"{base}/healthz")) is not None and r.status_code == 200 and r,
            timeout=90,
            what=f"{service} ready",
        )
        assert ready.json()["status"] == "ready" and ready.json()["checks"]["consumer"] == "ok"
        detailed = httpx.get(f"{base}/healthz", headers=AS_OPERATOR, timeout=10).json()
        assert detailed["checks"]["consumer"]["detail"].endswith("partitions assigned")

        scrape = httpx.get(f"{base}/metrics", timeout=10)
        assert scrape.status_code == 200
        for name in metrics:
            assert name in scrape.text, name
        assert httpx.get(f"{base}/nope", timeout=10).status_code == 404
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        with contextlib.suppress(RuntimeError):  # closed already
            held.close()
    assert proc.returncode == 0, log_path.read_text()[-2000:]
    lines = [line for line in log_path.read_text().splitlines() if line.strip()]
    assert lines and all(line.startswith("{") for line in lines), lines[:5]

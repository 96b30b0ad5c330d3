"""Signed tenant headers against the real broker: a processor that takes the `agentruns-tenant`
header only with its signature puts a signed task in its tenant, dead-letters a forged, a
replayed and a body-named tenant, goes on with the next record, and believes the API's tenants
(the API signs them)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import Producer

from agentruns.connectors.api.client import RunsProducer, main_submit, task_input
from agentruns.connectors.api.inputs import MAX_RECORD_BYTES, encoded_input
from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.keys import processor_tenant_keys, tenant_header_root, tenant_kafka_key
from agentruns.streams import dlq
from agentruns.streams.kafka_defaults import release
from agentruns.streams.processor import ProcessorConfig
from agentruns.streams.tenant_headers import SIGNATURE_HEADER, TENANT_HEADER
from agentruns.streams.topics import DLQ, EVENTS, INBOX, topic_name
from tests.support.api import (
    CREDENTIALS,
    OPERATOR_TOKEN,
    SECRET,
    TENANT_A,
    TENANT_B,
    Stack,
    pipeline,
)
from tests.support.pipeline import read_all, read_raw, running_processor
from tests.support.waiting import wait_for

#: One partition: the records are handled in the order they are produced, so "the next one"
#: is the next record of the same partition.
PARTITIONS = 1
ROOT = tenant_header_root(b"tenant-headers-integration-secret")
TASK = {"goal": "find three documents", "messages": [{"role": "user", "content": "go"}]}


def _tenants(bootstrap: str, prefix: str) -> dict[str, str]:
    """run_id -> the tenant its RunSubmitted event names (absent: the default tenant)."""
    out: dict[str, str] = {}
    for r in read_all(bootstrap, topic_name(EVENTS, prefix), "Event"):
        if r.value["type"] == "RunSubmitted" and r.value["disposition"] == "APPLIED":
            out[str(r.value["run_id"])] = json.loads(str(r.value["body"])).get("tenant", "default")
    return out


def _producer(bootstrap: str, prefix: str, name: str, tenant: str | None, key: bytes | None) -> Any:
    return RunsProducer(
        bootstrap,
        producer_id=name,
        prefix=prefix,
        partitions=PARTITIONS,
        tenant=tenant,
        tenant_key=key,
    )


def test_a_signed_task_lands_in_its_tenant_and_forged_ones_are_dead_lettered(
    kafka_bootstrap: str, database_url: str, prefix: str
) -> None:
    config = ProcessorConfig(
        bootstrap=kafka_bootstrap,
        prefix=prefix,
        group_id=f"{prefix}-proc",
        default_tenant="upstream",
        tenant_header="signed",
        tenant_key=processor_tenant_keys(ROOT.hex(), ""),  # the root, not the secret
    )
    shop, ops = tenant_kafka_key(ROOT, "shop"), tenant_kafka_key(ROOT, "ops")
    inbox = topic_name(INBOX, prefix)
    with running_processor(config, database_url) as proc:
        with _producer(kafka_bootstrap, prefix, "shop-svc", "shop", shop) as p:
            good = p.submit(TASK, idempotency_key="order-1").run_id
        # a producer of ops that names shop: ops's key does not sign for shop
        with _producer(kafka_bootstrap, prefix, "ops-svc", "shop", ops) as p:
            forged = p.submit(TASK, idempotency_key="order-2").run_id
        # shop's signed headers copied onto another record
        (signed,) = [r for r in read_raw(kafka_bootstrap, inbox) if r.key == good.encode()]
        copied = [(k, v) for k, v in signed.headers if k in (TENANT_HEADER, SIGNATURE_HEADER)]
        assert len(copied) == 2
        replay, record = task_input(TASK, idempotency_key="order-3", producer_id="replayer")
        raw = Producer({"bootstrap.servers": kafka_bootstrap, "log_level": 3})
        try:
            value = encoded_input(record, MAX_RECORD_BYTES)
            raw.produce(inbox, key=replay.run_id.encode(), value=value, headers=copied)
            assert raw.flush(30) == 0
        finally:
            release(raw, 5)
        # an unsigned producer that names a tenant in the task itself
        with _producer(kafka_bootstrap, prefix, "plain", None, None) as p:
            named = p.submit({**TASK, "tenant": "shop"}, idempotency_key="order-4").run_id
            unsigned = p.submit(TASK, idempotency_key="order-5").run_id
        with _producer(kafka_bootstrap, prefix, "ops-svc", "ops", ops) as p:
            after = p.submit(TASK, idempotency_key="order-6").run_id
        wait_for(
            lambda: after in _tenants(kafka_bootstrap, prefix) and proc.stats.dead_letters >= 3,
            timeout=60,
            what="the signed tasks and the dead letters",
        )
    tenants = _tenants(kafka_bootstrap, prefix)
    assert tenants == {good: "shop", unsigned: "upstream", after: "ops"}
    dead = {
        str(r.value["run_id"]): r.value
        for r in read_all(kafka_bootstrap, topic_name(DLQ, prefix), "DeadLetter")
    }
    assert set(dead) == {forged, replay.run_id, named}
    for run_id in (forged, replay.run_id):
        reason = str(dead[run_id]["reason"])
        assert dead[run_id]["error_class"] == dlq.INVALID_EVENT
        assert "tenant shop" in reason and "signature" in reason, reason
    assert "without a signed agentruns-tenant header" in str(dead[named]["reason"])
    assert proc.stats.aborts == 0


@pytest.fixture(scope="module")
def signed_stack(kafka_bootstrap: str, database_url: str) -> Iterator[Stack]:
    """The API's stack with a processor that takes signed tenant headers only, holding the
    tenant-header root of the API's secret."""
    options = {"tenant_header": "signed", "tenant_key": processor_tenant_keys("", SECRET.decode())}
    with pipeline(kafka_bootstrap, database_url, processor_options=options) as s:
        yield s


def test_the_api_signs_the_tenant_of_its_submissions(signed_stack: Stack) -> None:
    token = CREDENTIALS["a-submit"][2]
    with signed_stack.client(token) as client:
        r = client.post("/runs", json=TASK, headers={"Idempotency-Key": "signed-by-api"})
        assert r.status_code in (200, 202), r.text
        run_id = r.json()["run_id"]
    with signed_stack.client(OPERATOR_TOKEN) as admin:
        wait_for(
            lambda: admin.get(f"/runs/{run_id}").status_code == 200,
            timeout=60,
            what="the run projected",
        )
        assert admin.get(f"/runs/{run_id}").json()["tenant"] == TENANT_A
    inbox = topic_name(INBOX, signed_stack.prefix)
    # the run's first inbox record is its submission; the executors' answers may follow it
    record, *_ = [r for r in read_raw(signed_stack.bootstrap, inbox) if r.key == run_id.encode()]
    assert (TENANT_HEADER, TENANT_A.encode()) in record.headers


def test_agentruns_submit_signs_for_its_tenant_with_the_kafka_key(
    signed_stack: Stack, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", signed_stack.bootstrap)
    monkeypatch.delenv("AGENTRUNS_API_URL", raising=False)
    monkeypatch.delenv("AGENTRUNS_TENANT_KAFKA_KEY", raising=False)
    argv = ["--key", "cli-signed", "--goal", "g", "--prefix", signed_stack.prefix]
    with pytest.raises(AgentrunsError, match="AGENTRUNS_TENANT_KAFKA_KEY"):
        main_submit([*argv, "--tenant", TENANT_B])
    root = tenant_header_root(SECRET)
    monkeypatch.setenv("AGENTRUNS_TENANT_KAFKA_KEY", tenant_kafka_key(root, TENANT_B).hex())
    assert main_submit([*argv, "--tenant", TENANT_B]) == 0
    run_id = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_id"]
    with signed_stack.client(OPERATOR_TOKEN) as admin:
        wait_for(
            lambda: admin.get(f"/runs/{run_id}").status_code == 200,
            timeout=60,
            what="the run projected",
        )
        assert admin.get(f"/runs/{run_id}").json()["tenant"] == TENANT_B

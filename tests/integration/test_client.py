"""The users' paths: RunsProducer upstream, ResultsConsumer downstream, ApiClient and the
`agentruns submit | results | reply | cancel` entry points, against the real pipeline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from agentruns.connectors.api.client import (
    ApiClient,
    ClientError,
    InvalidInputError,
    ResultsConsumer,
    RunsProducer,
    main_cancel,
    main_reply,
    main_results,
    main_submit,
)
from agentruns.connectors.errors import AgentrunsError
from agentruns.processors.ids import run_id_for_key
from agentruns.streams.topics import DLQ, INBOX, topic_name
from tests.support.api import GUARDED, TOKEN, Stack
from tests.support.pipeline import SEARCH, now_ms, read_all

TASK = {"goal": "find three documents", "tools": [SEARCH.model_dump(mode="json")]}


def test_producer_submits_idempotently_and_the_consumer_yields_each_result_once(
    stack: Stack,
) -> None:
    at = now_ms()
    keys = [f"batch-{uuid.uuid4().hex}" for _ in range(3)]
    with RunsProducer(stack.bootstrap, producer_id="orders", prefix=stack.prefix) as producer:
        subs = [producer.submit(TASK, idempotency_key=k, at=at) for k in keys]
        again = producer.submit(TASK, idempotency_key=keys[0], at=at)  # a retry after a crash
    assert again == subs[0]
    wanted = {s.run_id for s in subs}
    group = f"{stack.prefix}-downstream"
    got: dict[str, str] = {}
    with ResultsConsumer(stack.bootstrap, group_id=group, prefix=stack.prefix) as consumer:
        for result in consumer.results(follow=True):
            got[result.run_id] = result.status.value
            if wanted <= set(got):
                consumer.ack(result)  # handled: not delivered again
                break
    assert {r: got[r] for r in wanted} == dict.fromkeys(wanted, "SUCCEEDED")
    # Offsets were committed: the same group sees nothing of these again.
    with ResultsConsumer(stack.bootstrap, group_id=group, prefix=stack.prefix) as consumer:
        replay = [r.run_id for r in consumer.results(follow=False, idle_timeout_s=15)]
    assert not wanted & set(replay)
    client = ApiClient(stack.url, TOKEN)
    try:
        run = client.wait(subs[0].run_id, timeout_s=30)
        assert run["status"] == "SUCCEEDED" and run["result"]["result_ref"]
        events = client.events(subs[0].run_id)["events"]
        assert [e["type"] for e in events].count("RunSubmitted") == 1
    finally:
        client.close()
    # the byte-identical retry was dropped as an exact duplicate, not dead-lettered
    dead = read_all(stack.bootstrap, topic_name(DLQ, stack.prefix), "DeadLetter")
    assert not [d for d in dead if d.value.get("run_id") in wanted]


def test_cli_submit_results_reply_and_cancel(
    stack: Stack,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", stack.bootstrap)
    monkeypatch.setenv("AGENTRUNS_API_TOKEN", TOKEN)
    key = f"cli-{uuid.uuid4().hex}"
    task_file = tmp_path / "task.json"
    task_file.write_text(json.dumps(TASK))
    argv = ["--key", key, "--task", str(task_file), "--goal", "cli goal", "--prefix", stack.prefix]
    assert main_submit(argv) == 0
    submitted = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    run_id = submitted["run_id"]
    run = stack.wait_status(run_id, "SUCCEEDED")
    assert run["goal"] == "cli goal"

    # a run that asks for approval, answered with `agentruns reply` (token read from the run)
    task = {**TASK, "tools": [GUARDED.model_dump(mode="json")]}
    task["policy"] = {"approval_required": ["write"]}
    client = ApiClient(stack.url, TOKEN)
    try:
        asked = client.submit(task, idempotency_key=f"cli-ask-{uuid.uuid4().hex}")["run_id"]
        token = stack.wait_status(asked, "WAITING_USER")["question"]["resume_token"]
        api = ["--api-url", stack.url]
        assert main_reply([asked, "--response", '{"approved": true}', *api]) == 0
        assert json.loads(capsys.readouterr().out)["accepted"] is True
        with pytest.raises(ClientError) as err:  # the token is now used up
            client.reply(asked, token, {"approved": True})
        assert err.value.status == 409 and err.value.code == "token_used"
    finally:
        client.close()
    stack.wait_status(asked, "SUCCEEDED")

    # cancel through the API: a run already terminal is refused with 409 (exit code 2 via cli)
    with pytest.raises(ClientError) as refused:
        main_cancel([run_id, "--api-url", stack.url])
    assert refused.value.status == 409

    group = f"{stack.prefix}-cli"
    assert main_results(["--prefix", stack.prefix, "--group", group]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert {run_id, asked} <= {x["run_id"] for x in lines}


def test_the_producer_refuses_a_task_the_core_would_refuse_and_produces_nothing(
    stack: Stack,
) -> None:
    search = SEARCH.model_dump(mode="json")
    big = [{"role": "user", "content": "m" * 200_000} for _ in range(5)]
    cases: dict[str, tuple[dict[str, Any], str]] = {
        "duplicate": ({**TASK, "tools": [search, search]}, "invalid_input:duplicate_tool"),
        "schema": (
            {**TASK, "tools": [{**search, "parameters": {"type": 12}}]},
            "invalid_input:tool_schema",
        ),
        "deadline": (
            {**TASK, "budgets": {"deadline_at": 2**63}},
            "invalid_input:integer_out_of_range",
        ),
        "type": ({**TASK, "goal": 7}, "invalid_input:task"),
        "surrogate": ({**TASK, "goal": "half \ud800 a pair"}, "invalid_input:encoding"),
        "record": ({**TASK, "messages": big}, "invalid_input:record_too_large"),
    }
    keys = {name: f"refused-{name}-{uuid.uuid4().hex}" for name in cases}
    with RunsProducer(stack.bootstrap, producer_id="refusing", prefix=stack.prefix) as producer:
        for name, (task, reason) in cases.items():
            with pytest.raises(InvalidInputError) as refused:
                producer.submit(task, idempotency_key=keys[name])
            assert isinstance(refused.value, AgentrunsError)
            assert refused.value.reason.startswith(reason), (name, refused.value.reason)
        good = producer.submit(TASK, idempotency_key=f"good-after-refusals-{uuid.uuid4().hex}")
    with (
        RunsProducer(
            stack.bootstrap, producer_id="small", prefix=stack.prefix, max_record_bytes=2_000
        ) as small,
        pytest.raises(InvalidInputError) as too_large,
    ):
        small.submit({**TASK, "goal": "g" * 3_000}, idempotency_key=f"small-{uuid.uuid4()}")
    assert too_large.value.reason.startswith("invalid_input:record_too_large")
    stack.wait_status(good.run_id, "SUCCEEDED")
    produced = {
        str(r.value["run_id"])
        for r in read_all(stack.bootstrap, topic_name(INBOX, stack.prefix), "Input")
    }
    assert good.run_id in produced
    assert not {run_id_for_key(k) for k in keys.values()} & produced


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_results_follow_ends_cleanly_on_a_signal_even_with_sigint_ignored(
    kafka_bootstrap: str, prefix: str, signum: int
) -> None:
    # A shell's background job inherits SIGINT ignored; Ctrl-C or a supervisor's SIGTERM must
    # still end the follow, its offsets committed, exit 0.
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "AGENTRUNS_TOPIC_PREFIX": prefix,
    }
    with subprocess.Popen(
        [sys.executable, "-m", "agentruns.connectors.cli", "results", "--follow"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    ) as proc:
        try:
            time.sleep(3)  # subscribed and polling
            assert proc.poll() is None
            proc.send_signal(signum)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err

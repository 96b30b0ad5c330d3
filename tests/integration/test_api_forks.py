"""Forks and resumes through the API and the client library (`POST /runs/{id}/fork|resume`,
`ApiClient.fork|resume`): processor, sink, executor double and API on one prefix. The lineage
shows both ways on `GET /runs/{id}`; one key is one fork; the hostile cases end as they must,
with nothing produced."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentruns.connectors.api.client import ApiClient, ClientError
from agentruns.connectors.dev.servers.hostile import Doors, cases, check, inject, positions
from agentruns.processors.ids import run_id_for_key
from agentruns.streams.topics import topic_name
from tests.support.api import CREDENTIALS, OPERATOR, OPERATOR_TOKEN, PARTITIONS, TOKEN, Stack
from tests.support.console import csrf_of, logged_in
from tests.support.pipeline import read_all
from tests.support.waiting import wait_for


@pytest.fixture
def operator(stack: Stack) -> Iterator[ApiClient]:
    client = ApiClient(stack.url, OPERATOR_TOKEN)
    yield client
    client.close()


def ended(stack: Stack, key: str, **task: Any) -> tuple[str, dict[str, Any]]:
    run_id = stack.submit(key, **task)
    run = stack.wait_status(
        run_id, "SUCCEEDED", "FAILED", "BUDGET_EXHAUSTED", "EXPIRED", "CANCELLED"
    )
    return run_id, run


def test_a_fork_through_the_client_runs_and_shows_its_lineage_both_ways(
    stack: Stack, operator: ApiClient
) -> None:
    run_id, source = ended(stack, f"api-fork-{uuid.uuid4().hex}")
    assert source["status"] == "SUCCEEDED" and source["forks"] == []
    assert source["forked_from"] is None
    key = f"api-fork-of-{run_id}"
    answer = operator.fork(run_id, 2, model_route="other", idempotency_key=key)
    assert answer["created"] is True and answer["run_id"] == run_id_for_key(key)
    assert (answer["source_run_id"], answer["source_seq"]) == (run_id, 2)
    assert answer["actor"] == f"operator:{OPERATOR}" and answer["action"] == "fork"
    fork = stack.wait_status(answer["run_id"], "SUCCEEDED")
    assert fork["forked_from"] == {
        "source_run_id": run_id,
        "source_seq": 2,
        "edits": {"model_route": "other", "messages": [], "replaced_inputs": [], "budgets": None},
    }
    events = stack.http.get(f"/runs/{answer['run_id']}/events").json()["events"]
    assert events[0]["type"] == "ForkedFrom" and events[0]["payload"]["actor"] == answer["actor"]
    shown = stack.run(run_id)
    assert shown["forks"] == [{"run_id": answer["run_id"], "seq": 2, "status": "SUCCEEDED"}]
    # the same key: the same fork, nothing new produced
    again = operator.fork(run_id, 2, model_route="other", idempotency_key=key)
    assert again["created"] is False and again["run_id"] == answer["run_id"]
    # the same request through the raw API answers 200 for the repeat
    r = httpx.post(
        f"{stack.url}/runs/{run_id}/fork",
        json={"at": 2, "model_route": "other"},
        headers={"Authorization": f"Bearer {OPERATOR_TOKEN}", "Idempotency-Key": key},
    )
    assert r.status_code == 200 and r.json()["run_id"] == answer["run_id"]


def test_a_fork_through_the_api_may_replace_a_record_before_its_point(
    stack: Stack, operator: ApiClient
) -> None:
    run_id, _ = ended(stack, f"api-replace-{uuid.uuid4().hex}")
    events = stack.http.get(f"/runs/{run_id}/events").json()["events"]
    third = events[2]["payload"]
    body = {"at": 3, "replace_inputs": [{"seq": 3, "event": third}]}
    answer = operator._operator(run_id, "fork", body, f"replace-{run_id}")
    assert answer["edits"]["replaced_inputs"][0]["seq"] == 3
    stack.wait_status(answer["run_id"], "SUCCEEDED")
    other = {**third, "run_id": "run-other"}
    for replacement, status in (
        ({"seq": 3, "event": other}, 409),  # another run's record
        ({"seq": 4, "event": third}, 409),  # after the fork point
        ({"seq": 3, "event": {"type": "Nothing"}}, 409),  # not an event
        ({"seq": 3, "event": "text"}, 422),  # not an object
    ):
        with pytest.raises(ClientError) as caught:
            operator._operator(run_id, "fork", {"at": 3, "replace_inputs": [replacement]}, None)
        assert caught.value.status == status, (replacement, caught.value)


def test_resume_of_a_budget_stop_forks_before_the_stop(stack: Stack, operator: ApiClient) -> None:
    run_id, source = ended(stack, f"api-budget-{uuid.uuid4().hex}", budgets={"max_steps": 1})
    assert source["status"] == "BUDGET_EXHAUSTED", source
    answer = operator.resume(run_id)
    last = source["last_seq"]
    assert answer["action"] == "resume" and answer["source_seq"] == last - 1
    fork = stack.wait_status(answer["run_id"], "BUDGET_EXHAUSTED")  # the same budget: it stops
    assert fork["forked_from"]["source_run_id"] == run_id
    assert operator.resume(run_id)["run_id"] == answer["run_id"]  # one resume per point
    # with a raised budget it goes on to the end, keeping what the source spent
    more = operator.resume(run_id, budgets={"max_steps": 20})
    assert more["run_id"] != answer["run_id"] and more["source_seq"] == last - 1
    assert more["edits"]["budgets"]["max_steps"] == 20
    done = stack.wait_status(more["run_id"], "SUCCEEDED")
    assert done["forked_from"]["edits"]["budgets"]["max_steps"] == 20
    # from an earlier seq than the failure, and never after it
    earlier = operator.resume(run_id, from_seq=1, budgets={"max_steps": 20})
    assert earlier["source_seq"] == 1
    with pytest.raises(ClientError, match="after the failure"):
        operator.resume(run_id, from_seq=last)


def test_hostile_forks_are_refused_and_nothing_is_produced(
    stack: Stack, operator: ApiClient
) -> None:
    run_id, source = ended(stack, f"api-hostile-{uuid.uuid4().hex}")
    last = source["last_seq"]

    def refused(status: int, error: str, call: Any) -> str:
        with pytest.raises(ClientError) as caught:
            call()
        assert caught.value.status == status, caught.value
        assert error in str(caught.value), caught.value
        return str(caught.value)

    refused(404, "no run", lambda: operator.fork("run-missing", 1))
    refused(404, "no run", lambda: operator.resume("run-missing"))
    refused(409, f"(1..{last})", lambda: operator.fork(run_id, last + 1))
    refused(422, "invalid_body", lambda: operator.fork(run_id, 0))
    refused(409, "SUCCEEDED", lambda: operator.resume(run_id))
    refused(
        422, "invalid_body", lambda: operator._operator(run_id, "fork", {"at": 1, "x": 1}, None)
    )
    refused(422, "invalid_body", lambda: operator._operator(run_id, "resume", {"at": 1}, None))
    refused(422, "invalid_body", lambda: operator.fork(run_id, 1, model_route="r" * 600))
    refused(400, "Idempotency-Key", lambda: operator.fork(run_id, 1, idempotency_key="k" * 300))
    refused(409, "never lowers them", lambda: operator.fork(run_id, 1, budgets={"max_steps": 0}))
    refused(422, "invalid_body", lambda: operator.fork(run_id, 1, budgets={"max_steps": -1}))
    refused(422, "invalid_body", lambda: operator.fork(run_id, 1, budgets={"spend": 5}))
    refused(422, "invalid_body", lambda: operator.fork(run_id, 1, budgets={"max_tokens": 10**30}))
    refused(409, "fork_refused", lambda: operator.fork(run_id, 1, budgets={"deadline_at": 1}))
    refused(409, "SUCCEEDED", lambda: operator.resume(run_id, cancelled=True))
    # a credential without the submit role cannot fork
    with stack.client(CREDENTIALS["a-read"][2]) as reader:
        r = reader.post(f"/runs/{run_id}/fork", json={"at": 1})
    assert r.status_code == 403, r.text
    assert stack.run(run_id)["forks"] == []
    # a fork of a fork of a fork names its direct source
    source_id = run_id
    for generation in range(3):
        answer = operator.fork(source_id, 1, idempotency_key=f"{run_id}-g{generation}")
        assert answer["source_run_id"] == source_id
        fork = stack.wait_status(answer["run_id"], "SUCCEEDED")
        assert fork["forked_from"]["source_run_id"] == source_id
        wait_for(
            lambda s=source_id, f=answer["run_id"]: (
                [x["run_id"] for x in stack.run(s)["forks"]] == [f]
            ),
            30,
            "the source's forks",
        )
        source_id = answer["run_id"]


def test_the_hostile_fork_cases_end_as_they_must(stack: Stack) -> None:
    """The fork cases of the hostile suite (`agentruns chaos --hostile` runs them beside good
    runs), here against the API and the processor alone."""
    doors = Doors(
        stack.bootstrap,
        stack.prefix,
        PARTITIONS,
        "http://unused",
        "http://unused",
        (),
        api_url=stack.url,
        api_token=TOKEN,
        operator_token=OPERATOR_TOKEN,
    )
    fork_cases = [c for c in cases(api=True) if "fork" in c.name or "resume" in c.name]
    assert len(fork_cases) == 5
    dlq_topic = topic_name("dlq", stack.prefix)
    try:
        injected = [(c, inject(c, doors, f"hostile-{uuid.uuid4().hex}")) for c in fork_cases]
        doors.flush()

        def dead_letters() -> dict[tuple[str, int, int], list[Any]] | None:
            found = positions(r.value for r in read_all(stack.bootstrap, dlq_topic, "DeadLetter"))
            want = [i.position for _, i in injected if i.position is not None]
            return found if all(p in found for p in want) else None

        letters = wait_for(dead_letters, 60, "the dead letters of the fork records")
        for case, done in injected:
            assert check(case, done, {}, letters) is None, (case.name, done)
    finally:
        doors.close()


def test_the_console_shows_the_lineage_and_forks_for_an_operator(stack: Stack) -> None:
    run_id, _ = ended(stack, f"console-fork-{uuid.uuid4().hex}")
    with logged_in(stack) as viewer:  # submit and read, not an admin
        page = viewer.get(f"/ui/runs/{run_id}")
        assert page.status_code == 200 and 'id="fork"' not in page.text
    with logged_in(stack, CREDENTIALS["a-read"][2]) as reader:  # no submit role
        page = reader.get("/ui/runs")
        refused = reader.post(f"/ui/runs/{run_id}/fork", data={"csrf": csrf_of(page.text)})
        assert refused.status_code == 403
    with logged_in(stack, OPERATOR_TOKEN) as operator:
        page = operator.get(f"/ui/runs/{run_id}")
        assert 'id="fork"' in page.text and 'id="resume"' not in page.text  # it succeeded
        form = {"csrf": csrf_of(page.text), "at": "2", "model_route": "console-route"}
        done = operator.post(f"/ui/runs/{run_id}/fork", data=form)
        assert done.status_code == 303, done.text
        fork_id = done.headers["location"].rsplit("/", 1)[1]
        stack.wait_status(fork_id, "SUCCEEDED")
        page = operator.get(f"/ui/runs/{fork_id}")
        assert 'id="forked-from"' in page.text and run_id in page.text
        assert "console-route" in page.text
        wait_for(
            lambda: fork_id in operator.get(f"/ui/runs/{run_id}").text, 30, "the source's forks"
        )
        bad = operator.post(f"/ui/runs/{run_id}/fork", data={**form, "at": "999999"})
        assert bad.status_code == 409 and "outside" in bad.text


def test_each_step_of_a_transcript_forks_before_its_answer_for_an_operator(stack: Stack) -> None:
    """The transcript offers an operator "fork here" on every step, at the record before the
    step's first answer (the state then waits for the model); a viewer is offered none."""
    run_id, _ = ended(stack, f"transcript-fork-{uuid.uuid4().hex}")
    with logged_in(stack) as viewer:
        html = viewer.get(f"/ui/runs/{run_id}/transcript").text
        assert "fork-here" not in html and "The model answered" in html
    with logged_in(stack, OPERATOR_TOKEN) as operator:
        html = operator.get(f"/ui/runs/{run_id}/transcript").text
        answers = [int(s) for s in re.findall(r"The model answered <small>[^<]*seq (\d+)<", html)]
        offered = [int(s) for s in re.findall(r'name="at" value="(\d+)"', html)]
        assert len(answers) >= 2 and offered == [seq - 1 for seq in answers]
        assert "resume-here" not in html  # it succeeded
        form = {"csrf": csrf_of(html), "at": str(offered[1])}
        done = operator.post(f"/ui/runs/{run_id}/fork", data=form)
        assert done.status_code == 303, done.text
        fork_id = done.headers["location"].rsplit("/", 1)[1]
        stack.wait_status(fork_id, "SUCCEEDED")
        fork = operator.get(f"/ui/runs/{fork_id}/transcript")
        assert fork.status_code == 200 and "The model answered" in fork.text

"""The operator's catalog changing while the components run, against the real broker,
Postgres, the example MCP server as a process and a real tool executor: a refresh on its
schedule reaches the API, `RunsProducer` and the processor (a tool of a removed MCP server is
refused at every door); a server that is down keeps the catalog it had; and the tool executor
holds each call to the catalog as it is at call time, whatever the run was checked against."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentruns.connectors.api.client import InvalidInputError, RunsProducer
from agentruns.connectors.catalog import CatalogRefresher, configured_catalog
from agentruns.connectors.executors.config import ExecutorConfig
from agentruns.connectors.executors.tool import ToolExecutor
from agentruns.processors.effects import CallModel
from agentruns.processors.events import (
    Candidate,
    Event,
    ModelCallCompleted,
    ModelOutcome,
    ToolCallRequest,
)
from agentruns.processors.ids import run_id_for_key
from agentruns.processors.state import ToolSpec
from agentruns.streams.clock import now_ms
from agentruns.streams.records import input_record
from tests.integration.test_mcp_tools import ServerProcess
from tests.support.api import PARTITIONS, ScriptedDouble, Stack, pipeline
from tests.support.pipeline import Inbox, running_on_thread, submitted
from tests.support.waiting import wait_for

LOOKUP = "shop__lookup_order"
NOTE = "shop__set_order_note"
REFRESH_S = 1.0


class CallingDouble(ScriptedDouble):
    """The model executor's double only (a real tool executor answers the tool effects): the
    first model call of a run in `calls` calls that tool, at once or, for a run in `holding`,
    when the test releases it; the next one is the final answer."""

    def __init__(self, bootstrap: str, prefix: str) -> None:
        super().__init__(bootstrap, prefix, kinds=("model",))
        self.calls: dict[str, tuple[str, dict[str, Any]]] = {}
        self.holding: set[str] = set()
        self.held: dict[str, CallModel] = {}

    def answer(self, effect: Any) -> Iterable[Event]:
        first = isinstance(effect, CallModel) and (effect.step, effect.attempt) == (1, 1)
        if first and effect.run_id in self.calls:
            if effect.run_id in self.holding:
                self.held[effect.run_id] = effect
            else:
                yield self.calling(effect)
            return
        yield from super().answer(effect)

    def calling(self, effect: CallModel) -> ModelCallCompleted:
        tool, arguments = self.calls[effect.run_id]
        call = ToolCallRequest(id="c1", name=tool, arguments_json=json.dumps(arguments))
        return ModelCallCompleted(
            run_id=effect.run_id,
            event_id=f"{effect.idempotency_key}:result",
            trace_id=effect.trace_id,
            at=now_ms(),
            step=effect.step,
            attempt=effect.attempt,
            outcome=ModelOutcome.FINISHED,
            candidate_ref="sha256:" + "c" * 64,
            candidate=Candidate(tool_calls=(call,)),
        )

    def release(self, run_id: str) -> None:
        effect = wait_for(lambda: self.held.get(run_id), 30, f"{run_id}'s first model call")
        self.inbox.send(input_record(self.calling(effect)))
        self.inbox.flush()


@dataclass
class LiveEnv:
    stack: Stack
    double: CallingDouble
    server: ServerProcess
    registry: Path
    refresher: CatalogRefresher
    original: str

    def write(self, data: dict[str, Any]) -> None:
        self.registry.write_text(json.dumps(data))

    def refreshed(self, check: Any, what: str) -> None:
        """Wait for the scheduled refresh to take a catalog for which ``check`` holds."""
        wait_for(lambda: check(self.refresher.catalog), 30, what)


@pytest.fixture(scope="module")
def live(
    kafka_bootstrap: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveEnv]:
    tmp = tmp_path_factory.mktemp("catalive")
    server = ServerProcess(tmp)
    server.start()
    registry = tmp / "registry.json"
    entry = {"name": "shop", "url": f"{server.url}/mcp", "timeout_ms": 1500}
    original = json.dumps({"version": "live-1", "mcp_servers": [entry]})
    registry.write_text(original)
    catalog = configured_catalog(registry, component="test")
    assert catalog is not None and LOOKUP in catalog.tools
    doubles: list[CallingDouble] = []

    def make_double(bootstrap: str, prefix: str) -> CallingDouble:
        doubles.append(CallingDouble(bootstrap, prefix))
        return doubles[0]

    try:
        with pipeline(
            kafka_bootstrap, database_url, catalog=catalog, make_double=make_double
        ) as stack:
            config = ExecutorConfig(kafka_bootstrap, database_url, "tool", prefix=stack.prefix)
            executor = ToolExecutor(config, registry, catalog_refresh_s=REFRESH_S)
            refresher = CatalogRefresher(
                registry, catalog, stack.set_catalog, component="test", interval_s=REFRESH_S
            ).start()
            try:
                with running_on_thread(executor.run, "tool-executor"):
                    yield LiveEnv(stack, doubles[0], server, registry, refresher, original)
            finally:
                refresher.stop()
    finally:
        server.stop()
        server.http.close()


@pytest.fixture
def env(live: LiveEnv) -> Iterator[LiveEnv]:
    if live.server.process is None or live.server.process.poll() is not None:
        live.server.start()
    live.server.http.delete("/faults").raise_for_status()
    live.registry.write_text(live.original)
    live.refreshed(lambda c: LOOKUP in c.tools and not c.tools[LOOKUP].approval_required, "start")
    yield live


def _submit_with(env: LiveEnv, tool: str, arguments: dict[str, Any], *, hold: bool) -> str:
    key = f"live-{uuid.uuid4().hex}"
    run_id = run_id_for_key(key)  # scripted before its first model call can come
    env.double.calls[run_id] = (tool, arguments)
    if hold:
        env.double.holding.add(run_id)
    assert env.stack.submit(key, tools=[{"name": tool}]) == run_id
    return run_id


def test_a_refresh_against_a_dead_server_keeps_the_catalog_it_had(env: LiveEnv) -> None:
    before = env.refresher.catalog
    assert env.server.process is not None
    env.server.stop()
    assert env.refresher.refresh() == "unanswered"
    assert env.refresher.catalog is before  # the same tools: the same version, kept
    # the API still takes a task naming the server's tool, checked against that version
    run_id = env.stack.submit(f"live-dead-{uuid.uuid4().hex}", tools=[{"name": LOOKUP}])
    version = wait_for(lambda: env.stack.run(run_id).get("catalog_version"), 30, "the run")
    assert version == before.version
    env.server.start()


def test_the_executor_refuses_a_call_the_catalog_no_longer_allows(env: LiveEnv) -> None:
    stricter = _submit_with(env, LOOKUP, {"order_id": "o-1"}, hold=True)
    approval = _submit_with(env, NOTE, {"order_id": "o-1", "note": "n"}, hold=True)
    allowed = _submit_with(env, LOOKUP, {"order_id": "o-2"}, hold=False)
    assert env.stack.wait_status(allowed, "SUCCEEDED")["status"] == "SUCCEEDED"
    submitted_under = env.stack.run(stricter)["catalog_version"]
    # submitted and checked; now the operator makes lookup_order a write tool and puts
    # set_order_note under approval
    entry = json.loads(env.original)["mcp_servers"][0]
    entry["tools"] = {
        "lookup_order": {"permission": "write"},
        "set_order_note": {"approval_required": True},
    }
    env.write({"version": "live-2", "mcp_servers": [entry]})
    env.refreshed(lambda c: c.tools[LOOKUP].permission == "write", "the stricter catalog")
    time.sleep(REFRESH_S * 1.5)  # the executor's own reading of the file is due by now
    calls_before = env.server.stats()["calls"]
    env.double.release(stricter)
    env.double.release(approval)
    for run_id, tool in ((stricter, LOOKUP), (approval, NOTE)):
        run = env.stack.wait_status(run_id, "FAILED")
        assert run["outcome"] == f"tool:PERMISSION_DENIED:{tool}"
        assert run["catalog_version"] == submitted_under  # the version it was checked against
    codes = {}
    for run_id in (stricter, approval):
        events = env.stack.http.get(f"/runs/{run_id}/events").json()["events"]
        (failed,) = [e["payload"] for e in events if e["type"] == "ToolCallFailed"]
        failed = json.loads(failed) if isinstance(failed, str) else failed
        codes[run_id] = (failed["error_class"], failed["error_code"])
    assert codes == {
        stricter: ("PERMISSION_DENIED", "permission_stricter"),
        approval: ("PERMISSION_DENIED", "not_approved"),
    }
    assert env.server.stats()["calls"] == calls_before  # neither call reached the server


def test_a_tool_of_a_removed_mcp_server_is_refused_at_every_door(env: LiveEnv) -> None:
    env.write({"version": "live-3", "tools": [], "mcp_servers": []})
    env.refreshed(lambda c: LOOKUP not in c.tools, "the catalog without the MCP server")
    version = env.refresher.catalog.version
    reason = f"invalid_input:tool_not_in_catalog: {LOOKUP}"
    r = env.stack.http.post(
        "/runs",
        json={"goal": "g", "tools": [{"name": LOOKUP}]},
        headers={"Idempotency-Key": f"live-api-{uuid.uuid4().hex}"},
    )
    assert r.status_code == 422 and r.json()["reason"] == reason, r.text
    with (
        RunsProducer(
            env.stack.bootstrap,
            producer_id="live-test",
            prefix=env.stack.prefix,
            partitions=PARTITIONS,
            catalog=env.refresher.catalog,
        ) as producer,
        pytest.raises(InvalidInputError) as refused,
    ):
        producer.submit(
            {"goal": "g", "tools": [{"name": LOOKUP}]},
            idempotency_key=f"live-client-{uuid.uuid4().hex}",
        )
    assert refused.value.reason == reason
    run_id = f"live-raw-{uuid.uuid4().hex}"
    task = submitted(run_id).model_copy(update={"tools": (ToolSpec(name=LOOKUP),)})
    inbox = Inbox(env.stack.bootstrap, env.stack.prefix, PARTITIONS)
    try:
        inbox.send(input_record(task, producer_id="raw", producer_seq=1))
        inbox.flush()
    finally:
        inbox.close()
    run = env.stack.wait_status(run_id, "FAILED")
    assert run["outcome"] == reason and run["catalog_version"] == version

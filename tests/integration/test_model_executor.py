"""The model executor against the real broker, the real Postgres and the scripted model server.

The tests play the processor: they write context artifacts like READY does, produce CallModel
effects and read the ModelCallCompleted inputs the executor commits to the inbox.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest

from agentruns.connectors.dev.servers import model_server, tool_server
from agentruns.connectors.executors.conversation import build_conversation
from agentruns.connectors.executors.model import (
    Assembled,
    ModelExecutor,
    ModelHandler,
    RouteConfig,
    Routes,
    StreamAssembler,
)
from agentruns.connectors.postgres.artifacts import PostgresArtifactStore
from agentruns.processors.effects import RepairNote
from agentruns.processors.events import ModelOutcome
from agentruns.processors.ids import canonical_json
from agentruns.processors.transition import load_candidate
from tests.support.executors import ModelEnv, make_harness
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def model_env(kafka_bootstrap: str, database_url: str) -> Iterator[ModelEnv]:
    server = model_server.serve("127.0.0.1", 0)
    prefix = f"t-model-exec-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    harness = make_harness(kafka_bootstrap, database_url, prefix, "model")
    base = server.url + "/v1"
    routes = Routes(
        {
            "default": RouteConfig(base_url=base, model="scenario:multi_tool"),
            "offline": RouteConfig(base_url="http://127.0.0.1:9/v1", connect_timeout_s=1),
            "costly": RouteConfig(
                base_url=base,
                model="scenario:multi_tool",
                input_cost_micros_per_1k=1000,
                output_cost_micros_per_1k=2000,
            ),
            "claude": RouteConfig(
                base_url=server.url,
                provider="anthropic",
                api_key="sk-ant-test-key",
                model="claude-test",
                input_cost_micros_per_1k=1000,
                output_cost_micros_per_1k=2000,
            ),
        },
        RouteConfig(base_url=base),
    )
    harness.start(ModelExecutor(harness.config("model"), routes, tool_server.DEFAULT_REGISTRY))
    http = httpx.Client(base_url=server.url, timeout=5.0)
    store = PostgresArtifactStore(database_url)
    try:
        yield ModelEnv(harness, server, http, store)
    finally:
        harness.close()
        store.close()
        http.close()
        server.close()


@pytest.fixture
def env(model_env: ModelEnv) -> ModelEnv:
    model_env.http.delete("/faults").raise_for_status()
    return model_env


def run_id_for(request: pytest.FixtureRequest) -> str:
    return f"run-{request.node.name[:40]}-{time.monotonic_ns() % 10**9}"


# --------------------------------------------------------------------------- tests


def test_finished_stream_becomes_a_candidate_with_complete_tool_calls(
    env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    run_id = run_id_for(request)
    event = env.call(env.effect(run_id, env.context(run_id), route="costly"))
    assert event.outcome is ModelOutcome.FINISHED and event.candidate is not None
    (call,) = event.candidate.tool_calls
    assert call.name == "search_docs"
    assert json.loads(call.arguments_json) == {"query": "escalation policy", "limit": 3}
    assert event.candidate.content == "Let me look up the escalation policy first."
    assert event.usage.input_tokens > 0 and event.usage.output_tokens > 0
    assert event.usage.cost_micros == event.usage.input_tokens + 2 * event.usage.output_tokens
    assert event.candidate_ref is not None
    artifact = env.harness.artifact(event.candidate_ref)
    assert artifact["finish_reason"] == "tool_calls" and artifact["outcome"] == "finished"
    message = artifact["message"]
    assert message["role"] == "assistant" and message["content"] == event.candidate.content
    assert message["tool_calls"][0]["id"] == call.id
    assert message["tool_calls"][0]["function"]["arguments"] == call.arguments_json
    stored = env.store.get(event.candidate_ref) or ""
    assert load_candidate(stored) == event.candidate  # what audit re-validates


@pytest.mark.parametrize(
    ("rule", "outcome"),
    [
        ({"kind": "disconnect", "after_chunks": 4}, ModelOutcome.INCOMPLETE),
        ({"kind": "incomplete", "after_chunks": 3}, ModelOutcome.INCOMPLETE),
        ({"kind": "length"}, ModelOutcome.TRUNCATED),
        ({"kind": "content_filter"}, ModelOutcome.BLOCKED),
        ({"kind": "429", "retry_after": 1.5}, ModelOutcome.RATE_LIMITED),
        ({"kind": "500"}, ModelOutcome.TRANSPORT_ERROR),
        ({"kind": "503"}, ModelOutcome.TRANSPORT_ERROR),
        ({"kind": "slow", "delay_ms": 5}, ModelOutcome.FINISHED),
    ],
)
def test_stream_classification(
    env: ModelEnv, request: pytest.FixtureRequest, rule: dict[str, Any], outcome: ModelOutcome
) -> None:
    run_id = run_id_for(request)
    env.fault(conversation=run_id, **rule)
    event = env.call(env.effect(run_id, env.context(run_id)))
    assert event.outcome is outcome
    assert event.candidate is not None
    if outcome is ModelOutcome.FINISHED:
        assert len(event.candidate.tool_calls) == 1
        return
    assert event.candidate.tool_calls == ()  # no tool starts on half-streamed arguments
    if outcome is ModelOutcome.RATE_LIMITED:
        assert event.retry_after_ms == 1500
    if outcome in (ModelOutcome.RATE_LIMITED, ModelOutcome.TRANSPORT_ERROR):
        assert event.candidate_ref is None
    else:
        artifact = env.harness.artifact(event.candidate_ref or "")
        assert artifact["outcome"] == outcome.value and "tool_calls" not in artifact["message"]


def test_unreachable_endpoint_is_a_transport_error(
    env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    run_id = run_id_for(request)
    event = env.call(env.effect(run_id, env.context(run_id), route="offline"))
    assert event.outcome is ModelOutcome.TRANSPORT_ERROR and event.candidate_ref is None


def test_disconnect_then_a_new_attempt_on_the_same_context(
    env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    run_id = run_id_for(request)
    context = env.context(run_id)
    env.fault(conversation=run_id, kind="disconnect", after_chunks=5)
    first = env.call(env.effect(run_id, context, attempt=1))
    assert first.outcome is ModelOutcome.INCOMPLETE
    second = env.call(env.effect(run_id, context, attempt=2))
    assert second.outcome is ModelOutcome.FINISHED and second.candidate is not None
    # one generation, not two merged: the text appears once, one tool call
    assert second.candidate.content == "Let me look up the escalation policy first."
    assert len(second.candidate.tool_calls) == 1


def test_redelivered_effect_is_answered_from_the_record(
    env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    run_id = run_id_for(request)
    effect = env.effect(run_id, env.context(run_id))
    env.call(effect)
    before = env.stats()["requests"]
    env.harness.effects.send(effect)  # the same effect again: a redelivery
    input_id = f"{effect.idempotency_key}:result"
    inbox = env.harness.inbox
    wait_for(lambda: (inbox.drain(), len(inbox.seen[input_id]) == 2)[1], 20, "second answer")
    (a, _), (b, _) = inbox.seen[input_id]
    assert a == b  # byte-identical
    assert env.stats()["requests"] == before  # no second model call


def test_conversation_is_rebuilt_from_the_context_chain(
    env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    """Step 2's context links to step 1's: the model sees one tool-result group (turn 1)."""
    run_id = run_id_for(request)
    first_context = env.context(run_id)
    step1 = env.call(env.effect(run_id, first_context))
    assert step1.candidate is not None and step1.candidate_ref is not None
    (call,) = step1.candidate.tool_calls
    result = env.store.put(
        canonical_json(
            {
                "type": "tool_result",
                "operation_key": "op-1",
                "tool": "search_docs",
                "arguments": json.loads(call.arguments_json),
                "status": "succeeded",
                "output": {"hits": ["policy: printers are high priority"]},
            }
        )
    )
    second_context = env.context(
        run_id, step=2, previous=first_context, candidate=step1.candidate_ref, inputs=(result,)
    )
    step2 = env.call(env.effect(run_id, second_context, step=2))
    assert step2.outcome is ModelOutcome.FINISHED and step2.candidate is not None
    assert [c.name for c in step2.candidate.tool_calls] == ["create_ticket"]

    loads = PostgresArtifactStore(env.harness.database_url)
    try:

        def load(refs: Any) -> dict[str, Any]:
            return {k: json.loads(v) for k, v in loads.get_many(list(refs)).items()}

        repair = RepairNote(candidate_ref="sha256:x", error_code="BAD_ARGS", detail="limit > 20")
        messages, context = build_conversation(
            env.effect(run_id, second_context, step=2, repair=repair), load
        )
    finally:
        loads.close()
    assert context["step"] == 2
    roles = [m["role"] for m in messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert messages[2]["tool_calls"][0]["id"] == call.id
    assert messages[3]["tool_call_id"] == call.id
    assert json.loads(messages[3]["content"]) == {"hits": ["policy: printers are high priority"]}
    assert "BAD_ARGS" in messages[4]["content"]


def test_assembler_never_passes_half_streamed_arguments() -> None:
    assembler = StreamAssembler()
    assembler.feed({"choices": [{"delta": {"role": "assistant", "content": "Hi"}}]})
    call = {"index": 0, "id": "c1", "function": {"name": "search_docs", "arguments": '{"qu'}}
    assembler.feed({"choices": [{"delta": {"tool_calls": [call]}}]})
    cut = assembler.result(interrupted="connection lost")
    assert cut.outcome is ModelOutcome.INCOMPLETE and cut.tool_calls == ()
    more = {"index": 0, "function": {"arguments": 'ery":"x"}'}}
    assembler.feed({"choices": [{"delta": {"tool_calls": [more]}, "finish_reason": "tool_calls"}]})
    done = assembler.result()
    assert done.outcome is ModelOutcome.FINISHED
    assert done.tool_calls[0]["function"]["arguments"] == '{"query":"x"}'


QUESTION = {
    "model": "scenario:multi_tool",
    "stream": True,
    "messages": [{"role": "user", "content": "Which printers are high priority?"}],
}


def test_sequential_calls_share_one_connection(database_url: str) -> None:
    with model_server.serve("127.0.0.1", 0) as server:
        route = RouteConfig(base_url=server.url + "/v1", model="scenario:multi_tool")
        handler = ModelHandler(database_url, Routes({}, route))

        async def calls() -> list[ModelOutcome]:
            try:
                return [(await handler.stream(route, QUESTION)).outcome for _ in range(5)]
            finally:
                handler.close()

        outcomes = asyncio.run(calls())
        assert outcomes == [ModelOutcome.FINISHED] * 5
        # the body is read to its end after [DONE], so the connection goes back to the pool
        assert server.connections_accepted == 1


def test_a_body_that_goes_on_after_done_is_closed(database_url: str) -> None:
    with model_server.serve("127.0.0.1", 0) as server:
        plain = RouteConfig(base_url=server.url + "/v1", model="scenario:multi_tool")
        # the whole answer, then a ping every 20 ms for ever; the call's deadline is past the
        # test's timeout, so only the bound after [DONE] lets this call return
        pinging = RouteConfig(
            base_url=plain.base_url,
            model=plain.model,
            headers={"X-Fault": "keepalive; delay_ms=20; after_chunks=1000"},
            read_timeout_s=3600,
            total_timeout_s=3600,
        )
        handler = ModelHandler(database_url, Routes({}, plain))

        async def calls() -> tuple[Assembled, Assembled]:
            try:
                return await handler.stream(pinging, QUESTION), await handler.stream(
                    plain, QUESTION
                )
            finally:
                handler.close()

        first, second = asyncio.run(calls())
        assert first.outcome is ModelOutcome.FINISHED and len(first.tool_calls) == 1
        assert second.outcome is ModelOutcome.FINISHED
        assert server.connections_accepted == 2  # the pinging one was not kept


# --------------------------------------------------------------------------- Anthropic routes


def tool_result(call_arguments: str) -> dict[str, Any]:
    return {
        "type": "tool_result",
        "operation_key": "op-1",
        "tool": "search_docs",
        "arguments": json.loads(call_arguments),
        "status": "succeeded",
        "output": {"hits": ["policy: printers are high priority"]},
    }


def test_an_anthropic_route_runs_a_tool_use_conversation(
    env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    run_id = run_id_for(request)
    first_context = env.context(run_id)
    step1 = env.call(env.effect(run_id, first_context, route="claude"))
    assert step1.outcome is ModelOutcome.FINISHED and step1.candidate is not None
    (call,) = step1.candidate.tool_calls
    assert call.name == "search_docs"
    assert json.loads(call.arguments_json) == {"query": "escalation policy", "limit": 3}
    assert step1.candidate.content == "Let me look up the escalation policy first."
    usage = step1.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.cost_micros == usage.input_tokens + 2 * usage.output_tokens
    assert step1.candidate_ref is not None
    artifact = env.harness.artifact(step1.candidate_ref)
    assert artifact["finish_reason"] == "tool_calls" and artifact["model"] == "claude-test"

    # step 2: the tool's result goes back as a tool_result block; the scenario's next turn
    result = env.store.put(canonical_json(tool_result(call.arguments_json)))
    second_context = env.context(
        run_id, step=2, previous=first_context, candidate=step1.candidate_ref, inputs=(result,)
    )
    step2 = env.call(env.effect(run_id, second_context, step=2, route="claude"))
    assert step2.outcome is ModelOutcome.FINISHED and step2.candidate is not None
    assert [c.name for c in step2.candidate.tool_calls] == ["create_ticket"]


@pytest.mark.parametrize(
    ("rule", "outcome", "retry_after_ms"),
    [
        # message_start, 6 events of the text block, the tool_use start, one input piece
        ({"kind": "disconnect", "after_chunks": 9}, ModelOutcome.INCOMPLETE, None),
        ({"kind": "overloaded", "after_chunks": 4}, ModelOutcome.RATE_LIMITED, None),
        ({"kind": "529", "retry_after": 1.5}, ModelOutcome.RATE_LIMITED, 1500),
    ],
)
def test_an_anthropic_route_classifies_cuts_and_overload(
    env: ModelEnv,
    request: pytest.FixtureRequest,
    rule: dict[str, Any],
    outcome: ModelOutcome,
    retry_after_ms: int | None,
) -> None:
    run_id = run_id_for(request)
    env.fault(conversation=run_id, **rule)
    event = env.call(env.effect(run_id, env.context(run_id), route="claude"))
    assert event.outcome is outcome
    assert event.candidate is None or event.candidate.tool_calls == ()  # no half arguments
    assert event.retry_after_ms == retry_after_ms
    if outcome is ModelOutcome.RATE_LIMITED:
        assert event.candidate_ref is None


def test_a_route_the_routes_file_does_not_have_is_refused(
    env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    run_id = run_id_for(request)
    before = env.stats()["requests"]
    event = env.call(env.effect(run_id, env.context(run_id), route="gpt-4-32k"))
    assert event.outcome is ModelOutcome.BLOCKED  # not retried: the run fails model:blocked
    assert event.candidate is None or event.candidate.tool_calls == ()
    assert env.stats()["requests"] == before  # nothing was sent
    with psycopg.connect(env.harness.database_url) as conn:
        row = conn.execute(
            "SELECT detail FROM executed_actions WHERE idempotency_key = %s",
            (f"{run_id}:model:1:1",),
        ).fetchone()
    assert row is not None and "unknown model route 'gpt-4-32k'" in row[0]

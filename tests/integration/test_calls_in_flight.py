"""Calls that take seconds: an executor carries hundreds at once, answers each as soon as it is
done, keeps every route within its own limits, and hands its calls in flight over correctly when
its partitions move. Real broker, real Postgres, the scripted servers' `latency` fault."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentruns.connectors.dev.servers import model_server, tool_server
from agentruns.connectors.executors.model import ModelExecutor, RouteConfig, Routes
from agentruns.connectors.executors.tool import ToolExecutor, ToolRegistry
from agentruns.connectors.postgres.artifacts import PostgresArtifactStore
from agentruns.processors.effects import CallModel, CallTool, Effect
from agentruns.processors.events import ModelCallCompleted, ModelOutcome, ToolCallSucceeded
from agentruns.processors.ids import canonical_json
from agentruns.streams.records import parse_event_body
from tests.support.executors import (
    TICKET,
    Harness,
    Ids,
    ModelEnv,
    fast_registry,
    make_harness,
)
from tests.support.pipeline import running_pipeline
from tests.support.waiting import wait_for


def _prefix(name: str) -> str:
    return f"t-inflight-{name}-{os.getpid()}-{time.monotonic_ns() % 10**9}"


@contextlib.contextmanager
def model_executor(
    kafka_bootstrap: str,
    database_url: str,
    routes: Callable[[str], Routes],
    **config: Any,
) -> Iterator[ModelEnv]:
    """A model executor (a thread of this process) in front of a scripted model server."""
    server = model_server.serve("127.0.0.1", 0)
    harness = make_harness(kafka_bootstrap, database_url, _prefix("model"), "model")
    executor = ModelExecutor(
        harness.config("model", **config), routes(server.url + "/v1"), tool_server.DEFAULT_REGISTRY
    )
    harness.start(executor)
    http = httpx.Client(base_url=server.url, timeout=5.0)
    store = PostgresArtifactStore(database_url)
    try:
        yield ModelEnv(harness, server, http, store)
    finally:
        harness.close()
        store.close()
        http.close()
        server.close()


def arrivals(harness: Harness, effects: Sequence[Effect], timeout: float) -> dict[str, float]:
    """When each effect's answer was first seen in the inbox (monotonic), all of them."""
    seen: dict[str, float] = {}
    wanted = {f"{e.idempotency_key}:result" for e in effects}

    def all_seen() -> bool:
        harness.inbox.drain()
        now = time.monotonic()
        for input_id in wanted & harness.inbox.seen.keys():
            seen.setdefault(input_id.removesuffix(":result"), now)
        return len(seen) == len(wanted)

    wait_for(all_seen, timeout, f"{len(wanted)} answers", every=0.02)
    return seen


def model_calls(env: ModelEnv, count: int, route: str, tag: str) -> list[CallModel]:
    base = f"run-{tag}-{time.monotonic_ns() % 10**9}"
    calls = []
    for i in range(count):
        run_id = f"{base}-{i}"
        calls.append(env.effect(run_id, env.context(run_id), route=route))
    return calls


def test_five_hundred_calls_of_two_seconds_are_in_flight_together(
    kafka_bootstrap: str, database_url: str
) -> None:
    """500 model calls that each take 2 s: all of them run at once and are answered about
    2 s after they start, not 16 at a time (that took 62 s)."""
    with model_executor(
        kafka_bootstrap,
        database_url,
        lambda base: Routes({}, RouteConfig(base_url=base)),
        max_in_flight=600,
        max_batch=256,
    ) as env:
        env.fault(kind="latency", times=None, median_ms=2000, sigma=0, chunk_ms=0)
        calls = model_calls(env, 500, "default", "five-hundred")
        executor = env.harness.executor
        assert executor is not None
        peak = {"running": 0}
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                peak["running"] = max(peak["running"], executor.held()["running"])
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        began = time.monotonic()
        env.harness.effects.send(*calls)
        try:
            answered = arrivals(env.harness, calls, 120)
        finally:
            sampling.set()
            sampler.join(5)
        assert peak["running"] >= 400, peak
        # the last answer within a few call times of the first send (in batches of the old
        # 16 calls at a time it came after 62 s)
        assert max(answered.values()) - began < 4 * 2.0 + 4.0
        for call in calls:
            ((_, record),) = env.harness.inbox.seen[f"{call.idempotency_key}:result"]
            event = parse_event_body(record["body"])
            assert isinstance(event, ModelCallCompleted)
            assert event.outcome is ModelOutcome.FINISHED


def lanes(base: str) -> Routes:
    """``narrow``: one call at a time; ``wide``: no limit; both answer as ``multi_tool``."""
    return Routes(
        {
            "narrow": RouteConfig(base_url=base, model="scenario:approval", max_in_flight=1),
            "wide": RouteConfig(base_url=base, model="scenario:multi_tool"),
        },
        RouteConfig(base_url=base),
    )


def test_a_route_at_its_calls_at_once_delays_only_its_own_calls(
    kafka_bootstrap: str, database_url: str
) -> None:
    with model_executor(kafka_bootstrap, database_url, lanes) as env:
        env.fault(kind="latency", times=None, median_ms=500, sigma=0, chunk_ms=0)
        narrow = model_calls(env, 5, "narrow", "narrow")
        wide = model_calls(env, 5, "wide", "wide")
        began = time.monotonic()
        env.harness.effects.send(*narrow, *wide)
        answered = arrivals(env.harness, [*narrow, *wide], 60)
        wide_done = max(answered[c.idempotency_key] for c in wide)
        narrow_times = sorted(answered[c.idempotency_key] for c in narrow)
        # every wide call ran beside the first narrow one; the narrow ones ran one at a time
        assert sum(t <= wide_done for t in narrow_times) <= 2
        assert narrow_times[-1] - began >= 5 * 0.5
        assert env.harness.executor is not None
        assert env.harness.executor.held()["waiting"] == 0


def test_a_backend_asking_to_slow_down_holds_its_route_only(
    kafka_bootstrap: str, database_url: str
) -> None:
    """A 429 with ``Retry-After: 2`` on the narrow route's model: its next calls wait the two
    seconds; the wide route's calls go at once."""
    with model_executor(
        kafka_bootstrap,
        database_url,
        lambda base: Routes(
            {
                "slowed": RouteConfig(base_url=base, model="scenario:approval"),
                "wide": RouteConfig(base_url=base, model="scenario:multi_tool"),
            },
            RouteConfig(base_url=base),
        ),
    ) as env:
        env.fault(kind="429", scenario="approval", times=1, retry_after=2)
        (first,) = model_calls(env, 1, "slowed", "throttled-first")
        env.harness.effects.send(first)
        limited = env.harness.inbox.typed(first, ModelCallCompleted)
        throttled_at = time.monotonic()
        assert limited.outcome is ModelOutcome.RATE_LIMITED and limited.retry_after_ms == 2000
        slowed = model_calls(env, 3, "slowed", "throttled")
        wide = model_calls(env, 3, "wide", "free")
        env.harness.effects.send(*slowed, *wide)
        answered = arrivals(env.harness, [*slowed, *wide], 60)
        assert max(answered[c.idempotency_key] for c in wide) - throttled_at < 1.5
        assert min(answered[c.idempotency_key] for c in slowed) - throttled_at >= 1.5
        for call in slowed:
            assert (
                env.harness.inbox.typed(call, ModelCallCompleted).outcome is ModelOutcome.FINISHED
            )


def test_a_call_whose_run_deadline_passed_while_it_waited_is_not_sent(
    kafka_bootstrap: str, database_url: str
) -> None:
    with model_executor(
        kafka_bootstrap, database_url, lambda base: Routes({}, RouteConfig(base_url=base))
    ) as env:
        run_id = f"run-late-{time.monotonic_ns() % 10**9}"
        registry = env.store.put(canonical_json([]))
        body = {
            "run_id": run_id,
            "step": 1,
            "goal": "too late",
            "previous_context": None,
            "previous_candidate": None,
            "messages": [{"role": "user", "content": "scenario:multi_tool"}],
            "inputs": [],
            "tool_registry": registry,
            "model_route": "default",
            "remaining": {"deadline_at": int(time.time() * 1000) - 1},
        }
        call = env.effect(run_id, env.store.put(canonical_json(body)))
        before = env.stats()["requests"]
        event = env.call(call)
        assert event.outcome is ModelOutcome.TRANSPORT_ERROR
        assert env.stats()["requests"] == before


@contextlib.contextmanager
def tool_env(
    kafka_bootstrap: str, database_url: str, tmp: Path
) -> Iterator[tuple[Harness, tool_server.ServerHandle, ToolRegistry]]:
    """A harness for a tool executor, the tool server, and its registry with every tool's
    timeout at 20 s (the calls here take seconds; a timeout is not what is tested)."""
    server = tool_server.serve("127.0.0.1", 0)
    registry = ToolRegistry.load(fast_registry(tmp, server.url))
    patient = {n: dataclasses.replace(t, timeout_ms=20_000) for n, t in registry.tools.items()}
    registry = dataclasses.replace(registry, tools=patient)
    harness = make_harness(kafka_bootstrap, database_url, _prefix("tool"), "tool")
    try:
        yield harness, server, registry
    finally:
        harness.close()
        server.close()


def slow_tools(server: tool_server.ServerHandle, ms: float, max_ms: float | None = None) -> None:
    """Every tool call takes ``ms`` (or, with ``max_ms``, anything up to it)."""
    top = ms if max_ms is None else max_ms
    rule = {"target": "*", "kind": "latency", "times": None, "min_ms": ms, "max_ms": top}
    httpx.post(server.url + "/faults", json=rule, timeout=5).raise_for_status()


def tool_calls(count: int, tag: str) -> list[CallTool]:
    base = f"run-{tag}-{time.monotonic_ns() % 10**9}"
    return [
        Ids(f"{base}-{i}").call("create_ticket", {**TICKET, "title": f"ticket {i}"})
        for i in range(count)
    ]


def executions(server: tool_server.ServerHandle, calls: Sequence[CallTool]) -> set[int]:
    stats = server.app.stats()  # type: ignore[attr-defined]
    return {stats["executions"].get(c.operation.key, 0) for c in calls}


@pytest.mark.parametrize("revoke_wait_s", [30.0, 0.2])
def test_a_rebalance_with_calls_in_flight_answers_each_effect_once(
    kafka_bootstrap: str, database_url: str, tmp_path: Path, revoke_wait_s: float
) -> None:
    """A second executor joins while the first has calls of 0.3 to 2.5 s in flight, so they
    end out of order. With time to wait, the partition that moves waits for its calls and
    commits their answers before it goes; with 0.2 s, its calls still running are handed over:
    the new owner looks each up (the tool executed it already) and answers it, the old one
    records it and sends nothing, and the calls that ended after one still running (answered
    above the committed offset) are named in the offset's note, so the new owner passes them
    over. Either way every effect is answered exactly once and every ticket is created once."""
    with tool_env(kafka_bootstrap, database_url, tmp_path) as (harness, server, registry):
        slow_tools(server, 300, 2500)
        first = ToolExecutor(harness.config("tool", revoke_wait_s=revoke_wait_s), registry)
        harness.start(first)
        calls = tool_calls(100, f"rebalance-{int(revoke_wait_s * 10)}")
        harness.effects.send(*calls[:20])  # the first joins its group, takes both partitions
        wait_for(lambda: first.held()["running"] >= 10, 30, "calls in flight")
        sent = 20
        second = Harness(
            harness.bootstrap, harness.database_url, harness.prefix, harness.inbox, harness.effects
        )
        config = harness.config("tool", instance_id="1", revoke_wait_s=revoke_wait_s)
        second.start(ToolExecutor(config, registry))
        try:
            assert second.executor is not None
            joined = second.executor.membership

            def assigned() -> bool:  # calls keep coming, so some are in flight at the rebalance
                nonlocal sent
                if sent < len(calls) - 20:
                    harness.effects.send(*calls[sent : sent + 5])
                    sent += 5
                return joined.state[0] and joined.state[1] > 0

            wait_for(assigned, 60, "the second executor to get a partition", every=0.3)
            harness.effects.send(*calls[sent:])
            arrivals(harness, calls, 90)
            time.sleep(2.0)  # a second copy of any answer would land by now
            harness.inbox.drain()
        finally:
            second.stop_executor()
        copies = [len(harness.inbox.seen[f"{c.idempotency_key}:result"]) for c in calls]
        assert copies == [1] * len(calls)
        assert executions(server, calls) == {1}
        for call in calls:
            harness.inbox.typed(call, ToolCallSucceeded)
        assert second.executor is not None and second.executor.stats.effects > 0
        if revoke_wait_s < 1:
            assert first.stats.handed_back >= 1
            assert second.executor.stats.answered_before >= 1


def test_a_call_longer_than_the_poll_interval_keeps_the_executor_in_its_group(
    kafka_bootstrap: str, database_url: str, tmp_path: Path
) -> None:
    """Calls of 9 s with ``max.poll.interval.ms`` at 7 s: the executor keeps polling while
    they run, so it never leaves its group (no partition is revoked or lost)."""
    with tool_env(kafka_bootstrap, database_url, tmp_path) as (harness, server, registry):
        slow_tools(server, 9000)
        executor = ToolExecutor(harness.config("tool", max_poll_interval_ms=7000), registry)
        harness.start(executor)
        calls = tool_calls(5, "poll-interval")
        harness.effects.send(*calls)
        arrivals(harness, calls, 60)
        assert executor.stats.revoked == 0 and executor.stats.aborts == 0
        assert executions(server, calls) == {1}


def test_held_effects_at_the_limit_pause_the_partitions_until_they_drain(
    kafka_bootstrap: str, database_url: str, tmp_path: Path
) -> None:
    with tool_env(kafka_bootstrap, database_url, tmp_path) as (harness, server, registry):
        slow_tools(server, 300)
        executor = ToolExecutor(
            harness.config("tool", max_in_flight=4, max_held=8, max_batch=4), registry
        )
        harness.start(executor)
        calls = tool_calls(40, "pause")
        peak = {"held": 0}
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                held = executor.held()
                peak["held"] = max(peak["held"], held["waiting"] + held["running"])
                time.sleep(0.01)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            harness.effects.send(*calls)
            arrivals(harness, calls, 60)
        finally:
            stop.set()
            sampler.join(5)
        assert executor.stats.pauses >= 1
        assert peak["held"] <= 8 + 4  # the limit, and one poll batch past it
        assert executions(server, calls) == {1}


def test_an_instant_run_ends_while_slow_runs_are_still_in_their_first_call(
    kafka_bootstrap: str, database_url: str, tmp_path: Path
) -> None:
    """Eight runs whose first model call takes 8 s, then one run whose calls are instant: the
    instant run's calls never wait for a slow one, so it ends before any slow call does."""
    with running_pipeline(kafka_bootstrap, database_url, tmp_path) as pipe:
        pipe.model_fault(
            kind="latency", scenario="bench_10", turn=0, times=None,
            median_ms=8000, sigma=0, max_ms=8000, chunk_ms=200,
        )  # fmt: skip
        base = f"run-mixed-{time.monotonic_ns() % 10**9}"
        slow = [f"{base}-slow-{i}" for i in range(8)]
        for run_id in slow:
            pipe.submit(run_id, scenario="bench_10")
        time.sleep(0.5)  # the slow calls are under way
        pipe.submit(f"{base}-instant", scenario="multi_tool")
        assert pipe.result(f"{base}-instant", timeout=60)["status"] == "SUCCEEDED"
        # by the times the events carry (the answers' are the executors' clocks, the run's end
        # the processor's: one machine): the instant run ended before any slow call answered
        instant_ended = max(e["at"] for e in pipe.events(f"{base}-instant"))
        results = pipe.results(slow, timeout=120)
        first_answers = [
            min(e["at"] for e in pipe.events(run_id) if e["type"] == "ModelCallCompleted")
            for run_id in slow
        ]
        assert instant_ended < min(first_answers)
        assert {r["status"] for r in results.values()} == {"SUCCEEDED"}

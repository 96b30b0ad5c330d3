"""``agentruns bench console``: the run list and a run page with a large projection.

Fills the projection with ``--runs`` runs (default 100,000) and one run of ``--events`` events
(default 1,000), then times over real HTTP (uvicorn on a free port, the API's own app):

* ``GET /runs`` first pages (50 runs) under each filter of the console: none, a status, waiting
  for a person, stuck for 10 minutes, a time range, a search by idempotency key;
* the console's runs page (``/ui/runs``) under the same filters (with its counts and charts);
* the console's page of the run with ``--events`` events.

Rows are what the sink writes (``agentruns.connectors.projection.rows.run_values`` and
``event_values``): states and events folded by the real core from simulated runs
(``agentruns.connectors.dev.servers.workload``), each copied under many run ids with start times
spread over the last week, so the status mix is the one the simulated world ends in, plus a
share of resting runs. Every run has its events (one row per event, each with its step), so the
runs page's step latency chart reads the per-step rows of the runs that moved in the last hour
among those of the whole week. Each request is repeated
``--repeat`` times per filter after one warm-up; the p50/p95 are over all of them.

The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg

from agentruns.bench.core import host_speed
from agentruns.bench.latency import percentile
from agentruns.bench.targets import Target, evaluate
from agentruns.connectors.dev.servers.workload import simulate
from agentruns.connectors.projection.rows import (
    EVENT_COLUMNS,
    RUN_COLUMNS,
    event_values,
    ms_time,
    run_row,
    run_values,
)
from agentruns.processors.events import Event
from agentruns.processors.ids import run_id_for_key
from agentruns.processors.state import RunState
from agentruns.processors.transition import transition
from agentruns.streams.records import event_body, event_record

TARGETS = (
    Target("list_ms.p95", 100, at_most=True),
    Target("runs_page_ms.p95", 100, at_most=True),
    Target("run_page_ms.p95", 200, at_most=True),
)
DAY_MS = 86_400_000


class _Template:
    """A simulated run folded by the core: its state and log, and its events rows as the
    sink stages them (``event_values``)."""

    def __init__(self, state: RunState, log: list[Event], events: list[tuple[Any, ...]]) -> None:
        self.state, self.log, self.events = state, log, events


def _states(rng: random.Random, count: int) -> list[_Template]:
    """Folded states of simulated runs: each at its end, or, for a fifth of them, resting
    part-way (a run waiting for a model, a tool or a person)."""
    out: list[_Template] = []
    for i in range(count):
        log = simulate(rng, f"tpl-{i:04d}", steps=rng.randint(2, 12))
        cut = len(log) if rng.random() < 0.8 else rng.randint(1, len(log))
        state: RunState | None = None
        rows: list[tuple[Any, ...]] = []
        for event in log[:cut]:
            result = transition(state, event)
            state = result.state or state
            assert state is not None
            record = event_record(state.run_id, len(rows) + 1, event, result, input_id=None)
            rows.append(event_values(record, str(state.status)))
        assert state is not None
        out.append(_Template(state, log[:cut], rows))
    return out


def _placed(runs: int, templates: list[_Template], now: int, rng: random.Random) -> list[Any]:
    """(template, run id, trace id, time shift) of every run: its last event in the last week."""
    last_col = RUN_COLUMNS.index("last_event_at")
    out = []
    for i in range(runs):
        t = templates[i % len(templates)]
        last = run_values(t.state, len(t.log))[last_col]
        shift = now - rng.randrange(7 * DAY_MS) - last
        trace = uuid.UUID(int=rng.getrandbits(128)).hex
        out.append((t, run_id_for_key(f"bench-console-{i}"), trace, shift))
    return out


def _run_rows(placed: list[Any]) -> Iterator[tuple[Any, ...]]:
    started_col = RUN_COLUMNS.index("started_at")
    last_col = RUN_COLUMNS.index("last_event_at")
    ended_col = RUN_COLUMNS.index("ended_at")
    for t, run_id, trace, shift in placed:
        values = list(run_values(t.state, len(t.log)))
        values[0] = run_id
        values[RUN_COLUMNS.index("trace_id")] = trace
        for c in (started_col, last_col, ended_col):
            if values[c] is not None:
                values[c] = ms_time(values[c] + shift)
        yield tuple(values)


def _event_rows(placed: list[Any]) -> Iterator[tuple[Any, ...]]:
    """Every run's events: its template's rows under its id, trace and times."""
    trace_col, at_col = EVENT_COLUMNS.index("trace_id"), EVENT_COLUMNS.index("at")
    for t, run_id, trace, shift in placed:
        for row in t.events:
            values = list(row)
            values[0] = run_id
            values[trace_col] = trace
            values[at_col] = ms_time(values[at_col] + shift)
            yield tuple(values)


def fill(database_url: str, runs: int, events: int, seed: int = 11) -> str:
    """Write the runs and the big run; the big run's id."""
    rng = random.Random(seed)
    templates = _states(rng, 200)
    now = int(time.time() * 1000)
    placed = _placed(runs, templates, now, rng)
    with psycopg.connect(database_url) as conn:
        with conn.cursor().copy(f"COPY runs ({', '.join(RUN_COLUMNS)}) FROM STDIN") as copy:
            for row in _run_rows(placed):
                copy.write_row(row)
        with conn.cursor().copy(f"COPY events ({', '.join(EVENT_COLUMNS)}) FROM STDIN") as copy:
            for row in _event_rows(placed):
                copy.write_row(row)
        # the big run: a waiting run whose log is repeated to `events` events
        big_t = next(t for t in templates if not t.state.terminal and len(t.log) > 3)
        state, log = big_t.state, big_t.log
        big = state.run_id
        with conn.cursor().copy(f"COPY events ({', '.join(EVENT_COLUMNS)}) FROM STDIN") as copy:
            for seq in range(1, events + 1):
                e = log[(seq - 1) % len(log)]
                copy.write_row(
                    (
                        big,
                        seq,
                        f"{e.event_id}:{seq}",
                        e.type,
                        getattr(e, "step", 1),
                        getattr(e, "attempt", 1),
                        state.trace_id,
                        ms_time(e.at),
                        "APPLIED",
                        None,
                        None,
                        str(state.status),
                        event_body(e),
                    )
                )
        big_row = run_row(state, events)
        conn.execute(
            f"INSERT INTO runs ({', '.join(RUN_COLUMNS)}) VALUES"
            f" ({', '.join(['%s'] * len(RUN_COLUMNS))}) ON CONFLICT (run_id) DO NOTHING",
            [big_row[c] for c in RUN_COLUMNS],
        )
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE runs")
        conn.execute("VACUUM ANALYZE events")
    return big


def _timed(client: httpx.Client, path: str, params: dict[str, Any], repeat: int) -> list[float]:
    r = client.get(path, params=params)  # warm-up
    assert r.status_code == 200, (path, params, r.status_code, r.text[:300])
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        r = client.get(path, params=params)
        out.append((time.perf_counter() - started) * 1000)
        assert r.status_code == 200, (path, r.status_code)
    return out


def _summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(samples, 0.5), 1),
        "p95": round(percentile(samples, 0.95), 1),
        "max": round(max(samples), 1),
    }


def run_bench(
    bootstrap: str, database_url: str, *, runs: int, events: int, repeat: int
) -> dict[str, Any]:
    from agentruns.connectors.api.config import ApiConfig
    from agentruns.connectors.api.serve import serving
    from agentruns.connectors.postgres.migrate import migrate
    from agentruns.streams.admin import ensure_topics

    migrate(database_url)
    prefix = f"bench-console-{uuid.uuid4().hex[:8]}"
    ensure_topics(bootstrap, prefix=prefix, partitions=3)
    started = time.perf_counter()
    big = fill(database_url, runs, events)
    fill_s = time.perf_counter() - started
    token = uuid.uuid4().hex
    config = ApiConfig(
        bootstrap=bootstrap,
        database_url=database_url,
        api_token=token,
        secret=uuid.uuid4().bytes,
        prefix=prefix,
    )
    week_ago = int(time.time() * 1000) - 7 * DAY_MS
    filters: dict[str, dict[str, Any]] = {
        "none": {},
        "status": {"status": "SUCCEEDED"},
        "waiting_user": {"waiting": "user"},
        "stuck": {"stuck_minutes": 10},
        "time_range": {"since": week_ago + DAY_MS, "until": week_ago + 2 * DAY_MS},
        "search_key": {"q": "bench-console-4242"},
    }
    per_filter: dict[str, Any] = {}
    list_all: list[float] = []
    page_all: list[float] = []
    with serving(config) as url:
        with httpx.Client(base_url=url, timeout=60) as api:
            api.headers["Authorization"] = f"Bearer {token}"
            for name, params in filters.items():
                samples = _timed(api, "/runs", {**params, "limit": 50}, repeat)
                list_all += samples
                per_filter[name] = {"list_ms": _summary(samples)}
        with httpx.Client(base_url=url, timeout=60) as ui:
            form = ui.get("/ui/login").text
            csrf = form.split('name="csrf" value="')[1].split('"')[0]
            r = ui.post("/ui/login", data={"csrf": csrf, "token": token})
            assert r.status_code == 303, r.text
            for name, params in filters.items():
                samples = _timed(ui, "/ui/runs", params, repeat)
                page_all += samples
                per_filter[name]["runs_page_ms"] = _summary(samples)
            run_page = _timed(ui, f"/ui/runs/{big}", {}, repeat)
            body = ui.get(f"/ui/runs/{big}").text
            shown = body.count("</tr>")
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT count(*) FROM events").fetchone()
        assert row is not None
        event_rows = int(row[0])
    figures: dict[str, Any] = {
        "bench": "console",
        "runs": runs,
        "event_rows": event_rows,
        "events_of_big_run": events,
        "rows_shown_on_run_page": shown,
        "repeat": repeat,
        "fill_s": round(fill_s, 1),
        "list_ms": _summary(list_all),
        "runs_page_ms": _summary(page_all),
        "run_page_ms": _summary(run_page),
        "by_filter": per_filter,
    }
    return {**figures, **evaluate(figures, TARGETS)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns bench console")
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--events", type=int, default=1_000, help="events of the big run")
    parser.add_argument("--repeat", type=int, default=40, help="timed requests per filter")
    args = parser.parse_args(argv)
    from agentruns.connectors.dev.stack.services import ServiceStack

    speed = host_speed()
    with ServiceStack(ephemeral=True) as stack:
        assert stack.endpoints is not None
        report = run_bench(
            stack.endpoints.kafka_bootstrap,
            stack.endpoints.database_url,
            runs=args.runs,
            events=args.events,
            repeat=args.repeat,
        )
    report["host_speed"] = speed
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

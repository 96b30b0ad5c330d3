"""`agentruns audit`: the log, the snapshots and the Postgres projection compared (R27, R28).

`agentruns audit [--sample N]` folds every run (or a sample) from the event log, each under the
rules version it was submitted under (`agentruns.processors.versions`), and compares the
result with the latest snapshot (`<prefix>.state`) and with the Postgres projection; prints each
difference, exits 1 if there is any. `--every SECONDS` keeps doing it (the `Reconciler`, a
reconciliation job): differences become log lines and the
`agentruns_reconcile_differences_total` counter.

Reading order matters when the pipeline is live: the log first, then snapshots, then Postgres, so
a snapshot or row can only be AHEAD of the log that was read (skipped as "in flux" by the
periodic job), never legitimately behind it.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import threading
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from prometheus_client import Counter, Gauge

from agentruns.connectors import health
from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.lifecycle import progress, stop_on_signals
from agentruns.connectors.projection.reading import AuditError, Say, read_log, read_snapshots
from agentruns.connectors.projection.rows import (
    EVENT_COLUMNS,
    OP_COLUMNS,
    QUESTION_COLUMNS,
    RUN_COLUMNS,
    merge_op,
    merge_question,
    project_event,
    run_row,
)
from agentruns.processors import versions
from agentruns.processors.events import ForkedFrom
from agentruns.processors.lineage import ForkError, folded, state_at, with_replaced
from agentruns.processors.state import RunState
from agentruns.streams.records import RunSlot, parse_event_body
from agentruns.streams.topics import default_prefix

log = logging.getLogger("agentruns.audit")

RECONCILE_DIFFERENCES = Counter(
    "agentruns_reconcile_differences_total", "Differences found by the reconciliation job"
)
RECONCILE_RUNS = Counter("agentruns_reconcile_runs_total", "Runs compared by reconciliation")
RECONCILE_LAGGING = Gauge(
    "agentruns_reconcile_lagging_runs", "Runs whose projection was behind the log last round"
)


# --------------------------------------------------------------------------- audit


@dataclass(frozen=True)
class Difference:
    run_id: str
    where: str  # "log" (current core vs recorded), "snapshot", "postgres", "lineage" (a fork)
    what: str
    expected: Any
    found: Any

    def line(self) -> str:
        return (
            f"{self.run_id}: {self.where}: {self.what}: expected {self.expected!r}, "
            f"found {self.found!r}"
        )


@dataclass
class Expected:
    """The projection of one run, rebuilt from its log with the current core."""

    last_seq: int = 0
    state: RunState | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    ops: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    questions: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    divergences: list[Difference] = field(default_factory=list)


def expected_projection(run_id: str, records: Sequence[dict[str, Any]]) -> Expected:
    out = Expected()
    for record in records:
        if record["seq"] != out.last_seq + 1:
            out.divergences.append(
                Difference(run_id, "log", "seq", out.last_seq + 1, record["seq"])
            )
        try:
            projected = project_event(out.state, record)
        except versions.UnknownRulesVersionError as exc:
            # a run of a newer build's rules: this audit cannot fold it (nor vouch for it)
            out.divergences.append(Difference(run_id, "log", "rules version", "known", str(exc)))
            break
        if projected is None:
            continue
        if str(projected.disposition) != record["disposition"]:
            out.divergences.append(
                Difference(
                    run_id,
                    "log",
                    f"seq {record['seq']} disposition",
                    str(projected.disposition),
                    record["disposition"],
                )
            )
        out.state = projected.state
        out.last_seq = record["seq"]
        out.events.append(projected.event)
        for row in projected.ops:
            merge_op(out.ops, row)
        for row in projected.questions:
            merge_question(out.questions, row)
    return out


def fork_source(records: Sequence[dict[str, Any]]) -> str | None:
    """The run a fork was forked from (its first record's source), None for a submitted run."""
    if not records or records[0]["type"] != "ForkedFrom":
        return None
    event = parse_event_body(records[0]["body"])
    return event.source_run_id if isinstance(event, ForkedFrom) else None


def compare_lineage(
    run_id: str, records: Sequence[dict[str, Any]], source: Sequence[dict[str, Any]] | None
) -> list[Difference]:
    """A fork's first record against its source's log: the state it carries must be the
    source's state folded to the seq it names (the source's log is the judge)."""
    event = parse_event_body(records[0]["body"])
    assert isinstance(event, ForkedFrom)
    where = f"lineage of {event.source_run_id} seq {event.source_seq}"
    if not source:
        return [Difference(run_id, "lineage", where, "the source's log", None)]
    try:
        log = folded((r["seq"], parse_event_body(r["body"])) for r in source)
        expected = state_at(with_replaced(log, event.edits, event.source_seq), event.source_seq)
    except ForkError as exc:
        return [Difference(run_id, "lineage", where, "a state", str(exc))]
    except versions.UnknownRulesVersionError as exc:
        return [Difference(run_id, "lineage", where, "known rules", str(exc))]
    if expected == event.state:
        return []
    return [
        Difference(run_id, "lineage", f"{where}: {f}", "the source's", "another")
        for f in _state_fields(expected, event.state)
    ]


def _state_fields(a: RunState, b: RunState) -> list[str]:
    da, db = a.model_dump(mode="json"), b.model_dump(mode="json")
    return sorted(k for k in da.keys() | db.keys() if da.get(k) != db.get(k))


def compare_snapshot(
    run_id: str, exp: Expected, snapshot: dict[str, Any] | None, *, tolerate_ahead: bool
) -> list[Difference]:
    if snapshot is None:
        return [Difference(run_id, "snapshot", "snapshot", f"seq {exp.last_seq}", None)]
    if snapshot["last_seq"] != exp.last_seq:
        if tolerate_ahead and snapshot["last_seq"] > exp.last_seq:
            return []
        return [Difference(run_id, "snapshot", "last_seq", exp.last_seq, snapshot["last_seq"])]
    slot = RunSlot.from_record(snapshot)
    if slot.state is None or exp.state is None:
        return [
            Difference(
                run_id,
                "snapshot",
                "state",
                None if exp.state is None else str(exp.state.status),
                None if slot.state is None else str(slot.state.status),
            )
        ]
    if slot.state != exp.state:
        fields = _state_fields(exp.state, slot.state)
        ed, sd = exp.state.model_dump(mode="json"), slot.state.model_dump(mode="json")
        return [Difference(run_id, "snapshot", f"state.{f}", ed.get(f), sd.get(f)) for f in fields]
    return []


def _normal(column: str, value: Any) -> Any:
    if column in ("state", "payload") and isinstance(value, str):
        return json.loads(value)
    return value


def _compare_row(
    run_id: str, what: str, columns: Sequence[str], expected: dict[str, Any], found: dict[str, Any]
) -> list[Difference]:
    out = []
    for c in columns:
        e, f = _normal(c, expected[c]), _normal(c, found.get(c))
        if e != f:
            if c == "state" and isinstance(e, dict) and isinstance(f, dict):
                for k in sorted(e.keys() | f.keys()):
                    if e.get(k) != f.get(k):
                        out.append(
                            Difference(run_id, "postgres", f"{what}.state.{k}", e.get(k), f.get(k))
                        )
                continue
            out.append(Difference(run_id, "postgres", f"{what}.{c}", e, f))
    return out


@dataclass
class PostgresRows:
    runs: dict[str, dict[str, Any]]
    events: dict[str, dict[int, dict[str, Any]]]
    ops: dict[str, dict[str, dict[str, Any]]]
    questions: dict[str, dict[str, dict[str, Any]]]


def _select(conn: psycopg.Connection[Any], sql: str, run_ids: list[str]) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute(sql, (run_ids,))
        return list(cur.fetchall())


def read_postgres(database_url: str, run_ids: Sequence[str]) -> PostgresRows:
    ids = list(run_ids)
    try:
        with psycopg.connect(database_url, connect_timeout=10) as conn:
            runs = _select(
                conn, f"SELECT {', '.join(RUN_COLUMNS)} FROM runs WHERE run_id = ANY(%s)", ids
            )
            events = _select(
                conn,
                f"SELECT {', '.join(EVENT_COLUMNS)} FROM events WHERE run_id = ANY(%s)",
                ids,
            )
            ops = _select(
                conn,
                f"SELECT {', '.join(OP_COLUMNS)} FROM operations WHERE run_id = ANY(%s)",
                ids,
            )
            questions = _select(
                conn,
                f"SELECT {', '.join(QUESTION_COLUMNS)} FROM questions WHERE run_id = ANY(%s)",
                ids,
            )
    except psycopg.Error as exc:
        raise AuditError(f"reading the projection failed: {exc}") from exc
    rows = PostgresRows({r["run_id"]: r for r in runs}, {}, {}, {})
    for e in events:
        rows.events.setdefault(e["run_id"], {})[e["seq"]] = e
    for o in ops:
        rows.ops.setdefault(o["run_id"], {})[o["op_key"]] = o
    for q in questions:
        rows.questions.setdefault(q["run_id"], {})[q["question_id"]] = q
    return rows


def _compare_table(
    run_id: str,
    table: str,
    columns: Sequence[str],
    expected: Iterable[tuple[Any, dict[str, Any]]],
    found: dict[Any, dict[str, Any]],
    *,
    label: str | None = None,
) -> list[Difference]:
    """Expected rows (by key) against the rows found: missing, different and extra rows."""
    label = label or table
    found = dict(found)
    out: list[Difference] = []
    for key, row in expected:
        got = found.pop(key, None)
        if got is None:
            out.append(Difference(run_id, "postgres", f"{label} {key}", "row", None))
            continue
        out.extend(_compare_row(run_id, f"{table}[{key}]", columns, row, got))
    for key in sorted(found):
        out.append(Difference(run_id, "postgres", f"{label} {key}", None, "extra row"))
    return out


def compare_postgres(
    run_id: str, exp: Expected, rows: PostgresRows, *, tolerate_lag: bool
) -> tuple[list[Difference], bool]:
    """Differences between the rebuilt projection and Postgres; (differences, lagging)."""
    found_run = rows.runs.get(run_id)
    if exp.state is None:
        return [], False
    if found_run is None:
        if tolerate_lag:
            return [], True
        return [Difference(run_id, "postgres", "runs row", f"seq {exp.last_seq}", None)], False
    if found_run["last_seq"] != exp.last_seq:
        if tolerate_lag:
            return [], True
        return [
            Difference(run_id, "postgres", "runs.last_seq", exp.last_seq, found_run["last_seq"])
        ], False
    out = _compare_row(run_id, "runs", RUN_COLUMNS, run_row(exp.state, exp.last_seq), found_run)
    out += _compare_table(
        run_id,
        "events",
        EVENT_COLUMNS,
        ((row["seq"], row) for row in exp.events),
        rows.events.get(run_id, {}),
        label="events seq",
    )
    out += _compare_table(
        run_id,
        "operations",
        OP_COLUMNS,
        ((key, row) for (_, key), row in sorted(exp.ops.items())),
        rows.ops.get(run_id, {}),
    )
    out += _compare_table(
        run_id,
        "questions",
        QUESTION_COLUMNS,
        ((qid, row) for (_, qid), row in sorted(exp.questions.items())),
        rows.questions.get(run_id, {}),
    )
    return out, False


@dataclass
class AuditReport:
    runs: int
    differences: list[Difference]
    lagging: list[str]
    skipped_in_flux: int = 0

    def summary(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "differences": len(self.differences),
            "runs_with_differences": len({d.run_id for d in self.differences}),
            "lagging": len(self.lagging),
        }


#: From how many runs on an audit says it is comparing them (fewer take no noticeable time).
PROGRESS_RUNS = 10_000


def audit(
    bootstrap: str,
    prefix: str,
    database_url: str | None,
    *,
    sample: int | None = None,
    run_ids: Sequence[str] | None = None,
    seed: int | None = None,
    live: bool = False,
    say: Say | None = None,
) -> AuditReport:
    """Rebuild runs from the log and compare them with snapshots and Postgres.

    `live=True` (the periodic job) tolerates a projection behind the log and a snapshot ahead
    of it (both normal while the pipeline runs); a one-shot audit reports them. ``say`` hears
    how far a long audit got.
    """
    logs = read_log(bootstrap, prefix, run_ids, say=say)
    chosen = sorted(logs)
    sources = {r: fork_source(logs[r]) for r in chosen}
    missing = sorted({s for s in sources.values() if s is not None and s not in logs})
    if missing:  # a fork's source outside the audited runs: read to check the lineage
        logs = {**read_log(bootstrap, prefix, missing, say=say), **logs}
    if sample is not None and sample < len(chosen):
        chosen = sorted(random.Random(seed).sample(chosen, sample))
    snapshots = read_snapshots(bootstrap, prefix, say=say)
    if say is not None and len(chosen) >= PROGRESS_RUNS:
        say(f"comparing {len(chosen)} runs" + (" with Postgres" if database_url else ""))
    rows = read_postgres(database_url, chosen) if database_url else None
    differences: list[Difference] = []
    lagging: list[str] = []
    for run_id in chosen:
        exp = expected_projection(run_id, logs[run_id])
        differences.extend(exp.divergences)
        source = sources.get(run_id)
        if source is not None:
            differences.extend(compare_lineage(run_id, logs[run_id], logs.get(source)))
        evicted = run_id in snapshots and snapshots[run_id] is None
        if evicted and exp.state is not None and exp.state.terminal:
            pass  # evicted after it ended: the log and Postgres still say all there is
        else:
            differences.extend(
                compare_snapshot(run_id, exp, snapshots.get(run_id), tolerate_ahead=live)
            )
        if rows is not None:
            found, lag = compare_postgres(run_id, exp, rows, tolerate_lag=live)
            differences.extend(found)
            if lag:
                lagging.append(run_id)
    return AuditReport(len(chosen), differences, lagging)


class Reconciler:
    """The periodic reconciliation job (R27): sample, compare, log and count differences."""

    def __init__(
        self,
        bootstrap: str,
        prefix: str,
        database_url: str | None,
        *,
        every_s: float,
        sample: int | None,
    ) -> None:
        self.bootstrap = bootstrap
        self.prefix = prefix
        self.database_url = database_url
        self.every_s = every_s
        self.sample = sample
        self.rounds = 0
        self.differences = 0
        self.last: AuditReport | None = None

    def round(self) -> AuditReport:
        report = audit(
            self.bootstrap,
            self.prefix,
            self.database_url,
            sample=self.sample,
            seed=self.rounds,
            live=True,
        )
        self.rounds += 1
        self.differences += len(report.differences)
        self.last = report
        RECONCILE_RUNS.inc(report.runs)
        RECONCILE_DIFFERENCES.inc(len(report.differences))
        RECONCILE_LAGGING.set(len(report.lagging))
        for d in report.differences:
            log.warning("reconciliation difference: %s", d.line(), extra={"run_id": d.run_id})
        log.info("reconciliation round %d: %s", self.rounds, json.dumps(report.summary()))
        return report

    def run(self, stop: threading.Event, rounds: int | None = None) -> None:
        while not stop.is_set():
            try:
                self.round()
            except AgentrunsError as exc:
                log.error("reconciliation round failed: %s", exc.one_line())
            if rounds is not None and self.rounds >= rounds:
                return
            stop.wait(self.every_s)


def main(argv: list[str] | None = None) -> int:
    """`agentruns audit`."""
    parser = argparse.ArgumentParser(
        prog="agentruns audit",
        description="fold runs from the event log and compare with snapshots and Postgres",
    )
    parser.add_argument("--prefix", default=default_prefix())
    parser.add_argument("--sample", type=int, help="audit N runs chosen at random")
    parser.add_argument("--seed", type=int, help="seed of the sample")
    parser.add_argument("--run", action="append", dest="runs", help="audit this run (repeat)")
    parser.add_argument("--no-postgres", action="store_true", help="compare with snapshots only")
    parser.add_argument("--every", type=float, help="reconcile every SECONDS (periodic job)")
    parser.add_argument("--rounds", type=int, help="with --every: stop after N rounds")
    health.add_arguments(parser)  # with --every
    parser.add_argument("--json", action="store_true", help="differences as JSON lines")
    args = parser.parse_args(argv)
    from agentruns.connectors.endpoints import configured_kafka, configured_postgres

    bootstrap = configured_kafka()
    # The projection comparison needs Postgres: without one, say so rather than skip it.
    url = None if args.no_postgres else configured_postgres(required="pass --no-postgres")
    if args.every is not None:
        from agentruns.connectors.logs import setup_logging

        setup_logging("INFO", component="reconcile")
        stop = stop_on_signals()
        serving = health.serving(
            args, "reconcile", bootstrap=bootstrap, database_url=url, consumer=False
        )
        with serving as status:
            status.watch_loop(stop, threading.current_thread())
            job = Reconciler(bootstrap, args.prefix, url, every_s=args.every, sample=args.sample)
            job.run(stop, rounds=args.rounds)
        return 1 if job.differences else 0
    report = audit(
        bootstrap,
        args.prefix,
        url,
        sample=args.sample,
        run_ids=args.runs,
        seed=args.seed,
        say=progress("audit"),
    )
    for d in report.differences:
        if args.json:
            print(json.dumps(asdict(d), default=str, sort_keys=True))
        else:
            print(d.line())
    summary = report.summary()
    print(json.dumps(summary, sort_keys=True) if args.json else _summary_line(summary))
    return 1 if report.differences else 0


def _summary_line(summary: dict[str, Any]) -> str:
    return (
        f"audited {summary['runs']} runs: {summary['differences']} differences in "
        f"{summary['runs_with_differences']} runs"
    )


if __name__ == "__main__":
    from agentruns.connectors.lifecycle import run_command

    raise SystemExit(run_command(main))

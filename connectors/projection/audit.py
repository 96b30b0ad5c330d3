"""Audit from the topics alone (R28) and reconciliation of the projection (R27).

* `agentruns replay RUN_ID [--json]`: the run's timeline, rebuilt from `<prefix>.events` only by
  folding with the CURRENT core: seq, time, type, disposition, status change, effects,
  operations, waits.
* `agentruns audit [--sample N]`: folds every run (or a sample) from the event log and compares
  the result with the latest snapshot (`<prefix>.state`) and with the Postgres projection; prints
  each difference, exits 1 if there is any. `--every SECONDS` keeps doing it (a reconciliation
  job): differences become log lines and the `agentruns_reconcile_differences_total` counter.
* `agentruns revalidate --validator-version N`: re-runs a validator version over every stored
  candidate (artifact store, else the event body) without a model (R10).

Reading order matters when the pipeline is live: the log first, then snapshots, then Postgres, so
a snapshot or row can only be AHEAD of the log that was read (skipped as "in flux" by the
periodic job), never legitimately behind it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from agentruns.connectors.errors import AgentrunsError, AgentrunsKafkaError
from agentruns.connectors.executors.model import candidate_from_artifact
from agentruns.connectors.lifecycle import stop_on_signals
from agentruns.connectors.projection.sink import (
    EVENT_COLUMNS,
    OP_COLUMNS,
    QUESTION_COLUMNS,
    RUN_COLUMNS,
    merge_op,
    merge_question,
    project_event,
    run_row,
)
from agentruns.processors.effects import (
    AskUser,
    CallModel,
    CallTool,
    CancelTimer,
    CancelTool,
    Effect,
    PollTool,
    PublishResult,
    Reconcile,
    ScheduleTimer,
)
from agentruns.processors.events import ModelCallCompleted, ModelOutcome
from agentruns.processors.state import RunState
from agentruns.processors.transition import Disposition, transition
from agentruns.processors.validation import ValidationContext, revalidate
from agentruns.streams.codec import CodecError, decode
from agentruns.streams.partitioning import partition_for
from agentruns.streams.records import RunSlot, parse_event_body
from agentruns.streams.topics import DEFAULT_PREFIX, EVENTS, STATE, topic_name
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition
from prometheus_client import Counter, Gauge

log = logging.getLogger("agentruns.audit")

RECONCILE_DIFFERENCES = Counter(
    "agentruns_reconcile_differences_total", "Differences found by the reconciliation job"
)
RECONCILE_RUNS = Counter("agentruns_reconcile_runs_total", "Runs compared by reconciliation")
RECONCILE_LAGGING = Gauge(
    "agentruns_reconcile_lagging_runs", "Runs whose projection was behind the log last round"
)


class AuditError(AgentrunsError):
    """The topics or the database could not be read for an audit."""


# --------------------------------------------------------------------------- reading topics


def read_topic(
    bootstrap: str,
    topic: str,
    expected_name: str,
    *,
    partitions: Sequence[int] | None = None,
    timeout_s: float = 120.0,
) -> Iterator[dict[str, Any]]:
    """Every committed record of `topic` (or of some partitions), up to the current end."""
    for _, record in read_keyed(
        bootstrap, topic, expected_name, partitions=partitions, timeout_s=timeout_s
    ):
        if record is not None:
            yield record


def read_keyed(
    bootstrap: str,
    topic: str,
    expected_name: str,
    *,
    partitions: Sequence[int] | None = None,
    timeout_s: float = 120.0,
) -> Iterator[tuple[bytes | None, dict[str, Any] | None]]:
    """Every committed record of `topic` with its key, tombstones (None) included, in each
    partition's order, up to the current end."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"agentruns-audit-{uuid.uuid4().hex[:12]}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "fetch.wait.max.ms": 10,
            "log_level": 3,
        }
    )
    try:
        meta = consumer.list_topics(topic, timeout=30).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise AuditError(
                f"topic {topic} does not exist", hint="check --prefix (agentruns topics list)"
            )
        wanted = sorted(meta.partitions) if partitions is None else list(partitions)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in wanted])
        pending = set(wanted)
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise AuditError(f"reading {topic} partitions {sorted(pending)} timed out")
            for message in consumer.consume(1000, 0.5):
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        pending.discard(message.partition() or 0)
                        continue
                    raise AgentrunsKafkaError(f"reading {topic}: {error}")
                value = message.value()
                if value is None:
                    yield message.key(), None
                    continue
                try:
                    yield message.key(), decode(value, expected_name=expected_name).record
                except CodecError as exc:
                    log.error("undecodable record in %s: %s", topic, exc)
    except KafkaException as exc:
        raise AgentrunsKafkaError(f"reading {topic} failed: {exc}") from exc
    finally:
        consumer.close()


def partition_count(bootstrap: str, topic: str) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "agentruns-audit-meta"})
    try:
        meta = consumer.list_topics(topic, timeout=30).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise AuditError(f"topic {topic} does not exist", hint="check --prefix")
        return len(meta.partitions)
    finally:
        consumer.close()


def read_log(
    bootstrap: str, prefix: str, run_ids: Sequence[str] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Event records per run, in seq order (only the partitions of `run_ids` when given)."""
    topic = topic_name(EVENTS, prefix)
    partitions = None
    if run_ids is not None:
        n = partition_count(bootstrap, topic)
        partitions = sorted({partition_for(r, n) for r in run_ids})
    wanted = None if run_ids is None else set(run_ids)
    logs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in read_topic(bootstrap, topic, "Event", partitions=partitions):
        if wanted is None or record["run_id"] in wanted:
            logs[record["run_id"]].append(record)
    for records in logs.values():
        records.sort(key=lambda r: r["seq"])
    return dict(logs)


def read_snapshots(bootstrap: str, prefix: str) -> dict[str, dict[str, Any] | None]:
    """The latest Snapshot record per run (highest version); None for a run whose last state
    record is a tombstone: the processor evicted it after it ended (its log stays whole)."""
    latest: dict[str, dict[str, Any] | None] = {}
    for key, record in read_keyed(bootstrap, topic_name(STATE, prefix), "Snapshot"):
        if record is None:
            if key is not None:
                latest[key.decode("utf-8", "replace")] = None
            continue
        held = latest.get(record["run_id"])
        if held is None or held["version"] <= record["version"]:
            latest[record["run_id"]] = record
    return latest


# --------------------------------------------------------------------------- replay


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def describe_effect(effect: Effect) -> str:
    match effect:
        case CallModel():
            repair = f" repair={effect.repair.error_code}" if effect.repair else ""
            return f"CallModel {effect.step}.{effect.attempt}{repair}"
        case CallTool():
            op = effect.operation
            return f"CallTool {op.tool} op={op.key} dispatch={op.dispatch}"
        case Reconcile():
            return f"Reconcile {effect.tool} op={effect.operation_key}"
        case PollTool():
            return f"PollTool {effect.tool} op={effect.operation_key} poll={effect.poll}"
        case CancelTool():
            return f"CancelTool {effect.tool} op={effect.operation_key}"
        case ScheduleTimer():
            return f"ScheduleTimer {effect.purpose} due={_iso(effect.due_at)}"
        case CancelTimer():
            return f"CancelTimer {effect.timer_id}"
        case AskUser():
            return f"AskUser {effect.question_id} expires={_iso(effect.expires_at)}"
        case PublishResult():
            return f"PublishResult {effect.status} {effect.result_ref}"
    return str(effect.type)  # pragma: no cover - every effect type is listed above


@dataclass
class TimelineEntry:
    seq: int
    at: str
    type: str
    step: int
    attempt: int
    disposition: str
    recorded_disposition: str
    status_before: str | None
    status_after: str
    path: list[str]
    reason: str | None
    effects: list[str]
    operations: list[str]
    waits_ms: dict[str, int]


def timeline(records: Sequence[dict[str, Any]]) -> tuple[list[TimelineEntry], RunState | None]:
    """Fold a run's Event records with the current core; one entry per event."""
    state: RunState | None = None
    entries: list[TimelineEntry] = []
    for record in records:
        projected = project_event(state, record)
        if projected is None:
            continue
        new = projected.state
        before = {} if state is None else {o.key: o for o in state.ops}
        ops: list[str] = []
        for row in projected.ops:
            old = before.get(row["op_key"])
            was = "new" if old is None else str(old.status)
            polls = f" polls={row['polls']}" if row["polls"] else ""
            if row["reconciliation"]:
                polls += f" reconciled={row['reconciliation']}"
            ops.append(
                f"{row['tool']} op={row['op_key']} {was}->{row['status']} "
                f"dispatch={row['dispatch']}{polls}"
            )
        for q in projected.questions:
            expires = q["expires_at"].strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
            ops.append(f"question {q['question_id']} {q['kind']} {q['status']} expires={expires}")
        waits = {"system": 0, "tool": 0, "user": 0}
        if state is not None:
            waits = {
                "system": new.time.system_ms - state.time.system_ms,
                "tool": new.time.tool_wait_ms - state.time.tool_wait_ms,
                "user": new.time.user_wait_ms - state.time.user_wait_ms,
            }
        applied = projected.disposition is Disposition.APPLIED
        entries.append(
            TimelineEntry(
                seq=record["seq"],
                at=_iso(record["at"]),
                type=record["type"],
                step=record["step"],
                attempt=record["attempt"],
                disposition=str(projected.disposition),
                recorded_disposition=record["disposition"],
                status_before=None if state is None else str(state.status),
                status_after=str(new.status),
                path=[str(s) for s in new.path] if applied else [],
                reason=projected.reason,
                effects=[describe_effect(e) for e in projected.effects],
                operations=ops,
                waits_ms=waits,
            )
        )
        state = new
    return entries, state


def format_timeline(run_id: str, entries: Sequence[TimelineEntry], state: RunState | None) -> str:
    lines = [f"run {run_id}: {len(entries)} events"]
    for e in entries:
        change = (
            f"{e.status_before or '-'} -> {e.status_after}"
            if e.status_before != e.status_after
            else f"{e.status_after}"
        )
        disposition = e.disposition
        if e.recorded_disposition != e.disposition:
            disposition += f" (recorded {e.recorded_disposition})"
        lines.append(
            f"{e.seq:>4}  {e.at}  {e.type:<20} {e.step}.{e.attempt}  {disposition:<9} {change}"
        )
        if e.path and len(e.path) > 1:
            lines.append(f"      path: {' -> '.join(e.path)}")
        if e.reason:
            lines.append(f"      reason: {e.reason}")
        for effect in e.effects:
            lines.append(f"      effect: {effect}")
        for op in e.operations:
            kind = "" if op.startswith("question ") else "operation: "
            lines.append(f"      {kind}{op}")
        waited = ", ".join(f"{k} +{v}ms" for k, v in e.waits_ms.items() if v)
        if waited:
            lines.append(f"      time: {waited}")
    if state is not None:
        t = state.time
        lines.append(
            f"final: {state.status} step {state.step} version {state.version} "
            f"resolution {state.resolution} outcome {state.outcome or '-'}"
        )
        lines.append(
            f"time: system {t.system_ms}ms, tool wait {t.tool_wait_ms}ms, "
            f"user wait {t.user_wait_ms}ms; usage: {state.usage.input_tokens} in / "
            f"{state.usage.output_tokens} out tokens, {state.usage.cost_micros} micros"
        )
        if state.result_ref:
            lines.append(f"result: {state.result_ref}")
    return "\n".join(lines)


def timeline_json(run_id: str, entries: Sequence[TimelineEntry], state: RunState | None) -> str:
    final = None
    if state is not None:
        final = {
            "status": str(state.status),
            "step": state.step,
            "version": state.version,
            "resolution": state.resolution,
            "outcome": state.outcome,
            "result_ref": state.result_ref,
            "time": state.time.model_dump(),
            "usage": state.usage.model_dump(),
        }
    return json.dumps(
        {"run_id": run_id, "events": [asdict(e) for e in entries], "final": final},
        sort_keys=True,
    )


# --------------------------------------------------------------------------- audit


@dataclass(frozen=True)
class Difference:
    run_id: str
    where: str  # "log" (current core vs recorded), "snapshot", "postgres"
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
        projected = project_event(out.state, record)
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


def audit(
    bootstrap: str,
    prefix: str,
    database_url: str | None,
    *,
    sample: int | None = None,
    run_ids: Sequence[str] | None = None,
    seed: int | None = None,
    live: bool = False,
) -> AuditReport:
    """Rebuild runs from the log and compare them with snapshots and Postgres.

    `live=True` (the periodic job) tolerates a projection behind the log and a snapshot ahead
    of it (both normal while the pipeline runs); a one-shot audit reports them.
    """
    logs = read_log(bootstrap, prefix, run_ids)
    chosen = sorted(logs)
    if sample is not None and sample < len(chosen):
        chosen = sorted(random.Random(seed).sample(chosen, sample))
    snapshots = read_snapshots(bootstrap, prefix)
    rows = read_postgres(database_url, chosen) if database_url else None
    differences: list[Difference] = []
    lagging: list[str] = []
    for run_id in chosen:
        exp = expected_projection(run_id, logs[run_id])
        differences.extend(exp.divergences)
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


# --------------------------------------------------------------------------- revalidate


@dataclass
class Revalidation:
    run_id: str
    seq: int
    step: int
    attempt: int
    candidate_ref: str
    source: str  # "artifacts" or "event"
    recorded_version: int
    recorded_action: str
    recorded_error: str | None
    reproduced: bool  # the recorded version gives the recorded decision again
    version: int
    action: str
    error: str | None
    detail: str
    changed: bool


def _load_candidates(database_url: str | None, refs: Iterable[str]) -> dict[str, str]:
    wanted = sorted(set(refs))
    if database_url is None or not wanted:
        return {}
    try:
        with psycopg.connect(database_url, connect_timeout=10) as conn:
            rows = conn.execute(
                "SELECT ref, content FROM artifacts WHERE ref = ANY(%s)", (wanted,)
            ).fetchall()
    except psycopg.Error as exc:
        raise AuditError(f"reading candidate artifacts failed: {exc}") from exc
    return {str(ref): bytes(content).decode() for ref, content in rows}


def revalidate_runs(
    logs: dict[str, list[dict[str, Any]]], version: int, database_url: str | None
) -> list[Revalidation]:
    """Every validated candidate in the logs, re-validated with `version` (no model)."""
    found: list[tuple[str, int, ModelCallCompleted, RunState, RunState]] = []
    for run_id in sorted(logs):
        state: RunState | None = None
        for record in logs[run_id]:
            event = parse_event_body(record["body"])
            result = transition(state, event)
            new = result.state
            if (
                isinstance(event, ModelCallCompleted)
                and state is not None
                and new is not None
                and result.disposition is Disposition.APPLIED
                and event.outcome is ModelOutcome.FINISHED
                and event.candidate is not None
                and new.last_decision is not None
                and new.last_decision is not state.last_decision
            ):
                found.append((run_id, record["seq"], event, state, new))
            state = new
    stored = _load_candidates(
        database_url, (n.last_decision.candidate_ref for *_, n in found if n.last_decision)
    )
    out: list[Revalidation] = []
    for run_id, seq, event, before, after in found:
        decision = after.last_decision
        assert decision is not None and event.candidate is not None
        content = stored.get(decision.candidate_ref)
        # The model executor's artifact (an assistant message) or the core's own format.
        candidate = event.candidate if content is None else candidate_from_artifact(content)
        context = ValidationContext.from_state(before)
        again = revalidate(candidate, context, decision.validator_version)
        fresh = revalidate(candidate, context, version)
        out.append(
            Revalidation(
                run_id=run_id,
                seq=seq,
                step=event.step,
                attempt=event.attempt,
                candidate_ref=decision.candidate_ref,
                source="event" if content is None else "artifacts",
                recorded_version=decision.validator_version,
                recorded_action=decision.action,
                recorded_error=decision.error_code,
                reproduced=(again.action, again.error_code, again.evidence_hash)
                == (decision.action, decision.error_code, decision.evidence_hash),
                version=version,
                action=fresh.action,
                error=fresh.error_code,
                detail=fresh.detail,
                changed=(fresh.action, fresh.error_code) != (decision.action, decision.error_code),
            )
        )
    return out


# --------------------------------------------------------------------------- CLI


def _endpoints() -> tuple[Any, str, str | None]:
    from agentruns.connectors.devstack.services import ServiceStack

    stack = ServiceStack()
    try:
        stack.start()
    except BaseException:
        stack.close()  # never leave a half-started stack behind
        raise
    assert stack.endpoints is not None
    return stack, stack.endpoints.kafka_bootstrap, stack.endpoints.database_url


def replay_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agentruns replay", description="a run's timeline, from the event log alone"
    )
    parser.add_argument("run_id")
    parser.add_argument(
        "--prefix", default=os.environ.get("AGENTRUNS_TOPIC_PREFIX", DEFAULT_PREFIX)
    )
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args(argv)
    try:
        stack, bootstrap, _ = _endpoints()
        try:
            records = read_log(bootstrap, args.prefix, [args.run_id]).get(args.run_id, [])
        finally:
            stack.close()
    except AgentrunsError as exc:
        print(f"agentruns replay: {exc.one_line()}", file=sys.stderr)
        return 2
    if not records:
        print(f"agentruns replay: no events for run {args.run_id}", file=sys.stderr)
        return 1
    entries, state = timeline(records)
    if args.json:
        print(timeline_json(args.run_id, entries, state))
    else:
        print(format_timeline(args.run_id, entries, state))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`agentruns audit`."""
    parser = argparse.ArgumentParser(
        prog="agentruns audit",
        description="fold runs from the event log and compare with snapshots and Postgres",
    )
    parser.add_argument(
        "--prefix", default=os.environ.get("AGENTRUNS_TOPIC_PREFIX", DEFAULT_PREFIX)
    )
    parser.add_argument("--sample", type=int, help="audit N runs chosen at random")
    parser.add_argument("--seed", type=int, help="seed of the sample")
    parser.add_argument("--run", action="append", dest="runs", help="audit this run (repeat)")
    parser.add_argument("--no-postgres", action="store_true", help="compare with snapshots only")
    parser.add_argument("--every", type=float, help="reconcile every SECONDS (periodic job)")
    parser.add_argument("--rounds", type=int, help="with --every: stop after N rounds")
    parser.add_argument("--metrics-port", type=int, help="with --every: serve Prometheus metrics")
    parser.add_argument("--json", action="store_true", help="differences as JSON lines")
    args = parser.parse_args(argv)
    try:
        stack, bootstrap, database_url = _endpoints()
    except AgentrunsError as exc:
        print(f"agentruns audit: {exc.one_line()}", file=sys.stderr)
        return 2
    url = None if args.no_postgres else database_url
    try:
        if args.every is not None:
            from agentruns.connectors.logs import setup_logging

            setup_logging("INFO", component="reconcile")
            if args.metrics_port:
                from prometheus_client import start_http_server

                start_http_server(args.metrics_port)
            stop = stop_on_signals()
            job = Reconciler(bootstrap, args.prefix, url, every_s=args.every, sample=args.sample)
            job.run(stop, rounds=args.rounds)
            return 1 if job.differences else 0
        report = audit(
            bootstrap, args.prefix, url, sample=args.sample, run_ids=args.runs, seed=args.seed
        )
    except AgentrunsError as exc:
        print(f"agentruns audit: {exc.one_line()}", file=sys.stderr)
        return 2
    finally:
        stack.close()
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


def revalidate_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agentruns revalidate",
        description="re-run a validator version over stored candidates, without a model (R10)",
    )
    parser.add_argument("--validator-version", type=int, required=True)
    parser.add_argument(
        "--prefix", default=os.environ.get("AGENTRUNS_TOPIC_PREFIX", DEFAULT_PREFIX)
    )
    parser.add_argument("--run", action="append", dest="runs", help="only this run (repeat)")
    parser.add_argument("--changed-only", action="store_true")
    parser.add_argument("--json", action="store_true", help="one JSON line per candidate")
    args = parser.parse_args(argv)
    try:
        stack, bootstrap, database_url = _endpoints()
        try:
            logs = read_log(bootstrap, args.prefix, args.runs)
            results = revalidate_runs(logs, args.validator_version, database_url)
        finally:
            stack.close()
    except AgentrunsError as exc:
        print(f"agentruns revalidate: {exc.one_line()}", file=sys.stderr)
        return 2
    changed = 0
    for r in results:
        changed += r.changed
        if args.changed_only and not r.changed:
            continue
        if args.json:
            print(json.dumps(asdict(r), sort_keys=True))
        else:
            recorded = f"v{r.recorded_version} {r.recorded_action}" + (
                f"({r.recorded_error})" if r.recorded_error else ""
            )
            now = f"v{r.version} {r.action}" + (f"({r.error})" if r.error else "")
            mark = "CHANGED" if r.changed else "same"
            lines = f"{r.run_id} seq {r.seq} {r.step}.{r.attempt}: {recorded} -> {now}  {mark}"
            if not r.reproduced:
                lines += "  (recorded decision NOT reproduced)"
            print(lines)
    summary = {
        "candidates": len(results),
        "changed": changed,
        "not_reproduced": sum(not r.reproduced for r in results),
        "validator_version": args.validator_version,
    }
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`agentruns revalidate --validator-version N`: re-runs a validator version over every stored
candidate (artifact store, else the event body) without a model (R10), and says whether the
recorded decision is reproduced and whether the new version decides otherwise.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import psycopg

from agentruns.connectors.lifecycle import progress
from agentruns.connectors.projection.reading import AuditError, read_log
from agentruns.processors import versions
from agentruns.processors.events import ModelCallCompleted, ModelOutcome
from agentruns.processors.state import RunState
from agentruns.processors.transition import Disposition, load_candidate
from agentruns.processors.validation import ValidationContext, revalidate
from agentruns.streams.records import parse_event_body
from agentruns.streams.topics import default_prefix


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
            result = versions.apply(state, event)  # the run's own rules version
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
        candidate = event.candidate if content is None else load_candidate(content)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agentruns revalidate",
        description="re-run a validator version over stored candidates, without a model (R10)",
    )
    parser.add_argument("--validator-version", type=int, required=True)
    parser.add_argument("--prefix", default=default_prefix())
    parser.add_argument("--run", action="append", dest="runs", help="only this run (repeat)")
    parser.add_argument("--changed-only", action="store_true")
    parser.add_argument("--json", action="store_true", help="one JSON line per candidate")
    args = parser.parse_args(argv)
    from agentruns.connectors.endpoints import configured_kafka, configured_postgres

    # Candidates stored only as artifacts need Postgres; the others are in the log itself.
    database_url = configured_postgres(required=None)
    logs = read_log(configured_kafka(), args.prefix, args.runs, say=progress("revalidate"))
    results = revalidate_runs(logs, args.validator_version, database_url)
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
    from agentruns.connectors.lifecycle import run_command

    raise SystemExit(run_command(main))

"""`agentruns versions`: which transition rules versions the runs in the projection use.

Read from the Postgres projection (`runs.state` holds each run's state as the sink folded
it; a state without `rules_version` is version 1), counted by version, live and ended runs
apart. Before a build that drops a rule set is deployed, its version must have no live runs
(docs/operations.md).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import psycopg

from agentruns.connectors.projection.stuck import TERMINAL_SQL
from agentruns.processors import versions

# One pass over the runs table; the state text is parsed by Postgres (json, not jsonb: no
# need to build the binary form to read one top-level key).
COUNT_SQL = (
    "SELECT coalesce((state::json ->> 'rules_version')::int, 1) AS version,"
    f" count(*) FILTER (WHERE status NOT IN {TERMINAL_SQL}) AS live,"
    f" count(*) FILTER (WHERE status IN {TERMINAL_SQL}) AS ended"
    " FROM runs GROUP BY 1 ORDER BY 1"
)


def count_versions(database_url: str) -> list[dict[str, int]]:
    """[{"version", "live", "ended"}] for every rules version a projected run uses."""
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(COUNT_SQL).fetchall()
    return [{"version": int(v), "live": int(live), "ended": int(e)} for v, live, e in rows]


def report(counts: list[dict[str, int]]) -> dict[str, Any]:
    return {
        "versions": counts,
        "this_build": sorted(versions.RULES),
        "unknown_to_this_build": [
            c["version"] for c in counts if not versions.known(c["version"]) and c["live"]
        ],
    }


def format_report(found: dict[str, Any]) -> str:
    lines = [f"{'rules version':>13}  {'live runs':>9}  {'ended runs':>10}"]
    for c in found["versions"]:
        lines.append(f"{c['version']:>13}  {c['live']:>9}  {c['ended']:>10}")
    if not found["versions"]:
        lines.append("(no runs projected)")
    built = ", ".join(str(v) for v in found["this_build"])
    lines.append(f"this build has rules versions {built}")
    unknown = found["unknown_to_this_build"]
    if unknown:
        lines.append(
            "live runs of versions this build does not have: "
            + ", ".join(str(v) for v in unknown)
            + " (a processor of this build stops their partitions)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agentruns versions",
        description="which transition rules versions the projected runs use, with counts",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args(argv)
    from agentruns.connectors.endpoints import configured_postgres

    database_url = configured_postgres(required="")
    assert database_url is not None
    found = report(count_versions(database_url))
    print(json.dumps(found) if args.json else format_report(found))
    return 0


if __name__ == "__main__":
    from agentruns.connectors.lifecycle import run_command

    raise SystemExit(run_command(main))

"""`agentruns replay RUN_ID [--json]`: a run's timeline from the event log alone (R28), see
`agentruns.connectors.projection.timeline`.
"""

from __future__ import annotations

import argparse
import sys

from agentruns.connectors.lifecycle import progress
from agentruns.connectors.projection.reading import read_log
from agentruns.connectors.projection.timeline import format_timeline, timeline, timeline_json
from agentruns.streams.topics import default_prefix


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agentruns replay", description="a run's timeline, from the event log alone"
    )
    parser.add_argument("run_id")
    parser.add_argument("--prefix", default=default_prefix())
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args(argv)
    from agentruns.connectors.endpoints import configured_kafka

    logs = read_log(configured_kafka(), args.prefix, [args.run_id], say=progress("replay"))
    records = logs.get(args.run_id, [])
    if not records:
        print(f"agentruns: no events for run {args.run_id}", file=sys.stderr)
        return 1
    entries, state = timeline(records)
    if args.json:
        print(timeline_json(args.run_id, entries, state))
    else:
        print(format_timeline(args.run_id, entries, state))
    return 0


if __name__ == "__main__":
    from agentruns.connectors.lifecycle import run_command

    raise SystemExit(run_command(main))

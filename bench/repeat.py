"""``agentruns bench repeat [--trials N] BENCH [ARGS...]``: run one bench N times, report medians.

On a shared 2-core VM one bench run says little: identical runs of the same code differ by 25%
and more from one minute to the next (every bench prints the hypervisor's steal and how busy the
machine was). A target is judged on the median of several trials, with the spread beside it.

Each trial is exactly ``agentruns bench BENCH ARGS`` in a subprocess (its last stdout line is
its JSON figures), so it starts and stops its own Kafka and Postgres unless
``KAFKA_BOOTSTRAP_SERVERS`` and ``DATABASE_URL`` name them: the trials are the independent
runs a target is stated for.

Prints, as one JSON object on its last line: ``median``, ``min`` and ``max`` of every number the
trials reported (nested objects too; lists and strings are left out), the bench's targets
judged on the median (``median_checks``, ``median_meets_targets``; see ``bench/targets.py``), how
many trials met all of them on their own, and ``trials``: each trial's whole JSON, in order.

``--contend N`` runs N busy-loop processes beside each trial
(``agentruns.bench.machine.neighbours``), each
taking a core's worth of CPU at normal priority: a noisy neighbour made reproducible, so a change
meant for a busy host can be judged against the same load twice.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentruns.bench.machine import neighbours
from agentruns.bench.results_file import report
from agentruns.bench.targets import evaluate, figure, targets_of

BENCHES = ("core", "processor", "executors", "sink", "floor", "loop", "console")
# The benches that also write their figures to a file (``--out``, by default their latest result
# in bench/results/): a trial is not the latest result, so it writes to a file of its own.
WRITES_OUT = ("processor", "floor", "loop")

Json = dict[str, Any]


def combine(trials: Sequence[Json], pick: Callable[[list[float]], float]) -> Json:
    """``pick`` over the trials of every numeric leaf (booleans, strings and lists are not
    figures to combine); a key some trial lacks or holds something else in is left out."""
    out: Json = {}
    for key, first in trials[0].items():
        values = [t.get(key) for t in trials]
        if isinstance(first, dict) and all(isinstance(v, dict) for v in values):
            nested = combine(values, pick)  # type: ignore[arg-type]
            if nested:
                out[key] = nested
        elif all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            picked = pick([float(v) for v in values])  # type: ignore[arg-type]
            out[key] = round(picked, 3)
    return out


def last_json_line(stdout: str) -> Json:
    """The JSON object a bench prints on its last (non-empty) line."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError("the bench printed nothing")
    figures = json.loads(lines[-1])
    if not isinstance(figures, dict):
        raise ValueError(f"the bench's last line is not a JSON object: {lines[-1][:200]}")
    return figures


def trial_args(bench: str, args: Sequence[str], scratch: str) -> list[str]:
    """The bench's arguments for one trial: an ``--out`` in ``scratch`` unless they name one,
    so no trial writes over the bench's latest result."""
    named = any(a == "--out" or a.startswith("--out=") for a in args)
    if bench not in WRITES_OUT or named:
        return list(args)
    return [*args, "--out", str(Path(scratch) / f"{bench}.json")]


def run_trial(bench: str, args: Sequence[str]) -> Json:
    """One run of ``agentruns bench BENCH ARGS`` in a subprocess (its stderr passes through)."""
    with tempfile.TemporaryDirectory(prefix="agentruns-trial-") as scratch:
        argv = trial_args(bench, args, scratch)
        cmd = [sys.executable, "-m", "agentruns.connectors.cli", "bench", bench, *argv]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"trial failed (exit {done.returncode}): {' '.join(cmd)}")
    return last_json_line(done.stdout)


def summary(figures: Json) -> list[str]:
    """One line per target for people: median, range over the trials, met on the median."""
    contend = f", {figures['contend']} busy neighbour(s)" if figures.get("contend") else ""
    lines = [f"{figures['of']}: {figures['trials_run']} trials{contend}"]
    low, high = figures["min"], figures["max"]
    for check in figures["median_checks"]:
        path, sign = check["figure"], "<=" if check["at_most"] else ">="
        verdict = {True: "met", False: "MISSED", None: "not measured"}[check["met"]]
        lines.append(
            f"  {path} {sign} {check['bound']:g}: median {check['value']}"
            f" ({figure(low, path)} .. {figure(high, path)}) {verdict}"
        )
    lines.append(f"  trials meeting every target: {figures['trials_meeting_targets']}")
    lines.extend(f"  trial {i}: {host_line(t)}" for i, t in enumerate(figures["trials"], 1))
    return lines


def _steal(value: Any) -> list[float]:
    """Every ``steal_pct`` the bench reported, in any phase."""
    if isinstance(value, dict):
        found = [float(v) for k, v in value.items() if k == "steal_pct" and v is not None]
        return found + [s for v in value.values() for s in _steal(v)]
    return []


def host_line(trial: Json) -> str:
    """How the host was during one trial, beside its verdict: a missed target on a host that
    was stolen from or slow says little about the code."""
    parts = []
    steal = _steal(trial)
    if steal:
        parts.append(f"steal up to {max(steal):g}%")
    speed = trial.get("host_speed")
    if isinstance(speed, dict) and speed.get("core_fold_us_per_event") is not None:
        parts.append(f"host_speed {speed['core_fold_us_per_event']:g} µs/event")
    met = trial.get("meets_targets")
    verdict = "no targets" if met is None else "met every target" if met else "missed a target"
    return ", ".join([*parts, verdict])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns bench repeat", description=__doc__)
    parser.add_argument("--trials", type=int, default=3, help="runs of the bench (at least 2)")
    parser.add_argument(
        "--out", help="also write the JSON here (default bench/results/BENCH-trials.json)"
    )
    parser.add_argument(
        "--contend",
        type=int,
        default=0,
        help="busy-loop processes running beside each trial (a noisy neighbour)",
    )
    parser.add_argument("bench", choices=BENCHES)
    parser.add_argument("args", nargs=argparse.REMAINDER, help="passed to the bench")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.trials < 2:
        parser.error("--trials must be at least 2: one run is what `agentruns bench` does")
    if args.contend < 0:
        parser.error("--contend must not be negative")
    trials: list[Json] = []
    for i in range(args.trials):
        print(f"trial {i + 1}/{args.trials}: bench {args.bench}", file=sys.stderr, flush=True)
        with neighbours(args.contend):
            trials.append(run_trial(args.bench, args.args))
    median = combine(trials, statistics.median)
    checks = trials[0].get("checks")
    judged = evaluate(median, targets_of(checks)) if isinstance(checks, list) else {}
    figures = {
        "bench": "repeat",
        "of": args.bench,
        "args": args.args,
        "contend": args.contend,
        "trials_run": len(trials),
        # the targets judged on the median of the trials, not on any one of them
        "median_checks": judged.get("checks", []),
        "median_meets_targets": judged.get("meets_targets"),
        "trials_meeting_targets": sum(1 for t in trials if t.get("meets_targets") is True),
        "median": median,
        "min": combine(trials, min),
        "max": combine(trials, max),
        "trials": trials,
    }
    for line in summary(figures):
        print(line, file=sys.stderr)
    report(figures, args.out or f"bench/results/{args.bench}-trials.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the pipeline adds to runs whose backends take time: each run's latency against the sum of
its own backends' latencies, throughput against the ideal for those latencies, and the effects
the executors keep in flight (`agentruns bench loop --model-latency ... --tool-latency ...`).

The scripted servers draw each call's latency (their ``latency`` fault) and account it per run
(``GET /latency``: the model server by conversation, which is the run id; the tool server by the
``X-Agentruns-Run-Id`` header), so a run's own backend time is measured, not assumed.
"""

from __future__ import annotations

import heapq
import json
import statistics
import threading
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from agentruns.bench.latency import percentile

Json = dict[str, Any]


def model_latency_rule(text: str, chunk_ms: float, scenario: str | None) -> Json:
    """``MEDIAN_MS[:SIGMA]`` as the model server's ``latency`` rule for every call (of
    ``scenario`` only, when given), streaming a chunk every ``chunk_ms``."""
    median, _, sigma = text.partition(":")
    rule: Json = {
        "kind": "latency",
        "times": None,
        "median_ms": float(median),
        "sigma": float(sigma) if sigma else 0.5,
        "chunk_ms": chunk_ms,
    }
    if scenario is not None:
        rule["scenario"] = scenario
    return rule


def tool_latency_rule(text: str) -> Json:
    """``MIN_MS:MAX_MS`` as the tool server's ``latency`` rule for every tool (log-uniform)."""
    low, _, high = text.partition(":")
    return {
        "target": "*",
        "kind": "latency",
        "times": None,
        "min_ms": float(low),
        "max_ms": float(high or low),
    }


def post_json(url: str, body: Json, timeout: float = 10.0) -> Any:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return json.loads(answer.read())


def backend_ms_by_kind(
    model: Mapping[str, Any], tool: Mapping[str, Any]
) -> dict[str, dict[str, float]]:
    """``model`` and ``tool``: run id -> the milliseconds its calls of that backend were
    planned to take, from the model server's ``/latency`` answer (``conversations``) and the
    tool server's (``runs``)."""
    return {
        kind: {run_id: float(figures.get("ms", 0.0)) for run_id, figures in section.items()}
        for kind, section in (
            ("model", model.get("conversations") or {}),
            ("tool", tool.get("runs") or {}),
        )
    }


def backend_ms(model: Mapping[str, Any], tool: Mapping[str, Any]) -> dict[str, float]:
    """Run id -> the milliseconds its backends were planned to take, both kinds together
    (`backend_ms_by_kind`)."""
    out: dict[str, float] = {}
    for runs in backend_ms_by_kind(model, tool).values():
        for run_id, ms in runs.items():
            out[run_id] = out.get(run_id, 0.0) + ms
    return out


def planned_call_ms_mean(latency: Mapping[str, Any], runs: Iterable[str]) -> float | None:
    """The mean time a scripted server planned for one call of ``runs``, from its
    ``/latency`` answer (the model server's ``conversations``, the tool server's ``runs``):
    against the executor's ``call_ms_mean``, what the client side adds to a call."""
    section = latency.get("conversations") or latency.get("runs") or {}
    calls = ms = 0.0
    for run_id in runs:
        figures = section.get(run_id) or {}
        calls += float(figures.get("calls", 0))
        ms += float(figures.get("ms", 0.0))
    return round(ms / calls, 1) if calls else None


def served_over_planned(model: Mapping[str, Any], runs: Iterable[str]) -> float | None:
    """How much longer the model server took to serve ``runs``' calls than it planned (its
    ``served_ms`` over its ``ms``): above 1.0 the server itself fell behind (a busy machine),
    and the runs' backend time is more than the planned time the ratios divide by."""
    conversations = model.get("conversations") or {}
    planned = served = 0.0
    for run_id in runs:
        figures = conversations.get(run_id) or {}
        planned += float(figures.get("ms", 0.0))
        served += float(figures.get("served_ms", 0.0))
    return round(served / planned, 3) if planned > 0 else None


def ideal_elapsed_s(backend_s: Sequence[float], concurrency: int) -> float:
    """How long the driver's closed loop would take if every run took exactly its backends'
    time: ``concurrency`` slots, each run started in order as soon as a slot is free."""
    if not backend_s or concurrency < 1:
        return 0.0
    slots = [0.0] * min(concurrency, len(backend_s))
    heapq.heapify(slots)
    end = 0.0
    for seconds in backend_s:
        start = heapq.heappop(slots)
        finish = start + seconds
        end = max(end, finish)
        heapq.heappush(slots, finish)
    return end


def overhead_figures(
    runs: Sequence[str],
    latency_s: Mapping[str, float],
    backends_ms: Mapping[str, float],
    concurrency: int,
    elapsed_s: float,
) -> Json:
    """Each finished run's latency over its own backend time (p50, p99: 1.0 is no overhead),
    that backend time (p50), and throughput against the ideal for those backend times
    (``ideal_elapsed_s`` over the level's elapsed time: 1.0 is ideal)."""
    measured = [r for r in runs if r in latency_s and backends_ms.get(r, 0.0) > 0]
    ratios = [latency_s[r] / (backends_ms[r] / 1000) for r in measured]
    backend = [backends_ms[r] / 1000 for r in runs if backends_ms.get(r, 0.0) > 0]
    ideal = ideal_elapsed_s(backend, concurrency) if len(backend) == len(runs) else None
    return {
        "runs_measured": len(measured),
        "run_backend_ms_p50": round(percentile(backend, 0.5) * 1000, 1) if backend else None,
        "run_over_backend_p50": round(percentile(ratios, 0.5), 3) if ratios else None,
        "run_over_backend_p99": round(percentile(ratios, 0.99), 3) if ratios else None,
        "throughput_vs_ideal": round(ideal / elapsed_s, 3) if ideal and elapsed_s else None,
    }


def in_flight_of(metrics: str) -> dict[str, float]:
    """``kind`` -> effects running, from an executor's ``/metrics`` text."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        if family.name != "agentruns_executor_in_flight":
            continue
        for sample in family.samples:
            if sample.labels.get("state") == "running":
                out[sample.labels.get("kind", "")] = sample.value
    return out


def histogram_sums(metrics: str, family: str, label: str | None = None) -> dict[str, list[float]]:
    """A histogram's [sum, count] so far from a ``/metrics`` text, by the value of ``label``
    (one entry, "", without it)."""
    out: dict[str, list[float]] = {}
    for found in text_string_to_metric_families(metrics):
        if found.name != family:
            continue
        for sample in found.samples:
            key = sample.labels.get(label, "") if label else ""
            totals = out.setdefault(key, [0.0, 0.0])
            if sample.name.endswith("_sum"):
                totals[0] += sample.value
            elif sample.name.endswith("_count"):
                totals[1] += sample.value
    return out


def calls_of(metrics: str) -> tuple[float, float]:
    """(seconds, count) of the handler calls an executor's ``/metrics`` text counts so far."""
    seconds, count = histogram_sums(metrics, "agentruns_executor_call_seconds").get("", [0, 0])
    return seconds, count


def means_between(
    before: Mapping[str, Sequence[float]], after: Mapping[str, Sequence[float]], scale: float
) -> dict[str, float]:
    """Per key, the mean of what was observed between two ``histogram_sums`` readings."""
    out: dict[str, float] = {}
    for key, (total, count) in after.items():
        total0, count0 = before.get(key, (0.0, 0.0))
        if count > count0:
            out[key] = round((total - total0) / (count - count0) * scale, 2)
    return out


class InFlightSampler:
    """Reads the components' ``/metrics`` while a level runs. For each executor, every
    ``every_s``: the effects it keeps in flight (running calls), as p50 and max, and the mean
    time of the calls it made meanwhile as it saw them (``call_ms_mean``: the backend's time
    plus the client's own delays). For each processor: the mean time of each commit stage and
    the mean inputs per transaction over the level."""

    def __init__(
        self,
        executors: Mapping[str, str],
        processors: Mapping[str, str] | None = None,
        every_s: float = 0.5,
    ) -> None:
        self._executors = dict(executors)  # name -> http://host:port/metrics
        self._processors = dict(processors or {})
        self._every_s = every_s
        self._samples: dict[str, list[float]] = {name: [] for name in executors}
        self._before: dict[str, str | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> InFlightSampler:
        self._before = {n: _read(u) for n, u in {**self._executors, **self._processors}.items()}
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            for name, url in self._executors.items():
                text = _read(url)
                if text is not None:
                    self._samples[name].append(sum(in_flight_of(text).values()))

    def stop(self) -> Json:
        self._stop.set()
        self._thread.join(5)
        out: Json = {name: _summary(values) for name, values in self._samples.items()}
        for name, url in self._executors.items():
            before, after = self._before.get(name), _read(url)
            if before is not None and after is not None:
                calls = means_between({"": calls_of(before)}, {"": calls_of(after)}, 1000.0).get("")
                if calls is not None:
                    out[name]["call_ms_mean"] = round(calls, 1)
        for name, url in self._processors.items():
            before, after = self._before.get(name), _read(url)
            if before is None or after is None:
                continue
            stage = "agentruns_commit_stage_seconds"
            out[name] = {
                "commit_stage_ms_mean": means_between(
                    histogram_sums(before, stage, "stage"),
                    histogram_sums(after, stage, "stage"),
                    1000.0,
                ),
                "inputs_per_transaction": means_between(
                    histogram_sums(before, "agentruns_batch_inputs"),
                    histogram_sums(after, "agentruns_batch_inputs"),
                    1.0,
                ).get(""),
            }
        return out


def _read(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as answer:
            text: str = answer.read().decode()
            return text
    except OSError:
        return None


def _summary(values: Iterable[float]) -> Json:
    ordered = sorted(values)
    if not ordered:
        return {}
    return {"p50": statistics.median(ordered), "max": ordered[-1]}


__all__ = [
    "InFlightSampler",
    "backend_ms",
    "get_json",
    "histogram_sums",
    "ideal_elapsed_s",
    "in_flight_of",
    "means_between",
    "model_latency_rule",
    "overhead_figures",
    "post_json",
    "served_over_planned",
    "tool_latency_rule",
]

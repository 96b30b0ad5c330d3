"""Every consuming service, each in its own process, scraped during a run: each family's name,
type and labels are the ones docs/metrics.md lists, its names follow Prometheus' rules, and the
metrics an operator's alerts read (build info, consumer lag per partition, tokens and cost per
route, runs ended, step latency) are there. `/readyz` and `/livez` answer beside `/healthz`."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentruns.connectors.dev.servers import model_server, tool_server
from agentruns.connectors.dev.stack.procs import free_port_block
from agentruns.connectors.dev.stack.supervisor import Supervisor
from agentruns.processors.state import ToolSpec
from agentruns.streams.topics import INBOX, effect_suffix, topic_name
from tests.support.executors import fast_registry
from tests.support.metrics_doc import documented, naming_problems
from tests.support.pipeline import Inbox, Pipeline
from tests.support.waiting import wait_for

PARTITIONS = 2

SERVICES = ("processor", "model-executor", "tool-executor", "timer", "sink")


def _argv(service: str, registry: Path, models: str, tools: str) -> tuple[str, ...]:
    return {
        "processor": ("agentruns.connectors.runtime.processor", "--registry", str(registry)),
        "model-executor": (
            "agentruns.connectors.executors.model",
            *("--base-url", models + "/v1", "--registry", str(registry)),
        ),
        "tool-executor": (
            "agentruns.connectors.executors.tool",
            *("--base-url", tools, "--registry", str(registry)),
        ),
        "timer": ("agentruns.connectors.runtime.timers",),
        "sink": ("agentruns.connectors.projection.sink",),
    }[service]


def _scrape(url: str) -> dict[str, tuple[str, list[dict[str, str]]]]:  # a Scrape
    """The agentruns_* families of one scrape: name as scraped -> (type, each sample's labels)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("agentruns_"):
            continue
        if family.name.endswith("_created"):  # prometheus-client's creation time of a family
            continue
        name = family.name + "_total" if family.type == "counter" else family.name
        found[name] = (family.type, [dict(s.labels) for s in family.samples])
    return found


def _labels(kind: str, samples: list[dict[str, str]]) -> set[frozenset[str]]:
    structural = {"le"} if kind == "histogram" else set()
    return {frozenset(k for k in s if k not in structural) for s in samples}


# what each service's scrape must carry once a run succeeded: (name, labels it has)
Check = tuple[str, dict[str, str]]
EVERY_SERVICE: list[Check] = [("agentruns_build_info", {}), ("agentruns_consumer_lag", {})]
WANTED: dict[str, list[Check]] = {
    "processor": [
        ("agentruns_transitions_total", {"disposition": "applied"}),
        ("agentruns_consumer_offset", {}),
    ],
    "model-executor": [
        ("agentruns_model_tokens_total", {"direction": "input", "route": "default"}),
        ("agentruns_model_tokens_total", {"direction": "output", "route": "default"}),
        ("agentruns_model_cost_total", {"route": "default"}),
    ],
    "tool-executor": [("agentruns_executor_records_total", {"kind": "tool"})],
    "timer": [],
    "sink": [
        ("agentruns_runs_ended_total", {"status": "succeeded", "reason": "answer"}),
        ("agentruns_run_step_seconds", {}),
    ],
}
Scrape = dict[str, tuple[str, list[dict[str, str]]]]


def _carrying(url: str, checks: list[Check]) -> Scrape | None:
    """The service's scrape once it carries every one of ``checks``."""
    scrape = _scrape(url)
    return scrape if all(_has(scrape, name, **labels) for name, labels in checks) else None


def _has(scrape: Scrape, name: str, **labels: str) -> bool:
    _, samples = scrape.get(name, ("", []))
    return any(all(s.get(k) == v for k, v in labels.items()) for s in samples)


@pytest.mark.timeout(300)
def test_every_service_scrape_matches_the_documented_metrics(
    kafka_bootstrap: str, database_url: str, prefix: str, tmp_path: Path
) -> None:
    ports = free_port_block(len(SERVICES), start=29300)
    urls = {s: f"http://127.0.0.1:{ports + i}" for i, s in enumerate(SERVICES)}
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "DATABASE_URL": database_url,
        "AGENTRUNS_LOG_LEVEL": "WARNING",
    }
    with (
        model_server.serve("127.0.0.1", 0) as models,
        tool_server.serve("127.0.0.1", 0) as tools,
    ):
        registry = fast_registry(tmp_path, tools.url)
        specs = tuple(
            ToolSpec(
                name=t["name"], parameters=t["parameters"], permission=t["permission"],
                is_async=t["async"],
            )
            for t in json.loads(registry.read_text())["tools"]
            if t["permission"] != "admin"
        )  # fmt: skip
        sup = Supervisor(tmp_path / "logs", env)
        for service in SERVICES:
            sup.add(
                service,
                *_argv(service, registry, models.url, tools.url),
                *("--prefix", prefix, "--metrics-address", urls[service].removeprefix("http://")),
            )
        sup.start_all()
        inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
        try:
            for service, url in urls.items():
                wait_for(
                    lambda url=url: _ready(url), timeout=120, what=f"{service} ready on /readyz"
                )
            pipeline = Pipeline(kafka_bootstrap, prefix, models, tools, specs, inbox)
            run_id = f"run-scrape-{time.monotonic_ns() % 10**9}"
            pipeline.submit(run_id)
            assert pipeline.result(run_id, timeout=120)["status"] == "SUCCEEDED"

            scrapes = {
                service: wait_for(
                    lambda url=url, checks=[*WANTED[service], *EVERY_SERVICE]: _carrying(
                        url, checks
                    ),
                    timeout=60,
                    what=f"{service}'s metrics",
                )
                for service, url in urls.items()
            }
        finally:
            inbox.close()
            sup.stop_all()

    docs = documented()
    problems: list[str] = []
    for service, scrape in scrapes.items():
        for name, (kind, samples) in scrape.items():
            doc = docs.get(name)
            if doc is None:
                problems.append(f"{service}: {name} is not in docs/metrics.md")
                continue
            if doc.type != kind:
                problems.append(f"{service}: {name} is a {kind}, documented as a {doc.type}")
            for labels in _labels(kind, samples):
                if labels != doc.labels:
                    problems.append(f"{service}: {name} {sorted(labels)} != {sorted(doc.labels)}")
            for sample in samples:
                problems += [f"{service}: {p}" for p in naming_problems(name, kind, sample)]
        lag = scrape["agentruns_consumer_lag"][1]
        assert lag and all(int(s["partition"]) >= 0 for s in lag), (service, lag)
        assert {s["group"] for s in lag} and all(s["group"].startswith(prefix) for s in lag)
    assert sorted(set(problems)) == [], "\n".join(sorted(set(problems)))
    (info,) = scrapes["sink"]["agentruns_build_info"][1]
    assert info["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    lag_of = {
        s: {x["topic"] for x in scrape["agentruns_consumer_lag"][1]}
        for s, scrape in scrapes.items()
    }
    assert lag_of["processor"] == {topic_name(INBOX, prefix)}
    assert lag_of["model-executor"] == {topic_name(effect_suffix("model"), prefix)}


def _ready(url: str) -> bool:
    try:
        ready = httpx.get(url + "/readyz", timeout=5)
        live = httpx.get(url + "/livez", timeout=5)
        healthz = httpx.get(url + "/healthz", timeout=5)
    except httpx.TransportError:
        return False
    return ready.status_code == live.status_code == healthz.status_code == 200

"""The shipped Prometheus rules (deploy/prometheus): valid for `promtool check rules`, their
unit tests passing under `promtool test rules` (a stalled partition fires, among others), every
metric they read listed in docs/metrics.md and every alert's runbook in docs/observability.md.

promtool is Debian's `prometheus` package (`make test` installs it when missing, as root)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.support.metrics_doc import documented

ROOT = Path(__file__).resolve().parents[2]
RULES_DIR = ROOT / "deploy" / "prometheus"
RULES = RULES_DIR / "agentruns.rules.yml"
RULE_TESTS = RULES_DIR / "agentruns.rules.test.yml"
OBSERVABILITY = ROOT / "docs" / "observability.md"


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    assert promtool is not None, (
        "promtool is missing: install Debian's prometheus package "
        "(apt-get install -y prometheus; `make test` does it when run as root)"
    )
    return subprocess.run(
        [promtool, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=120
    )


def test_promtool_checks_the_rules() -> None:
    checked = _promtool("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout


def test_promtool_runs_the_rules_unit_tests() -> None:
    tested = _promtool("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def _rules() -> list[dict[str, str]]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def test_the_unit_tests_cover_every_alert_and_the_stalled_partition_fires() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    firing = {
        case["alertname"]
        for t in tests
        for case in t.get("alert_rule_test", [])
        if case["exp_alerts"]
    }
    alerts = {rule["alert"] for rule in _rules() if "alert" in rule}
    assert alerts == firing
    assert "AgentrunsPartitionStalled" in alerts


def test_every_metric_the_rules_read_is_documented() -> None:
    docs = documented()
    known = set(docs) | {f"{n}_bucket" for n, d in docs.items() if d.type == "histogram"}
    read = set()
    for rule in _rules():
        read |= set(re.findall(r"\b(agentruns_[a-z0-9_]+)", rule["expr"]))
    assert read and sorted(read - known) == []


def test_every_alert_has_a_runbook_section() -> None:
    text = OBSERVABILITY.read_text()
    for rule in _rules():
        if "alert" in rule:
            name = rule["alert"]
            assert re.search(rf"^### {name}$", text, re.MULTILINE), name
            assert rule["annotations"]["runbook"] == f"docs/observability.md#{name.lower()}"

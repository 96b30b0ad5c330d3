"""Runs traced into a real Arize Phoenix, read back as Phoenix reports them.

`agentruns run --dev-servers` exports its spans over OTLP to a Phoenix server the test starts
(local only: `PHOENIX_ALLOW_EXTERNAL_RESOURCES=false`, a working directory of its own, free
ports). Three runs go through: model and tool steps (`multi_tool`), a wait for a person's
approval (`approval`, answered through the API) and a model stream rate limited, then cut
mid-stream, each retried (`flaky_stream`). Phoenix's REST API gives each run's trace back: the
run's `invoke_agent` span at its root (an agent), the processor's `process` spans of the inputs
under it, with their messaging attributes; `chat {model}` spans as LLM spans with the model's
name, token counts and messages; `execute_tool {tool}` spans as tools, by name; the HTTP
exchanges under them; the wait for a person as a span of its own. Phoenix keeps neither
OpenTelemetry's span kinds nor links (its API has none): tests/integration/test_tracing.py
checks those on the spans as they are made.

Phoenix lives in a virtual environment of its own (`make phoenix`: its pins conflict with the
project's test dependencies); `AGENTRUNS_PHOENIX` names another `phoenix` executable. A
screenshot of the approval run's trace, taken with headless Chromium, goes to
$AGENTRUNS_SCREENSHOTS (docs/img keeps the current one), else to the test's temporary directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.wait import WebDriverWait

from agentruns.connectors.api.client import ApiClient
from agentruns.connectors.dev.demo.run import registry_tools
from agentruns.connectors.dev.stack.procs import free_port_block
from agentruns.streams import tracing
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "agentruns-e2e"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@dataclass
class Phoenix:
    url: str
    log: Path

    def spans(self, trace_id: str) -> list[dict[str, Any]]:
        """The spans of one trace, as Phoenix reports them (OpenInference span kinds)."""
        return self._get(f"/v1/projects/{PROJECT}/spans", trace_id)

    def otlp_spans(self, trace_id: str) -> list[dict[str, Any]]:
        """The same spans in OTLP form: their OpenTelemetry kinds and links."""
        return self._get(f"/v1/projects/{PROJECT}/spans/otlpv1", trace_id)

    def _get(self, path: str, trace_id: str) -> list[dict[str, Any]]:
        params = {"trace_id": trace_id, "limit": 1000}
        answer = httpx.get(self.url + path, params=params, timeout=30)
        if answer.status_code == 404:  # the project exists once its first span arrived
            return []
        answer.raise_for_status()
        return list(answer.json()["data"])


def phoenix_executable() -> str:
    found = os.environ.get("AGENTRUNS_PHOENIX") or str(ROOT / ".venv-phoenix" / "bin" / "phoenix")
    if not Path(found).exists():
        pytest.fail(
            f"Arize Phoenix is missing ({found}): run `make phoenix`"
            " (a virtual environment of its own, from deploy/phoenix/requirements.txt)",
            pytrace=False,
        )
    return found


@pytest.fixture
def phoenix(tmp_path: Path) -> Iterator[Phoenix]:
    port = free_port_block(2, start=31000)
    home = tmp_path / "phoenix"
    home.mkdir()
    env = {
        **os.environ,
        "PHOENIX_WORKING_DIR": str(home),
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(port + 1),
        "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
        "PHOENIX_TELEMETRY_ENABLED": "false",
    }
    log = tmp_path / "phoenix.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [phoenix_executable(), "serve"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            assert proc.poll() is None, log.read_text()[-3000:]
            return False

    try:
        wait_for(up, 120, "Phoenix to answer", every=0.5)
        yield Phoenix(url, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    target = Path(os.environ.get("AGENTRUNS_SCREENSHOTS") or tmp_path)
    target.mkdir(parents=True, exist_ok=True)
    return target


def _task(scenario: str, name: str) -> dict[str, Any]:
    task = {
        "goal": f"scenario {scenario}",
        "messages": [{"role": "user", "content": f"scenario:{scenario} {name}"}],
        "tools": [t.model_dump(mode="json") for t in registry_tools()],
        "model_route": f"scenario:{scenario}",
    }
    if scenario == "approval":  # delete_record needs the admin permission, a person approves
        task["policy"] = {
            "approval_required": ["admin"],
            "allowed_permissions": ["read", "write", "admin"],
        }
    return task


def _by_name(spans: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["name"].startswith(prefix)]


def test_runs_read_back_from_phoenix(
    phoenix: Phoenix,
    kafka_bootstrap: str,
    database_url: str,
    unique_name: str,
    tmp_path: Path,
    shots: Path,
) -> None:
    port = free_port_block(1, start=29500)
    token = uuid.uuid4().hex
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "DATABASE_URL": database_url,
        "AGENTRUNS_API_TOKEN": token,
        "AGENTRUNS_API_SECRET": uuid.uuid4().hex,
        "OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_RESOURCE_ATTRIBUTES": f"openinference.project.name={PROJECT}",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "AGENTRUNS_TRACE_MESSAGES": "true",
    }
    log = tmp_path / "monolith.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentruns.connectors.monolith", "--dev-servers",
             "--prefix", unique_name, "--partitions", "2", "--api-port", str(port),
             "--log-level", "WARNING"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    client = ApiClient(f"http://127.0.0.1:{port}", token)

    def healthy() -> bool:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        assert proc.poll() is None, log.read_text()[-3000:]
        return False

    try:
        wait_for(healthy, 90, "the monolith's API to answer", every=0.3)
        runs = {
            scenario: client.submit(
                _task(scenario, unique_name), idempotency_key=f"{unique_name}-{scenario}"
            )
            for scenario in ("multi_tool", "approval", "flaky_stream")
        }
        approval = runs["approval"]["run_id"]

        def question() -> dict[str, Any] | None:
            run = client.get(approval)
            return run.get("question") if run.get("status") == "WAITING_USER" else None

        asked = wait_for(question, 120, "the approval question", every=0.3)
        client.reply(approval, asked["resume_token"], {"approved": True})
        for submitted in runs.values():
            run = client.wait(submitted["run_id"], timeout_s=120)
            assert run["status"] == "SUCCEEDED", run
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)  # the exporter sends what it holds on the way out
        code = proc.wait(timeout=60)
    assert code == 0, log.read_text()[-3000:]

    traces = {}
    for scenario, submitted in runs.items():
        run_id = submitted["run_id"]
        trace_id = tracing.run_trace_id(run_id, submitted["trace_id"])

        def whole(trace_id: str = trace_id) -> list[dict[str, Any]] | None:
            spans = phoenix.spans(trace_id)
            return spans if any(s["name"] == "invoke_agent" for s in spans) else None

        traces[scenario] = wait_for(whole, 60, f"the {scenario} trace in Phoenix", every=0.5)

    # what Phoenix said, for reading when an assertion below fails
    (tmp_path / "phoenix-spans.json").write_text(json.dumps(traces, indent=1))
    for scenario, spans in traces.items():
        run_id = runs[scenario]["run_id"]
        by_id = {s["context"]["span_id"]: s for s in spans}
        (run,) = _by_name(spans, "invoke_agent")
        assert run["span_kind"] == "AGENT", run
        assert run["parent_id"] is None  # the root of the run's trace
        assert run["context"]["span_id"] == tracing.run_span_id(run_id)
        assert run["attributes"]["session.id"] == run_id  # from gen_ai.conversation.id
        assert run["attributes"]["llm.token_count.prompt"] > 0
        for span in spans:  # every span leads back to the run's
            chain = span
            while chain["parent_id"] is not None:
                assert chain["parent_id"] in by_id, (scenario, span["name"])
                chain = by_id[chain["parent_id"]]
            assert chain is run, (scenario, span["name"])
        processed = [s for s in _by_name(spans, "process ") if "agentruns.seq" in s["attributes"]]
        assert any(s["name"] == "process RunSubmitted" for s in processed)
        for span in processed:
            assert span["parent_id"] == run["context"]["span_id"]
            assert span["attributes"]["messaging.system"] == "kafka"
            assert span["attributes"]["messaging.destination.name"] == f"{unique_name}.inbox"
        chats = _by_name(spans, "chat ")
        assert chats, scenario
        for chat in chats:
            attributes = chat["attributes"]
            assert chat["span_kind"] == "LLM", chat
            assert attributes["llm.model_name"] == chat["name"].removeprefix("chat ")
            assert attributes["session.id"] == run_id
        finished = [c for c in chats if c["status_code"] != "ERROR"]
        assert finished, scenario
        for chat in finished:
            attributes = chat["attributes"]
            assert attributes["llm.token_count.prompt"] > 0
            assert attributes["llm.token_count.completion"] > 0
            assert attributes["llm.input_messages.0.message.role"] == "user"
            assert attributes["llm.output_messages.0.message.role"] == "assistant"
        tools = _by_name(spans, "execute_tool ")
        assert tools and all(t["span_kind"] == "TOOL" for t in tools), scenario
        assert all(t["attributes"]["tool.name"] == t["name"].split()[1] for t in tools)
        http = [s for s in spans if s["name"] == "POST"]
        assert http, scenario
        for exchange in http:
            assert by_id[exchange["parent_id"]]["name"].startswith(("chat ", "execute_tool "))
            assert exchange["attributes"]["url.full"].startswith("http://127.0.0.1:")

    names = {scenario: {s["name"] for s in spans} for scenario, spans in traces.items()}
    assert {"execute_tool search_docs", "execute_tool create_ticket"} <= names["multi_tool"]
    assert "execute_tool delete_record" in names["approval"]
    (wait,) = _by_name(traces["approval"], "wait for a person")
    assert wait["attributes"]["agentruns.ended_by"] == "UserReplied"
    # the retried stream: a step whose call failed (rate limited) is called again
    chats = _by_name(traces["flaky_stream"], "chat ")
    failed = [c for c in chats if c["status_code"] == "ERROR"]
    assert failed, [(c["name"], c["attributes"].get("agentruns.model_outcome")) for c in chats]
    for chat in failed:
        step = chat["attributes"]["agentruns.step"]
        again = [c for c in chats if c["attributes"]["agentruns.step"] == step and c is not chat]
        assert any(c["status_code"] != "ERROR" for c in again), step

    # the approval run's trace as a person sees it in Phoenix
    approved = tracing.run_trace_id(approval, runs["approval"]["trace_id"])
    _screenshot(f"{phoenix.url}/redirects/traces/{approved}", shots / "phoenix-trace.png")


def _screenshot(url: str, target: Path) -> None:
    driver_path = shutil.which("chromedriver") or CHROMEDRIVER
    if not (Path(CHROMIUM).exists() and Path(driver_path).exists()):
        pytest.fail(
            "chromium is missing: run `make chromium`"
            " (apt-get install -y chromium chromium-driver)",
            pytrace=False,
        )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1600,1000")
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(60)
    try:
        driver.get(url)
        # the trace's tree is drawn: the run's span and the wait for a person in it
        WebDriverWait(driver, 60).until(
            lambda d: "wait for a person" in d.find_element(By.TAG_NAME, "body").text
        )
        chat = driver.find_elements(By.XPATH, "//*[starts-with(text(), 'chat ')]")
        if chat:  # a model call's details: its model, tokens and messages
            chat[0].click()
            WebDriverWait(driver, 30).until(
                lambda d: "assistant" in d.find_element(By.TAG_NAME, "body").text.lower()
            )
        # the pointer away from the tree (no tooltip over it), and the last panel drawn
        ActionChains(driver).move_to_element(
            driver.find_element(By.XPATH, "//*[text()='Tracing']")
        ).perform()
        time.sleep(1)
        driver.save_screenshot(str(target))
    finally:
        driver.quit()

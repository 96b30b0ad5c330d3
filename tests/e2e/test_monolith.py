"""`agentruns run` (R29): every layer in one process; a task over HTTP ends SUCCEEDED."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx

from agentruns.connectors.api.client import ApiClient
from agentruns.connectors.dev.demo.run import registry_tools
from agentruns.connectors.dev.stack.procs import free_port_block
from tests.support.waiting import wait_for


def test_monolith_runs_a_task_submitted_over_http(
    kafka_bootstrap: str, database_url: str, unique_name: str
) -> None:
    port = free_port_block(1, start=29000)
    token = uuid.uuid4().hex
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "DATABASE_URL": database_url,
        "AGENTRUNS_API_TOKEN": token,
        "AGENTRUNS_API_SECRET": uuid.uuid4().hex,
    }
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"{unique_name}-monolith.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentruns.connectors.monolith", "--dev-servers",
            "--prefix",
             unique_name, "--partitions", "3", "--api-port", str(port), "--log-level", "WARNING"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    client = ApiClient(f"http://127.0.0.1:{port}", token)

    def healthy() -> bool:  # the API answers once every component is up
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        assert proc.poll() is None, log.read_text()[-3000:]
        return False

    try:
        wait_for(healthy, 90, "the monolith's API to answer", every=0.3)
        task = {
            "goal": "open a ticket and notify the customer",
            "messages": [{"role": "user", "content": f"scenario:multi_tool {unique_name}"}],
            "tools": [t.model_dump(mode="json") for t in registry_tools()],
            "model_route": "scenario:multi_tool",
        }
        submitted = client.submit(task, idempotency_key=f"{unique_name}-task")
        run = client.wait(submitted["run_id"], timeout_s=120)
        assert run["status"] == "SUCCEEDED", run
        assert run["result"] is not None
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0, log.read_text()[-3000:]

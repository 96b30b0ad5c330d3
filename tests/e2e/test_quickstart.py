"""The README's quick start, run as written: its fenced blocks after `<!-- quickstart -->`
markers, against `agentruns run --dev-servers` (the block after `<!-- quickstart:service -->`)
on the test's Kafka and Postgres, with a topic prefix of its own."""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent
MARKER = re.compile(r"<!-- quickstart(:service)? -->\s*\n```sh\n(.*?)```", re.S)
RUN_ID = re.compile(r"\brun-[0-9a-f]{32}\b")
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED", "BUDGET_EXHAUSTED", "CANCEL_UNKNOWN"}


def quickstart_blocks() -> tuple[list[list[str]], list[list[str]]]:
    """(service commands, user commands) of the README's quick start, each split as a shell
    would (comments dropped)."""
    service: list[list[str]] = []
    commands: list[list[str]] = []
    for match in MARKER.finditer(README.read_text()):
        target = service if match.group(1) else commands
        for line in match.group(2).splitlines():
            words = shlex.split(line, comments=True)
            if words:
                target.append(words)
    return service, commands


def executable(words: list[str]) -> list[str]:
    """The venv's `agentruns` / `python` for the README's bare names."""
    head = {"agentruns": str(BIN / "agentruns"), "python": sys.executable}.get(words[0])
    assert head is not None, f"the quick start runs {words[0]!r}, which this test cannot provide"
    return [head, *words[1:]]


def lines_of(stream: IO[str]) -> queue.Queue[str | None]:
    """A queue fed with `stream`'s lines by a thread; None once it ends (the thread then
    closes the stream)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        with stream:
            for line in stream:
                lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def drain(lines: queue.Queue[str | None], timeout: float = 30.0) -> list[str]:
    """The lines left until the stream ends (so its pump has closed it)."""
    rest: list[str] = []
    try:
        while (line := lines.get(timeout=timeout)) is not None:
            rest.append(line)
    except queue.Empty:
        pass  # already ended (its None taken) or held open by a child: nothing more to read
    return rest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_blocks_are_found() -> None:
    service, commands = quickstart_blocks()
    assert service == [["agentruns", "run", "--dev-servers"]]
    assert any(w[:2] == ["agentruns", "submit"] for w in commands)
    assert any(w[:2] == ["agentruns", "results"] for w in commands)
    assert any(w[:2] == ["agentruns", "replay"] for w in commands)
    assert any(w[:2] == ["agentruns", "audit"] for w in commands)


@pytest.mark.timeout(600)
def test_the_readme_quick_start_runs_as_written(
    kafka_bootstrap: str, database_url: str, unique_name: str, tmp_path: Path
) -> None:
    service, commands = quickstart_blocks()
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "DATABASE_URL": database_url,
        "AGENTRUNS_TOPIC_PREFIX": unique_name,
        "AGENTRUNS_STATE_DIR": str(tmp_path / "state"),
        "AGENTRUNS_API_TOKEN": "quickstart-token",
    }
    # The API's fixed default port may be taken on a shared machine: only the port differs.
    proc = subprocess.Popen(
        [*executable(service[0]), "--api-port", str(free_port())],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = lines_of(proc.stdout)  # type: ignore[arg-type]
    log: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any("Ctrl-C stops" in line for line in log):
            assert time.monotonic() < deadline, "agentruns run did not start:\n" + "".join(log)
            line = output.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "agentruns run exited:\n" + "".join(log)
            log.append(line)

        submitted: list[str] = []
        results: dict[str, str] = {}
        printed: dict[str, str] = {}
        for words in commands:
            if "--follow" in words:
                results.update(follow(words, env, submitted))
                continue
            done = subprocess.run(
                executable(words), cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
            )
            printed[" ".join(words)] = done.stdout
            assert done.returncode == 0, f"{' '.join(words)}:\n{done.stdout}{done.stderr}"
            if words[1:2] == ["submit"] or words[0] == "python":
                submitted.extend(RUN_ID.findall(done.stdout)[:1])

        assert len(submitted) == 4
        assert results == {run_id: "SUCCEEDED" for run_id in submitted}
        replay = next(out for cmd, out in printed.items() if cmd.startswith("agentruns replay"))
        assert RUN_ID.findall(replay)[0] in submitted
        assert "final: SUCCEEDED" in replay
        audit = next(out for cmd, out in printed.items() if cmd.startswith("agentruns audit"))
        assert "audited 4 runs: 0 differences" in audit
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        log.extend(drain(output))
    assert code == 0, "".join(log)


def follow(words: list[str], env: dict[str, str], run_ids: list[str]) -> dict[str, str]:
    """Run a `--follow` command until it printed a terminal result of every run, as a person
    watching it would, then stop it with Ctrl-C; the results it printed by run id."""
    proc = subprocess.Popen(executable(words), cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    output = lines_of(proc.stdout)  # type: ignore[arg-type]
    seen: dict[str, str] = {}
    deadline = time.monotonic() + 180
    try:
        while not set(run_ids) <= seen.keys():
            assert time.monotonic() < deadline, f"results after 180 s: {seen}"
            try:
                line = output.get(timeout=1.0)
            except queue.Empty:
                continue
            assert line is not None, f"{' '.join(words)} exited; results: {seen}"
            result = json.loads(line)
            assert result["status"] in TERMINAL
            seen[result["run_id"]] = result["status"]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        drain(output)
    return seen

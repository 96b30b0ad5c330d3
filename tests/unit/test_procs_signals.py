"""stop_on_signals: SIGTERM and SIGINT set the returned event instead of killing the process;
run_command: how a command ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from agentruns.connectors.lifecycle import RESTART_ME, run_command, stop_on_signals
from agentruns.streams.errors import AgentrunsError, FatalConsumerError


@pytest.fixture
def restored_handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_sets_the_stop_event(restored_handlers: None, signum: int) -> None:
    stop = stop_on_signals()
    assert not stop.is_set()
    os.kill(os.getpid(), signum)  # delivered to the main thread before kill returns here
    assert stop.wait(5)


def test_a_fenced_service_exits_to_be_restarted_an_error_to_be_read(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def fenced(_: list[str]) -> int:
        raise FatalConsumerError("static consumer fenced", hint="its supervisor starts it again")

    def misconfigured(_: list[str]) -> int:
        raise AgentrunsError("no such topic", hint="create it")

    assert run_command(fenced, []) == RESTART_ME == 75
    assert run_command(misconfigured, []) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "agentruns: static consumer fenced — its supervisor starts it again",
        "agentruns: no such topic — create it",
    ]


def test_sigterm_ends_a_command_through_its_cleanup() -> None:
    # a bench or a chaos run killed by SIGTERM stops what it started on the way out
    program = textwrap.dedent(
        """
        import sys, time
        from agentruns.connectors.lifecycle import run_command

        def main(_):
            try:
                print("running", flush=True)
                time.sleep(60)
            finally:
                print("cleaned up", flush=True)
            return 0

        sys.exit(run_command(main, []))
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", program], stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "running"
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=30)
    assert out.strip() == "cleaned up"
    assert child.returncode == 128 + signal.SIGTERM

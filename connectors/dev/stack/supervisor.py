"""Run pipeline components as separate processes (production mode), for the demo, chaos tests
and benchmarks: start, kill -9, pause, restart and stop them by name, with their logs in one
folder.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Component:
    name: str
    argv: list[str]  # after `python -m`
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    kills: int = 0
    # Down on purpose (killed or stopped and not started again yet): a chaos driver holds a
    # killed component down for a while, and that is not a crash.
    held_down: bool = False


@dataclass
class Supervisor:
    log_dir: Path
    env: dict[str, str]
    components: dict[str, Component] = field(default_factory=dict)
    # One change of a component at a time: a chaos driver's killer thread and its watcher
    # restarting a crashed component would otherwise both start one (two processes, one lost).
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def add(self, name: str, *argv: str) -> Component:
        component = Component(name, list(argv))
        self.components[name] = component
        return component

    def start(self, name: str) -> None:
        with self._lock:
            self._start(name)

    def _start(self, name: str) -> None:
        c = self.components[name]
        if c.process is not None and c.process.poll() is None:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as log:
            c.process = subprocess.Popen(
                [sys.executable, "-m", *c.argv],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        c.starts += 1
        c.held_down = False

    def start_all(self) -> None:
        for name in self.components:
            self.start(name)

    def exited(self, name: str) -> int | None:
        """The exit status of a component that ended without the supervisor ending it (a
        crash, or a clean exit nobody asked for); None while it runs or is held down."""
        with self._lock:
            c = self.components[name]
            if c.process is None or c.held_down:
                return None
            return c.process.poll()

    def dump_stacks(self) -> list[str]:
        """Ask every running component for the stacks of its threads (SIGUSR1: written to its
        log, it goes on); the names of those asked."""
        asked = []
        with self._lock:
            for name, c in self.components.items():
                if c.process is not None and c.process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(c.process.pid, signal.SIGUSR1)
                        asked.append(name)
        return asked

    def kill(self, name: str) -> None:
        with self._lock:
            self._kill(name)

    def _kill(self, name: str) -> None:
        """SIGKILL: no cleanup, no commit, no goodbye to the group."""
        c = self.components[name]
        c.held_down = True
        if c.process is not None and c.process.poll() is None:
            os.killpg(c.process.pid, signal.SIGKILL)
            c.process.wait()
            c.kills += 1

    def pause(self, name: str) -> bool:
        with self._lock:
            return self._pause(name)

    def _pause(self, name: str) -> bool:
        """SIGSTOP the component's process group: a process that stops answering without dying
        (a long GC pause, a stalled VM) and comes back as a zombie when `resume`d. False when
        it was not running."""
        c = self.components[name]
        if c.process is None or c.process.poll() is not None:
            return False
        os.killpg(c.process.pid, signal.SIGSTOP)
        return True

    def resume(self, name: str) -> None:
        with self._lock:
            self._resume(name)

    def _resume(self, name: str) -> None:
        c = self.components[name]
        if c.process is not None and c.process.poll() is None:
            os.killpg(c.process.pid, signal.SIGCONT)

    def restart(self, name: str) -> None:
        with self._lock:
            self._restart(name)

    def _restart(self, name: str) -> None:
        self.kill(name)
        self.start(name)

    def stop(self, name: str, timeout: float = 30.0) -> None:
        with self._lock:
            self._stop(name, timeout)

    def _stop(self, name: str, timeout: float = 30.0) -> None:
        c = self.components[name]
        c.held_down = True
        if c.process is None:
            return
        if c.process.poll() is None:
            c.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.process.pid, signal.SIGCONT)  # a paused one handles it only then
            try:
                c.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(c.process.pid, signal.SIGKILL)
                c.process.wait()
        c.process = None

    def stop_all(self) -> None:
        for name in reversed(list(self.components)):
            self.stop(name)

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.log_dir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

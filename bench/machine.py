"""How busy the whole machine was while a bench measured: the figures of a shared 2-core VM
swing by 25% or more, and these say whether a slow run was the code or the host.

``busy`` is every CPU second the kernel accounted to work on this machine (user, nice, system,
irq, softirq: the bench, the broker, Postgres and anything else); ``steal`` is time the
hypervisor gave our virtual CPUs to somebody else. Linux only (``/proc/stat``); elsewhere the
figures are None.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read() -> tuple[float, float] | None:
    """(busy, steal) CPU seconds since boot, all CPUs together."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal guest guest_nice
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in first[1:9])
    return (user + nice + system + irq + softirq) / _TICK, steal / _TICK


@dataclass
class MachineCpu:
    """CPU use of the whole machine between ``MachineCpu.start()`` and ``stop()``."""

    began: float
    first: tuple[float, float] | None

    @classmethod
    def start(cls) -> MachineCpu:
        return cls(time.monotonic(), _read())

    def stop(self) -> dict[str, float | None]:
        """``busy_cores``: mean cores busy; ``steal_pct``: share of the machine's CPU time
        taken by the hypervisor; ``busy_s``: CPU seconds of work (to divide by items)."""
        elapsed = time.monotonic() - self.began
        last = _read()
        if self.first is None or last is None or elapsed <= 0:
            return {"busy_s": None, "busy_cores": None, "steal_pct": None}
        busy, steal = last[0] - self.first[0], last[1] - self.first[1]
        cpus = os.cpu_count() or 1
        return {
            "busy_s": round(busy, 3),
            "busy_cores": round(busy / elapsed, 2),
            "steal_pct": round(100 * steal / (elapsed * cpus), 1),
        }


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of one process (Linux /proc), or None elsewhere."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def metrics_text(port: int) -> str | None:
    """A process's Prometheus exposition on this machine (None: the endpoint is not up)."""
    try:
        body: bytes = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    except OSError:
        return None
    return body.decode()


def scrape(port: int, name: str) -> float | None:
    """One unlabelled sample from a process's Prometheus endpoint on this machine (None: the
    endpoint is not up, or has no such sample)."""
    text = metrics_text(port)
    for line in (text or "").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


@contextlib.contextmanager
def neighbours(count: int) -> Iterator[list[int]]:
    """``count`` busy-loop processes at normal priority while the block runs (their pids): a
    noisy neighbour on demand. Each takes a core's worth of CPU if it gets it; they are killed
    when the block ends, however it ends.

    Each runs in a session of its own: with the kernel's autogroup scheduling (on by default)
    CPU is shared fairly between sessions, and a busy loop in the bench's own session would
    take its share from the bench and the process under test alone, not from the machine as
    another tenant does (the local broker and Postgres run in sessions of their own too)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for _ in range(count)
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()

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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentruns.connectors.dev.stack.services import ServiceStack

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


#: the groups of ``cores_by_process``, in the order printed
GROUPS = ("broker", "postgres", "bench", "other")


def group_of(pid: int, comm: str, cmdline: str, labels: Mapping[int, str]) -> str:
    """Which group a process's CPU counts for: an explicit label (the process under test), the
    bench itself, the local broker (a JVM running ``kafka.Kafka``), Postgres (its postmaster and
    every backend), or ``other`` (anything else on the machine, kernel threads included).

    A group some label names holds its labelled processes only: with the bench's own broker
    labelled ``broker``, another broker on the machine (another tenant's) counts as ``other``."""
    if pid in labels:
        return labels[pid]
    if pid == os.getpid():
        return "bench"
    named = labels.values()
    if "kafka.Kafka" in cmdline and "broker" not in named:
        return "broker"
    if (comm == "postgres" or comm.startswith("postgres:")) and "postgres" not in named:
        return "postgres"
    return "other"


def _stat(text: str) -> tuple[str, int, float, int]:
    """(comm, start time in ticks, user + system CPU seconds, parent pid) from a
    /proc/<pid>/stat text."""
    comm = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return comm, int(fields[19]), (int(fields[11]) + int(fields[12])) / _TICK, int(fields[1])


def inherited(labels: Mapping[int, str], parents: Mapping[int, int]) -> dict[int, str]:
    """``labels`` extended to every descendant of a labelled process (a Postgres backend is
    its postmaster's); a descendant's nearest labelled ancestor wins."""
    out = dict(labels)
    for pid in parents:
        seen: list[int] = []
        at = pid
        while at not in out and at in parents and at not in seen and len(seen) < 64:
            seen.append(at)
            at = parents[at]
        if at in out:
            for p in seen:
                out[p] = out[at]
    return out


def _processes() -> dict[int, tuple[str, str, int, float, int]]:
    """pid -> (comm, cmdline, start time in ticks, CPU seconds so far, parent pid) of every
    process visible in /proc (the start time tells a reused pid from the process it had
    before)."""
    out: dict[int, tuple[str, str, int, float, int]] = {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, UnicodeDecodeError):
            continue  # gone meanwhile, or not ours to read
        comm, started, cpu, parent = _stat(stat)
        out[int(entry.name)] = (comm, cmdline, started, cpu, parent)
    return out


@dataclass
class MachineCpu:
    """CPU use of the whole machine between ``MachineCpu.start()`` and ``stop()``, in all and
    by process group (who of the broker, Postgres, the process under test and the bench used
    the cores: on two cores each one's share is another's wait)."""

    began: float
    first: tuple[float, float] | None
    first_processes: dict[int, tuple[str, str, int, float, int]]
    labels: dict[int, str]

    @classmethod
    def start(cls, labels: Mapping[int, str] | None = None) -> MachineCpu:
        """``labels``: pid -> group name for the processes under test (e.g. "processor")."""
        return cls(time.monotonic(), _read(), _processes(), dict(labels or {}))

    def stop(self) -> dict[str, Any]:
        """``busy_cores``: mean cores busy; ``steal_pct``: share of the machine's CPU time
        taken by the hypervisor; ``busy_s``: CPU seconds of work (to divide by items);
        ``cores_by_process``: mean cores per group (a process that ended during the phase is
        missing from it; one that began counts from its start); ``cpu_s_by_process``: CPU
        seconds per group (to divide by items). A label holds for the labelled process's
        descendants too."""
        elapsed = time.monotonic() - self.began
        last = _read()
        if self.first is None or last is None or elapsed <= 0:
            return {"busy_s": None, "busy_cores": None, "steal_pct": None}
        busy, steal = last[0] - self.first[0], last[1] - self.first[1]
        cpus = os.cpu_count() or 1
        groups = dict.fromkeys((*sorted(set(self.labels.values())), *GROUPS), 0.0)
        now = _processes()
        labels = inherited(self.labels, {pid: p[4] for pid, p in now.items()})
        for pid, (comm, cmdline, started, cpu, _parent) in now.items():
            before = self.first_processes.get(pid)
            used = cpu - before[3] if before is not None and before[2] == started else cpu
            groups[group_of(pid, comm, cmdline, labels)] += used
        return {
            "busy_s": round(busy, 3),
            "busy_cores": round(busy / elapsed, 2),
            "steal_pct": round(100 * steal / (elapsed * cpus), 1),
            "cores_by_process": {name: round(used / elapsed, 2) for name, used in groups.items()},
            "cpu_s_by_process": {name: round(used, 3) for name, used in groups.items()},
        }


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of one process (Linux /proc), or None elsewhere."""
    try:
        return _stat(Path(f"/proc/{pid}/stat").read_text())[2]
    except OSError:
        return None


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


def stack_labels(stack: ServiceStack) -> dict[int, str]:
    """pid -> ``broker`` / ``postgres`` for the local services a bench's `ServiceStack` runs
    (empty for containers or services named by the environment): with them labelled, a
    broker or Postgres of another tenant of the machine is not counted as the bench's."""
    local = stack.local
    if local is None:
        return {}
    labels = dict.fromkeys(local.kafka.running(), "broker")
    try:
        postmaster = int((local.postgres.data / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return labels
    labels[postmaster] = "postgres"
    return labels

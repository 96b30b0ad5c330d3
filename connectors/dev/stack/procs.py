"""Small process and port helpers shared by the local service launchers."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import time
from collections.abc import Iterable
from pathlib import Path

from agentruns.connectors.errors import PortInUseError


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours still answers kill(0): reap it if it is ours.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    return True


def stop_pid(pid_file: Path, *, sig: int = signal.SIGTERM, timeout: float = 30.0) -> bool:
    """Signal the process group in `pid_file`, escalate to SIGKILL; True if one was running."""
    pid = read_pid(pid_file)
    if pid is None:
        return False
    was_alive = pid_alive(pid)
    if was_alive:
        _signal_group(pid, sig)
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(pid):
            _signal_group(pid, signal.SIGKILL)
            while pid_alive(pid):
                time.sleep(0.05)
    pid_file.unlink(missing_ok=True)
    return was_alive


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def ensure_ports_free(ports: Iterable[int], *, what: str, hint: str) -> None:
    taken = [p for p in ports if not port_free(p)]
    if taken:
        raise PortInUseError(
            f"{what} cannot start: port {', '.join(map(str, taken))} on 127.0.0.1 is in use",
            hint=hint,
        )


def _ephemeral_start(default: int = 32768) -> int:
    """Where the kernel's range of ports for outgoing connections begins (Linux; else 32768)."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port_block(count: int, start: int = 20000, end: int | None = None) -> int:
    """The first port p >= start such that p .. p+count-1 are all free (for a local cluster).

    Below the kernel's ephemeral range by default: a port picked there can be taken, between
    the check and the bind, by any process's outgoing connection (seen: `make test` beside a
    bench, "Address already in use")."""
    end = end if end is not None else _ephemeral_start()
    # Start from a pid-dependent offset so parallel test runs rarely race for one block.
    span = end - start
    if span < count:
        raise PortInUseError(f"no block of {count} ports in {start}-{end}", hint="a lower start")
    base = start + (os.getpid() * 7 * count) % span
    for i in range(0, span, count):
        p = start + (base - start + i) % span
        if p + count <= end and all(port_free(q) for q in range(p, p + count)):
            return p
    raise PortInUseError(f"no block of {count} free ports in {start}-{end}", hint="free some ports")


def tail(text: str, lines: int) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()][-lines:]
    return " | ".join(kept) if kept else "(no output)"

"""Network partitions on one Linux machine, for fault tests: each member (a broker, a pipeline
process) in a network namespace of its own, linked to a router namespace by a veth pair, on
private addresses (10.<net>.<i>.2) that exist only inside this machine. The machine's own
namespace (where the test runs) is a member too, so it reaches every other one.

A partition is a pair of policy rules in the router (``ip rule ... blackhole``): packets between
the two members are dropped silently, as on a network that lost a link (connections hang and
time out; nothing is refused). No iptables or nft needed. Needs root and ``ip`` (iproute2).
`NetLab` is a context manager: its namespaces and links go away at the end, whatever happened
(a process killed -9 leaves them: they are named ``arn-<tag>-*``, `ip netns list` shows them).
"""

from __future__ import annotations

import random
import shutil
import subprocess
import uuid
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from agentruns.connectors.errors import MissingToolError

PREFIX = "arn"
HOST = "host"  # the member that is the machine's own namespace


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def usable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    probe = f"{PREFIX}-probe-{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Member:
    name: str
    address: str
    netns: str | None  # None: the machine's own namespace

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this member's namespace (exec'd: the pid is the command's)."""
        return argv if self.netns is None else ["ip", "netns", "exec", self.netns, *argv]


class NetLab(AbstractContextManager["NetLab"]):
    """Members ``names`` (and `HOST`) linked through a router namespace."""

    def __init__(self, names: list[str]) -> None:
        if (why := usable()) is not None:
            raise MissingToolError(f"network namespaces cannot be made: {why}", hint="run as root")
        self.tag = uuid.uuid4().hex[:6]
        # 10.<net>.<member>.0/30 each: another lab on this machine picks another <net>
        self.net = random.randint(64, 250)
        self.router = f"{PREFIX}-{self.tag}-r"
        self.members: dict[str, Member] = {}
        self._rules: set[tuple[str, str]] = set()
        self._host_link = f"{PREFIX}{self.tag}h"
        try:
            _ip("netns", "add", self.router)
            self._in_router("sysctl", "-qw", "net.ipv4.ip_forward=1")
            _ip("-n", self.router, "link", "set", "lo", "up")
            for i, name in enumerate([HOST, *names]):
                self._link(i, name)
        except BaseException:
            self.close()
            raise

    def _in_router(self, *argv: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.router, *argv], check=True)

    def _link(self, i: int, name: str) -> None:
        outer, inner = f"{PREFIX}{self.tag}{i}r", f"{PREFIX}{self.tag}{i}m"
        address = f"10.{self.net}.{i}.2"
        netns = None if name == HOST else f"{PREFIX}-{self.tag}-{i}"
        if name == HOST:
            inner = self._host_link
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", outer, "netns", self.router)
        _ip("-n", self.router, "addr", "add", f"10.{self.net}.{i}.1/30", "dev", outer)
        _ip("-n", self.router, "link", "set", outer, "up")
        ns: tuple[str, ...] = ()
        if netns is not None:
            _ip("netns", "add", netns)
            _ip("link", "set", inner, "netns", netns)
            ns = ("-n", netns)
            _ip(*ns, "link", "set", "lo", "up")
        _ip(*ns, "addr", "add", f"{address}/30", "dev", inner)
        _ip(*ns, "link", "set", inner, "up")
        if netns is not None:
            _ip(*ns, "route", "add", "default", "via", f"10.{self.net}.{i}.1")
        else:
            _ip("route", "add", f"10.{self.net}.0.0/16", "via", f"10.{self.net}.{i}.1")
        self.members[name] = Member(name, address, netns)

    def partition(self, a: str, b: str) -> None:
        """Drop every packet between members ``a`` and ``b``, both ways."""
        for src, dst in ((a, b), (b, a)):
            if (src, dst) not in self._rules:
                self._rule("add", src, dst)
                self._rules.add((src, dst))

    def heal(self, a: str | None = None, b: str | None = None) -> None:
        """Undo the partition between ``a`` and ``b`` (every partition without arguments)."""
        for src, dst in sorted(self._rules):
            if a is None or {src, dst} == {a, b}:
                self._rule("del", src, dst)
                self._rules.discard((src, dst))

    def _rule(self, action: str, src: str, dst: str) -> None:
        _ip(
            "-n",
            self.router,
            "rule",
            action,
            "from",
            self.members[src].address,
            "to",
            self.members[dst].address,
            "blackhole",
        )

    def close(self) -> None:
        """Remove the namespaces (their links go with them) and the machine's link."""
        for member in self.members.values():
            if member.netns is not None:
                _ip("netns", "del", member.netns, check=False)
        _ip("link", "del", self._host_link, check=False)
        _ip("netns", "del", self.router, check=False)

    def __exit__(self, *exc: Any) -> None:
        self.close()

"""A small filesystem of its own for one directory, for fault tests: a broker whose disk fills.

An ext4 image file loop-mounted on the directory; `take` fills part of it with a ballast file
and `give_back` removes that (the space an operator frees: growing a mounted filesystem is not
allowed in every container), and the end unmounts it and removes the image, whatever happened.
Needs root, ``mount`` with loop devices and ``mkfs.ext4``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from agentruns.connectors.errors import MissingToolError

MB = 1 << 20
BALLAST = "ballast"


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


class SmallDisk(AbstractContextManager["SmallDisk"]):
    """``mountpoint`` on a filesystem of ``size_mb``, backed by ``image``."""

    def __init__(self, mountpoint: Path, size_mb: int, image: Path | None = None) -> None:
        missing = [t for t in ("mount", "mkfs.ext4") if not shutil.which(t)]
        if missing or os.geteuid() != 0:
            raise MissingToolError(
                f"a loop-mounted filesystem cannot be made here: "
                f"{'missing ' + ', '.join(missing) if missing else 'not root'}",
                hint="run as root with util-linux and e2fsprogs",
            )
        self.mountpoint = mountpoint
        self.image = image or mountpoint.with_name(mountpoint.name + ".img")
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with open(self.image, "wb") as f:
            f.truncate(size_mb * MB)
        try:
            _run("mkfs.ext4", "-q", "-F", "-m", "0", str(self.image))
            _run("mount", "-o", "loop", str(self.image), str(self.mountpoint))
        except BaseException:
            self.image.unlink(missing_ok=True)
            raise

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.mountpoint).free

    def take(self, size_mb: int) -> None:
        """Occupy ``size_mb`` of the filesystem with a ballast file (written, not sparse)."""
        block = b"\0" * MB
        with open(self.mountpoint / BALLAST, "wb") as f:
            for _ in range(size_mb):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    def give_back(self) -> None:
        """Remove the ballast: the space an operator frees on a full disk."""
        (self.mountpoint / BALLAST).unlink(missing_ok=True)

    def close(self) -> None:
        # lazily: a process killed a moment ago may still hold files open
        subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True, check=False)
        self.image.unlink(missing_ok=True)

    def __exit__(self, *exc: Any) -> None:
        self.close()

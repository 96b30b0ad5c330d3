"""What this build is: the installed distribution's version, and `agentruns_build_info`.

`agentruns_build_info{version, python}` is 1 in every process that serves `/metrics` (the
services' health server and the API), so a dashboard can tell which build each scrape target
runs and a rollout can be followed (docs/metrics.md).
"""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _distribution_version

from prometheus_client import Gauge

BUILD_INFO = Gauge(
    "agentruns_build_info",
    "1, labelled with the agentruns version and the Python version this process runs",
    ["version", "python"],
)


def version() -> str:
    """The installed distribution's version (the one pip reports)."""
    try:
        return _distribution_version("agentruns")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _label(value: str) -> str:
    # label values are lower case (docs/metrics.md): "0.1.0", "3.11.9", "unknown"
    return value.lower().split(" ", 1)[0]


BUILD_INFO.labels(_label(version()), _label(platform.python_version())).set(1)

__all__ = ["BUILD_INFO", "version"]

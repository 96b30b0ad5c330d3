"""Drawn latencies for the test servers' ``latency`` fault.

A benchmark wants backends that take realistic, varied time, yet a rerun must see the same
times: each latency is a pure function of a key (seed, conversation or idempotency key,
turn, attempt) hashed with SHA-256, never of a clock or a random generator. Log-normal draws
(model calls: a long right tail around a median) and log-uniform draws (tools: spread evenly
across orders of magnitude) are both clamped to ``[min_ms, max_ms]``.
"""

from __future__ import annotations

import hashlib
import math
from statistics import NormalDist

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_MS = 600_000.0  # ten minutes: the longest latency a rule may ask for
MAX_SIGMA = 5.0
_STANDARD_NORMAL = NormalDist()


def uniform(*parts: object) -> float:
    """A number in the open interval (0, 1) from SHA-256 of the parts joined by ``:``
    (52 bits, centred in their cell, so neither 0 nor 1 can come out)."""
    key = ":".join(str(part) for part in parts)
    bits = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 12
    return (bits + 0.5) / 2**52


def lognormal_ms(u: float, median_ms: float, sigma: float, min_ms: float, max_ms: float) -> float:
    """``median * exp(sigma * z)`` with ``z`` the standard normal quantile of ``u``, clamped."""
    z = _STANDARD_NORMAL.inv_cdf(u)
    return min(max_ms, max(min_ms, median_ms * math.exp(sigma * z)))


def loguniform_ms(u: float, min_ms: float, max_ms: float) -> float:
    """Uniform in log space between the bounds: as likely 50-100 ms as 1-2 s."""
    return min(max_ms, max(min_ms, min_ms * math.exp(u * math.log(max_ms / min_ms))))


class LatencyParams(BaseModel):
    """The parameters of a drawn latency, refused when out of bounds (every duration in
    ``(0, MAX_MS]``, ``sigma`` in ``[0, MAX_SIGMA]``, ``max_ms >= min_ms``). With a
    ``median_ms`` the draw is log-normal, without one log-uniform. Each server subclasses it
    with its own defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    median_ms: float | None = Field(default=None, gt=0, le=MAX_MS)
    sigma: float = Field(default=0.5, ge=0, le=MAX_SIGMA)
    min_ms: float = Field(default=50.0, gt=0, le=MAX_MS)
    max_ms: float = Field(default=2000.0, gt=0, le=MAX_MS)
    seed: int = 0

    @model_validator(mode="after")
    def _ordered(self) -> LatencyParams:
        if self.max_ms < self.min_ms:
            raise ValueError(f"max_ms ({self.max_ms:g}) is below min_ms ({self.min_ms:g})")
        return self

    def draw_ms(self, *parts: object) -> float:
        """The latency (ms) of the request named by ``parts`` (seed first in the hashed key)."""
        u = uniform(self.seed, *parts)
        if self.median_ms is None:
            return loguniform_ms(u, self.min_ms, self.max_ms)
        return lognormal_ms(u, self.median_ms, self.sigma, self.min_ms, self.max_ms)

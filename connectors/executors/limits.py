"""Per-route limits that protect a backend: calls at once, a request rate, a token rate, and the
back-off a backend asks for (``Retry-After`` on a 429 or 529).

A route is what one limit is kept for: a model route of the routes file, a tool of the
registry. Providers publish their limits as requests and tokens per minute; each becomes a
token bucket that refills at the rate and holds one second's worth (at least one call's worth),
so a burst after a quiet minute is spread instead of sent at once. A token limit counts the
tokens calls really used, known only when a call ends: a call may start when the bucket holds
the route's estimate of a call (the running mean of the calls so far, or the route's own
estimate before the first), and its real use is charged when it ends; the bucket may go below
zero, which holds the next calls back until the rate has paid it.

Pure: no clock is read here (the executor passes ``time.monotonic()``), nothing blocks.
The executor holds a lock around it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: The estimate of a call's tokens before a route's first call has ended.
DEFAULT_TOKENS_PER_CALL = 1000
#: How much of the running mean a new call's real use moves (an exponential moving average).
ESTIMATE_WEIGHT = 0.2


@dataclass(frozen=True)
class RouteLimits:
    """The limits of one route; None: no such limit."""

    max_in_flight: int | None = None
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    tokens_per_call: int = DEFAULT_TOKENS_PER_CALL  # the estimate before the first call ends

    def __post_init__(self) -> None:
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, not {self.max_in_flight}")
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number, not {value}")
        if self.tokens_per_call < 1:
            raise ValueError(f"tokens_per_call must be at least 1, not {self.tokens_per_call}")

    @property
    def unlimited(self) -> bool:
        return (
            self.max_in_flight is None
            and self.requests_per_minute is None
            and self.tokens_per_minute is None
        )


NO_LIMITS = RouteLimits()


class _Bucket:
    """A token bucket: ``rate`` per second, holding at most ``capacity``; its level may go
    below zero (a charge larger than what it held)."""

    __slots__ = ("capacity", "level", "rate", "updated")

    def __init__(self, per_minute: float, now: float, at_least: float = 1.0) -> None:
        self.rate = per_minute / 60.0
        self.capacity = max(self.rate, at_least)
        self.level = self.capacity
        self.updated = now

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait_s(self, need: float, now: float) -> float:
        """Seconds until ``need`` may be taken (0: now). A need over the capacity waits for a
        full bucket."""
        self.refill(now)
        need = min(need, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, amount: float) -> None:
        self.level -= amount

    def give(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


@dataclass
class Permit:
    """One call's admission to its route: what to give back when it ends."""

    route: str
    tokens: float  # the estimate charged at the start


class _Route:
    __slots__ = ("blocked_until", "estimate", "in_flight", "limits", "requests", "tokens")

    def __init__(self, limits: RouteLimits, now: float) -> None:
        self.limits = limits
        self.in_flight = 0
        self.blocked_until = 0.0
        self.estimate = float(limits.tokens_per_call)
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        self.requests = None if rpm is None else _Bucket(rpm, now)
        self.tokens = None if tpm is None else _Bucket(tpm, now, limits.tokens_per_call)


class RouteLimiter:
    """The state of every route's limits. ``limits_of(route)`` is asked once per route."""

    def __init__(self, limits_of: Callable[[str], RouteLimits]) -> None:
        self._limits_of = limits_of
        self._routes: dict[str, _Route] = {}

    def _route(self, route: str, now: float) -> _Route:
        state = self._routes.get(route)
        if state is None:
            state = self._routes[route] = _Route(self._limits_of(route), now)
        return state

    def wait_s(self, route: str, now: float) -> float | None:
        """How long a call to ``route`` must wait: 0 (it may start now), seconds (a rate or a
        back-off), or None (the route is at its calls at once: until one of them ends)."""
        state = self._route(route, now)
        limits = state.limits
        if limits.max_in_flight is not None and state.in_flight >= limits.max_in_flight:
            return None
        wait = max(0.0, state.blocked_until - now)
        if state.requests is not None:
            wait = max(wait, state.requests.wait_s(1.0, now))
        if state.tokens is not None:
            wait = max(wait, state.tokens.wait_s(state.estimate, now))
        return wait

    def start(self, route: str, now: float) -> Permit:
        """A call to ``route`` starts (after `wait_s` said 0)."""
        state = self._route(route, now)
        state.in_flight += 1
        if state.requests is not None:
            state.requests.refill(now)
            state.requests.take(1.0)
        charged = 0.0
        if state.tokens is not None:
            state.tokens.refill(now)
            charged = state.estimate
            state.tokens.take(charged)
        return Permit(route, charged)

    def cancel(self, permit: Permit, now: float) -> None:
        """A started call was not sent after all: its slot, request and tokens come back."""
        state = self._route(permit.route, now)
        state.in_flight = max(0, state.in_flight - 1)
        if state.requests is not None:
            state.requests.give(1.0)
        if state.tokens is not None:
            state.tokens.give(permit.tokens)

    def end(
        self,
        permit: Permit,
        now: float,
        *,
        tokens: int | None = None,
        throttle_s: float | None = None,
    ) -> None:
        """A call ended: ``tokens`` it really used (charged for the estimate), ``throttle_s``
        the back-off its backend asked for (the route sends nothing before it has passed)."""
        state = self._route(permit.route, now)
        state.in_flight = max(0, state.in_flight - 1)
        if tokens is not None and tokens >= 0:
            if state.tokens is not None:
                state.tokens.take(tokens - permit.tokens)
            state.estimate += ESTIMATE_WEIGHT * (max(1, tokens) - state.estimate)
        if throttle_s is not None and throttle_s > 0:
            state.blocked_until = max(state.blocked_until, now + throttle_s)

    def in_flight(self, route: str) -> int:
        state = self._routes.get(route)
        return 0 if state is None else state.in_flight

    def blocked_until(self, route: str) -> float:
        state = self._routes.get(route)
        return 0.0 if state is None else state.blocked_until


__all__ = ["NO_LIMITS", "Permit", "RouteLimiter", "RouteLimits"]

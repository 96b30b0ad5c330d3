"""An executor's configuration: its topics and group, how many calls it carries, how long it
waits, and its limits on what it holds and writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentruns.connectors.postgres.artifacts import MAX_ARTIFACT_BYTES
from agentruns.streams.access import executor_group


@dataclass
class ExecutorConfig:
    bootstrap: str
    database_url: str
    kind: str  # "model" or "tool": which effects topic
    prefix: str = "agentruns"
    group_id: str | None = None  # default: <prefix>-executor-<kind>
    # Stable per process slot: a restarted executor with the same id aborts the transaction
    # its predecessor left open at once (instead of waiting for transaction.timeout.ms).
    instance_id: str = "0"
    # Calls in progress at once (each a task on the calls thread); more effects wait for a
    # free one.
    max_in_flight: int = 512
    # Effects held at once (waiting, running, answered and not yet committed) before the
    # partitions are paused; None: 2 x max_in_flight. A poll batch may go past it by its size.
    max_held: int | None = None
    # The bytes of the held effects' records and answers before the partitions are paused.
    max_held_bytes: int = 256 * 1024 * 1024
    max_batch: int = 256  # records taken by one poll
    poll_timeout_s: float = 0.1
    # After the first effect of a batch, wait this long for more (a producer's linger on the
    # consuming side), while effects come at least one a window (`Linger`): effects coming
    # fast share one records statement, while a lone effect of an idle or trickling stream is
    # not held (docs/design.md, "Fetching"). Unlike a fetch window (fetch.min.bytes) it costs
    # an idle executor no extra fetches.
    gather_ms: int = 10
    # The guard around each effect's handler (one place, Executor._answer): an exception that
    # looks transient (OSError) is retried for that effect alone, up to `handler_attempts` in
    # all, waiting `handler_backoff_ms`, doubling; then the effect gets its failure answer.
    handler_attempts: int = 3
    handler_backoff_ms: int = 200
    # An effect started this many times without an answer (its handler kills the process, or
    # its records keep failing) is answered with its failure instead of run again.
    max_starts: int = 5
    # An artifact a handler returns over this size becomes the failure
    # `invalid_output:too_large` (the store refuses more than MAX_ARTIFACT_BYTES).
    max_artifact_bytes: int = MAX_ARTIFACT_BYTES
    # An answer whose Input record encodes to more than this becomes the failure
    # `invalid_output:too_large`: the broker refuses a record over its message.max.bytes
    # (1 MiB by default), and a refused record would fail every transaction it is in.
    max_input_bytes: int = 1_000_000
    # A records statement (or a transaction) that fails is tried again after this back-off,
    # doubling up to the maximum while it keeps failing.
    retry_backoff_s: float = 0.5
    retry_backoff_max_s: float = 10.0
    # A backend that answers 429 or 529 stops its route for its Retry-After, at most this long
    # (the run's own back-off follows the Retry-After as the core clamps it): one answer,
    # hostile or wrong, cannot stop every run's calls to a route for long.
    max_throttle_s: float = 60.0
    # A partition that moves to another member waits this long for its effects in flight;
    # one still running then is answered by its next owner (which reconciles it).
    revoke_wait_s: float = 30.0
    # A stopping executor waits this long for its calls in flight to end and be committed.
    stop_wait_s: float = 30.0
    transaction_timeout_ms: int = 10_000
    session_timeout_ms: int = 6000
    max_poll_interval_ms: int = 300_000
    extra_consumer: dict[str, Any] = field(default_factory=dict)
    extra_producer: dict[str, Any] = field(default_factory=dict)

    @property
    def group(self) -> str:
        return self.group_id or executor_group(self.prefix, self.kind)

    def handler_backoff_s(self, attempt: int) -> float:
        """The guard's wait after the ``attempt``-th failed attempt (1: the first): the back-off,
        doubling (the exponent bounded, so any attempt count gives a number)."""
        return max(0, self.handler_backoff_ms) / 1000 * float(2 ** min(max(0, attempt - 1), 40))

    @property
    def held_limit(self) -> int:
        return self.max_held if self.max_held is not None else 2 * self.max_in_flight

"""The executors' Prometheus metrics (docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# Labelled by `kind` (model, tool): both executors may share a process (`agentruns run`).
EXECUTOR_RECORDS = Counter(
    "agentruns_executor_records_total", "Effect records consumed by the executor", ["kind"]
)
EXECUTOR_EFFECTS = Counter(
    "agentruns_executor_effects_total",
    "Effects answered, by outcome: executed (the handler's answer), failed (a failure answer"
    " from the guard), replayed (the stored answer of a completed effect, sent again)",
    ["kind", "outcome"],
)
EXECUTOR_CALL_SECONDS = Histogram(
    "agentruns_executor_call_seconds",
    "Time of one handler call (the model or tool call), by outcome: ok or error (it raised)",
    ["kind", "outcome"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
EXECUTOR_HANDLER_ERRORS = Counter(
    "agentruns_executor_handler_errors_total", "Exceptions out of a handler, caught", ["kind"]
)
EXECUTOR_DEAD_LETTERS = Counter(
    "agentruns_executor_dead_letters_total", "Effect records sent to the DLQ", ["kind"]
)
EXECUTOR_TRANSACTIONS = Counter(
    "agentruns_executor_transactions_total",
    "Executor transactions, by outcome: committed or aborted (their answers are handed over again)",
    ["kind", "outcome"],
)
EXECUTOR_BATCH_RETRIES = Counter(
    "agentruns_executor_batch_retries_total",
    "Records statements retried after a failure (the database down): effects that could not"
    " begin, or answers that could not be recorded",
    ["kind"],
)
EXECUTOR_COMMIT_SECONDS = Histogram(
    "agentruns_executor_commit_seconds",
    "Time of one executor transaction (offsets, produce, flush, commit)",
    ["kind"],
    buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
EXECUTOR_IN_FLIGHT = Gauge(
    "agentruns_executor_in_flight",
    "Effects held by the executor, by state: waiting (for a route's limits or a free call),"
    " running (the call in progress), answered (waiting for their transaction)",
    ["kind", "state"],
)
EXECUTOR_ROUTE_WAIT_SECONDS = Histogram(
    "agentruns_executor_route_wait_seconds",
    "Time an effect waited, from admission to the start of its call (its route's limits and"
    " the executor's max_in_flight)",
    ["kind"],
    buckets=(0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
EXECUTOR_THROTTLES = Counter(
    "agentruns_executor_throttles_total",
    "Calls whose backend asked the route to slow down (a 429 or 529, with Retry-After or not)",
    ["kind", "route"],
)
EXECUTOR_PAUSES = Counter(
    "agentruns_executor_pauses_total",
    "Times the executor paused its partitions: the held effects reached max_held, or their"
    " bytes max_held_bytes",
    ["kind"],
)
MODEL_TOKENS = Counter(
    "agentruns_model_tokens_total",
    "Tokens of model calls as the provider's usage reported them, by configured route and"
    " direction: input (the prompt) or output (the completion)",
    ["route", "direction"],
)
MODEL_COST = Counter(
    "agentruns_model_cost_total",
    "Cost of model calls by configured route, in the currency of the route's"
    " input/output_cost_micros_per_1k (their micros / 1e6); 0 for a route that names no price",
    ["route"],
)


def route_label(name: str) -> str:
    """A configured route's name as the `route` label: ``default`` for the default route (its
    name is empty), ``*`` for the routes file's catch-all entry."""
    return name or "default"

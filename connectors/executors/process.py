"""An executor as a process (`agentruns executor model|tool`): its command-line flags, where
it finds Kafka and Postgres, and the service runner it starts through."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentruns.connectors import endpoints, health
from agentruns.connectors.endpoints import Endpoints
from agentruns.connectors.executors.base import ExecutorError
from agentruns.connectors.executors.config import ExecutorConfig
from agentruns.connectors.executors.loop import Executor
from agentruns.connectors.service import run_service
from agentruns.connectors.settings import current
from agentruns.streams.topics import default_prefix


def add_common_arguments(parser: Any, kind: str) -> None:
    parser.add_argument("--bootstrap", default=current().kafka_bootstrap_servers)
    parser.add_argument("--database-url", default=current().database_url)
    parser.add_argument(
        "--prefix",
        default=default_prefix(),
        help="topic prefix",
    )
    parser.add_argument("--group", default=None, help=f"consumer group (<prefix>-executor-{kind})")
    parser.add_argument(
        "--instance", default="0", help="stable instance id (transactional.id suffix)"
    )
    parser.add_argument(
        "--max-in-flight",
        "--workers",
        dest="max_in_flight",
        type=int,
        default=ExecutorConfig.max_in_flight,
        help="calls in progress at once (--workers: the old name)",
    )
    parser.add_argument(
        "--max-held",
        type=int,
        default=None,
        help="effects held (waiting, running, answered) before the partitions are paused"
        " (default: twice --max-in-flight)",
    )
    parser.add_argument("--max-batch", type=int, default=ExecutorConfig.max_batch)
    parser.add_argument(
        "--gather-ms",
        type=int,
        default=ExecutorConfig.gather_ms,
        help="after a batch's first effect, wait this long for more (0: take what is there)",
    )
    parser.add_argument(
        "--stop-wait-s",
        type=float,
        default=ExecutorConfig.stop_wait_s,
        help="on SIGTERM, how long the calls in flight get to end and be committed",
    )
    parser.add_argument("--log-level", default="WARNING")
    health.add_arguments(parser)


def endpoints_from_args(args: Any) -> Endpoints:
    """Kafka and Postgres from ``--bootstrap`` / ``--database-url``, else the settings."""
    patience = endpoints.SERVICE_PATIENCE_S
    if args.bootstrap:
        endpoints.check_kafka(args.bootstrap)  # unreachable, or credentials refused: one line
    bootstrap = args.bootstrap or endpoints.configured_kafka(patience_s=patience)
    database = args.database_url or endpoints.configured_postgres(
        required="pass --database-url", patience_s=patience
    )
    assert database is not None
    return Endpoints(
        bootstrap, database, "--bootstrap" if args.bootstrap else "settings", "settings"
    )


def serve_executor(args: Any, kind: str, make: Callable[[ExecutorConfig], Executor]) -> int:
    """Run the executor ``make`` builds from the command's flags (`service.run_service`) until
    SIGTERM/SIGINT; the calls in flight then get ``stop_wait_s`` to end and be committed."""
    for name in ("max_in_flight", "max_batch"):
        if getattr(args, name) < 1:
            raise ExecutorError(f"--{name.replace('_', '-')} must be at least 1")
    component = f"executor-{kind}"
    with run_service(args, component, resolve=lambda: endpoints_from_args(args)) as running:
        ep, status = running.endpoints, running.health
        assert status is not None
        config = ExecutorConfig(
            bootstrap=ep.kafka_bootstrap,
            database_url=ep.database_url,
            kind=kind,
            prefix=args.prefix,
            group_id=args.group,
            instance_id=args.instance,
            max_in_flight=args.max_in_flight,
            max_held=args.max_held,
            max_batch=args.max_batch,
            gather_ms=args.gather_ms,
            stop_wait_s=args.stop_wait_s,
        )
        executor = make(config)
        status.watch_consumer(executor.membership, config.group)
        running.serving_loop()
        executor.run(running.stop)
    return 0


__all__ = ["add_common_arguments", "endpoints_from_args", "serve_executor"]

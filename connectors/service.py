"""The start of every long-running service (processor, executors, timer, sink, scanner, API), in
one place: logging, tracing, the signals that stop it, its Kafka and Postgres (from the settings,
`endpoints`), the migrations, and its health server for as long as it runs.

A service's `main` parses its flags, then runs its loop inside `run_service(...)`. How it ends
is `lifecycle.run_command`'s: 0 after SIGTERM, 2 and one line after an error someone must act
on, `RESTART_ME` when its consumer was fenced.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from agentruns.connectors import endpoints, health
from agentruns.connectors.endpoints import Endpoints
from agentruns.connectors.lifecycle import stop_on_signals
from agentruns.connectors.logs import setup_logging
from agentruns.streams import tracing


@dataclass
class Running:
    """What a service's loop runs with."""

    endpoints: Endpoints
    stop: threading.Event
    health: health.Health | None

    def serving_loop(self) -> None:
        """From here on, the service is live while its loop (this thread) runs and not stopped."""
        if self.health is not None:
            self.health.watch_loop(self.stop, threading.current_thread())


@contextmanager
def run_service(
    args: argparse.Namespace,
    component: str,
    *,
    serve_health: bool = True,
    consumer: bool = True,
    migrations: bool = True,
    signals: bool = True,
    resolve: Callable[[], Endpoints] = endpoints.resolve,
) -> Iterator[Running]:
    """The service ``component`` set up from ``args`` (``--log-level`` and the health flags of
    `health.add_arguments`); ``resolve`` finds its Kafka and Postgres (the settings; a command
    with flags of its own for them passes its own)."""
    from agentruns.connectors.postgres.migrate import migrate

    setup_logging(args.log_level, component=component)
    tracing.configure_from_env(component)
    stop = stop_on_signals() if signals else threading.Event()
    ep = resolve()
    with ExitStack() as stack:
        status = None
        if serve_health:
            status = stack.enter_context(
                health.serving(
                    args,
                    component,
                    bootstrap=ep.kafka_bootstrap,
                    database_url=ep.database_url,
                    consumer=consumer,
                )
            )
        if migrations:
            migrate(ep.database_url)
        yield Running(ep, stop, status)

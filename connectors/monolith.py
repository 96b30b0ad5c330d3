"""`agentruns run`: every layer in one process, for development (R29).

Processor, model executor, tool executor, timer service and sink run as threads against the
configured Kafka and Postgres (same resolution as every command); `--dev-servers` also starts
the scripted model server, the example tool server and the example MCP server and points the
executors at them; the HTTP API (uvicorn) runs in a thread too. The tool catalog is refreshed
as in the processor and the API (`catalog.refreshing`), and each version reaches both.
Production runs the same classes as separate, independently scaled processes (`agentruns
processor`, `agentruns executor model|tool`, `agentruns timer`, `agentruns sink`, `agentruns
api`).
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

from agentruns.connectors.catalog import CatalogRefresher, catalog_of, refreshing
from agentruns.connectors.executors.config import ExecutorConfig
from agentruns.connectors.executors.model import ModelExecutor, Routes
from agentruns.connectors.executors.tool import (
    REGISTRY_ENV,
    ToolExecutor,
    ToolRegistry,
    registry_from_args,
)
from agentruns.connectors.keys import processor_tenant_header
from agentruns.connectors.lifecycle import stop_on_signals
from agentruns.connectors.logs import setup_logging
from agentruns.connectors.postgres.artifacts import PostgresArtifactStore
from agentruns.connectors.postgres.migrate import migrate
from agentruns.connectors.projection.sink import Sink, SinkConfig
from agentruns.connectors.runtime.timers import TimerService
from agentruns.connectors.settings import current
from agentruns.processors.catalog import Catalog
from agentruns.streams import tracing
from agentruns.streams.admin import ensure_topics
from agentruns.streams.processor import Processor, ProcessorConfig
from agentruns.streams.topics import default_prefix

log = logging.getLogger("agentruns.run")


class Monolith:
    """The pipeline's components as threads; `stop()` ends them all and waits."""

    def __init__(
        self,
        bootstrap: str,
        database_url: str,
        *,
        prefix: str = "agentruns",
        registry: ToolRegistry,
        model_base_url: str | None = None,
        tool_base_url: str | None = None,
    ) -> None:
        self.stop_event = threading.Event()
        self.failed: str | None = None  # the component that stopped with an error
        self._threads: list[threading.Thread] = []
        self._closers: list[Callable[[], object]] = []
        self._refreshing = ExitStack()
        self.refresher: CatalogRefresher | None = None
        self.registry = registry
        store = PostgresArtifactStore(database_url)
        self._closers.append(store.close)

        def executor(kind: str) -> ExecutorConfig:
            return ExecutorConfig(
                bootstrap=bootstrap, database_url=database_url, kind=kind, prefix=prefix
            )

        self.tool_executor = ToolExecutor(executor("tool"), registry, base_url=tool_base_url)
        # the tools the tool executor runs (its MCP servers listed once, by it) are also the
        # catalog tasks are held to and the descriptions the model is offered
        tools = self.tool_executor.tools()
        self.catalog = catalog_of(registry, tools)
        log.info("tool catalog %s (%d tools)", self.catalog.version, len(self.catalog.tools))
        tenant_header, tenant_key = processor_tenant_header(
            current().tenant_header_mode(), current().tenant_header_key, current().api_secret
        )
        self.processor = Processor(
            ProcessorConfig(
                bootstrap=bootstrap,
                prefix=prefix,
                store_dir=str(current().processor_store_dir()),
                catalog=self.catalog,
                default_tenant=current().default_tenant,
                tenant_header=tenant_header,
                tenant_key=tenant_key,
            ),
            store.put_many,
        )
        # who holds the catalog and takes each new version (the API joins: `take_catalog`)
        self._takers: list[Callable[[Catalog], None]] = [self.processor.set_catalog]
        self.model_executor = ModelExecutor(
            executor("model"), Routes.from_env(None, model_base_url), registry, tools
        )
        self.timer = TimerService(bootstrap, database_url, prefix=prefix)
        self.sink = Sink(SinkConfig(bootstrap=bootstrap, database_url=database_url, prefix=prefix))
        self.components: dict[str, Any] = {
            "processor": self.processor,
            "model-executor": self.model_executor,
            "tool-executor": self.tool_executor,
            "timer": self.timer,
            "sink": self.sink,
        }

    def take_catalog(self, apply: Callable[[Catalog], None]) -> None:
        """``apply`` is given the catalog now and every new version after (the API's config)."""
        self._takers.append(apply)
        apply(self.catalog)

    def set_catalog(self, catalog: Catalog) -> None:
        self.catalog = catalog
        for apply in self._takers:
            apply(catalog)

    def start(self) -> None:
        # the catalog is made again on the schedule and when an MCP server announces a change,
        # from the registry file, or from the registry made in memory (`--dev-servers`)
        self.refresher = self._refreshing.enter_context(
            refreshing(self.registry, self.catalog, self.set_catalog, component="run")
        )
        for name, component in self.components.items():
            thread = threading.Thread(
                target=self._guard, args=(name, component), name=name, daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _guard(self, name: str, component: Any) -> None:
        try:
            component.run(self.stop_event)
        except Exception:
            log.exception("%s stopped with an error; stopping the monolith", name)
            self.failed = self.failed or name
            self.stop_event.set()

    def stop(self, timeout: float = 30.0) -> None:
        self._refreshing.close()
        self.stop_event.set()
        for thread in self._threads:
            thread.join(timeout=timeout)
        for close in self._closers:
            close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns run", description=__doc__)
    parser.add_argument("--prefix", default=default_prefix())
    parser.add_argument("--partitions", type=int, default=None)
    parser.add_argument(
        "--dev-servers",
        action="store_true",
        help="also run the scripted model server and example tool server (and use the example"
        " tool registry unless --registry is given)",
    )
    parser.add_argument(
        "--registry",
        default=current().tool_registry,
        help=f"the tool registry, a JSON file (required without --dev-servers; default"
        f" ${REGISTRY_ENV})",
    )
    parser.add_argument("--api-port", type=int, default=8080)
    parser.add_argument("--log-level", default=current().log_level)
    args = parser.parse_args(list(argv) if argv is not None else None)
    dev_registry = args.dev_servers and not args.registry
    if dev_registry:
        from agentruns.connectors.dev.servers import tool_server

        args.registry = str(tool_server.DEFAULT_REGISTRY)
    registry = registry_from_args(args.registry)
    setup_logging(args.log_level, component="run")
    tracing.configure_from_env("run")
    stop = stop_on_signals()
    # the dev stack is what `agentruns run` starts when nothing is configured: loaded here only
    from agentruns.connectors.dev.stack.services import ServiceStack
    from agentruns.connectors.endpoints import SERVICE_PATIENCE_S

    with ServiceStack(patience_s=SERVICE_PATIENCE_S) as stack, ExitStack() as resources:
        assert stack.endpoints is not None
        ep = stack.endpoints
        migrate(ep.database_url)
        ensure_topics(ep.kafka_bootstrap, prefix=args.prefix, partitions=args.partitions)
        model_url = tool_url = None
        if args.dev_servers:
            from agentruns.connectors.dev.servers import mcp_server, model_server, tool_server
            from agentruns.connectors.executors.mcp_rules import parse_mcp_servers

            model_url = resources.enter_context(model_server.serve("127.0.0.1", 0)).url
            tool_url = resources.enter_context(tool_server.serve("127.0.0.1", 0)).url
            mcp_url = resources.enter_context(mcp_server.serve("127.0.0.1", 0)).url
            log.info("dev servers: model %s, tools %s, MCP %s", model_url, tool_url, mcp_url)
            if dev_registry:  # the example MCP server's tools join the example registry
                entry = {"mcp_servers": [mcp_server.dev_registry_entry(mcp_url)]}
                servers = parse_mcp_servers(entry, "the dev registry")
                # made in memory: no file to read again (the tool executor keeps this one)
                registry = replace(
                    registry, mcp_servers={**registry.mcp_servers, **servers}, path=""
                )
        monolith = Monolith(
            ep.kafka_bootstrap,
            ep.database_url,
            prefix=args.prefix,
            registry=registry,
            model_base_url=model_url,
            tool_base_url=tool_url,
        )
        monolith.start()
        api = _start_api(ep.kafka_bootstrap, ep.database_url, args.prefix, args.api_port, monolith)
        if "testcontainers" in (ep.kafka_source, ep.postgres_source):
            # The client commands find a local stack in the state directory, not containers.
            print(
                "agentruns run: in another terminal, first: "
                f"export KAFKA_BOOTSTRAP_SERVERS={ep.kafka_bootstrap} "
                f"DATABASE_URL={ep.database_url}",
                flush=True,
            )
        print(
            f"agentruns run: {', '.join(monolith.components)}"
            + (f", api on http://127.0.0.1:{args.api_port}" if api else "")
            + f" (kafka {ep.kafka_bootstrap}, topics {args.prefix}.*); Ctrl-C stops",
            flush=True,
        )
        while not stop.wait(0.5) and not monolith.stop_event.is_set():
            pass
        if api is not None:
            api()
        monolith.stop()
    # non-zero when a component failed, so a supervisor (systemd, Kubernetes) restarts us
    return 1 if monolith.failed else 0


def _start_api(
    bootstrap: str, database_url: str, prefix: str, port: int, monolith: Monolith
) -> Callable[[], None] | None:
    """Serve the HTTP API from a uvicorn server in a thread, on the monolith's catalog (and
    each version it takes after); return its stopper."""
    import uvicorn

    from agentruns.connectors.api.config import ApiConfig
    from agentruns.connectors.api.http import create_app

    config = ApiConfig.from_env(bootstrap, database_url, prefix=prefix, catalog=monolith.catalog)
    monolith.take_catalog(config.set_catalog)
    app = create_app(config)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="api", daemon=True)
    thread.start()

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=30)

    return stop


if __name__ == "__main__":
    from agentruns.connectors.lifecycle import run_command

    raise SystemExit(run_command(main))

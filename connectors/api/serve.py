"""`agentruns api`: the HTTP API (Starlette on uvicorn) over the inbox and the projection.

Takes Kafka and Postgres from the settings (`connectors.endpoints`), applies the migrations,
reads the token and the signing secret from the environment (`ApiConfig.from_env`) and serves
`create_app` until stopped.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from agentruns.connectors.api.config import ApiConfig
from agentruns.connectors.api.http import create_app
from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.settings import current
from agentruns.streams.topics import default_prefix


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentruns api", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default=current().api_host)
    parser.add_argument("--port", type=int, default=current().api_port)
    parser.add_argument("--prefix", default=default_prefix())
    parser.add_argument(
        "--production",
        action="store_true",
        default=current().production,
        help="refuse to start without AGENTRUNS_API_TOKEN and AGENTRUNS_API_SECRET "
        "(also AGENTRUNS_ENV=production)",
    )
    parser.add_argument(
        "--registry",
        default=current().tool_registry,
        help="the tool registry whose catalog every task is held to (default"
        " $AGENTRUNS_TOOL_REGISTRY); none: tasks declare their own tools",
    )
    parser.add_argument(
        "--routes",
        default=current().model_routes,
        help="the model routes file (the model executor's): with --registry, a task naming"
        " another route is refused (default $AGENTRUNS_MODEL_ROUTES)",
    )
    parser.add_argument("--log-level", default=current().log_level)
    return parser


@contextmanager
def serving(config: ApiConfig) -> Iterator[str]:
    """The API on uvicorn, on a free port, in a thread of this process; yields its base URL
    (the tests and the console bench serve it this way)."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(create_app(config), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True, name="api")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise AgentrunsError("the API did not start on uvicorn")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    from agentruns.connectors.catalog import configured_catalog, refreshing
    from agentruns.connectors.service import run_service

    args = build_parser().parse_args(list(argv) if argv is not None else None)
    # uvicorn stops on SIGTERM itself; the API's health is its own /healthz
    with run_service(args, "api", serve_health=False, signals=False) as running:
        ep = running.endpoints
        catalog = configured_catalog(args.registry, component="api", routes=args.routes)
        config = ApiConfig.from_env(
            ep.kafka_bootstrap,
            ep.database_url,
            prefix=args.prefix,
            production=args.production,
            catalog=catalog,
        )
        app = create_app(config)
        with refreshing(
            args.registry, catalog, config.set_catalog, component="api", routes=args.routes
        ):
            uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0


if __name__ == "__main__":
    from agentruns.connectors.lifecycle import run_command

    raise SystemExit(run_command(main))

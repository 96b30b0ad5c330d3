"""`agentruns`: the one command line of the project.

Every subcommand turns an `AgentrunsError` into one line on stderr (what is wrong, what to do)
and exit code 2; it never prints a bare stack trace for a problem the user can fix.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence

from agentruns.connectors.lifecycle import run_command
from agentruns.streams.topics import default_prefix


def _dev_up(args: argparse.Namespace) -> int:
    from agentruns.connectors.dev.stack.services import LocalStack, StackConfig
    from agentruns.connectors.endpoints import state_dir

    directory = state_dir()
    config = StackConfig.load(directory) or StackConfig.from_env()
    if args.kafka_port:
        config.kafka_port = args.kafka_port
    if args.pg_port:
        config.pg_port = args.pg_port
    if args.brokers:
        config.brokers = args.brokers
    stack = LocalStack(directory, config)
    timings = stack.up()
    from agentruns.connectors.postgres.migrate import migrate

    applied = migrate(stack.postgres.url)
    print(f"kafka     {stack.kafka.bootstrap_servers}  (ready in {timings['kafka_ready_s']:.1f}s)")
    print(f"postgres  {stack.postgres.url}  (ready in {timings['postgres_ready_s']:.1f}s)")
    print(f"migrations applied: {', '.join(applied) if applied else 'none new'}")
    print(f"state     {directory}   (stop with `agentruns dev down`)")
    print("export KAFKA_BOOTSTRAP_SERVERS=" + stack.kafka.bootstrap_servers)
    print("export DATABASE_URL=" + stack.postgres.url)
    return 0


def _dev_down(args: argparse.Namespace) -> int:
    from agentruns.connectors.dev.stack.services import LocalStack, StackConfig
    from agentruns.connectors.endpoints import state_dir

    directory = state_dir()
    config = StackConfig.load(directory)
    if config is None:
        print(f"nothing to stop: no stack in {directory}")
        return 0
    LocalStack(directory, config).down(wipe=args.wipe)
    print(f"stopped the stack in {directory}" + (" and removed its data" if args.wipe else ""))
    return 0


def _dev_status(args: argparse.Namespace) -> int:
    from agentruns.connectors.dev.stack.services import LocalStack, StackConfig
    from agentruns.connectors.endpoints import state_dir

    directory = state_dir()
    config = StackConfig.load(directory)
    if config is None:
        print(f"no stack in {directory} (start one with `agentruns dev up`)")
        return 1
    status = LocalStack(directory, config).status()
    if args.json:
        print(json.dumps(status))
    else:
        k, p = status["kafka"], status["postgres"]
        kstate = f"running (pids {', '.join(map(str, k['pids']))})" if k["pids"] else "stopped"
        print(f"kafka     {k['bootstrap_servers']}  {kstate}  logs: {', '.join(k['logs'])}")
        print(f"postgres  {p['url']}  {'running' if p['running'] else 'stopped'}  log: {p['log']}")
    up = status["kafka"]["pids"] and status["postgres"]["running"]
    return 0 if up else 1


# Commands whose module parses its own arguments: `agentruns <words...> [args]` runs
# `module.main(args)`. They are listed in the parser too, for `agentruns --help`.
FORWARDED: dict[tuple[str, ...], tuple[str, str]] = {
    ("run",): ("agentruns.connectors.monolith", "every layer in one process (development)"),
    ("processor",): ("agentruns.connectors.runtime.processor", "run a processor process"),
    ("executor", "model"): ("agentruns.connectors.executors.model", "run a model executor process"),
    ("executor", "tool"): ("agentruns.connectors.executors.tool", "run a tool executor process"),
    ("timer",): (
        "agentruns.connectors.runtime.timers",
        "run the timer service (time enters as events)",
    ),
    ("sink",): ("agentruns.connectors.projection.sink", "project the topics into Postgres"),
    ("scan",): ("agentruns.connectors.runtime.scanner", "find and diagnose runs without progress"),
    ("api",): ("agentruns.connectors.api.serve", "the HTTP API"),
    ("submit",): (
        "agentruns.connectors.api.client:main_submit",
        "submit a task (upstream producer)",
    ),
    ("results",): (
        "agentruns.connectors.api.client:main_results",
        "print terminal results (--follow)",
    ),
    ("reply",): ("agentruns.connectors.api.client:main_reply", "answer a run's question"),
    ("cancel",): ("agentruns.connectors.api.client:main_cancel", "cancel a run"),
    ("resolve",): (
        "agentruns.connectors.api.client:main_resolve",
        "operator: continue, fail, succeed or reconcile a paused run",
    ),
    ("reopen",): ("agentruns.connectors.api.client:main_reopen", "operator: reopen an ended run"),
    ("redrive",): (
        "agentruns.connectors.api.client:main_redrive",
        "operator: drive a run stuck without a pending timer",
    ),
    ("replay",): (
        "agentruns.connectors.projection.replay",
        "print a run's timeline from the log",
    ),
    ("audit",): (
        "agentruns.connectors.projection.audit",
        "fold the log, compare with snapshots and Postgres",
    ),
    ("revalidate",): (
        "agentruns.connectors.projection.revalidate",
        "re-run validators over candidates",
    ),
    ("versions",): (
        "agentruns.connectors.projection.rules_versions",
        "which rules versions the runs use, with counts",
    ),
    ("demo",): (
        "agentruns.connectors.dev.demo.run",
        "start what is needed and run the demo scenarios",
    ),
    ("chaos",): ("agentruns.connectors.dev.demo.chaos", "mixed runs while components are killed"),
    ("dev", "model-server"): (
        "agentruns.connectors.dev.servers.model_server",
        "run the scripted model server",
    ),
    ("dev", "tool-server"): (
        "agentruns.connectors.dev.servers.tool_server",
        "run the example tool server",
    ),
    ("dev", "mcp-server"): (
        "agentruns.connectors.dev.servers.mcp_server",
        "run the example MCP tool server",
    ),
    ("bench", "core"): ("agentruns.bench.core", "fold events through the pure core"),
    ("bench", "processor"): ("agentruns.bench.processor", "the processor against the real broker"),
    ("bench", "executors"): ("agentruns.bench.executors", "tool calls through the tool executor"),
    ("bench", "sink"): ("agentruns.bench.sink", "projection rate and lag"),
    ("bench", "console"): (
        "agentruns.bench.console",
        "GET /runs and the console's pages over 100,000 runs",
    ),
    ("bench", "floor"): ("agentruns.bench.floor", "the Kafka floor: tokens between two loops"),
    ("bench", "loop"): ("agentruns.bench.loop", "N concurrent 10-step agent loops end to end"),
    ("bench", "inflight"): (
        "agentruns.bench.inflight",
        "CPU and memory per streamed model call in flight, on the executor's event loop",
    ),
    ("bench", "repeat"): (
        "agentruns.bench.repeat",
        "run a bench N times: median, min, max, targets",
    ),
}


def _forwarded(argv: list[str]) -> tuple[str, list[str]] | None:
    for words in sorted(FORWARDED, key=len, reverse=True):
        if tuple(argv[: len(words)]) == words:
            return FORWARDED[words][0], argv[len(words) :]
    return None


def _topics_create(args: argparse.Namespace) -> int:
    from agentruns.connectors.endpoints import configured_kafka
    from agentruns.streams.admin import ensure_topics

    outcome = ensure_topics(configured_kafka(), prefix=args.prefix, partitions=args.partitions)
    for name, what in outcome.items():
        print(f"{what:8} {name}")
    return 0


def _topics_list(args: argparse.Namespace) -> int:
    from agentruns.connectors.endpoints import configured_kafka
    from agentruns.streams.admin import describe_topics

    for row in describe_topics(configured_kafka(), prefix=args.prefix):
        print(row)
    return 0


def _db_migrate(args: argparse.Namespace) -> int:
    from agentruns.connectors.endpoints import configured_postgres
    from agentruns.connectors.postgres.migrate import migrate

    database = configured_postgres(required="set DATABASE_URL")
    assert database is not None
    applied = migrate(database)
    print(f"migrations applied: {', '.join(applied) if applied else 'none new'}")
    return 0


def _tools_list(args: argparse.Namespace) -> int:
    from agentruns.connectors.catalog import catalog_of, catalog_rows, format_listing
    from agentruns.connectors.executors.tool import registry_from_args, tools_of
    from agentruns.connectors.settings import current

    path = args.registry or current().tool_registry
    registry = registry_from_args(None if path is None else str(path))
    entries = tools_of(registry)
    catalog = catalog_of(registry, entries)
    rows = catalog_rows(entries, catalog)
    if args.json:
        print(json.dumps({"version": catalog.version, "tools": rows}, sort_keys=True))
    else:
        print(format_listing(catalog.version, rows))
    return 0


def _version() -> str:
    """The installed distribution's version (the one pip reports)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentruns")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentruns", description="Durable, restartable LLM-agent runs on Apache Kafka."
    )
    parser.add_argument("--version", action="version", version=f"agentruns {_version()}")
    parser.add_argument(
        "--kafka-config",
        metavar="FILE",
        help="Kafka client properties (key=value, as Kafka's --command-config) for every "
        "Kafka client; also $AGENTRUNS_KAFKA_CONFIG",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    dev = sub.add_parser("dev", help="local Kafka and Postgres, and the demo/test servers")
    dev_sub = dev.add_subparsers(dest="dev_command", required=True)
    up = dev_sub.add_parser("up", help="start a local Kafka (KRaft) broker and Postgres")
    up.add_argument("--kafka-port", type=int, help="first broker port (default 19092)")
    up.add_argument("--pg-port", type=int, help="Postgres port (default 15432)")
    up.add_argument("--brokers", type=int, choices=(1, 3), help="1 broker or a 3-node cluster")
    up.set_defaults(func=_dev_up)
    down = dev_sub.add_parser("down", help="stop what `dev up` started")
    down.add_argument("--wipe", action="store_true", help="also delete its data directories")
    down.set_defaults(func=_dev_down)
    status = dev_sub.add_parser("status", help="what runs where")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=_dev_status)
    for (*_, name), (_, text) in ((k, v) for k, v in FORWARDED.items() if k[0] == "dev"):
        dev_sub.add_parser(name, help=f"{text} (see its --help)")

    topics = sub.add_parser("topics", help="create or list the pipeline's topics")
    topics_sub = topics.add_subparsers(dest="topics_command", required=True)
    create = topics_sub.add_parser("create", help="create every topic, idempotently")
    create.add_argument("--prefix", default=default_prefix())
    create.add_argument("--partitions", type=int, default=None)
    create.set_defaults(func=_topics_create)
    listing = topics_sub.add_parser("list", help="the topics and their configs")
    listing.add_argument("--prefix", default=default_prefix())
    listing.set_defaults(func=_topics_list)

    tools = sub.add_parser("tools", help="the operator's tool catalog")
    tools_sub = tools.add_subparsers(dest="tools_command", required=True)
    tools_list = tools_sub.add_parser(
        "list", help="the catalog's version and tools, from the tool registry"
    )
    tools_list.add_argument(
        "--registry", default=None, help="the tool registry (default $AGENTRUNS_TOOL_REGISTRY)"
    )
    tools_list.add_argument("--json", action="store_true", help="one JSON object")
    tools_list.set_defaults(func=_tools_list)

    db = sub.add_parser("db", help="database schema")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    db_sub.add_parser("migrate", help="apply the versioned SQL migrations").set_defaults(
        func=_db_migrate
    )

    for (name,), (_, text) in ((k, v) for k, v in FORWARDED.items() if len(k) == 1):
        sub.add_parser(name, help=f"{text} (see its --help)")
    executor = sub.add_parser("executor", help="model or tool executor processes")
    executor_sub = executor.add_subparsers(dest="executor_kind", required=True)
    for (*_, name), (_, text) in ((k, v) for k, v in FORWARDED.items() if k[0] == "executor"):
        executor_sub.add_parser(name, help=f"{text} (see its --help)")
    bench = sub.add_parser("bench", help="benchmarks; each prints one JSON object last")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for (*_, name), (_, text) in ((k, v) for k, v in FORWARDED.items() if k[0] == "bench"):
        bench_sub.add_parser(name, help=f"{text} (see its --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_dispatch, argv)


def _dispatch(words: list[str]) -> int:
    forwarded = _forwarded(words)
    if forwarded is not None:
        target, rest = forwarded
        module, _, function = target.partition(":")
        return int(getattr(importlib.import_module(module), function or "main")(rest))
    args = build_parser().parse_args(words)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

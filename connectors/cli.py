"""`agentruns`: the one command line of the project.

Every subcommand turns an `AgentrunsError` into one line on stderr (what is wrong, what to do)
and exit code 2; it never prints a bare stack trace for a problem the user can fix. The
production commands are here; the development ones (`dev`, `demo`, `chaos`, `bench`) are the
harness's (`agentruns.connectors.dev.commands`), loaded only when one of them is asked for.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from agentruns.connectors.lifecycle import run_command
from agentruns.streams.topics import default_prefix

Command = Callable[[list[str]], int]


# Commands whose module parses its own arguments: `agentruns <words...> [args]` runs it with
# the rest. They are listed in the parser too, for `agentruns --help`.


def _run(argv: list[str]) -> int:
    from agentruns.connectors.monolith import main

    return main(argv)


def _processor(argv: list[str]) -> int:
    from agentruns.connectors.runtime.processor import main

    return main(argv)


def _executor_model(argv: list[str]) -> int:
    from agentruns.connectors.executors.model import main

    return main(argv)


def _executor_tool(argv: list[str]) -> int:
    from agentruns.connectors.executors.tool import main

    return main(argv)


def _timer(argv: list[str]) -> int:
    from agentruns.connectors.runtime.timers import main

    return main(argv)


def _sink(argv: list[str]) -> int:
    from agentruns.connectors.projection.sink import main

    return main(argv)


def _scan(argv: list[str]) -> int:
    from agentruns.connectors.runtime.scanner import main

    return main(argv)


def _api(argv: list[str]) -> int:
    from agentruns.connectors.api.serve import main

    return main(argv)


def _submit(argv: list[str]) -> int:
    from agentruns.connectors.api.client import main_submit

    return main_submit(argv)


def _results(argv: list[str]) -> int:
    from agentruns.connectors.api.client import main_results

    return main_results(argv)


def _reply(argv: list[str]) -> int:
    from agentruns.connectors.api.client import main_reply

    return main_reply(argv)


def _cancel(argv: list[str]) -> int:
    from agentruns.connectors.api.client import main_cancel

    return main_cancel(argv)


def _resolve(argv: list[str]) -> int:
    from agentruns.connectors.api.client import main_resolve

    return main_resolve(argv)


def _reopen(argv: list[str]) -> int:
    from agentruns.connectors.api.client import main_reopen

    return main_reopen(argv)


def _redrive(argv: list[str]) -> int:
    from agentruns.connectors.api.client import main_redrive

    return main_redrive(argv)


def _fork(argv: list[str]) -> int:
    from agentruns.connectors.forks import main_fork

    return main_fork(argv)


def _resume(argv: list[str]) -> int:
    from agentruns.connectors.forks import main_resume

    return main_resume(argv)


def _replay(argv: list[str]) -> int:
    from agentruns.connectors.projection.replay import main

    return main(argv)


def _audit(argv: list[str]) -> int:
    from agentruns.connectors.projection.audit import main

    return main(argv)


def _revalidate(argv: list[str]) -> int:
    from agentruns.connectors.projection.revalidate import main

    return main(argv)


def _kafka_acls(argv: list[str]) -> int:
    from agentruns.connectors.kafka_acls import main

    return main(argv)


def _keys(argv: list[str]) -> int:
    from agentruns.connectors.keys import main

    return main(argv)


def _versions(argv: list[str]) -> int:
    from agentruns.connectors.projection.rules_versions import main

    return main(argv)


def _credentials_add(argv: list[str]) -> int:
    from agentruns.connectors.api.credentials_cli import main_add

    return main_add(argv)


def _credentials_list(argv: list[str]) -> int:
    from agentruns.connectors.api.credentials_cli import main_list

    return main_list(argv)


def _credentials_remove(argv: list[str]) -> int:
    from agentruns.connectors.api.credentials_cli import main_remove

    return main_remove(argv)


def _credentials_kafka_key(argv: list[str]) -> int:
    from agentruns.connectors.keys import main_kafka_key

    return main_kafka_key(argv)


COMMANDS: dict[tuple[str, ...], tuple[Command, str]] = {
    ("run",): (_run, "every layer in one process (development)"),
    ("processor",): (_processor, "run a processor process"),
    ("executor", "model"): (_executor_model, "run a model executor process"),
    ("executor", "tool"): (_executor_tool, "run a tool executor process"),
    ("timer",): (_timer, "run the timer service (time enters as events)"),
    ("sink",): (_sink, "project the topics into Postgres"),
    ("scan",): (_scan, "find and diagnose runs without progress"),
    ("api",): (_api, "the HTTP API"),
    ("submit",): (_submit, "submit a task (upstream producer)"),
    ("results",): (_results, "print terminal results (--follow)"),
    ("reply",): (_reply, "answer a run's question"),
    ("cancel",): (_cancel, "cancel a run"),
    ("resolve",): (_resolve, "operator: continue, fail, succeed or reconcile a paused run"),
    ("reopen",): (_reopen, "operator: reopen an ended run"),
    ("redrive",): (_redrive, "operator: drive a run stuck without a pending timer"),
    ("fork",): (_fork, "start a new run from a run's state at one seq"),
    ("resume",): (_resume, "resume a failed run after a fix (a fork before its failure)"),
    ("replay",): (_replay, "print a run's timeline from the log"),
    ("audit",): (_audit, "fold the log, compare with snapshots and Postgres"),
    ("revalidate",): (_revalidate, "re-run validators over candidates"),
    ("versions",): (_versions, "which rules versions the runs use, with counts"),
    ("kafka", "acls"): (_kafka_acls, "the Kafka ACLs a service's principal needs"),
    ("keys",): (_keys, "a key of AGENTRUNS_API_SECRET: callback (tool executors), tenant-header"),
    ("credentials", "add"): (_credentials_add, "mint an API credential (tenant, roles)"),
    ("credentials", "list"): (_credentials_list, "the API credentials: id, tenant, roles"),
    ("credentials", "remove"): (_credentials_remove, "remove an API credential"),
    ("credentials", "kafka-key"): (
        _credentials_kafka_key,
        "a tenant's Kafka key: its producers sign their tenant header with it",
    ),
}

#: The first words of the development commands (`agentruns.connectors.dev.commands`).
DEVELOPMENT = frozenset({"dev", "demo", "chaos", "bench"})


def _command(words: list[str]) -> tuple[Command, list[str]] | None:
    table = COMMANDS
    if words and words[0] in DEVELOPMENT:
        from agentruns.connectors.dev import commands

        table = commands.COMMANDS
    for key in sorted(table, key=len, reverse=True):
        if tuple(words[: len(key)]) == key:
            return table[key][0], words[len(key) :]
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

    database = configured_postgres(required="")
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
    from agentruns.connectors.build import version

    return version()


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

    for (name,), (_, text) in ((k, v) for k, v in COMMANDS.items() if len(k) == 1):
        sub.add_parser(name, help=f"{text} (see its --help)")
    executor = sub.add_parser("executor", help="model or tool executor processes")
    executor_sub = executor.add_subparsers(dest="executor_kind", required=True)
    for (*_, name), (_, text) in ((k, v) for k, v in COMMANDS.items() if k[0] == "executor"):
        executor_sub.add_parser(name, help=f"{text} (see its --help)")
    kafka = sub.add_parser("kafka", help="the pipeline's Kafka permissions")
    kafka_sub = kafka.add_subparsers(dest="kafka_command", required=True)
    for (*_, name), (_, text) in ((k, v) for k, v in COMMANDS.items() if k[0] == "kafka"):
        kafka_sub.add_parser(name, help=f"{text} (see its --help)")
    credentials = sub.add_parser("credentials", help="the API's credentials file")
    credentials_sub = credentials.add_subparsers(dest="credentials_command", required=True)
    for (*_, name), (_, text) in ((k, v) for k, v in COMMANDS.items() if k[0] == "credentials"):
        credentials_sub.add_parser(name, help=f"{text} (see its --help)")
    from agentruns.connectors.dev import commands

    commands.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_dispatch, argv)


def _dispatch(words: list[str]) -> int:
    found = _command(words)
    if found is not None:
        command, rest = found
        return command(rest)
    args = build_parser().parse_args(words)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

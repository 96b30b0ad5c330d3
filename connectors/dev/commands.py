"""The development commands of `agentruns`: `dev up|down|status` (the local Kafka and Postgres),
`dev model-server|tool-server|mcp-server`, `demo`, `chaos` and the benchmarks. The command line
(`agentruns.connectors.cli`) reaches this module only for those words; each command imports what
it runs when it runs.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

Command = Callable[[list[str]], int]


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


# Commands whose module parses its own arguments: `agentruns <words...> [args]` runs it with
# the rest. They are listed in the parser too, for `agentruns --help`.


def _demo(argv: list[str]) -> int:
    from agentruns.connectors.dev.demo.run import main

    return main(argv)


def _chaos(argv: list[str]) -> int:
    from agentruns.connectors.dev.demo.chaos import main

    return main(argv)


def _dev_model_server(argv: list[str]) -> int:
    from agentruns.connectors.dev.servers.model_server import main

    return main(argv)


def _dev_tool_server(argv: list[str]) -> int:
    from agentruns.connectors.dev.servers.tool_server import main

    return main(argv)


def _dev_mcp_server(argv: list[str]) -> int:
    from agentruns.connectors.dev.servers.mcp_server import main

    return main(argv)


def _bench_core(argv: list[str]) -> int:
    from agentruns.bench.core import main

    return main(argv)


def _bench_processor(argv: list[str]) -> int:
    from agentruns.bench.processor import main

    return main(argv)


def _bench_executors(argv: list[str]) -> int:
    from agentruns.bench.executors import main

    return main(argv)


def _bench_sink(argv: list[str]) -> int:
    from agentruns.bench.sink import main

    return main(argv)


def _bench_console(argv: list[str]) -> int:
    from agentruns.bench.console import main

    return main(argv)


def _bench_floor(argv: list[str]) -> int:
    from agentruns.bench.floor import main

    return main(argv)


def _bench_loop(argv: list[str]) -> int:
    from agentruns.bench.loop import main

    return main(argv)


def _bench_inflight(argv: list[str]) -> int:
    from agentruns.bench.inflight import main

    return main(argv)


def _bench_spans(argv: list[str]) -> int:
    from agentruns.bench.spans import main

    return main(argv)


def _bench_repeat(argv: list[str]) -> int:
    from agentruns.bench.repeat import main

    return main(argv)


COMMANDS: dict[tuple[str, ...], tuple[Command, str]] = {
    ("demo",): (_demo, "start what is needed and run the demo scenarios"),
    ("chaos",): (_chaos, "mixed runs while components are killed"),
    ("dev", "model-server"): (_dev_model_server, "run the scripted model server"),
    ("dev", "tool-server"): (_dev_tool_server, "run the example tool server"),
    ("dev", "mcp-server"): (_dev_mcp_server, "run the example MCP tool server"),
    ("bench", "core"): (_bench_core, "fold events through the pure core"),
    ("bench", "processor"): (_bench_processor, "the processor against the real broker"),
    ("bench", "executors"): (_bench_executors, "tool calls through the tool executor"),
    ("bench", "sink"): (_bench_sink, "projection rate and lag"),
    ("bench", "console"): (_bench_console, "GET /runs and the console's pages over 100,000 runs"),
    ("bench", "floor"): (_bench_floor, "the Kafka floor: tokens between two loops"),
    ("bench", "loop"): (_bench_loop, "N concurrent 10-step agent loops end to end"),
    ("bench", "inflight"): (
        _bench_inflight,
        "CPU and memory per streamed model call in flight, on the executor's event loop",
    ),
    ("bench", "spans"): (
        _bench_spans,
        "CPU per recorded span: agentruns' tracing against the SDK's",
    ),
    ("bench", "repeat"): (_bench_repeat, "run a bench N times: median, min, max, targets"),
}


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The development commands in `agentruns --help`."""
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
    for (*_, name), (_, text) in ((k, v) for k, v in COMMANDS.items() if k[0] == "dev"):
        dev_sub.add_parser(name, help=f"{text} (see its --help)")
    for (name,), (_, text) in ((k, v) for k, v in COMMANDS.items() if len(k) == 1):
        sub.add_parser(name, help=f"{text} (see its --help)")
    bench = sub.add_parser("bench", help="benchmarks; each prints one JSON object last")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for (*_, name), (_, text) in ((k, v) for k, v in COMMANDS.items() if k[0] == "bench"):
        bench_sub.add_parser(name, help=f"{text} (see its --help)")

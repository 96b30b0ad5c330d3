"""`agentruns processor`: one processor process (production mode), wired to its adapters.

Kafka and Postgres come from the settings (`connectors.endpoints`); artifacts go
to the Postgres artifact store. SIGTERM/SIGINT stop it cleanly: the open transaction commits and
the consumer leaves the group. Run several with distinct `--instance-id`s to split partitions.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from agentruns.connectors import health
from agentruns.connectors.catalog import configured_catalog, refreshing
from agentruns.connectors.keys import processor_tenant_header
from agentruns.connectors.postgres.artifacts import PostgresArtifactStore
from agentruns.connectors.service import run_service
from agentruns.connectors.settings import current
from agentruns.processors import versions
from agentruns.streams.admin import ensure_topics
from agentruns.streams.interpreter import tune_gc, tune_switch_interval
from agentruns.streams.processor import Processor, ProcessorConfig
from agentruns.streams.topics import default_prefix

log = logging.getLogger("agentruns.processor")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentruns processor", description=__doc__)
    p.add_argument("--prefix", default=default_prefix())
    p.add_argument("--group", default="", help="consumer group id (default <prefix>-processor)")
    p.add_argument(
        "--instance-id",
        default=current().instance_id,
        help="stable id of this process slot (its transactional.id); distinct per process",
    )
    p.add_argument("--partitions", type=int, default=None, help="when creating missing topics")
    p.add_argument(
        "--commit-interval-ms",
        type=int,
        default=50,
        help="seal a batch this old once the committer is free, even if inputs keep coming",
    )
    p.add_argument(
        "--fetch-window-ms",
        type=int,
        default=ProcessorConfig.fetch_window_ms,
        help="fetch the inbox in windows of this many ms: inputs arriving together share a "
        "transaction (0: fetch each input as it lands)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=2000,
        help="inputs per transaction at most (the loop waits for the committer then)",
    )
    p.add_argument("--gap-timeout-ms", type=int, default=30_000)
    p.add_argument("--buffer-limit", type=int, default=64)
    p.add_argument(
        "--max-record-bytes",
        type=int,
        default=None,
        help="the largest record written (key + value + headers); default: each output "
        "topic's max.message.bytes as the broker reports it at start, less a margin. An input "
        "whose records would be larger fails its run (invalid_input:record_too_large) or is "
        "dead-lettered",
    )
    p.add_argument(
        "--terminal-retention-ms",
        type=int,
        default=ProcessorConfig.terminal_retention_ms,
        help="evict a run from memory and the state topic (a tombstone) this long after its "
        "end, in event time, to the runs topic and the store of ended runs; a negative value "
        "keeps ended runs in memory",
    )
    p.add_argument(
        "--store-dir",
        default=None,
        help="where the store of ended runs is kept (a copy of the runs topic, read again from "
        "the topic when missing); default: the store_dir setting",
    )
    p.add_argument(
        "--rules-version",
        type=int,
        default=None,
        help="the transition rules version new runs are submitted under (default: the newest "
        f"this build has; it has {', '.join(str(v) for v in sorted(versions.RULES))}). Keep "
        "the previous one while a new rule set rolls out, so a rollback stays possible "
        "(docs/operations.md)",
    )
    p.add_argument(
        "--registry",
        default=current().tool_registry,
        help="the tool registry whose catalog every new run's task is held to (default"
        " $AGENTRUNS_TOOL_REGISTRY); none: tasks declare their own tools (docs/tools.md)",
    )
    p.add_argument(
        "--routes",
        default=current().model_routes,
        help="the model routes file (the model executor's): with --registry, a task naming"
        " another route is refused (default $AGENTRUNS_MODEL_ROUTES)",
    )
    health.add_arguments(p)
    p.add_argument("--log-level", default=current().log_level)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.rules_version is not None and not versions.known(args.rules_version):
        parser.error(str(versions.UnknownRulesVersionError(args.rules_version)))
    with run_service(args, "processor") as running:
        ep, status = running.endpoints, running.health
        assert status is not None
        ensure_topics(ep.kafka_bootstrap, prefix=args.prefix, partitions=args.partitions)
        catalog = configured_catalog(args.registry, component="processor", routes=args.routes)
        store = PostgresArtifactStore(ep.database_url)
        tenant_header, tenant_key = processor_tenant_header(
            current().tenant_header_mode(), current().tenant_header_key, current().api_secret
        )
        config = ProcessorConfig(
            bootstrap=ep.kafka_bootstrap,
            prefix=args.prefix,
            group_id=args.group,
            instance_id=args.instance_id,
            commit_interval_ms=args.commit_interval_ms,
            fetch_window_ms=args.fetch_window_ms,
            max_batch=args.max_batch,
            gap_timeout_ms=args.gap_timeout_ms,
            buffer_limit=args.buffer_limit,
            max_record_bytes=args.max_record_bytes,
            terminal_retention_ms=(
                None if args.terminal_retention_ms < 0 else args.terminal_retention_ms
            ),
            store_dir=args.store_dir or str(current().processor_store_dir()),
            rules_version=args.rules_version,
            catalog=catalog,
            default_tenant=current().default_tenant,
            tenant_header=tenant_header,
            tenant_key=tenant_key,
        )
        tune_gc()
        tune_switch_interval()
        processor = Processor(config, store.put_many)
        status.watch_consumer(processor.membership, config.group_id)
        refresh = refreshing(
            args.registry, catalog, processor.set_catalog, component="processor", routes=args.routes
        )
        running.serving_loop()
        log.info("processor %s started on %s", args.instance_id, ep.kafka_bootstrap)
        try:
            with refresh:
                processor.run(running.stop)
        finally:
            store.close()
    log.info("processor %s stopped", args.instance_id)
    return 0


if __name__ == "__main__":
    from agentruns.connectors.lifecycle import run_command

    raise SystemExit(run_command(main))

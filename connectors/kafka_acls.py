"""`agentruns kafka acls --service NAME`: the ACLs a service's principal needs on a broker with
an authorizer, from `agentruns.streams.access` (the names the services use), as
`kafka-acls.sh` command lines (the default), JSON, a Markdown table, or applied at once
(`--apply`, with the admin's client properties)."""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING

from agentruns.connectors.errors import AgentrunsError
from agentruns.streams.access import SERVICES, Acl, acls, default_principal
from agentruns.streams.topics import default_prefix

if TYPE_CHECKING:
    from confluent_kafka.admin import AclBinding as Binding

#: kafka-acls.sh's option for each resource type.
_OPTION = {
    "Topic": "--topic",
    "Group": "--group",
    "TransactionalId": "--transactional-id",
    "Cluster": "--cluster",
}


def command_line(acl: Acl, principal: str) -> str:
    """One `kafka-acls.sh --add` for ``acl`` (bootstrap and admin config from the shell)."""
    words = [
        "kafka-acls.sh",
        "--bootstrap-server",
        "$KAFKA_BOOTSTRAP_SERVERS",
        "--command-config",
        "$ADMIN_CONFIG",
        "--add",
        "--allow-principal",
        principal,
        "--operation",
        acl.operation,
    ]
    option = _OPTION[acl.resource]
    words += [option] if acl.resource == "Cluster" else [option, acl.name]
    words += ["--resource-pattern-type", acl.pattern]
    # The two variables stay for the shell to expand; everything else is quoted as needed.
    return " ".join(w if w.startswith("$") else shlex.quote(w) for w in words)


def as_json(acl: Acl, principal: str) -> dict[str, str]:
    return {
        "principal": principal,
        "host": "*",
        "permission": "ALLOW",
        "resource_type": acl.resource,
        "resource_name": acl.name,
        "pattern_type": acl.pattern,
        "operation": acl.operation,
    }


def markdown_table(prefix: str) -> str:
    """Every service's ACLs as one Markdown table (docs/security.md carries it)."""
    rows = ["| service | resource | name | pattern | operation |", "|---|---|---|---|---|"]
    for service in SERVICES:
        for acl in acls(service, prefix):
            name = "" if acl.resource == "Cluster" else f"`{acl.name}`"
            rows.append(
                f"| {service} | {acl.resource} | {name} | {acl.pattern} | {acl.operation} |"
            )
    return "\n".join(rows) + "\n"


def bindings(found: Sequence[Acl], principal: str) -> list[Binding]:
    """confluent-kafka `AclBinding`s of ``found`` for ``principal`` (any host)."""
    from confluent_kafka.admin import (
        AclBinding,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    kinds = {
        "Topic": ResourceType.TOPIC,
        "Group": ResourceType.GROUP,
        "TransactionalId": ResourceType.TRANSACTIONAL_ID,
        "Cluster": ResourceType.BROKER,  # confluent-kafka's name for the cluster resource
    }
    operations = {
        "Read": AclOperation.READ,
        "Write": AclOperation.WRITE,
        "Describe": AclOperation.DESCRIBE,
        "DescribeConfigs": AclOperation.DESCRIBE_CONFIGS,
        "AlterConfigs": AclOperation.ALTER_CONFIGS,
        "Create": AclOperation.CREATE,
        "Alter": AclOperation.ALTER,
    }
    patterns = {"literal": ResourcePatternType.LITERAL, "prefixed": ResourcePatternType.PREFIXED}
    return [
        AclBinding(
            kinds[a.resource],
            a.name,
            patterns[a.pattern],
            principal,
            "*",
            operations[a.operation],
            AclPermissionType.ALLOW,
        )
        for a in found
    ]


def apply(bootstrap: str, found: Sequence[Acl], principal: str, timeout_s: float = 30.0) -> int:
    """Create the ACLs on the cluster (idempotent: an existing ACL is kept); their count."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from agentruns.streams.kafka_defaults import client_settings

    admin = AdminClient({"bootstrap.servers": bootstrap, **client_settings(), "log_level": 3})
    futures = admin.create_acls(bindings(found, principal))
    for binding, future in futures.items():
        try:
            future.result(timeout=timeout_s)
        except (KafkaException, TimeoutError) as exc:
            raise AgentrunsError(
                f"creating the ACL {binding} failed: {exc}",
                hint="the admin principal needs Alter on the cluster (--kafka-config FILE)",
            ) from exc
    return len(futures)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns kafka acls", description=__doc__)
    parser.add_argument("--service", required=True, choices=list(SERVICES))
    parser.add_argument("--prefix", default=default_prefix(), help="the topics' prefix")
    parser.add_argument(
        "--group", default=None, help="the service's consumer group, if not its default"
    )
    parser.add_argument(
        "--principal", default=None, help="the service's principal (default User:agentruns-NAME)"
    )
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="one JSON list of ACLs")
    shown.add_argument(
        "--apply", action="store_true", help="create them on the cluster (admin credentials)"
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    principal = args.principal or default_principal(args.service)
    if not principal.startswith("User:") or len(principal) == len("User:"):
        raise AgentrunsError(f"principal {principal!r} is not User:NAME")
    found = acls(args.service, args.prefix, group=args.group)
    if args.apply:
        from agentruns.connectors.endpoints import configured_kafka

        print(f"{apply(configured_kafka(), found, principal)} ACLs for {principal}")
    elif args.json:
        print(json.dumps([as_json(a, principal) for a in found], indent=2))
    else:
        print(f"# {args.service}: {SERVICES[args.service]}")
        for acl in found:
            print(command_line(acl, principal))
    return 0

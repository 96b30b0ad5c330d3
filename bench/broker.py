"""The broker settings a bench's figures depend on, printed with them."""

from __future__ import annotations

from confluent_kafka.admin import AdminClient, ConfigResource

from agentruns.streams.kafka_defaults import client_settings

# Per-partition transaction verification (KIP-890 part 1) costs a round trip to the transaction
# coordinator for every partition a transaction writes; see docs/design.md, "Broker settings".
SETTINGS = ("transaction.partition.verification.enable",)


def broker_settings(bootstrap: str) -> dict[str, str | None]:
    """The values of `SETTINGS` on the first broker (None if it would not say)."""
    admin = AdminClient({"bootstrap.servers": bootstrap, **client_settings(), "log_level": 0})
    broker = min(admin.list_topics(timeout=10).brokers)
    resource = ConfigResource(ConfigResource.Type.BROKER, str(broker))
    try:
        entries = admin.describe_configs([resource])[resource].result(timeout=10)
    except Exception:  # an old broker or no permission: the figures stand without it
        return dict.fromkeys(SETTINGS)
    return {name: entries[name].value if name in entries else None for name in SETTINGS}

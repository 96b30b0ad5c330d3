"""`Settings`: the one configuration every service and command reads.

Where a value comes from, strongest first: a command-line flag, the environment, a ``.env``
file in the working directory, the default. Kafka client properties (security) come from the
properties file ``AGENTRUNS_KAFKA_CONFIG`` (or ``--kafka-config FILE``) names, in Kafka's own
``key=value`` format (see `kafka_properties`), and go to every Kafka client of the process.
That file is named explicitly (flag or environment), never by a ``.env``: a file planted in
the working directory does not configure the Kafka clients.

A process loads its settings once, when its command starts (`load`, called by
`lifecycle.run_command`); `current()` is what it loaded. ``--kafka-config`` is exported to the
environment so the processes a command starts (the demo's services) use the same file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from agentruns.connectors.kafka_properties import check_with_librdkafka, read_properties_file
from agentruns.streams.kafka_defaults import client_properties, use_client_properties
from agentruns.streams.tenant_headers import MODES, Mode
from agentruns.streams.topics import DEFAULT_PREFIX

KAFKA_CONFIG_ENV = "AGENTRUNS_KAFKA_CONFIG"
KAFKA_CONFIG_FLAG = "--kafka-config"
TOPIC_PREFIX_ENV = "AGENTRUNS_TOPIC_PREFIX"


class Settings(BaseSettings):
    """Every setting, its environment variable (the alias) and default."""

    model_config = SettingsConfigDict(
        env_file=".env", extra="ignore", populate_by_name=True, frozen=True
    )

    kafka_bootstrap_servers: str | None = Field(
        None,
        alias="KAFKA_BOOTSTRAP_SERVERS",
        description="Kafka brokers, host:port[,...]; unset: a local broker is used or started",
    )
    kafka_config: Path | None = Field(
        None,
        alias=KAFKA_CONFIG_ENV,
        description="Kafka client properties file (key=value, as Kafka's --command-config): "
        "security.protocol, sasl.*, ssl.*; given to every Kafka client",
    )
    topic_prefix: str = Field(
        DEFAULT_PREFIX,
        alias=TOPIC_PREFIX_ENV,
        description="prefix of every topic name (`<prefix>.inbox`, ...) and consumer group",
    )
    database_url: str | None = Field(
        None,
        alias="DATABASE_URL",
        description="Postgres DSN; unset: a local Postgres is used or started",
    )
    instance_id: str = Field(
        "0",
        alias="AGENTRUNS_INSTANCE_ID",
        description="stable id of this process among its replicas (transactional.id suffix)",
    )
    log_level: str = Field(
        "INFO", alias="AGENTRUNS_LOG_LEVEL", description="log level (logs are JSON lines)"
    )
    metrics_address: str | None = Field(
        None,
        alias="AGENTRUNS_METRICS_ADDRESS",
        description="host:port of the /metrics, /readyz and /livez endpoints; unset: none",
    )
    api_host: str = Field("127.0.0.1", alias="AGENTRUNS_API_HOST", description="API bind host")
    api_port: int = Field(8080, alias="AGENTRUNS_API_PORT", description="API bind port")
    env: str = Field(
        "",
        alias="AGENTRUNS_ENV",
        description="'production' requires AGENTRUNS_API_TOKEN and AGENTRUNS_API_SECRET",
    )
    api_token: str = Field(
        "", alias="AGENTRUNS_API_TOKEN", description="API bearer token; unset: random (dev)"
    )
    api_secret: str = Field(
        "",
        alias="AGENTRUNS_API_SECRET",
        description="root secret: the console, resume-token, callback and tenant-header keys are"
        " derived from it (security.md); unset: random (dev)",
    )
    api_operator_tokens: str = Field(
        "",
        alias="AGENTRUNS_API_OPERATOR_TOKENS",
        description="operators who may resolve, reopen and re-drive runs, name:token[,...];"
        " unset: one random (dev), none in production",
    )
    operator_token: str = Field(
        "",
        alias="AGENTRUNS_OPERATOR_TOKEN",
        description="the operator token `resolve`, `reopen` and `redrive` send",
    )
    console_secure_cookies: bool = Field(
        False,
        alias="AGENTRUNS_CONSOLE_SECURE_COOKIES",
        description="mark the console's cookies Secure (HTTPS only); set behind a TLS proxy,"
        " automatic for a request that came over https",
    )
    api_url: str | None = Field(
        None, alias="AGENTRUNS_API_URL", description="the API the client commands talk to"
    )
    producer_id: str = Field(
        "cli", alias="AGENTRUNS_PRODUCER_ID", description="producer id of `submit`/`reply`"
    )
    model_base_url: str | None = Field(
        None,
        alias="AGENTRUNS_MODEL_BASE_URL",
        description="OpenAI-compatible endpoint of the model executor's default route",
    )
    model_api_key: str | None = Field(
        None, alias="AGENTRUNS_MODEL_API_KEY", description="API key of that default route"
    )
    tool_registry: Path | None = Field(
        None,
        alias="AGENTRUNS_TOOL_REGISTRY",
        description="the tools registry file, when --registry is not given",
    )
    model_routes: Path | None = Field(
        None,
        alias="AGENTRUNS_MODEL_ROUTES",
        description="the model routes file, when --routes is not given: the model executor's"
        " routes, and the only routes a task may name where a catalog is held",
    )
    catalog_refresh_s: float = Field(
        30.0,
        alias="AGENTRUNS_CATALOG_REFRESH_S",
        ge=1.0,
        le=86_400.0,
        description="how often the processor, the API and the tool executor make the tool"
        " catalog again from the registry file and its MCP servers (seconds, 1 to 86400)",
    )
    store_dir: Path | None = Field(
        None,
        alias="AGENTRUNS_STORE_DIR",
        description="where the processor keeps its store of ended runs (a copy of the runs "
        "topic); unset: $XDG_STATE_HOME/agentruns, else ~/.local/state/agentruns",
    )
    callback_url: str | None = Field(
        None,
        alias="AGENTRUNS_CALLBACK_URL",
        description="URL async tools call back (the API's /v1/callbacks)",
    )
    api_credentials: Path | None = Field(
        None,
        alias="AGENTRUNS_API_CREDENTIALS",
        description="the API credentials file (id, tenant, roles, token hash per line; see"
        " docs/security.md), read again when it changes; unset: AGENTRUNS_API_TOKEN only",
    )
    default_tenant: str = Field(
        "default",
        alias="AGENTRUNS_DEFAULT_TENANT",
        pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$",
        description="the tenant of a task produced straight to Kafka (the processor's)",
    )
    trust_tenant_header: bool = Field(
        False,
        alias="AGENTRUNS_TRUST_TENANT_HEADER",
        description="let a task produced straight to Kafka name its tenant in the"
        " `agentruns-tenant` header (the processor's); only where every inbox producer is trusted;"
        " the same as AGENTRUNS_TENANT_HEADER=trusted, which wins when set",
    )
    tenant_header: str = Field(
        "",
        alias="AGENTRUNS_TENANT_HEADER",
        pattern=r"^(default|trusted|signed)?$",
        description="how the processor takes the `agentruns-tenant` header of a task produced"
        " straight to Kafka: `default` (ignored), `trusted` (believed), `signed` (believed with a"
        " valid `agentruns-tenant-signature` only; security.md); unset: from"
        " AGENTRUNS_TRUST_TENANT_HEADER",
    )
    tenant_header_key: str = Field(
        "",
        alias="AGENTRUNS_TENANT_HEADER_KEY",
        description="the root of the tenants' Kafka keys, hex (`agentruns keys tenant-header`),"
        " the processor's in `signed` mode; unset: derived from AGENTRUNS_API_SECRET (dev)",
    )

    def tenant_header_mode(self) -> Mode:
        """AGENTRUNS_TENANT_HEADER, else what the older AGENTRUNS_TRUST_TENANT_HEADER says."""
        if self.tenant_header in MODES:
            return self.tenant_header
        return "trusted" if self.trust_tenant_header else "default"

    def processor_store_dir(self) -> Path:
        """`store_dir`, or the user's state directory (XDG) when unset."""
        if self.store_dir is not None:
            return self.store_dir
        base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        return Path(base) / "agentruns"

    @property
    def production(self) -> bool:
        return self.env == "production"

    def kafka_properties(self) -> dict[str, str]:
        """The librdkafka settings of the properties file, checked; {} without one."""
        if self.kafka_config is None:
            return {}
        properties = read_properties_file(self.kafka_config)
        check_with_librdkafka(properties, str(self.kafka_config))
        return properties


_CURRENT: list[Settings] = []


def read(flags: Mapping[str, Any] | None = None) -> Settings:
    """The settings: ``flags`` (by field name; None is not given) over the environment over
    ``.env`` over the defaults. A bad value is one error naming its variable."""
    from agentruns.connectors.errors import InvalidArgumentError

    given = {k: v for k, v in (flags or {}).items() if v is not None}
    try:
        settings = Settings(**given)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidArgumentError(f"setting {where}: {first['msg']}") from exc
    named = "kafka_config" in given or os.environ.get(KAFKA_CONFIG_ENV)
    if settings.kafka_config is not None and not named:
        raise InvalidArgumentError(
            f"{KAFKA_CONFIG_ENV} is set in .env only: a Kafka properties file is not read "
            "from the working directory's .env",
            hint=f"name it with {KAFKA_CONFIG_FLAG} FILE or in the environment",
        )
    return settings


def load(flags: Mapping[str, Any] | None = None) -> Settings:
    """`read` the settings, give the Kafka client properties to every client of the process,
    and make them `current()`."""
    settings = read(flags)
    use_client_properties(settings.kafka_properties())
    # What came from a flag or .env reaches the processes a command starts, and
    # streams.topics.default_prefix(), the one place topic names get their prefix.
    if settings.kafka_config is not None:
        os.environ[KAFKA_CONFIG_ENV] = str(settings.kafka_config.resolve())
    os.environ[TOPIC_PREFIX_ENV] = settings.topic_prefix
    _CURRENT[:] = [settings]
    return settings


@contextmanager
def loaded(flags: Mapping[str, Any] | None = None) -> Iterator[Settings]:
    """`load` for the length of a command; then the process is as before (a command run
    in-process, as tests do, leaves nothing behind for the next one)."""
    environ = {name: os.environ.get(name) for name in (KAFKA_CONFIG_ENV, TOPIC_PREFIX_ENV)}
    previous = _CURRENT[:]
    properties = client_properties()
    try:
        yield load(flags)
    finally:
        _CURRENT[:] = previous
        use_client_properties(properties)
        for name, value in environ.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def current() -> Settings:
    """The settings the command loaded when it started (`load`); in a process that loaded none
    (a library caller, a test), read afresh each time."""
    return _CURRENT[0] if _CURRENT else read()


def take_kafka_config_flag(argv: list[str]) -> tuple[list[str], Path | None]:
    """``argv`` without ``--kafka-config FILE`` (or ``--kafka-config=FILE``), and FILE."""
    rest: list[str] = []
    found: Path | None = None
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            rest.extend(argv[i:])
            break
        if word == KAFKA_CONFIG_FLAG and i + 1 < len(argv):
            found = Path(argv[i + 1])
            i += 2
            continue
        if word.startswith(KAFKA_CONFIG_FLAG + "="):
            found = Path(word.split("=", 1)[1])
            i += 1
            continue
        rest.append(word)
        i += 1
    return rest, found


def settings_table() -> str:
    """The README's table of every setting, made from the model."""
    rows = ["| setting | environment variable | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        default = field.default
        shown = "unset" if default is None else f"`{default}`" if default != "" else "empty"
        rows.append(f"| {name} | `{field.alias}` | {shown} | {field.description} |")
    return "\n".join(rows)

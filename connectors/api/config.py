"""`ApiConfig`: what the API process needs (Kafka, Postgres, bearer token, signing secret,
limits, clock), and how it is read from the environment.
"""

from __future__ import annotations

import functools
import logging
import secrets
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentruns.connectors.api.credentials import (
    MIN_TOKEN_CHARS,
    CredentialsError,
    parse_credentials,
)
from agentruns.connectors.api.inputs import MAX_BODY_BYTES, MAX_RECORD_BYTES
from agentruns.connectors.api.tokens import OperatorTokensError, parse_operator_tokens
from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.keys import Keys
from agentruns.connectors.settings import current
from agentruns.processors.catalog import Catalog
from agentruns.streams.clock import now_ms
from agentruns.streams.topics import DEFAULT_PREFIX

log = logging.getLogger("agentruns.api")

#: MIN_TOKEN_CHARS (agentruns.connectors.api.credentials) is also the shortest signing secret
#: a production API starts with: a short secret can be found offline from any resume token.
__all__ = ["MIN_TOKEN_CHARS", "ApiConfig"]


@functools.lru_cache(maxsize=8)
def _derived(secret: bytes) -> Keys:
    return Keys.derive(secret)


def _check_lengths(
    token: str, secret: str, operators: Mapping[str, str], *, production: bool
) -> None:
    """Refuse (production) or warn of (elsewhere) a token or secret under MIN_TOKEN_CHARS;
    the message names the variable, never its value."""
    short = [
        name
        for name, value in (("AGENTRUNS_API_TOKEN", token), ("AGENTRUNS_API_SECRET", secret))
        if value and len(value) < MIN_TOKEN_CHARS
    ]
    short += [
        f"AGENTRUNS_API_OPERATOR_TOKENS (operator {name})"
        for value, name in operators.items()
        if len(value) < MIN_TOKEN_CHARS
    ]
    if not short:
        return
    what = f"{', '.join(short)} shorter than {MIN_TOKEN_CHARS} characters"
    if production:
        raise AgentrunsError(
            f"{what}: refused in production",
            hint="use long random strings (e.g. `openssl rand -hex 32`)",
        )
    log.warning("%s: too short for anything but local development", what)


@dataclass
class ApiConfig:
    bootstrap: str
    database_url: str
    api_token: str
    secret: bytes
    prefix: str = DEFAULT_PREFIX
    #: Partitions of the inbox; None: read from the broker at start.
    partitions: int | None = None
    db_pool_size: int = 8
    produce_timeout_s: float = 15.0
    max_body_bytes: int = MAX_BODY_BYTES
    max_record_bytes: int = MAX_RECORD_BYTES
    clock: Callable[[], int] = now_ms
    #: Mark the console's cookies Secure even on a plain-HTTP request (TLS ends at a proxy).
    secure_cookies: bool = False
    #: Bearer tokens with the operator scope: {token: operator name}.
    operator_tokens: dict[str, str] = field(default_factory=dict)
    extra_producer: dict[str, Any] = field(default_factory=dict)
    #: The operator's tool catalog tasks are held to (422 when one widens it); None: none.
    catalog: Catalog | None = None
    #: The credentials file (`agentruns.connectors.api.credentials`); None: the API token
    #: and the operator tokens only.
    credentials_file: Path | None = None

    @property
    def keys(self) -> Keys:
        """One key per purpose, derived from ``secret`` (`agentruns.connectors.keys`): the
        secret itself signs nothing."""
        return _derived(self.secret)

    def set_catalog(self, catalog: Catalog | None) -> None:
        """Hold tasks to ``catalog`` from now on (a refresh: `agentruns.connectors.catalog.
        CatalogRefresher`); each request reads the catalog once, when it checks its task."""
        self.catalog = catalog

    @classmethod
    def from_env(
        cls,
        bootstrap: str,
        database_url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        production: bool = False,
        environ: Mapping[str, str] | None = None,
        catalog: Catalog | None = None,
    ) -> ApiConfig:
        """Token and secret from AGENTRUNS_API_TOKEN / AGENTRUNS_API_SECRET, operator tokens
        from AGENTRUNS_API_OPERATOR_TOKENS (in ``environ``, or the settings:
        `agentruns.connectors.settings`); Secure console cookies from the settings.

        In production token and secret are required; otherwise a random value is generated for
        this process with a warning (tokens then do not survive a restart). Without operator
        tokens, production has no operator; elsewhere one, ``dev``, gets a random token."""
        secure_cookies = current().console_secure_cookies
        if environ is None:
            settings = current()
            token, secret = settings.api_token, settings.api_secret
            operators_text = settings.api_operator_tokens
            credentials_file = settings.api_credentials
        else:
            token = environ.get("AGENTRUNS_API_TOKEN", "")
            secret = environ.get("AGENTRUNS_API_SECRET", "")
            operators_text = environ.get("AGENTRUNS_API_OPERATOR_TOKENS", "")
            named = environ.get("AGENTRUNS_API_CREDENTIALS", "")
            credentials_file = Path(named) if named else None
        if credentials_file is not None:
            try:  # read once here so a file that does not parse stops the start
                parse_credentials(credentials_file.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, CredentialsError) as exc:
                raise AgentrunsError(
                    f"AGENTRUNS_API_CREDENTIALS: {exc}",
                    hint="one `id tenant roles sha256:<hex>` a line (docs/security.md)",
                ) from None
        try:
            operators = parse_operator_tokens(operators_text)
        except OperatorTokensError as exc:
            raise AgentrunsError(
                f"AGENTRUNS_API_OPERATOR_TOKENS: {exc}",
                hint="give name:token pairs separated by commas, each token a long random string",
            ) from None
        if token and token in operators:
            raise AgentrunsError(
                "AGENTRUNS_API_OPERATOR_TOKENS holds the API token: an operator needs a token"
                " of its own"
            )
        if production and (not (token or credentials_file) or not secret):
            raise AgentrunsError(
                "AGENTRUNS_API_SECRET and AGENTRUNS_API_TOKEN (or AGENTRUNS_API_CREDENTIALS)"
                " must be set in production",
                hint="set both to long random strings (e.g. `openssl rand -hex 32`)",
            )
        _check_lengths(token, secret, operators, production=production)
        if not token and credentials_file is None:
            token = secrets.token_urlsafe(32)
            log.warning(
                "AGENTRUNS_API_TOKEN is not set: generated a development bearer token "
                "(written to stderr once); set it for anything but local development"
            )
            print(f"agentruns api: development bearer token: {token}", file=sys.stderr)
        if not operators and not production:
            dev_token = secrets.token_urlsafe(32)
            operators = {dev_token: "dev"}
            log.warning(
                "AGENTRUNS_API_OPERATOR_TOKENS is not set: generated a development operator"
                " token for operator 'dev' (written to stderr once)"
            )
            print(f"agentruns api: development operator token (dev): {dev_token}", file=sys.stderr)
        if not secret:
            log.warning(
                "AGENTRUNS_API_SECRET is not set: resume tokens are signed with a random "
                "per-process key and become invalid when the API restarts"
            )
        return cls(
            bootstrap=bootstrap,
            database_url=database_url,
            api_token=token,
            secret=secret.encode() if secret else secrets.token_bytes(32),
            prefix=prefix,
            secure_cookies=secure_cookies,
            operator_tokens=operators,
            catalog=catalog,
            credentials_file=credentials_file,
        )

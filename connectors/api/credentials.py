"""API credentials: who may call the API, for which tenant, with which roles.

A credential is a bearer token with an id, a tenant (`agentruns.processors.tenants`) and roles
(ROLES). The API holds only the SHA-256 of each token: the credentials file
(AGENTRUNS_API_CREDENTIALS) has one credential a line,

    # id       tenant   roles              token hash
    billing-ci billing  submit,read        sha256:9f86d081884c7d65...

and is read again when it changes (its size or modification time, looked at most once a
second), so a credential is added, rotated or revoked without a restart; a file that no longer
parses keeps the credentials last read, with an error in the log. `agentruns credentials add`
mints a token, prints it once and appends its line.

The single AGENTRUNS_API_TOKEN and the operator tokens (AGENTRUNS_API_OPERATOR_TOKENS) keep
working: each is an admin credential of the default tenant (``api``, and the operator's name).

The health servers of the other services (`agentruns.connectors.health`) hold the same
credentials (`configured_store`, from the same settings): their admins see the readiness
checks' details there.

What each role opens is the route table's to say (`agentruns.connectors.api.http.ROUTES`,
the console's `CONSOLE_ROUTES`); `admin` opens every route and every tenant's runs.

The API's store writes when each credential was last used to Postgres
(`agentruns.connectors.api.credential_use`), off the request path: its list shows the later of
this process's time and the one every API process wrote.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agentruns.connectors.api.tokens import parse_operator_tokens
from agentruns.connectors.settings import Settings
from agentruns.processors.tenants import DEFAULT_TENANT, valid_tenant

log = logging.getLogger("agentruns.api")

SUBMIT, READ, REPLY, CANCEL, ADMIN = "submit", "read", "reply", "cancel", "admin"
ROLES = (SUBMIT, READ, REPLY, CANCEL, ADMIN)
#: The shortest bearer token a credential may have: wrong tokens are throttled, but only
#: length keeps guessing hopeless from many addresses.
MIN_TOKEN_CHARS = 32
#: The longest token compared: a longer one (a 1 MB header) is refused before it is hashed.
MAX_TOKEN_CHARS = 512
#: A credential's id: what the log records as the actor of what it does.
CREDENTIAL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
#: The most credentials a file may hold.
MAX_CREDENTIALS = 10_000
#: How often the file's size and modification time are looked at.
CHECK_EVERY_MS = 1000
#: The first characters of a presented token that wrong tokens are counted by (besides the
#: client address): a guesser spread over many addresses still meets one budget.
PREFIX_CHARS = 12
#: The most tenants a metrics label names; any other tenant is counted as "other".
MAX_TENANT_LABELS = 50
#: The prefix of the tokens `agentruns credentials add` mints.
TOKEN_PREFIX = "agr_"


class CredentialsError(ValueError):
    """A credentials file or setting that does not parse (the message never holds a token)."""


def token_digest(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


def token_prefix(token: bytes | str) -> str:
    """What wrong tokens are counted by: the token's first PREFIX_CHARS characters."""
    text = token.decode("latin-1") if isinstance(token, bytes) else token
    return text[:PREFIX_CHARS]


@dataclass(frozen=True, slots=True)
class Credential:
    id: str
    tenant: str
    roles: frozenset[str]
    digest: str
    #: Where it was read: "file", or the environment variable that holds its token.
    source: str = "file"

    @property
    def admin(self) -> bool:
        return ADMIN in self.roles

    def may(self, role: str) -> bool:
        """Whether the credential holds ``role`` (admin holds every role)."""
        return self.admin or role in self.roles

    @property
    def tenant_scope(self) -> str | None:
        """The tenant whose runs it sees; None: every tenant's (admin)."""
        return None if self.admin else self.tenant

    def sees(self, tenant: str) -> bool:
        return self.admin or tenant == self.tenant

    @property
    def actor(self) -> str:
        """Who the run's log names as the actor of what this credential does."""
        return f"operator:{self.id}"

    @property
    def fingerprint(self) -> str:
        """Changes when the credential's token, tenant or roles change: what a console
        session is bound to (a rotation or a change of role ends its sessions)."""
        text = "\n".join((self.id, self.tenant, ",".join(sorted(self.roles)), self.digest))
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def _roles(text: str, where: str) -> frozenset[str]:
    roles = frozenset(r for r in text.split(",") if r)
    unknown = sorted(roles - set(ROLES))
    if not roles or unknown:
        raise CredentialsError(
            f"{where}: roles must be a comma-separated list of {', '.join(ROLES)}"
            + (f" (unknown: {unknown[0][:40]!r})" if unknown else "")
        )
    return roles


def parse_credentials(text: str, source: str = "credentials file") -> list[Credential]:
    """The credentials of a file's text: ``id tenant roles sha256:<hex>`` a line, ``#``
    comments and blank lines ignored; no id or hash twice."""
    out: list[Credential] = []
    ids: set[str] = set()
    digests: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {number}"
        fields = line.split()
        if len(fields) != 4:
            raise CredentialsError(f"{where}: expected `id tenant roles sha256:<hex>`")
        cid, tenant, roles, digest = fields
        if CREDENTIAL_ID.fullmatch(cid) is None:
            raise CredentialsError(f"{where}: an id is letters, digits and ._@- (at most 64)")
        if not valid_tenant(tenant):
            raise CredentialsError(f"{where}: {tenant[:64]!r} is not a tenant name")
        if _DIGEST.fullmatch(digest) is None:
            raise CredentialsError(f"{where}: the hash is sha256: and 64 lower-case hex digits")
        if cid in ids or digest in digests:
            raise CredentialsError(f"{where}: credential {cid} or its token is listed twice")
        ids.add(cid)
        digests.add(digest)
        out.append(Credential(cid, tenant, _roles(roles, where), digest))
        if len(out) > MAX_CREDENTIALS:
            raise CredentialsError(f"{source}: more than {MAX_CREDENTIALS} credentials")
    return out


def credential_line(credential: Credential) -> str:
    roles = ",".join(r for r in ROLES if r in credential.roles)
    return f"{credential.id} {credential.tenant} {roles} {credential.digest}\n"


def fixed_credentials(api_token: str, operators: Mapping[str, str]) -> list[Credential]:
    """The credentials of the environment: the API token (``api``) and each operator token,
    each an admin of the default tenant."""
    out = []
    if api_token:
        out.append(
            Credential(
                "api",
                DEFAULT_TENANT,
                frozenset(ROLES),
                token_digest(api_token),
                "AGENTRUNS_API_TOKEN",
            )
        )
    for token, name in operators.items():
        out.append(
            Credential(
                name,
                DEFAULT_TENANT,
                frozenset(ROLES),
                token_digest(token),
                "AGENTRUNS_API_OPERATOR_TOKENS",
            )
        )
    return out


def configured_store(settings: Settings, clock: Callable[[], int]) -> CredentialStore | None:
    """The credentials ``settings`` configure, as the API reads them (AGENTRUNS_API_TOKEN,
    AGENTRUNS_API_OPERATOR_TOKENS, AGENTRUNS_API_CREDENTIALS) but without the API's
    development defaults: None when none is configured. Raises `CredentialsError`
    (`OperatorTokensError`) for a setting or a file that does not parse."""
    operators = parse_operator_tokens(settings.api_operator_tokens)
    fixed = fixed_credentials(settings.api_token, operators)
    if not fixed and settings.api_credentials is None:
        return None
    return CredentialStore(fixed, settings.api_credentials, clock)


def _later(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


class UseRecord(Protocol):
    """Where uses are kept beyond this process (`credential_use.CredentialUse`): noted and
    told the ids held without I/O, read for a list."""

    def note(self, credential_id: str, at: int) -> None: ...

    def held(self, ids: Iterable[str]) -> None: ...

    def read(self, ids: Iterable[str]) -> dict[str, int]: ...


class CredentialStore:
    """The credentials the API holds: those of the environment and those of the file, the
    file's read again when it changes; and when each was last used (in memory, and in
    ``uses`` when given)."""

    def __init__(
        self,
        fixed: Iterable[Credential],
        path: Path | None,
        clock: Callable[[], int],
        *,
        check_every_ms: int = CHECK_EVERY_MS,
        uses: UseRecord | None = None,
    ) -> None:
        self.uses = uses
        self._fixed = list(fixed)
        self.path = path
        self.clock = clock
        self._check_every_ms = check_every_ms
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._checked_at = clock()
        self._by_digest: dict[str, Credential] = {}
        self._by_id: dict[str, Credential] = {}
        self._last_used: dict[str, int] = {}
        self._tenants: frozenset[str] = frozenset()
        self._install(self._read() if path is not None else [])

    def _read(self) -> list[Credential]:
        assert self.path is not None
        try:
            stat = os.stat(self.path)
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CredentialsError(f"credentials file {self.path}: {exc}") from None
        self._stamp = (stat.st_mtime_ns, stat.st_size)
        return parse_credentials(text, f"credentials file {self.path}")

    def _install(self, from_file: list[Credential]) -> None:
        every = self._fixed + from_file
        by_id: dict[str, Credential] = {}
        by_digest: dict[str, Credential] = {}
        for c in every:
            if c.id in by_id or c.digest in by_digest:
                raise CredentialsError(
                    f"credential {c.id} ({c.source}) has the id or the token of another"
                )
            by_id[c.id] = c
            by_digest[c.digest] = c
        self._by_id, self._by_digest = by_id, by_digest
        self._tenants = frozenset(sorted({c.tenant for c in every})[:MAX_TENANT_LABELS])
        if self.uses is not None:
            self.uses.held(by_id)

    def refresh(self) -> None:
        """Read the file again if it changed since it was last read (at most once per
        `check_every_ms`; a file that no longer parses keeps the credentials held)."""
        if self.path is None:
            return
        now = self.clock()
        with self._lock:
            if now - self._checked_at < self._check_every_ms:
                return
            self._checked_at = now
            try:
                stat = os.stat(self.path)
                if (stat.st_mtime_ns, stat.st_size) == self._stamp:
                    return
                self._install(self._read())
            except (OSError, CredentialsError) as exc:
                log.error("credentials not read again, the ones held stay: %s", exc)
                return
        log.info("credentials read again from %s: %d held", self.path, len(self._by_id))

    def lookup(self, token: str | bytes) -> Credential | None:
        """The credential whose token ``token`` is, or None. A token over MAX_TOKEN_CHARS is
        refused before it is hashed, one of the file under MIN_TOKEN_CHARS is refused."""
        if not token or len(token) > MAX_TOKEN_CHARS:
            return None
        self.refresh()
        try:
            text = token.decode() if isinstance(token, bytes) else token
        except UnicodeDecodeError:
            return None
        found = self._by_digest.get(token_digest(text))
        if found is None or (found.source == "file" and len(text) < MIN_TOKEN_CHARS):
            return None
        now = self.clock()
        self._last_used[found.id] = now
        if self.uses is not None:
            self.uses.note(found.id, now)
        return found

    def get(self, credential_id: str) -> Credential | None:
        """The credential held under ``credential_id`` now (a session's, checked again)."""
        self.refresh()
        return self._by_id.get(credential_id)

    def last_used(self, credential_id: str) -> int | None:
        """When this process last took a request with it (ms), None: not since it started."""
        return self._last_used.get(credential_id)

    def described(self) -> list[dict[str, object]]:
        """Every credential held, for an admin: id, tenant, roles, where it was read and when
        it was last used: the later of this process's time and the stored one (never its
        hash)."""
        self.refresh()
        stored = self.uses.read(self._by_id) if self.uses is not None else {}
        return [
            {
                "id": c.id,
                "tenant": c.tenant,
                "roles": [r for r in ROLES if r in c.roles],
                "source": c.source,
                "last_used_at": _later(self._last_used.get(c.id), stored.get(c.id)),
            }
            for c in sorted(self._by_id.values(), key=lambda c: c.id)
        ]

    def tenant_label(self, tenant: str) -> str:
        """``tenant`` as a metrics label: its name if a credential held names it (at most
        MAX_TENANT_LABELS of them), else "other" (an admin may submit for any tenant)."""
        return tenant if tenant in self._tenants else "other"

    def __len__(self) -> int:
        return len(self._by_id)

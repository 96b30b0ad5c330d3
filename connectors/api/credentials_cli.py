"""`agentruns credentials add|list|remove`: the API credentials file, edited in place.

``add`` mints a token, prints it once on stdout and appends only its hash to the file; the
API reads the file again within a second (`agentruns.connectors.api.credentials`), so a new
credential works, and a removed one stops working, without a restart. The file is written
through a temporary file and a rename, so the API never reads half of it. ``list`` shows, with
DATABASE_URL set, when each credential was last used at any API process (the table
`agentruns.connectors.api.credential_use` keeps).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
from pathlib import Path

import psycopg

from agentruns.connectors.api.credential_use import CredentialUse
from agentruns.connectors.api.credentials import (
    ROLES,
    TOKEN_PREFIX,
    Credential,
    CredentialsError,
    credential_line,
    parse_credentials,
    token_digest,
)
from agentruns.connectors.errors import AgentrunsError, InvalidArgumentError
from agentruns.connectors.postgres.dsn import scrub_dsn
from agentruns.connectors.settings import current
from agentruns.streams.clock import datetime_of, now_ms


def _file(given: str | None) -> Path:
    path = Path(given) if given else current().api_credentials
    if path is None:
        raise InvalidArgumentError(
            "no credentials file: give --file or set AGENTRUNS_API_CREDENTIALS"
        )
    return path


def _read(path: Path) -> tuple[str, list[Credential]]:
    if not path.exists():
        return "", []
    text = path.read_text(encoding="utf-8")
    try:
        return text, parse_credentials(text, f"credentials file {path}")
    except CredentialsError as exc:
        raise AgentrunsError(str(exc), hint="fix the line, then run the command again") from None


def _write(path: Path, text: str) -> None:
    """Replace the file at once (a rename), readable by its owner only."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _parser(command: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"agentruns credentials {command}", description=description
    )
    parser.add_argument("--file", help="the credentials file (default $AGENTRUNS_API_CREDENTIALS)")
    return parser


def main_add(argv: list[str]) -> int:
    parser = _parser("add", "mint a credential: prints its token once, stores its hash")
    parser.add_argument("--tenant", required=True, help="the tenant whose runs it opens")
    parser.add_argument("--roles", required=True, help=f"comma-separated, of {', '.join(ROLES)}")
    parser.add_argument("--id", help="its name in the log and the console (default: made up)")
    args = parser.parse_args(argv)
    path = _file(args.file)
    text, _ = _read(path)
    cid = args.id or f"{args.tenant}-{secrets.token_hex(3)}"
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    line = f"{cid} {args.tenant} {args.roles} {token_digest(token)}\n"
    try:
        (credential,) = parse_credentials(line, "the new credential")
        parse_credentials(text + ("" if not text or text.endswith("\n") else "\n") + line)
    except CredentialsError as exc:
        raise InvalidArgumentError(str(exc).replace("the new credential line 1: ", "")) from None
    text = text + ("" if not text or text.endswith("\n") else "\n")
    _write(path, text + credential_line(credential))
    print(token)
    print(
        f"agentruns credentials: added {cid} (tenant {args.tenant}, roles {args.roles}) to"
        f" {path}; the token above is shown only now",
        file=sys.stderr,
    )
    return 0


def _stored_uses(database_url: str, held: list[Credential]) -> dict[str, int] | None:
    """When each credential was last used, as the API processes wrote it; None (and why, on
    stderr) when Postgres cannot be read."""
    try:
        return CredentialUse(database_url, now_ms).stored(c.id for c in held)
    except (psycopg.Error, OSError) as exc:
        first = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        print(
            "agentruns credentials: last use not shown, Postgres not read"
            f" ({scrub_dsn(first, database_url)})",
            file=sys.stderr,
        )
        return None


def main_list(argv: list[str]) -> int:
    args = _parser(
        "list",
        "the credentials of the file: id, tenant, roles; with DATABASE_URL set, when each was"
        " last used at any API process (UTC, - never)",
    ).parse_args(argv)
    _, held = _read(_file(args.file))
    database_url = current().database_url
    uses = _stored_uses(database_url, held) if database_url else None
    for c in held:
        line = f"{c.id}\t{c.tenant}\t{','.join(r for r in ROLES if r in c.roles)}"
        if uses is not None:
            at = uses.get(c.id)
            line += "\t" + ("-" if at is None else f"{datetime_of(at):%Y-%m-%dT%H:%M:%SZ}")
        print(line)
    return 0


def main_remove(argv: list[str]) -> int:
    parser = _parser("remove", "remove a credential: it stops working within a second")
    parser.add_argument("id", help="the credential's id")
    args = parser.parse_args(argv)
    path = _file(args.file)
    text, held = _read(path)
    if all(c.id != args.id for c in held):
        raise InvalidArgumentError(f"no credential {args.id} in {path}")
    kept = [
        raw
        for raw in text.splitlines(keepends=True)
        if (raw.split("#", 1)[0].split() or [""])[0] != args.id
    ]
    _write(path, "".join(kept))
    print(f"agentruns credentials: removed {args.id} from {path}", file=sys.stderr)
    return 0

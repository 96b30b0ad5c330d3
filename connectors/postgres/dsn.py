"""Postgres DSNs in messages: the password never shown.

``DATABASE_URL`` carries the database password, and a message about the database (an
unreachable server, a malformed URL) is written to logs, to stderr and into API answers.
`redact_dsn` is what such a message shows of a DSN; `scrub_dsn` cleans a text that may repeat
it (psycopg's own errors quote a malformed URL whole). Both forms are handled: the URL
(``postgresql://user:password@host/db?password=...``) and key/value (``password=... host=...``).
"""

from __future__ import annotations

import re

MASK = "***"

#: ``scheme://user:password@``: the password is what lies between the first ':' of the
#: user-info and its last '@'.
_URL_USERINFO = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/?#@]*:)(?P<secret>[^/?#]*)@")
#: ``password=...`` as a URL query parameter.
_URL_QUERY = re.compile(r"(?P<head>[?&]password=)(?P<secret>[^&#]*)", re.IGNORECASE)
#: ``password = value`` or ``password='quoted value'`` in a key/value conninfo.
_KEYWORD = re.compile(
    r"(?P<head>\bpassword)\s*=\s*(?P<secret>'(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE
)


def redact_dsn(dsn: str) -> str:
    """``dsn`` with its password (in the user-info, a query parameter, or a key/value
    ``password=``) replaced by ``***``."""
    out = _URL_USERINFO.sub(lambda m: f"{m['head']}{MASK}@", dsn, count=1)
    out = _URL_QUERY.sub(lambda m: f"{m['head']}{MASK}", out)
    if "://" not in out:
        out = _KEYWORD.sub(lambda m: f"{m['head']}={MASK}", out)
    return out


def _secrets(dsn: str) -> list[str]:
    found = [m["secret"] for m in _URL_USERINFO.finditer(dsn)]
    found += [m["secret"] for m in _URL_QUERY.finditer(dsn)]
    if "://" not in dsn:
        found += [m["secret"].strip("'") for m in _KEYWORD.finditer(dsn)]
    return [s for s in found if s]


def scrub_dsn(text: str, dsn: str) -> str:
    """``text`` (an error message) without ``dsn``'s password: the DSN itself is shown
    redacted, and any other occurrence of the password is masked."""
    out = text.replace(dsn, redact_dsn(dsn))
    for secret in _secrets(dsn):
        out = out.replace(secret, MASK)
    return out

"""The tenant of a task produced straight to Kafka: its ``agentruns-tenant`` record header, and
the signature that binds that header to the producer (docs/security.md, "Tenants").

A Kafka broker does not tell a consumer which principal produced a record, so a tenant header
alone is a claim any producer allowed to write the inbox can make. In ``signed`` mode the
processor believes it only with ``agentruns-tenant-signature``: base64url (unpadded) of
HMAC-SHA256, under the tenant's own Kafka key, over `signed_message` -- the tenant, a digest of
the record key and a digest of the record value. A signature copied onto another record,
another run or another tenant does not verify. Each tenant's key is derived from one root
(`agentruns.connectors.keys.tenant_kafka_key`); the processor is handed a function from tenant
to key (`tenant_of_submission`'s ``key_of``) and never the secret.

Pure: no I/O; what a producer (`signed_headers`) and the processor (`tenant_of_submission`)
both need, so they cannot disagree on the bytes signed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Callable, Iterable
from typing import Literal

from agentruns.processors.tenants import valid_tenant

#: The header a producer straight to Kafka names its task's tenant in.
TENANT_HEADER = "agentruns-tenant"
#: The header that carries the tenant header's signature (`sign`).
SIGNATURE_HEADER = "agentruns-tenant-signature"
#: How the processor takes the tenant header: ignored (``default``), believed (``trusted``),
#: believed with a valid signature only (``signed``).
Mode = Literal["default", "trusted", "signed"]
MODES: tuple[Mode, ...] = ("default", "trusted", "signed")
#: A tenant name is at most 63 characters; a longer header value is refused unread.
MAX_TENANT_HEADER_BYTES = 63
#: base64url of 32 bytes, unpadded: every signature is exactly this long.
SIGNATURE_CHARS = 43
_VERSION = b"agentruns-tenant/v1"
_BASE64URL = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")

Header = tuple[str, str | bytes | None]


class TenantHeaderRefused(Exception):
    """A tenant header (or signature) the processor will not take: the reason, no key."""


def signed_message(tenant: str, record_key: bytes | None, value: bytes | None) -> bytes:
    """The bytes a tenant header's signature is over: version, tenant, SHA-256 of the record
    key and SHA-256 of the record value (an absent key or value counts as empty). The tenant
    name cannot hold a newline, and the digests are fixed-length hex, so no two different
    (tenant, key, value) give the same bytes."""
    key_digest = hashlib.sha256(record_key or b"").hexdigest().encode()
    value_digest = hashlib.sha256(value or b"").hexdigest().encode()
    return b"\n".join((_VERSION, tenant.encode(), key_digest, value_digest))


def sign(key: bytes, tenant: str, record_key: bytes | None, value: bytes | None) -> str:
    """The ``agentruns-tenant-signature`` of one record for ``tenant``, under the tenant's
    Kafka ``key``: base64url (no padding) of HMAC-SHA256 over `signed_message`."""
    if not valid_tenant(tenant):
        raise ValueError(f"{tenant!r} is not a tenant name")
    mac = hmac.new(key, signed_message(tenant, record_key, value), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def signed_headers(
    key: bytes, tenant: str, record_key: bytes | None, value: bytes | None
) -> list[tuple[str, bytes]]:
    """The two headers a producer adds to a task's record to submit it for ``tenant``.

    Example (a producer that does not use `agentruns.RunsProducer`)::

        headers = signed_headers(bytes.fromhex(os.environ["AGENTRUNS_TENANT_KAFKA_KEY"]),
                                 "shop", run_id.encode(), value)
        producer.produce("agentruns.inbox", key=run_id.encode(), value=value, headers=headers)
    """
    return [
        (TENANT_HEADER, tenant.encode()),
        (SIGNATURE_HEADER, sign(key, tenant, record_key, value).encode()),
    ]


def _one(headers: Iterable[Header], name: str) -> str | bytes | None:
    """The value of header ``name``; None when absent; refused when given twice or empty."""
    found: list[str | bytes | None] = [value for key, value in headers if key == name]
    if not found:
        return None
    if len(found) > 1:
        raise TenantHeaderRefused(f"{len(found)} {name} headers on one record")
    if found[0] is None:
        raise TenantHeaderRefused(f"the {name} header has no value")
    return found[0]


def _ascii(value: str | bytes, name: str, limit: int) -> str:
    raw = value.encode("utf-8", "replace") if isinstance(value, str) else value
    if len(raw) > limit:
        raise TenantHeaderRefused(f"the {name} header is {len(raw)} bytes, at most {limit}")
    if not raw.isascii():
        raise TenantHeaderRefused(f"the {name} header is not ASCII")
    return raw.decode("ascii")


def header_tenant(headers: Iterable[Header]) -> str | None:
    """The tenant the record's header names; None without one; refused when the header is
    given twice, over `MAX_TENANT_HEADER_BYTES`, not ASCII or not a tenant name."""
    value = _one(headers, TENANT_HEADER)
    if value is None:
        return None
    text = _ascii(value, TENANT_HEADER, MAX_TENANT_HEADER_BYTES)
    if not valid_tenant(text):
        raise TenantHeaderRefused(f"the {TENANT_HEADER} header {text!r} is not a tenant name")
    return text


def verify(
    key: bytes,
    tenant: str,
    signature: str | bytes | None,
    record_key: bytes | None,
    value: bytes | None,
) -> None:
    """Raise TenantHeaderRefused unless ``signature`` is `sign`'s for this record and tenant.
    Its length and alphabet are checked before any MAC is computed."""
    if signature is None:
        raise TenantHeaderRefused(f"tenant {tenant}: no {SIGNATURE_HEADER} header (unsigned)")
    raw = signature.encode("utf-8", "replace") if isinstance(signature, str) else signature
    if len(raw) != SIGNATURE_CHARS or not set(raw) <= _BASE64URL:
        raise TenantHeaderRefused(
            f"tenant {tenant}: the {SIGNATURE_HEADER} is not a signature ({len(raw)} bytes,"
            f" expected {SIGNATURE_CHARS} base64url characters)"
        )
    expected = sign(key, tenant, record_key, value).encode()
    if not hmac.compare_digest(expected, raw):
        raise TenantHeaderRefused(
            f"tenant {tenant}: the {SIGNATURE_HEADER} does not verify for this record"
        )


def tenant_of_submission(
    mode: Mode,
    headers: Iterable[Header],
    record_key: bytes | None,
    value: bytes | None,
    *,
    named: str | None,
    default: str,
    key_of: Callable[[str], bytes] | None = None,
) -> str:
    """The tenant of a new run's submission: ``named`` is the tenant its body names (the
    API's), ``default`` the processor's default tenant, ``key_of`` a tenant's Kafka key.

    - ``default``: ``named``, else ``default``; headers are not read.
    - ``trusted``: ``named``, else the tenant header, else ``default``.
    - ``signed``: a tenant header is taken only with a valid signature of this record, and a
      body that names a tenant other than the default needs that signed header too (same
      tenant), or any producer could name one in the task. A record with neither is of the
      default tenant: unsigned producers keep working, for the default tenant only.

    Raises TenantHeaderRefused (the input is dead-lettered) with the reason.
    """
    if mode == "default":
        return named or default
    headers = list(headers)
    if mode == "trusted":
        return named or header_tenant(headers) or default
    header = header_tenant(headers)
    if key_of is None:  # the processor refuses to start so; a guard for any other caller
        raise TenantHeaderRefused("signed tenant headers but no tenant keys configured")
    signature = _one(headers, SIGNATURE_HEADER)
    if header is None:
        if signature is not None:
            raise TenantHeaderRefused(f"a {SIGNATURE_HEADER} header without {TENANT_HEADER}")
        if named is not None and named != default:
            raise TenantHeaderRefused(
                f"tenant {named}: the task names it without a signed {TENANT_HEADER} header"
                " (signature missing)"
            )
        return named or default
    verify(key_of(header), header, signature, record_key, value)
    if named is not None and named != header:
        raise TenantHeaderRefused(
            f"tenant {named}: the task names it, but the signed {TENANT_HEADER} header says"
            f" {header}"
        )
    return header

"""One key per purpose, derived from the one secret (``AGENTRUNS_API_SECRET``) with HKDF
(RFC 5869, HMAC-SHA256): console sessions, resume tokens, callback signatures and signed
tenant headers each get their own key, so a process that needs one of them holds that one
only. The tool executor signs callbacks and needs nothing else: it is given the callback key
(``AGENTRUNS_CALLBACK_KEY``, printed by ``agentruns keys callback``), never the secret, so a
leak of its environment cannot forge a console session or a resume token.

Signed tenant headers (`agentruns.streams.tenant_headers`) have one more level: the root of
the tenant-header keys (``AGENTRUNS_TENANT_HEADER_KEY``, printed by ``agentruns keys
tenant-header``) is what the processor holds, and each tenant's Kafka key is derived from that
root and the tenant's name (`tenant_kafka_key`; ``agentruns credentials kafka-key --tenant
T`` prints it for that tenant's producers). A producer's key signs for its tenant only; the
processor can check every tenant's and cannot forge anything else.
"""

from __future__ import annotations

import argparse
import base64
import functools
import hashlib
import hmac
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from agentruns.connectors.errors import AgentrunsError
from agentruns.processors.tenants import valid_tenant
from agentruns.streams.tenant_headers import Mode

_HASH = hashlib.sha256
_HASH_BYTES = 32
#: The ``info`` of each purpose. Changing one changes that key (and ends what it signed).
CONSOLE = b"agentruns/console-sessions/v1"
RESUME = b"agentruns/resume-tokens/v1"
CALLBACK = b"agentruns/callbacks/v1"
TENANT_HEADERS = b"agentruns/tenant-headers/v1"
#: The ``info`` of one tenant's Kafka key under the tenant-header root: this, then the name.
TENANT_KAFKA = b"agentruns/tenant-kafka-key/v1:"
#: The environment variable that carries the callback key to a tool executor (hex).
CALLBACK_KEY_ENV = "AGENTRUNS_CALLBACK_KEY"
#: The root of the tenant-header keys, the processor's (hex).
TENANT_HEADER_KEY_ENV = "AGENTRUNS_TENANT_HEADER_KEY"
#: A producer's own tenant Kafka key (hex), what `agentruns submit --tenant` signs with.
TENANT_KAFKA_KEY_ENV = "AGENTRUNS_TENANT_KAFKA_KEY"
SECRET_ENV = "AGENTRUNS_API_SECRET"


def hkdf(secret: bytes, info: bytes, length: int = _HASH_BYTES, salt: bytes = b"") -> bytes:
    """HKDF-SHA256 (RFC 5869): extract with ``salt`` (zeros when empty), expand to ``length``
    bytes bound to ``info``."""
    if not 0 < length <= 255 * _HASH_BYTES:
        raise ValueError(f"HKDF output of {length} bytes is out of range")
    prk = hmac.new(salt or bytes(_HASH_BYTES), secret, _HASH).digest()
    out, block = b"", b""
    for counter in range(1, -(-length // _HASH_BYTES) + 1):
        block = hmac.new(prk, block + info + bytes([counter]), _HASH).digest()
        out += block
    return out[:length]


@dataclass(frozen=True)
class Keys:
    """The API's keys, one per purpose."""

    console: bytes
    resume: bytes
    callback: bytes
    tenant_headers: bytes  # the root of the tenants' Kafka keys (`tenant_kafka_key`)

    @classmethod
    def derive(cls, secret: bytes) -> Keys:
        return cls(
            hkdf(secret, CONSOLE),
            hkdf(secret, RESUME),
            hkdf(secret, CALLBACK),
            tenant_header_root(secret),
        )


def callback_key(secret: bytes) -> bytes:
    """The callback key of ``secret`` (what `Keys.derive` gives the API)."""
    return hkdf(secret, CALLBACK)


def tenant_header_root(secret: bytes) -> bytes:
    """The root of the tenant-header keys of ``secret`` (the processor's
    ``AGENTRUNS_TENANT_HEADER_KEY``)."""
    return hkdf(secret, TENANT_HEADERS)


def tenant_kafka_key(root: bytes, tenant: str) -> bytes:
    """The Kafka key of ``tenant`` under the tenant-header ``root``: what its producers sign
    their tenant header with (`agentruns.streams.tenant_headers.sign`)."""
    return hkdf(root, TENANT_KAFKA + tenant.encode())


def _hex_key(text: str, name: str, hint: str) -> bytes:
    """A 32-byte key given as 64 hex digits in ``name``."""
    text = text.strip()
    if len(text) != 2 * _HASH_BYTES or any(c not in "0123456789abcdefABCDEF" for c in text):
        raise AgentrunsError(f"{name} is not {2 * _HASH_BYTES} hex digits", hint=hint)
    return bytes.fromhex(text)


def parse_callback_key(text: str) -> bytes:
    """``AGENTRUNS_CALLBACK_KEY``: 64 hex digits (32 bytes)."""
    return _hex_key(
        text,
        CALLBACK_KEY_ENV,
        "print it from the API's secret: AGENTRUNS_API_SECRET=... agentruns keys callback",
    )


def processor_tenant_keys(root_hex: str, secret: str) -> Callable[[str], bytes] | None:
    """The processor's tenant -> Kafka key: from the tenant-header root ``root_hex``
    (``AGENTRUNS_TENANT_HEADER_KEY``); else, for development, from the ``secret``
    (``AGENTRUNS_API_SECRET``; a deployment gives the processor the root only); None without
    either."""
    if root_hex:
        root = _hex_key(
            root_hex,
            TENANT_HEADER_KEY_ENV,
            "print it from the API's secret: AGENTRUNS_API_SECRET=... agentruns keys tenant-header",
        )
    elif secret:
        root = tenant_header_root(secret.encode())
    else:
        return None
    return functools.partial(tenant_kafka_key, root)


def processor_tenant_header(
    mode: Mode, root_hex: str, secret: str
) -> tuple[Mode, Callable[[str], bytes] | None]:
    """The processor's tenant-header mode and its tenant -> Kafka key (`processor_tenant_keys`;
    None unless ``signed``); ``signed`` without a root or a secret stops the start."""
    if mode != "signed":
        return mode, None
    keys = processor_tenant_keys(root_hex, secret)
    if keys is None:
        raise AgentrunsError(
            f"AGENTRUNS_TENANT_HEADER=signed needs {TENANT_HEADER_KEY_ENV}",
            hint="print it where the API's secret is: agentruns keys tenant-header",
        )
    return mode, keys


def producer_tenant_key(environ: Mapping[str, str] | None = None) -> bytes | None:
    """A producer's tenant Kafka key, ``AGENTRUNS_TENANT_KAFKA_KEY``; None when unset."""
    env = os.environ if environ is None else environ
    text = env.get(TENANT_KAFKA_KEY_ENV, "")
    if not text:
        return None
    return _hex_key(
        text,
        TENANT_KAFKA_KEY_ENV,
        "print it where the API's secret is: agentruns credentials kafka-key --tenant T",
    )


def executor_callback_key(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The key a tool executor signs callbacks with: ``AGENTRUNS_CALLBACK_KEY``; else, for
    development, derived from ``AGENTRUNS_API_SECRET`` (a deployment gives the executor the
    callback key only); None without either (callbacks unsigned: the backend then needs the
    bearer token)."""
    env = os.environ if environ is None else environ
    if env.get(CALLBACK_KEY_ENV):
        return parse_callback_key(env[CALLBACK_KEY_ENV])
    secret = env.get(SECRET_ENV, "")
    return callback_key(secret.encode()) if secret else None


def main(argv: Sequence[str] | None = None) -> int:
    """`agentruns keys callback`: the callback key of $AGENTRUNS_API_SECRET, in hex, for the
    tool executors' ``AGENTRUNS_CALLBACK_KEY``; `agentruns keys tenant-header`: the root of
    the tenant-header keys, for the processors' ``AGENTRUNS_TENANT_HEADER_KEY``."""
    parser = argparse.ArgumentParser(prog="agentruns keys", description=main.__doc__)
    parser.add_argument("purpose", choices=["callback", "tenant-header"])
    args = parser.parse_args(list(argv) if argv is not None else None)
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise AgentrunsError(f"{SECRET_ENV} is not set", hint="run it where the API's secret is")
    derive = callback_key if args.purpose == "callback" else tenant_header_root
    print(derive(secret.encode()).hex())
    return 0


def main_kafka_key(argv: Sequence[str] | None = None) -> int:
    """`agentruns credentials kafka-key --tenant T`: tenant T's Kafka key, in hex, for its
    producers' ``AGENTRUNS_TENANT_KAFKA_KEY`` (they sign their tenant header with it). Derived
    from $AGENTRUNS_TENANT_HEADER_KEY, else from $AGENTRUNS_API_SECRET."""
    parser = argparse.ArgumentParser(
        prog="agentruns credentials kafka-key", description=main_kafka_key.__doc__
    )
    parser.add_argument("--tenant", required=True, help="the tenant whose producers sign")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if not valid_tenant(args.tenant):
        raise AgentrunsError(
            f"{args.tenant!r} is not a tenant name",
            hint="1 to 63 of a-z0-9._-, starting with a letter or digit",
        )
    keys = processor_tenant_keys(
        os.environ.get(TENANT_HEADER_KEY_ENV, ""), os.environ.get(SECRET_ENV, "")
    )
    if keys is None:
        raise AgentrunsError(
            f"neither {TENANT_HEADER_KEY_ENV} nor {SECRET_ENV} is set",
            hint="run it where the API's secret (or the processor's tenant-header key) is",
        )
    print(keys(args.tenant).hex())
    return 0


# ------------------------------------------------------------------------ callback signatures

#: The header a tool backend receives with ``X-Callback-URL`` and sends back with its callback.
CALLBACK_SIGNATURE_HEADER = "X-Callback-Signature"
_CALLBACK_VERSION = "cb1"
#: Longer than any signature `sign_callback` makes; a longer header is refused unread.
MAX_CALLBACK_SIGNATURE_CHARS = 128
#: How long a callback signature stays valid by default: an async tool reports within it.
DEFAULT_CALLBACK_TTL_MS = 24 * 3_600_000


class CallbackRefused(Exception):
    """A callback signature that does not authenticate the callback (the reason, no secret)."""


def _callback_mac(key: bytes, op_key: str, dispatch: int, expires_ms: int) -> str:
    message = f"{_CALLBACK_VERSION}\n{op_key}\n{dispatch}\n{expires_ms}".encode()
    digest = hmac.new(key, message, _HASH).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def sign_callback(key: bytes, op_key: str, dispatch: int, expires_ms: int) -> str:
    """``cb1.<dispatch>.<expires ms>.<base64url HMAC-SHA256>``: the callback of one dispatch
    of one operation, until ``expires_ms``."""
    mac = _callback_mac(key, op_key, dispatch, expires_ms)
    return f"{_CALLBACK_VERSION}.{dispatch}.{expires_ms}.{mac}"


def verify_callback(key: bytes, op_key: str, signature: str, now_ms: int) -> int:
    """The dispatch a valid, unexpired ``signature`` of ``op_key`` was made for; raises
    CallbackRefused otherwise. Size and shape are checked before any MAC is computed."""
    if len(signature) > MAX_CALLBACK_SIGNATURE_CHARS:
        raise CallbackRefused("callback signature too long")
    parts = signature.split(".")
    if len(parts) != 4 or parts[0] != _CALLBACK_VERSION:
        raise CallbackRefused("not a callback signature")
    _, dispatch, expires, mac = parts
    if not (dispatch.isascii() and dispatch.isdigit() and len(dispatch) <= 9) or not (
        expires.isascii() and expires.isdigit() and len(expires) <= 15
    ):
        raise CallbackRefused("callback signature is malformed")
    expected = _callback_mac(key, op_key, int(dispatch), int(expires))
    if not hmac.compare_digest(expected.encode(), mac.encode()):
        raise CallbackRefused("callback signature does not verify")
    if int(expires) <= now_ms:
        raise CallbackRefused("callback signature expired")
    return int(dispatch)

"""One key per purpose, derived from the one secret (``AGENTRUNS_API_SECRET``) with HKDF
(RFC 5869, HMAC-SHA256): console sessions, resume tokens and callback signatures each get
their own key, so a process that needs one of them holds that one only. The tool executor
signs callbacks and needs nothing else: it is given the callback key
(``AGENTRUNS_CALLBACK_KEY``, printed by ``agentruns keys callback``), never the secret, so a
leak of its environment cannot forge a console session or a resume token.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agentruns.connectors.errors import AgentrunsError

_HASH = hashlib.sha256
_HASH_BYTES = 32
#: The ``info`` of each purpose. Changing one changes that key (and ends what it signed).
CONSOLE = b"agentruns/console-sessions/v1"
RESUME = b"agentruns/resume-tokens/v1"
CALLBACK = b"agentruns/callbacks/v1"
#: The environment variable that carries the callback key to a tool executor (hex).
CALLBACK_KEY_ENV = "AGENTRUNS_CALLBACK_KEY"
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

    @classmethod
    def derive(cls, secret: bytes) -> Keys:
        return cls(hkdf(secret, CONSOLE), hkdf(secret, RESUME), hkdf(secret, CALLBACK))


def callback_key(secret: bytes) -> bytes:
    """The callback key of ``secret`` (what `Keys.derive` gives the API)."""
    return hkdf(secret, CALLBACK)


def parse_callback_key(text: str) -> bytes:
    """``AGENTRUNS_CALLBACK_KEY``: 64 hex digits (32 bytes)."""
    text = text.strip()
    if len(text) != 2 * _HASH_BYTES or any(c not in "0123456789abcdefABCDEF" for c in text):
        raise AgentrunsError(
            f"{CALLBACK_KEY_ENV} is not {2 * _HASH_BYTES} hex digits",
            hint="print it from the API's secret: AGENTRUNS_API_SECRET=... agentruns keys callback",
        )
    return bytes.fromhex(text)


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
    tool executors' ``AGENTRUNS_CALLBACK_KEY``."""
    parser = argparse.ArgumentParser(prog="agentruns keys", description=main.__doc__)
    parser.add_argument("purpose", choices=["callback"])
    parser.parse_args(list(argv) if argv is not None else None)
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise AgentrunsError(f"{SECRET_ENV} is not set", hint="run it where the API's secret is")
    print(callback_key(secret.encode()).hex())
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

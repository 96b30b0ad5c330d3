"""Resume tokens and operator tokens (R15); callback signatures are `agentruns.connectors.keys`'.

Operator tokens (AGENTRUNS_API_OPERATOR_TOKENS) are admin credentials of the default tenant
(`agentruns.connectors.api.credentials`): the operator's name goes into the run's log as the
actor of what it does.

A resume token ``art1.<claims>.<HMAC>`` binds run, question, token id, state version and
expiry; the API signs it (with the resume-token key, `keys.Keys.resume`) when it shows a
question and verifies it on a reply.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
from dataclasses import dataclass

from agentruns.connectors.api.errors import ApiError
from agentruns.processors.ids import canonical_json

TOKEN_PREFIX = "art1"
#: Longer than any token `sign_token` makes (three ids of at most 512 characters, base64url);
#: a longer one is refused before anything is decoded.
MAX_TOKEN_CHARS = 4096
#: Bounds of the operator token list (AGENTRUNS_API_OPERATOR_TOKENS).
MAX_OPERATORS = 64
MIN_OPERATOR_TOKEN_CHARS = 16
MAX_OPERATOR_TOKEN_CHARS = 256
#: An operator's name: what the run's log records as the actor (``operator:<name>``).
OPERATOR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class ResumeToken:
    """What a signed resume token binds: run, question, token id, state version, expiry (ms)."""

    run_id: str
    question_id: str
    token_id: str
    state_version: int
    expires_at: int


class TokenError(ApiError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(409, code, message)


def sign_token(secret: bytes, token: ResumeToken) -> str:
    """``art1.<base64url JSON claims>.<base64url HMAC-SHA256(secret, "art1." + claims)>``."""
    claims = {
        "r": token.run_id,
        "q": token.question_id,
        "t": token.token_id,
        "v": token.state_version,
        "e": token.expires_at,
    }
    body = _b64(canonical_json(claims).encode())
    mac = hmac.new(secret, f"{TOKEN_PREFIX}.{body}".encode(), hashlib.sha256).digest()
    return f"{TOKEN_PREFIX}.{body}.{_b64(mac)}"


def verify_token(secret: bytes, text: str) -> ResumeToken:
    """The claims of a token whose signature is valid; TokenError("token_forged") otherwise.

    The size is checked first, then the signature over the claims as sent; only a token this
    API signed has its claims decoded and parsed, so a forged payload (deeply nested JSON, huge,
    not UTF-8) is never read. Expiry and freshness are checked by the caller against the clock
    and the projection."""
    if len(text) > MAX_TOKEN_CHARS:
        raise TokenError("token_forged", f"resume token over {MAX_TOKEN_CHARS} characters")
    parts = text.split(".")
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        raise TokenError("token_forged", "not an agentruns resume token")
    expected = hmac.new(secret, f"{TOKEN_PREFIX}.{parts[1]}".encode(), hashlib.sha256).digest()
    try:
        given = _unb64(parts[2])
    except ValueError:
        raise TokenError("token_forged", "resume token is malformed") from None
    if not hmac.compare_digest(expected, given):
        raise TokenError("token_forged", "resume token signature does not verify")
    try:
        claims = json.loads(_unb64(parts[1]))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise TokenError("token_forged", "resume token is malformed") from None
    if not isinstance(claims, dict):
        raise TokenError("token_forged", "resume token claims are incomplete")
    try:
        return ResumeToken(
            run_id=str(claims["r"]),
            question_id=str(claims["q"]),
            token_id=str(claims["t"]),
            state_version=int(claims["v"]),
            expires_at=int(claims["e"]),
        )
    except (KeyError, TypeError, ValueError):
        raise TokenError("token_forged", "resume token claims are incomplete") from None


class OperatorTokensError(ValueError):
    """AGENTRUNS_API_OPERATOR_TOKENS is malformed (the message never holds a token)."""


def parse_operator_tokens(text: str) -> dict[str, str]:
    """``name:token[,name:token...]`` as {token: name}. Names match OPERATOR_NAME, tokens are
    MIN_OPERATOR_TOKEN_CHARS to MAX_OPERATOR_TOKEN_CHARS printable ASCII without spaces or
    commas, at most MAX_OPERATORS entries, no name or token twice."""
    out: dict[str, str] = {}
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if len(entries) > MAX_OPERATORS:
        raise OperatorTokensError(f"more than {MAX_OPERATORS} operator tokens")
    for i, entry in enumerate(entries, 1):
        name, sep, token = entry.partition(":")
        if not sep or OPERATOR_NAME.fullmatch(name) is None:
            raise OperatorTokensError(
                f"entry {i} is not name:token with a name of letters, digits and ._@- (≤ 64)"
            )
        if not (MIN_OPERATOR_TOKEN_CHARS <= len(token) <= MAX_OPERATOR_TOKEN_CHARS) or any(
            not (0x21 <= ord(c) <= 0x7E) for c in token
        ):
            raise OperatorTokensError(
                f"the token of operator {name} is not {MIN_OPERATOR_TOKEN_CHARS} to"
                f" {MAX_OPERATOR_TOKEN_CHARS} printable ASCII characters"
            )
        if token in out or name in out.values():
            raise OperatorTokensError(f"operator {name} or its token is listed twice")
        out[token] = name
    return out

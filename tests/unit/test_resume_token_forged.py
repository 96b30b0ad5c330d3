"""A resume token's signature is checked before its payload is decoded or parsed, and its size
is bounded: a forged token is a TokenError (409 token_forged), whatever its payload holds."""

from __future__ import annotations

import base64
import json

import pytest

from agentruns.connectors.api.tokens import (
    MAX_TOKEN_CHARS,
    ResumeToken,
    TokenError,
    sign_token,
    verify_token,
)

SECRET = b"k" * 32


def _token(payload: bytes, mac: str = "A" * 43) -> str:
    return "art1." + base64.urlsafe_b64encode(payload).rstrip(b"=").decode() + "." + mac


@pytest.mark.parametrize(
    "text",
    [
        _token(b"[" * 100_000),  # a recursive parser's RecursionError
        _token(b"[" * 100_000, mac="!!!"),
        _token(b"\xff\xfe not utf-8"),
        _token(b"not json"),
        "art1." + "A" * (MAX_TOKEN_CHARS + 1) + ".sig",
        "art1.%%%.AAAA",
        "art1..",
        "",
    ],
)
def test_a_forged_token_is_refused_before_its_payload_is_read(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: object, **kwargs: object) -> object:
        raise AssertionError("a payload was parsed before its signature was checked")

    monkeypatch.setattr(json, "loads", never)
    with pytest.raises(TokenError) as caught:
        verify_token(SECRET, text)
    assert caught.value.status == 409 and caught.value.code == "token_forged"


@pytest.mark.parametrize(
    "payload", [b"[" * 100_000, b"[1, 2]", b'"a string"', b"{}", b'{"r": "x"}', b"\xff"]
)
def test_a_signed_but_unusable_payload_is_refused_not_crashed(payload: bytes) -> None:
    import hashlib
    import hmac

    body = base64.urlsafe_b64encode(payload).rstrip(b"=").decode()
    mac = hmac.new(SECRET, f"art1.{body}".encode(), hashlib.sha256).digest()
    text = f"art1.{body}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"
    if len(text) > MAX_TOKEN_CHARS:
        text = text[: MAX_TOKEN_CHARS + 1]
    with pytest.raises(TokenError):
        verify_token(SECRET, text)


def test_a_good_token_still_verifies() -> None:
    claims = ResumeToken("run-1", "q-1", "t-1", 7, 1_700_000_000_000)
    assert verify_token(SECRET, sign_token(SECRET, claims)) == claims
    assert len(sign_token(SECRET, claims)) < MAX_TOKEN_CHARS

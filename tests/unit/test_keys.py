"""One key per purpose (HKDF, RFC 5869) and callback signatures: the RFC's test vectors, keys
that differ per purpose, and hostile signatures refused before any MAC is computed."""

from __future__ import annotations

import pytest

from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.keys import (
    CallbackRefused,
    Keys,
    callback_key,
    executor_callback_key,
    hkdf,
    main,
    sign_callback,
    verify_callback,
)


def test_hkdf_matches_rfc_5869_test_cases_1_and_3() -> None:
    okm = hkdf(bytes([0x0B] * 22), bytes(range(0xF0, 0xFA)), 42, salt=bytes(range(0x00, 0x0D)))
    assert okm.hex() == (
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"
    )
    assert hkdf(bytes([0x0B] * 22), b"", 42).hex() == (
        "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a96c8"
    )
    with pytest.raises(ValueError):
        hkdf(b"s", b"i", 255 * 32 + 1)


def test_each_purpose_has_its_own_key_and_none_is_the_secret() -> None:
    secret = b"s" * 40
    keys = Keys.derive(secret)
    assert len({keys.console, keys.resume, keys.callback, secret}) == 4
    assert keys.callback == callback_key(secret)
    assert Keys.derive(b"t" * 40).callback != keys.callback


def test_the_executor_takes_the_callback_key_and_refuses_a_malformed_one() -> None:
    key = callback_key(b"x" * 40)
    assert executor_callback_key({"AGENTRUNS_CALLBACK_KEY": key.hex()}) == key
    # development: derived from the secret when no callback key is given
    assert executor_callback_key({"AGENTRUNS_API_SECRET": "x" * 40}) == key
    assert executor_callback_key({}) is None
    for bad in ("abc", "zz" * 32, key.hex() + "00"):
        with pytest.raises(AgentrunsError, match="AGENTRUNS_CALLBACK_KEY"):
            executor_callback_key({"AGENTRUNS_CALLBACK_KEY": bad})


def test_agentruns_keys_callback_prints_the_executors_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AGENTRUNS_API_SECRET", "y" * 40)
    assert main(["callback"]) == 0
    assert capsys.readouterr().out.strip() == callback_key(b"y" * 40).hex()
    monkeypatch.delenv("AGENTRUNS_API_SECRET")
    with pytest.raises(AgentrunsError):
        main(["callback"])


def test_a_callback_signature_binds_operation_dispatch_and_expiry() -> None:
    key = callback_key(b"z" * 40)
    good = sign_callback(key, "op-1", 3, 10_000)
    assert verify_callback(key, "op-1", good, 9_999) == 3
    _, dispatch, expires, mac = good.split(".")
    refused = [
        ("op-2", good, 0),  # another operation
        ("op-1", good, 10_000),  # expired
        ("op-1", f"cb1.4.{expires}.{mac}", 0),  # the dispatch changed under the MAC
        ("op-1", f"cb1.{dispatch}.99999.{mac}", 0),  # the expiry pushed out
        ("op-1", sign_callback(b"other key", "op-1", 3, 10_000), 0),
        ("op-1", "cb1." * 1000, 0),  # huge
        ("op-1", "cb1.-1.5.x", 0),
        ("op-1", "cb1.1.1e9.x", 0),
        ("op-1", "cb1.\u0661.5.x", 0),  # a non-ASCII digit
        ("op-1", "cb2.3.10000." + mac, 0),
        ("op-1", "", 0),
    ]
    for op_key, signature, now in refused:
        with pytest.raises(CallbackRefused):
            verify_callback(key, op_key, signature, now)

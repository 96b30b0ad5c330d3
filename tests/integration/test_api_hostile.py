"""Hostile clients of the JSON API: made-up methods do not grow /metrics, wrong tokens are
throttled per address (one budget with the console's login form), and a forged resume token
is refused before its payload is read."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import httpx

from tests.support.api import OPERATOR_TOKEN, TOKEN, Stack, client_address
from tests.support.console import csrf_of

#: Label values a client chooses must stay in a fixed set whatever it sends.
KNOWN_METHODS = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other"}


def _method_labels(text: str) -> set[str]:
    return {
        line.split('method="', 1)[1].split('"', 1)[0]
        for line in text.splitlines()
        if line.startswith("agentruns_api_requests_total{")
    }


def test_made_up_methods_and_paths_do_not_grow_the_metrics(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as anon:
        before = len(anon.get("/metrics").text)
        for i in range(120):
            method = "M" + uuid.uuid4().hex[:16].upper()
            headers = {"X-Forwarded-For": client_address()}
            path = f"/runs/{uuid.uuid4().hex}"
            if i % 3 == 0:  # unauthorized
                anon.request(method, path, headers=headers)
            elif i % 3 == 1:  # authorized, a method no route takes
                anon.request(method, path, headers={**headers, "Authorization": f"Bearer {TOKEN}"})
            else:  # refused at the door (a DEL byte in a header value)
                anon.request(method, path, headers={**headers, "X-Bad": "a\x7fb"})
        text = anon.get("/metrics").text
    assert _method_labels(text) <= KNOWN_METHODS, _method_labels(text) - KNOWN_METHODS
    assert "other" in _method_labels(text)
    assert len(text) - before < 4096, len(text) - before


def test_wrong_tokens_are_throttled_per_address_on_every_route_and_with_the_console(
    stack: Stack,
) -> None:
    address = client_address()
    wrong = {"Authorization": "Bearer " + "x" * 40, "X-Forwarded-For": address}
    right = {"Authorization": f"Bearer {TOKEN}", "X-Forwarded-For": address}
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        for path in ("/runs", "/runs/x", "/runs/x/events", "/runs", "/runs/x"):
            assert client.get(path, headers=wrong).status_code == 401, path
        for headers in (wrong, right):  # refused before the token is compared
            for method, path in (("GET", "/runs"), ("POST", "/runs/x/replies")):
                limited = client.request(method, path, headers=headers, json={})
                assert limited.status_code == 429, (method, path, limited.text)
                assert 1 <= int(limited.headers["retry-after"]) <= 60
                assert limited.json()["error"] == "too_many_wrong_tokens"
        forged_callback = client.post(
            "/operations/k/callback",
            json={},
            headers={"X-Forwarded-For": address, "X-Callback-Signature": "cb1.1.1.forged"},
        )
        assert forged_callback.status_code == 429
        # the console's login form shares the budget: no more guesses there either
        form = client.get("/ui/login", headers={"X-Forwarded-For": address})
        login = client.post(
            "/ui/login",
            data={"token": TOKEN, "csrf": csrf_of(form.text)},
            headers={"X-Forwarded-For": address},
        )
        assert login.status_code == 429
        # another address is not throttled
        other = {"Authorization": f"Bearer {TOKEN}", "X-Forwarded-For": client_address()}
        assert client.get("/runs", headers=other).status_code == 200


def test_requests_without_any_credential_do_not_spend_the_budget(stack: Stack) -> None:
    """A browser asks for /favicon.ico with every page of the console: refused, never counted
    as a guess, so the right token from that address keeps working."""
    address = client_address()
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        for _ in range(12):
            bare = client.get("/favicon.ico", headers={"X-Forwarded-For": address})
            assert bare.status_code == 401
        right = {"Authorization": f"Bearer {TOKEN}", "X-Forwarded-For": address}
        assert client.get("/runs", headers=right).status_code == 200


def _forged(payload: bytes) -> str:
    body = base64.urlsafe_b64encode(payload).rstrip(b"=").decode()
    return f"art1.{body}.{'A' * 43}"


def test_a_forged_resume_token_is_refused_before_its_payload_is_parsed(stack: Stack) -> None:
    def reply(token: str) -> httpx.Response:
        body: dict[str, Any] = {"resume_token": token, "response": {"approved": True}}
        with stack.client(OPERATOR_TOKEN) as admin:  # no tenant check stops it sooner
            return admin.post("/runs/x/replies", json=body)

    for token in (
        _forged(b"[" * 200_000),  # deep nesting: a recursive parser's RecursionError
        _forged(b'{"r": "x"' + b" " * 300_000 + b"}"),  # huge
        "art1." + "A" * 1_000_000 + ".sig",
        _forged(b"not json at all"),
    ):
        r = reply(token)
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:200])
        assert r.json()["error"] in {"token_forged", "body_too_large"}, r.text[:200]
    assert stack.http.get("/runs").status_code == 200


def test_a_huge_credential_is_refused_without_being_compared(stack: Stack) -> None:
    """A 1 MB bearer token, and one of 100 kB in the console's login form: refused (the
    server's header limit, or 401 before it is hashed), never a 500, and the API answers on."""
    huge = "agr_" + "A" * (1 << 20)
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        try:
            r = client.get("/runs", headers={"Authorization": f"Bearer {huge}"})
            assert r.status_code in (400, 401, 413, 431), r.status_code
        except (httpx.RemoteProtocolError, httpx.ReadError):
            pass  # the server closed the connection on a header over its limit
        form = client.get("/ui/login", headers={"X-Forwarded-For": client_address()})
        wrong = client.post(
            "/ui/login",
            data={"token": huge[:100_000], "csrf": csrf_of(form.text)},
            headers={"X-Forwarded-For": client_address()},
        )
        assert wrong.status_code == 401 and "agentruns_console=" not in str(wrong.cookies)
    assert stack.http.get("/runs").status_code == 200

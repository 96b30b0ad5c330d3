"""Console sessions end on the server: a session cookie kept after log-out no longer opens the
console, nor does one opened with an API token that has since been rotated (another API process
on the same database and secret, holding the new token)."""

from __future__ import annotations

import uuid

import httpx

from agentruns.connectors.api.config import ApiConfig
from agentruns.connectors.api.serve import serving
from tests.support.api import OPERATOR, OPERATOR_TOKEN, SECRET, TOKEN, Stack
from tests.support.console import csrf_of, logged_in

COOKIE = "agentruns_console"


def _opens(url: str, cookie: str) -> bool:
    with httpx.Client(base_url=url, timeout=30, cookies={COOKIE: cookie}) as client:
        r = client.get("/ui/runs")
        assert r.status_code in (200, 303), r.text[:300]
        return r.status_code == 200


def test_a_cookie_kept_after_log_out_no_longer_opens_the_console(stack: Stack) -> None:
    with logged_in(stack) as console:
        cookie = console.cookies[COOKIE]
    with logged_in(stack) as second:
        kept = second.cookies[COOKIE]
    assert _opens(stack.url, cookie) and _opens(stack.url, kept)
    with httpx.Client(base_url=stack.url, timeout=30, cookies={COOKIE: cookie}) as client:
        page = client.get("/ui/runs")
        assert page.status_code == 200
        out = client.post("/ui/logout", data={"csrf": csrf_of(page.text)})
        assert out.status_code == 303
    assert not _opens(stack.url, cookie)
    assert _opens(stack.url, kept)


def test_rotating_the_token_ends_the_sessions_it_opened(stack: Stack) -> None:
    with logged_in(stack) as console:
        cookie = console.cookies[COOKIE]
    with logged_in(stack, OPERATOR_TOKEN) as operator:
        operator_cookie = operator.cookies[COOKIE]
    rotated = ApiConfig(
        bootstrap=stack.bootstrap,
        database_url=stack.database_url,
        api_token="rotated-" + uuid.uuid4().hex,
        secret=SECRET,
        prefix=stack.prefix,
        operator_tokens={OPERATOR_TOKEN: OPERATOR},
    )
    with serving(rotated) as url:
        assert not _opens(url, cookie)  # opened with the old API token
        assert _opens(url, operator_cookie)  # the operator's token did not change
    assert _opens(stack.url, cookie)  # where the token is still the same
    assert rotated.api_token != TOKEN

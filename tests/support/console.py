"""Logging in to the console over plain HTTP (the login form, its CSRF token, the cookie)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tests.support.api import TOKEN, Stack

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def csrf_of(html: str) -> str:
    found = CSRF.search(html)
    assert found is not None, html[:500]
    return found.group(1)


@contextmanager
def logged_in(stack: Stack, token: str = TOKEN) -> Iterator[httpx.Client]:
    """A client with a console session (no bearer token), opened with `token` (the API's, or
    an operator's)."""
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        form = client.get("/ui/login")
        assert form.status_code == 200, form.text
        r = client.post("/ui/login", data={"csrf": csrf_of(form.text), "token": token})
        assert r.status_code == 303 and r.headers["location"] == "/ui/runs", r.text
        yield client

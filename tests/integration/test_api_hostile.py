"""Hostile clients of the JSON API: made-up methods do not grow /metrics."""

from __future__ import annotations

import random
import uuid

import httpx

from tests.support.api import TOKEN, Stack

#: Label values a client chooses must stay in a fixed set whatever it sends.
KNOWN_METHODS = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other"}


def _address() -> str:
    """A client address of its own (uvicorn takes X-Forwarded-For from 127.0.0.1, its default
    trusted proxy), so one test's wrong tokens do not throttle another's requests."""
    return f"198.18.{random.randrange(256)}.{random.randrange(1, 255)}"


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
            headers = {"X-Forwarded-For": _address()}
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

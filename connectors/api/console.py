"""The web console under /ui: runs, a run, its question and cancel, dead letters.

Server-rendered (Jinja2, autoescaped) over the same `ApiService` the JSON endpoints use: a reply
or a cancel from a form goes through `ApiService.reply` / `ApiService.cancel`, with the same
checks and the same refusals. A small script (static/console.js, no build step) polls the page
it is on and swaps its live part when the run or the list changed.

Access: the login form takes the API's bearer token and sets a session cookie (HttpOnly,
SameSite=Strict, signed with the API secret, twelve hours; Secure over https or with the
`console_secure_cookies` setting). The session is bound to a fingerprint of the token that
opened it (rotating the token ends it), and log-out revokes it in Postgres (every API process
behind a load balancer refuses it from then on). Every page but the login form and the script
needs it; every POST form carries a CSRF token bound to the session (for the login form, to a
pre-login cookie) and is refused without it. A client address with LOGIN_FAILURES wrong
tokens in a minute is refused (429, Retry-After) until the oldest of them is a minute old.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import logging
import math
import secrets
import string
import threading
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

import psycopg
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from agentruns.connectors.api import queries, transcript
from agentruns.connectors.api.credentials import (
    ADMIN,
    CANCEL,
    READ,
    REPLY,
    SUBMIT,
    Credential,
    CredentialStore,
    token_prefix,
)
from agentruns.connectors.api.errors import ApiError
from agentruns.connectors.api.listing import RunFilter
from agentruns.connectors.api.operator import ACTIONS, allowed
from agentruns.connectors.api.service import ApiService, _state_of
from agentruns.connectors.errors import AgentrunsError
from agentruns.processors.diagram import edges
from agentruns.processors.state import TERMINAL, RunState, RunStatus
from agentruns.streams.clock import datetime_of, ms_of

UI_PREFIX = "/ui"
SESSION_COOKIE = "agentruns_console"
LOGIN_COOKIE = "agentruns_console_login"
SESSION_MS = 12 * 3600 * 1000
#: The most events a run page shows (the API pages through more with /runs/{id}/events).
MAX_EVENTS = 2000
#: The newest steps whose frozen context, model output and tool results a run page lists.
MAX_STEPS = 50
#: The steps a transcript shows at most (its oldest ones; a longer run says where it stops).
TRANSCRIPT_STEPS = 200
#: Artifacts larger than this are not read for a transcript (their refs are linked).
TRANSCRIPT_ARTIFACT_BYTES = 1 << 20
#: Dead letters per page (newest first; older ones through the page's cursor).
DEAD_LETTERS_PAGE = 100
#: Error classes offered by the dead-letter filter.
MAX_CLASSES = 100
PREVIEW_BYTES = 512
MAX_FORM_BYTES = 256 * 1024
BAD_CSRF = "missing or wrong CSRF token"
#: How long the runs page's charts are reused before they are read again.
CHARTS_TTL_MS = 10_000
log = logging.getLogger("agentruns.api")

#: Wrong tokens a client address may post to the login form per LOGIN_WINDOW_MS.
LOGIN_FAILURES = 5
LOGIN_WINDOW_MS = 60_000
#: Addresses whose failures are remembered; past it the one that failed longest ago goes.
LOGIN_ADDRESSES = 10_000
#: Wrong credentials from all addresses together in LOGIN_WINDOW_MS beyond which every
#: address waits (a global back-off): many addresses, or every user behind a proxy whose
#: address the API does not trust (FORWARDED_ALLOW_IPS), cannot guess faster than this.
GLOBAL_LOGIN_FAILURES = 200

_HERE = Path(__file__).parent
_ENV = Environment(
    loader=FileSystemLoader(_HERE / "templates"),
    autoescape=select_autoescape(["html"], default=True),
    trim_blocks=True,
    lstrip_blocks=True,
)
_SCRIPT = (_HERE / "static" / "console.js").read_bytes()
_STYLE = (_HERE / "static" / "console.css").read_bytes()
_SECURITY_HEADERS = {
    # nothing but the console's own script and style, never framed
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self';"
    " script-src 'self'; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _mac(secret: bytes, purpose: str, value: str) -> str:
    return _b64(hmac.new(secret, f"console.{purpose}.{value}".encode(), hashlib.sha256).digest())


class Sessions:
    """Signed session cookies, each bound to the credential that opened it, and the CSRF
    tokens bound to them.

    A session id is ``<random>~<credential id, base64url>~<credential fingerprint>``, inside
    the signed part: a session is valid only while the credentials hold a credential of that
    id with that fingerprint, so removing the credential, changing its token, its tenant or
    its roles ends its sessions at once (`Credential.fingerprint`)."""

    def __init__(
        self, secret: bytes, clock: Callable[[], int], credentials: CredentialStore
    ) -> None:
        self.secret = secret
        self.clock = clock
        self.credentials = credentials

    def new(self, credential: Credential) -> str:
        """A session cookie opened with ``credential``."""
        nonce = "~".join(
            (secrets.token_urlsafe(16), _b64(credential.id.encode()), credential.fingerprint)
        )
        body = f"{self.clock() + SESSION_MS}.{nonce}"
        return f"{body}.{_mac(self.secret, 'session', body)}"

    def credential(self, session: str) -> Credential | None:
        """The credential of a session (`valid`'s value) while it is held unchanged."""
        parts = session.split("~")
        if len(parts) != 3:
            return None
        try:
            cid = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)).decode()
        except (ValueError, UnicodeDecodeError):
            return None
        found = self.credentials.get(cid)
        if found is None or not hmac.compare_digest(found.fingerprint, parts[2]):
            return None  # removed, rotated, or its tenant or roles changed
        return found

    def valid(self, cookie: str | None) -> str | None:
        """The session id of a valid, unexpired cookie whose credential is still held as it
        was; None otherwise. (Whether it was logged out is the console's revocation store's
        to say.)"""
        if not cookie or cookie.count(".") != 2 or len(cookie) > 1024:
            return None
        expires, nonce, mac = cookie.split(".")
        body = f"{expires}.{nonce}"
        if not hmac.compare_digest(mac, _mac(self.secret, "session", body)):
            return None
        if not expires.isdigit() or int(expires) <= self.clock():
            return None
        if self.credential(nonce) is None:
            return None
        return nonce

    def csrf(self, session: str) -> str:
        return _mac(self.secret, "csrf", session)

    def csrf_ok(self, session: str, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self.csrf(session).encode())


class LoginLimiter:
    """Failed logins per client address in a sliding window, in a table of at most
    `capacity` addresses (each holding at most `failures` times); and all of them together:
    past `global_failures` in the window every address waits (the global back-off)."""

    def __init__(
        self,
        clock: Callable[[], int],
        failures: int = LOGIN_FAILURES,
        window_ms: int = LOGIN_WINDOW_MS,
        capacity: int = LOGIN_ADDRESSES,
        global_failures: int = GLOBAL_LOGIN_FAILURES,
    ) -> None:
        self.clock = clock
        self.failures = failures
        self.window_ms = window_ms
        self.capacity = capacity
        self.global_failures = global_failures
        self._failed: OrderedDict[str, deque[int]] = OrderedDict()
        # the times of the latest `global_failures` failures, from any address
        self._all: deque[int] = deque(maxlen=global_failures)
        self._backing_off = False

    def __len__(self) -> int:
        return len(self._failed)

    def retry_after(self, address: str) -> int | None:
        """Seconds until `address` may try again; None when it may now."""
        everyone = self._global_wait()
        if everyone is not None:
            return everyone
        times = self._failed.get(address)
        if times is None:
            return None
        now = self.clock()
        while times and times[0] <= now - self.window_ms:
            times.popleft()
        if not times:
            del self._failed[address]
            return None
        if len(times) < self.failures:
            return None
        return max(1, math.ceil((times[0] + self.window_ms - now) / 1000))

    def _global_wait(self) -> int | None:
        """Seconds until the failures of all addresses are back under `global_failures` in
        the window; None when they are."""
        now = self.clock()
        full = len(self._all) >= self.global_failures
        if not full or self._all[0] <= now - self.window_ms:
            self._backing_off = False
            return None
        if not self._backing_off:
            self._backing_off = True
            log.warning(
                "%d wrong credentials from all addresses within %d s: every address waits "
                "(global back-off)",
                self.global_failures,
                self.window_ms // 1000,
            )
        return max(1, math.ceil((self._all[0] + self.window_ms - now) / 1000))

    def failed(self, address: str) -> None:
        self._all.append(self.clock())
        times = self._failed.pop(address, None) or deque(maxlen=self.failures)
        times.append(self.clock())
        self._failed[address] = times  # the newest failure last
        while len(self._failed) > self.capacity:
            self._failed.popitem(last=False)

    def succeeded(self, address: str) -> None:
        self._failed.pop(address, None)


def _session_hash(session: str) -> str:
    return hashlib.sha256(session.encode()).hexdigest()


def _address(request: Request) -> str:
    return request.client.host if request.client is not None else ""


def _page(name: str, status: int = 200, **context: Any) -> HTMLResponse:
    html = _ENV.get_template(name).render(prefix=UI_PREFIX, **context)
    return HTMLResponse(html, status_code=status, headers=_SECURITY_HEADERS)


async def _form(request: Request) -> dict[str, str]:
    """The fields of an urlencoded form (the only kind the console's forms post), read up to
    MAX_FORM_BYTES; a larger or undecodable body is a 413 / 400 `ApiError`."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_FORM_BYTES:
            raise ApiError(413, "body_too_large", f"form over {MAX_FORM_BYTES} bytes")
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode()
        return dict(parse_qsl(text, keep_blank_values=True, strict_parsing=False))
    except (UnicodeDecodeError, ValueError):
        raise ApiError(400, "invalid_form", "the form is not UTF-8 urlencoded") from None


def _fragment(request: Request) -> bool:
    return request.headers.get("x-console-fragment") == "live"


def _ago(ms: int | None, now: int) -> str:
    if ms is None:
        return ""
    s = max(0, (now - ms) // 1000)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def _duration(ms: int | None) -> str:
    if ms is None:
        return ""
    if ms < 1000:
        return f"{ms} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    return f"{ms / 60_000:.1f} min"


def _when(ms: int | None) -> str:
    if ms is None:
        return ""
    return datetime_of(ms).strftime("%Y-%m-%d %H:%M:%S UTC")


_ENV.filters["duration"] = _duration
_ENV.filters["when"] = _when


def _usage(payload: Any) -> dict[str, int] | None:
    """A model answer's token usage (its event's ``usage``), or None for any other event."""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    if not isinstance(usage, dict):
        return None
    try:
        return {k: int(usage.get(k) or 0) for k in ("input_tokens", "output_tokens")}
    except (TypeError, ValueError):
        return None


def _refs(payload: Any) -> list[tuple[str, str]]:
    """(field, artifact ref) of every `*_ref` / `*_refs` field of an event."""
    found: list[tuple[str, str]] = []
    if isinstance(payload, dict):
        for key, value in payload.items():
            if key.endswith("_ref") and isinstance(value, str):
                found.append((key, value))
            elif key.endswith("_refs") and isinstance(value, list):
                found += [(key, v) for v in value if isinstance(v, str)]
            elif isinstance(value, dict | list):
                found += _refs(value)
    elif isinstance(payload, list):
        for item in payload:
            found += _refs(item)
    return found


_PRINTABLE = set(string.printable) - set("\t\n\r\x0b\x0c")


def preview(data: bytes | None, limit: int = PREVIEW_BYTES) -> dict[str, Any]:
    """Hex and printable text of the first `limit` bytes (a dot for anything else): shown as
    text, never interpreted."""
    if data is None:
        return {"hex": "", "text": "", "size": 0, "cut": False}
    head = data[:limit]
    lines = []
    for i in range(0, len(head), 16):
        chunk = head[i : i + 16]
        text = "".join(chr(b) if chr(b) in _PRINTABLE else "." for b in chunk)
        lines.append(f"{i:08x}  {chunk.hex(' '):<47}  {text}")
    return {
        "hex": "\n".join(lines),
        "text": "".join(chr(b) if chr(b) in _PRINTABLE else "." for b in head),
        "size": len(data),
        "cut": len(data) > limit,
    }


def _form_response(schema: dict[str, Any], form: dict[str, str]) -> dict[str, Any]:
    """The reply object of the question form, typed by the response schema's properties; the
    schema check itself stays in `ApiService.reply`."""
    out: dict[str, Any] = {}
    for name, spec in (schema.get("properties") or {}).items():
        raw = form.get(f"field.{name}", "")
        if raw == "":
            continue
        kind = spec.get("type") if isinstance(spec, dict) else None
        try:
            if kind == "boolean":
                out[name] = raw == "true"
            elif kind == "integer":
                out[name] = int(raw)
            elif kind == "number":
                out[name] = float(raw)
            elif kind == "string":
                out[name] = raw
            else:
                out[name] = json.loads(raw)
        except ValueError:
            raise ApiError(
                422, "response_invalid", f"{name}: {raw[:40]!r} is not a valid {kind or 'JSON'}"
            ) from None
    return out


def _fields(schema: dict[str, Any]) -> list[dict[str, Any]]:
    required = set(schema.get("required") or ())
    out = []
    for name, spec in (schema.get("properties") or {}).items():
        spec = spec if isinstance(spec, dict) else {}
        kind = spec.get("type")
        widget = "json"
        if kind == "boolean":
            widget = "boolean"
        elif kind in ("integer", "number"):
            widget = "number"
        elif kind == "string":
            widget = "enum" if spec.get("enum") else "text"
        out.append(
            {
                "name": name,
                "widget": widget,
                "enum": spec.get("enum") or [],
                "description": spec.get("description") or "",
                "required": name in required,
            }
        )
    return out


def _dead_letter_cursor(row: dict[str, Any]) -> str:
    key = [
        row["at"].isoformat(),
        row["source_topic"],
        row["source_partition"],
        row["source_offset"],
    ]
    return _b64(json.dumps(key).encode())


def _of_dead_letter_cursor(cursor: str) -> tuple[datetime, str, int, int]:
    """The position a dead-letter page's cursor names; anything else is a 400 `ApiError`."""
    try:
        raw = base64.urlsafe_b64decode(cursor[:2000] + "=" * (-len(cursor) % 4))
        at, topic, partition, offset = json.loads(raw)
        if not (isinstance(topic, str) and type(partition) is int and type(offset) is int):
            raise ValueError(cursor)
        if not (-(2**31) <= partition < 2**31 and -(2**63) <= offset < 2**63):
            raise ValueError(cursor)
        return datetime.fromisoformat(at), topic, partition, offset
    except (ValueError, TypeError):
        raise ApiError(400, "invalid_parameter", "cursor is not one this page made") from None


def _diagram(current: str) -> dict[str, Any]:
    """The state diagram from the transition table (`agentruns.processors.diagram.edges`), laid
    out on a circle, as SVG shapes."""
    states = [s.value for s in RunStatus]
    cx, cy, rx, ry = 410, 240, 320, 205
    pos = {
        s: (
            cx + rx * math.cos(2 * math.pi * i / len(states) - math.pi / 2),
            cy + ry * math.sin(2 * math.pi * i / len(states) - math.pi / 2),
        )
        for i, s in enumerate(states)
    }
    lines = [
        {
            "x1": round(pos[a.value][0]),
            "y1": round(pos[a.value][1]),
            "x2": round(pos[b.value][0]),
            "y2": round(pos[b.value][1]),
            "from_current": a.value == current,
        }
        for (a, b) in edges()
    ]
    nodes = [
        {"name": s, "x": round(x), "y": round(y), "current": s == current}
        for s, (x, y) in pos.items()
    ]
    return {"lines": lines, "nodes": nodes}


class Console:
    """The console's pages over one `ApiService`."""

    def __init__(self, service: ApiService) -> None:
        self.service = service
        config = service.config
        self.sessions = Sessions(config.keys.console, service.clock, service.credentials)
        # wrong credentials per client address and per their first characters, shared with
        # the JSON API's check (agentruns.connectors.api.http._Auth)
        self.logins = LoginLimiter(service.clock)
        self.prefixes = LoginLimiter(service.clock)
        self._charts_lock = threading.Lock()
        self._charts_made: tuple[int, dict[str, Any]] | None = None  # (when, charts)

    # ------------------------------------------------------------------ access

    def _session(self, request: Request) -> str | None:
        return self.sessions.valid(request.cookies.get(SESSION_COOKIE))

    def _revoked(self, session: str) -> bool:
        """Whether ``session`` was logged out (in Postgres: every API process sees it)."""
        with self.service.db.connection() as conn:
            row = conn.execute(
                "SELECT 1 FROM console_revoked_sessions WHERE session_hash = %s",
                (_session_hash(session),),
            ).fetchone()
        return row is not None

    def _revoke(self, session: str) -> None:
        """Record ``session`` as logged out until its cookie would have expired anyway, and
        forget the log-outs whose cookies have (the table holds at most SESSION_MS of them)."""
        now = self.service.clock()
        with self.service.db.connection() as conn, conn.transaction():
            conn.execute(
                "DELETE FROM console_revoked_sessions WHERE expires_at < %s", (datetime_of(now),)
            )
            conn.execute(
                "INSERT INTO console_revoked_sessions (session_hash, expires_at) VALUES (%s, %s)"
                " ON CONFLICT (session_hash) DO NOTHING",
                (_session_hash(session), datetime_of(now + SESSION_MS)),
            )

    def guarded(
        self, fn: Callable[[Request, str], Awaitable[Response]], role: str | None
    ) -> Callable[[Request], Awaitable[Response]]:
        """A page that needs a session (and, for a POST, its CSRF token) whose credential
        holds ``role`` (None: any session); the credential is `request.state.credential`."""

        async def handle(request: Request) -> Response:
            session = await run_in_threadpool(self._session, request)
            try:
                if session is not None and await run_in_threadpool(self._revoked, session):
                    session = None  # logged out
            except ApiError as exc:
                return _page("error.html", exc.status, message=str(exc), csrf="")
            except AgentrunsError as exc:
                return _page("error.html", 503, message=exc.one_line(), csrf="")
            if session is None:
                if request.method == "GET" and not _fragment(request):
                    return RedirectResponse(f"{UI_PREFIX}/login", status_code=303)
                return _page("error.html", 401, message="log in first", csrf="")
            csrf = self.sessions.csrf(session)
            credential = self.sessions.credential(session)
            if credential is None:  # dropped since the cookie was checked
                return _page("error.html", 401, message="log in first", csrf="")
            request.state.credential = credential
            if role is not None and not credential.may(role):
                message = f"insufficient_scope: this page needs a credential with the {role} role"
                return _page("error.html", 403, message=message, csrf=csrf)
            try:
                if request.method == "POST":
                    request.state.form = await _form(request)
                    given = request.state.form.get("csrf", "")
                    if not self.sessions.csrf_ok(session, given):
                        return _page(
                            "error.html", 403, message="missing or wrong CSRF token", csrf=""
                        )
                return await fn(request, session)
            except ApiError as exc:
                return _page("error.html", exc.status, message=str(exc), csrf=csrf)
            except AgentrunsError as exc:
                return _page("error.html", 503, message=exc.one_line(), csrf=csrf)

        return handle

    async def login_form(self, request: Request) -> Response:
        nonce = request.cookies.get(LOGIN_COOKIE) or secrets.token_urlsafe(16)
        response = _page(
            "login.html", csrf=_mac(self.sessions.secret, "login", nonce), error=None, csrf_ok=True
        )
        self._cookie(request, response, LOGIN_COOKIE, nonce, 600)
        return response

    async def login(self, request: Request) -> Response:
        try:
            form = await _form(request)
        except ApiError as exc:
            return _page("error.html", exc.status, message=str(exc), csrf="")
        nonce = request.cookies.get(LOGIN_COOKIE, "")
        given, token = form.get("csrf"), form.get("token")
        expected = _mac(self.sessions.secret, "login", nonce)
        if not nonce or not isinstance(given, str) or not hmac.compare_digest(given, expected):
            return _page("error.html", 403, message=BAD_CSRF, csrf="")
        address = _address(request)
        wait_s = self.logins.retry_after(address)
        if wait_s is not None:  # refused before the token is compared, right or wrong
            refused = _page("login.html", 429, csrf=expected, error="too many wrong tokens")
            refused.headers["Retry-After"] = str(wait_s)
            return refused
        prefix = token_prefix(token) if isinstance(token, str) else ""
        wait_s = self.prefixes.retry_after(prefix) if prefix else None
        if wait_s is not None:
            refused = _page("login.html", 429, csrf=expected, error="too many wrong tokens")
            refused.headers["Retry-After"] = str(wait_s)
            return refused
        credential = None
        if isinstance(token, str):
            credential = await run_in_threadpool(self.service.credentials.lookup, token)
        if credential is None:
            self.logins.failed(address)
            if prefix:
                self.prefixes.failed(prefix)
            return _page("login.html", 401, csrf=expected, error="wrong token")
        self.logins.succeeded(address)
        response = RedirectResponse(f"{UI_PREFIX}/runs", status_code=303)
        session = self.sessions.new(credential)
        self._cookie(request, response, SESSION_COOKIE, session, SESSION_MS // 1000)
        self._cookie(request, response, LOGIN_COOKIE, "", 0)
        return response

    async def logout(self, request: Request, session: str) -> Response:
        await run_in_threadpool(self._revoke, session)  # the cookie ends on the server too
        response = RedirectResponse(f"{UI_PREFIX}/login", status_code=303)
        self._cookie(request, response, SESSION_COOKIE, "", 0)
        return response

    def _cookie(
        self, request: Request, response: Response, name: str, value: str, max_age: int
    ) -> None:
        """Set (or, with max_age 0, delete) a console cookie: Secure when the request came
        over https or the setting says TLS ends in front of the API."""
        response.set_cookie(
            name,
            value,
            max_age=max_age,
            path=UI_PREFIX,
            httponly=True,
            samesite="strict",
            secure=self.service.config.secure_cookies or request.url.scheme == "https",
        )

    # ------------------------------------------------------------------ pages

    async def index(self, request: Request) -> Response:
        return RedirectResponse(f"{UI_PREFIX}/runs", status_code=303)

    async def runs(self, request: Request, session: str) -> Response:
        query = dict(request.query_params)
        caller = _caller(request)
        f = RunFilter.of_query(query, caller)
        page = await run_in_threadpool(self.service.list_runs, f)
        # the charts count every tenant's runs: an admin's only
        charts = None
        if caller.admin and not _fragment(request):
            charts = await run_in_threadpool(self._recent_charts)
        now = self.service.clock()
        for run in page["runs"]:
            run["age"] = _ago(run["started_at"], now)
            run["idle"] = _ago(run["last_event_at"], now)
        kept = {k: v for k, v in query.items() if k != "cursor" and v}
        version = hashlib.sha256(
            json.dumps(
                [[r["run_id"], r["last_seq"], r["status"]] for r in page["runs"]] + [page["counts"]]
            ).encode()
        ).hexdigest()[:16]
        context: dict[str, Any] = {
            "page": page,
            "query": query,
            "statuses": [s.value for s in RunStatus],
            "next_url": None
            if page["next_cursor"] is None
            else f"?{urlencode({**kept, 'cursor': page['next_cursor']})}",
            "charts": charts,
            "version": version,
            "csrf": self.sessions.csrf(session),
            "caller": caller,
        }
        if _fragment(request):
            return _page("_runs_live.html", **context)
        return _page("runs.html", **context)

    def _recent_charts(self) -> dict[str, Any]:
        """`_charts`, made at most once per CHARTS_TTL_MS: per-minute figures of the last hour
        need not be read again for every page load (two aggregates over an hour of events)."""
        now = self.service.clock()
        with self._charts_lock:
            made = self._charts_made
            if made is not None and now - made[0] < CHARTS_TTL_MS:
                return made[1]
        charts = self._charts()
        with self._charts_lock:
            self._charts_made = (now, charts)
        return charts

    def _charts(self) -> dict[str, Any]:
        """Runs finished per minute by status (from the runs table), and the p50 and p95 step
        latency per minute (from the events table), over the last hour."""
        with self.service.db.connection() as conn:
            rows = queries.finished_per_minute(conn)
            latency = queries.step_latency(conn, self.service.clock())
        finished: dict[int, dict[str, int]] = {}
        for slot, status, n in rows:
            if 0 <= slot < 60:
                finished.setdefault(slot, {})[status] = int(n)
        colors = {"SUCCEEDED": "ok", "FAILED": "bad", "CANCELLED": "warn"}
        top = max([sum(v.values()) for v in finished.values()] or [1])
        bars = []
        for slot, per in sorted(finished.items()):
            y = 100.0
            for status, n in sorted(per.items()):
                h = 100.0 * n / top
                y -= h
                klass = colors.get(status, "other")
                bars.append(
                    {"x": slot * 10, "y": round(y, 1), "h": round(h, 1), "class": klass, "n": n}
                )
                bars[-1]["title"] = f"{n} {status}"
        per_minute = {slot: (p50, p95, n) for slot, p50, p95, n in latency if 0 <= slot < 60}
        peak = max([p95 for _, p95, _ in per_minute.values()] or [1.0]) or 1.0
        lines: dict[str, list[dict[str, Any]]] = {"p50": [], "p95": []}
        for slot, (p50, p95, n) in sorted(per_minute.items()):
            for name, ms in (("p50", p50), ("p95", p95)):
                lines[name].append(
                    {
                        "x": slot * 10 + 5,
                        "y": round(95 - 90 * ms / peak, 1),
                        "title": f"{name} {_duration(int(ms))} over {n} steps",
                    }
                )
        return {
            "bars": bars,
            "top": top,
            "latency": [
                {
                    "name": name,
                    "points": " ".join(f"{d['x']},{d['y']}" for d in dots),
                    "dots": dots,
                }
                for name, dots in lines.items()
            ],
            "peak": _duration(int(peak)),
            "steps": sum(n for _, _, n in per_minute.values()),
            "total": sum(sum(v.values()) for v in finished.values()),
        }

    def _run_page(self, run_id: str, tenant: str | None) -> dict[str, Any]:
        service = self.service
        view = service.get_run(run_id, tenant)
        with service.db.connection() as conn:
            events = queries.run_events(conn, run_id, MAX_EVENTS)
        run = service.run_row(run_id)
        state = None if run is None else _state_of(run)
        for e in events:
            e["refs"] = _refs(e["payload"])
            e["usage"] = _usage(e["payload"])
            e["at_text"] = e["at"].strftime("%H:%M:%S.%f")[:-3]
        waits = view.get("waits") or {}
        split = [
            ("system", int(waits.get("system_ms") or 0)),
            ("tool", int(waits.get("tool_wait_ms") or 0)),
            ("user", int(waits.get("user_wait_ms") or 0)),
        ]
        current = waits.get("current")
        if current:
            split = [
                (k, v + (current["ms"] if k == current["waiting_for"] else 0)) for k, v in split
            ]
        total = sum(v for _, v in split) or 1
        budgets: list[dict[str, Any]] = []
        artifacts: list[tuple[str, str]] = []
        steps: list[dict[str, Any]] = []
        older: int | None = None
        timers: list[dict[str, Any]] = []
        if state is not None:
            b = state.config.budgets
            usage = view.get("usage") or {}
            tokens = int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0))
            for name, used, limit in (
                ("steps", state.step, b.max_steps),
                ("tokens", tokens, b.max_tokens),
                ("cost (micros)", int(usage.get("cost_micros", 0)), b.max_cost_micros),
                ("tool calls", int(usage.get("tool_calls", 0)), b.max_tool_calls),
                ("events", state.version, state.config.loop.max_events),
            ):
                pct = None if not limit else min(100, round(100 * used / limit))
                budgets.append({"name": name, "used": used, "limit": limit, "pct": pct})
            artifacts = [("run configuration", state.config.config_ref)]
            steps, older = self._steps(state)
            if state.memory_ref:
                artifacts.append(("memory", state.memory_ref))
            timers = [
                {"timer_id": t.timer_id, "purpose": t.purpose, "due_at": t.due_at}
                for t in state.timers
            ]
        question = view.get("question")
        return {
            "run": view,
            "actions": None if state is None else allowed(state),
            "pause_reason": state.outcome
            if state is not None and state.status is RunStatus.PAUSED
            else None,
            "events": events,
            "split": [{"name": k, "ms": v, "pct": round(100 * v / total, 1)} for k, v in split],
            "budgets": budgets,
            "artifacts": artifacts,
            "steps": steps,
            "older_steps": older,
            "timers": timers,
            "fields": _fields(question["response_schema"]) if question else [],
            "diagram": _diagram(view["status"]),
            "result_json": None
            if not view.get("result")
            else json.dumps(view["result"].get("content"), indent=2, ensure_ascii=False),
            "question_json": None
            if not question
            else json.dumps(question.get("content"), indent=2, ensure_ascii=False),
            "terminal": view["status"] in {s.value for s in TERMINAL},
            "version": f"{view.get('last_seq')}-{view['status']}",
        }

    def _steps(self, state: RunState) -> tuple[list[dict[str, Any]], int | None]:
        """The newest MAX_STEPS steps of the frozen context chain, newest first: each step's
        context, its model output and its tool results (the refs the NEXT context names, or
        the state's for the current step), in one query that walks `previous_context` in
        Postgres. Also the step of the newest context left out, if the chain goes on."""
        if not state.context_ref:
            return [], None
        try:
            with self.service.db.connection() as conn:
                rows = queries.context_chain(conn, state.context_ref, MAX_STEPS)
        except psycopg.DataError:  # an artifact of the chain is not JSON: list none of it
            return [], None
        steps: list[dict[str, Any]] = []
        candidate, inputs = state.candidate_ref, list(state.step_inputs)
        for ref, step, doc in rows[:MAX_STEPS]:
            steps.append(
                {
                    "step": step if isinstance(step, int) else "?",
                    "context": ref,
                    "candidate": candidate,
                    "results": [
                        i for i in inputs if isinstance(i, str) and i.startswith("sha256:")
                    ],
                }
            )
            doc = doc if isinstance(doc, dict) else {}
            previous = doc.get("previous_candidate")
            candidate = previous if isinstance(previous, str) else None
            listed = doc.get("inputs")
            inputs = listed if isinstance(listed, list) else []
        older = None
        if len(rows) > MAX_STEPS:
            step = rows[MAX_STEPS][1]
            older = step if isinstance(step, int) else 0
        return steps, older

    async def run(self, request: Request, session: str, error: ApiError | None = None) -> Response:
        run_id = request.path_params["run_id"]
        caller = _caller(request)
        context = await run_in_threadpool(self._run_page, run_id, caller.tenant_scope)
        context["csrf"] = self.sessions.csrf(session)
        context["operator"] = caller.id if caller.admin else None
        context["caller"] = caller
        context["error"] = None if error is None else f"{error.code}: {error}"
        if _fragment(request):
            return _page("_run_live.html", **context)
        return _page("run.html", 200 if error is None else error.status, **context)

    async def reply(self, request: Request, session: str) -> Response:
        run_id = request.path_params["run_id"]
        form: dict[str, str] = request.state.form
        tenant = _caller(request).tenant_scope
        try:
            view = await run_in_threadpool(self.service.get_run, run_id, tenant)
            question = view.get("question") or {}
            response = _form_response(question.get("response_schema") or {}, form)
            body = {"resume_token": form.get("resume_token", ""), "response": response}
            await run_in_threadpool(self.service.reply, run_id, body, tenant)
        except ApiError as exc:
            return await self.run(request, session, exc)
        return RedirectResponse(f"{UI_PREFIX}/runs/{run_id}", status_code=303)

    async def cancel(self, request: Request, session: str) -> Response:
        run_id = request.path_params["run_id"]
        reason = request.state.form.get("reason", "")
        body = {"reason": reason or "cancelled in console"}
        try:
            tenant = _caller(request).tenant_scope
            await run_in_threadpool(self.service.cancel, run_id, body, None, tenant)
        except ApiError as exc:
            return await self.run(request, session, exc)
        return RedirectResponse(f"{UI_PREFIX}/runs/{run_id}", status_code=303)

    def operator_action(self, action: str) -> Callable[[Request, str], Awaitable[Response]]:
        """A form of the run page's operator section: the same code as
        `POST /runs/{id}/<action>`, as the session's credential (an admin: `CONSOLE_ROUTES`)."""

        async def handle(request: Request, session: str) -> Response:
            run_id = request.path_params["run_id"]
            form: dict[str, str] = request.state.form
            body: dict[str, Any] = {"reason": form.get("reason") or f"{action} in console"}
            if action == "resolve":
                body["action"] = form.get("action", "")
                for name in ("outcome", "operation_key"):
                    if form.get(name):
                        body[name] = form[name]
            if action == "reopen" and form.get("goal"):
                body["goal"] = form["goal"]
            try:
                await run_in_threadpool(
                    self.service.operator_action,
                    action,
                    run_id,
                    body,
                    None,
                    _caller(request).actor,
                )
            except ApiError as exc:
                return await self.run(request, session, exc)
            return RedirectResponse(f"{UI_PREFIX}/runs/{run_id}", status_code=303)

        return handle

    def fork_action(self, action: str) -> Callable[[Request, str], Awaitable[Response]]:
        """The run page's fork and resume forms: the same code as `POST /runs/{id}/fork|resume`
        as the session's credential, of its tenant; on success, the fork's page."""

        async def handle(request: Request, session: str) -> Response:
            run_id = request.path_params["run_id"]
            caller = _caller(request)
            form: dict[str, str] = request.state.form
            body: dict[str, Any] = {}
            if action == "fork":
                at = form.get("at", "")
                body["at"] = int(at) if at.isdigit() and len(at) < 12 else at
                if form.get("model_route"):
                    body["model_route"] = form["model_route"]
            try:
                out = await run_in_threadpool(
                    self.service.fork,
                    action,
                    run_id,
                    body,
                    None,
                    caller.actor,
                    caller.tenant_scope,
                )
            except ApiError as exc:
                return await self.run(request, session, exc)
            return RedirectResponse(f"{UI_PREFIX}/runs/{out['run_id']}", status_code=303)

        return handle

    async def artifact(self, request: Request, session: str) -> Response:
        ref = request.path_params["ref"]

        def read() -> tuple[str, int, bytes] | None:
            with self.service.db.connection() as conn:
                return queries.artifact(conn, ref)

        found = await run_in_threadpool(read)
        if found is None:
            raise ApiError(404, "artifact_not_found", f"no artifact {ref}")
        media_type, size, content = found
        try:
            text = content.decode()
            with contextlib.suppress(ValueError):
                text = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
        except UnicodeDecodeError:
            text = preview(content, 64 * 1024)["hex"]
        return _page(
            "artifact.html",
            ref=ref,
            media_type=media_type,
            size=size,
            text=text,
            csrf=self.sessions.csrf(session),
            caller=_caller(request),
        )

    def _transcript(self, run_id: str, tenant: str | None) -> dict[str, Any]:
        service = self.service
        view = service.get_run(run_id, tenant)  # 404 for a run not there or not the tenant's
        run = service.run_row(run_id)
        state = None if run is None else _state_of(run)
        with service.db.connection() as conn:
            events = queries.run_events(conn, run_id, MAX_EVENTS)
            operations = queries.run_operations(conn, run_id)
            questions = queries.run_questions(conn, run_id)
            chain: list[tuple[str, Any, Any]] = []
            if state is not None and state.context_ref:
                with contextlib.suppress(psycopg.DataError):  # not JSON: no messages shown
                    chain = queries.context_chain(conn, state.context_ref, TRANSCRIPT_STEPS)
            docs = [doc for _, _, doc in chain]
            artifacts = queries.json_artifacts(
                conn, transcript.artifacts_named(docs, operations), TRANSCRIPT_ARTIFACT_BYTES
            )
        artifacts.update({ref: doc for ref, _, doc in chain})
        oldest_first = [(ref, step) for ref, step, _ in reversed(chain)]
        steps = transcript.build(events, operations, questions, oldest_first, artifacts)
        return {
            "run": view,
            "actions": None if state is None else allowed(state),
            "steps": steps[:TRANSCRIPT_STEPS],
            "more_steps": len(steps) > TRANSCRIPT_STEPS,
            "events_cut": len(events) >= MAX_EVENTS,
            "terminal": view["status"] in {s.value for s in TERMINAL},
        }

    async def transcript_page(self, request: Request, session: str) -> Response:
        """The run's conversation step by step (`agentruns.connectors.api.transcript`)."""
        caller = _caller(request)
        run_id = request.path_params["run_id"]
        context = await run_in_threadpool(self._transcript, run_id, caller.tenant_scope)
        context["operator"] = caller.id if caller.admin else None
        context["caller"] = caller
        return _page("transcript.html", csrf=self.sessions.csrf(session), **context)

    async def tools_page(self, request: Request, session: str) -> Response:
        """The operator's tool catalog the API holds tasks to (none: tasks declare their own)."""
        catalog = self.service.config.catalog
        tools = []
        if catalog is not None:
            for name in sorted(catalog.tools):
                tool = catalog.tools[name]
                schema = json.dumps(tool.parameters, indent=2, sort_keys=True)
                tools.append({"name": name, "tool": tool, "schema": schema})
        return _page(
            "tools.html",
            version=None if catalog is None else catalog.version,
            tools=tools,
            csrf=self.sessions.csrf(session),
            caller=_caller(request),
        )

    async def dead_letter_page(self, request: Request, session: str) -> Response:
        reason = request.query_params.get("reason", "").strip()[:400]
        cursor = request.query_params.get("cursor") or None
        rows, classes, more = await run_in_threadpool(self._read_dead_letters, reason, cursor)
        shown = []
        for d in rows:
            key, value = preview(d["original_key"], 64), preview(d["original_value"])
            key["size"], value["size"] = d["key_bytes"], d["value_bytes"]
            value["cut"] = d["value_bytes"] > PREVIEW_BYTES
            shown.append(
                {
                    "reason": d["reason"],
                    "error_class": d["error_class"],
                    "source": f"{d['source_topic']}/{d['source_partition']}/{d['source_offset']}",
                    "at": ms_of(d["at"]),
                    "run_id": d["run_id"],
                    "key": key,
                    "value": value,
                }
            )
        next_url = None
        if more and rows:
            kept = {"reason": reason} if reason else {}
            next_url = f"?{urlencode({**kept, 'cursor': _dead_letter_cursor(rows[-1])})}"
        return _page(
            "dead_letters.html",
            rows=shown,
            reason=reason,
            classes=classes,
            next_url=next_url,
            csrf=self.sessions.csrf(session),
            caller=_caller(request),
        )

    def _read_dead_letters(
        self, reason: str, cursor: str | None
    ) -> tuple[list[dict[str, Any]], list[str], bool]:
        """One page of the `dead_letters` table (the sink's projection of `<prefix>.dlq`),
        newest first, after `cursor`; `reason` is an error class (through its index) or else
        a piece of the reason. Returns (rows, the error classes there are, whether more)."""
        with self.service.db.connection() as conn:
            classes = queries.dead_letter_classes(conn, MAX_CLASSES)
            known = reason in classes or (
                bool(reason) and queries.dead_letter_class_exists(conn, reason)
            )
            before = None if cursor is None else _of_dead_letter_cursor(cursor)
            rows = queries.dead_letters_page(
                conn,
                error_class=reason if known else None,
                reason_piece=reason,
                before=before,
                limit=DEAD_LETTERS_PAGE + 1,
            )
        return rows[:DEAD_LETTERS_PAGE], classes, len(rows) > DEAD_LETTERS_PAGE

    async def script(self, request: Request) -> Response:
        return Response(_SCRIPT, media_type="text/javascript", headers=_SECURITY_HEADERS)

    async def style(self, request: Request) -> Response:
        return Response(_STYLE, media_type="text/css", headers=_SECURITY_HEADERS)

    def routes(self) -> list[Route]:
        handlers: dict[str, Callable[[Request, str], Awaitable[Response]]] = {
            "logout": self.logout,
            "runs": self.runs,
            "run": self.run,
            "transcript": self.transcript_page,
            "reply": self.reply,
            "cancel": self.cancel,
            **{action: self.operator_action(action) for action in ACTIONS},
            "fork": self.fork_action("fork"),
            "resume": self.fork_action("resume"),
            "artifact": self.artifact,
            "dead_letters": self.dead_letter_page,
            "tools": self.tools_page,
        }
        open_pages: dict[str, Callable[[Request], Awaitable[Response]]] = {
            "index": self.index,
            "login_form": self.login_form,
            "login": self.login,
            "script": self.script,
            "style": self.style,
        }
        routes = []
        for method, path, name, rule in CONSOLE_ROUTES:
            if rule == OPEN:
                endpoint = open_pages[name]
            else:
                endpoint = self.guarded(handlers[name], None if rule == SESSION else rule)
            routes.append(Route(UI_PREFIX + path, endpoint, methods=[method]))
        return routes


def _caller(request: Request) -> Credential:
    """The session's credential (`Console.guarded` set it)."""
    credential = request.state.credential
    assert isinstance(credential, Credential)
    return credential


#: What a console page lets through: anyone (OPEN), any session (SESSION), or a session
#: whose credential holds a role.
OPEN, SESSION = "open", "session"
#: (method, path under UI_PREFIX, name, rule) of every console page. A run of another tenant
#: is a 404 to a credential that is not an admin. The dead letters are every tenant's, and
#: the runs page's charts count every tenant's runs: an admin's only.
CONSOLE_ROUTES: tuple[tuple[str, str, str, str], ...] = (
    ("GET", "", "index", OPEN),
    ("GET", "/", "index", OPEN),
    ("GET", "/login", "login_form", OPEN),
    ("POST", "/login", "login", OPEN),
    ("POST", "/logout", "logout", SESSION),
    ("GET", "/runs", "runs", READ),
    ("GET", "/runs/{run_id}", "run", READ),
    ("GET", "/runs/{run_id}/transcript", "transcript", READ),
    ("POST", "/runs/{run_id}/reply", "reply", REPLY),
    ("POST", "/runs/{run_id}/cancel", "cancel", CANCEL),
    *(("POST", f"/runs/{{run_id}}/{action}", action, ADMIN) for action in ACTIONS),
    ("POST", "/runs/{run_id}/fork", "fork", SUBMIT),
    ("POST", "/runs/{run_id}/resume", "resume", SUBMIT),
    ("GET", "/artifacts/{ref}", "artifact", READ),
    ("GET", "/dead-letters", "dead_letters", ADMIN),
    ("GET", "/tools", "tools", READ),
    ("GET", "/static/console.js", "script", OPEN),
    ("GET", "/static/console.css", "style", OPEN),
)

"""The HTTP layer of the API (Starlette): guard, auth, endpoints, routes and `create_app`.

Hostile input is refused at the door, before anything is stored or produced: a body over
`max_body_bytes` (413, by Content-Length at once, or counted while read), a record over
`max_record_bytes` (413), a body that is not UTF-8 JSON, nests deeper than the limits, carries an
integer a bigint cannot hold, or a task the core would refuse (422 with the reason
`invalid_input:<what>: ...`), a header or query that is not UTF-8 or holds a control character
(400). Endpoints, auth, limits and the resume-token format are documented in docs/api.md.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from agentruns.connectors.api.config import ApiConfig
from agentruns.connectors.api.console import UI_PREFIX, Console, LoginLimiter
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
from agentruns.connectors.api.errors import ApiError, invalid_input
from agentruns.connectors.api.inputs import MAX_BODY_DEPTH
from agentruns.connectors.api.listing import RunFilter
from agentruns.connectors.api.openapi import OPENAPI
from agentruns.connectors.api.service import ApiService
from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.health import DETAILED_WITH_CREDENTIAL, metrics_text, public_report
from agentruns.connectors.keys import CALLBACK_SIGNATURE_HEADER, CallbackRefused, verify_callback
from agentruns.processors.limits import json_depth
from agentruns.streams import tracing
from agentruns.streams.clock import now_ms

log = logging.getLogger("agentruns.api")


PUBLIC_PATHS = frozenset({"/readyz", "/healthz", "/livez", "/metrics", "/openapi.json"})


REQUESTS = Counter(
    "agentruns_api_requests_total", "HTTP requests answered", ["method", "route", "status"]
)
#: The values of the ``method`` label: a client may send any token as its method, and every
#: distinct label value is a new series /metrics carries for the life of the process. The
#: ``route`` label is a route's name or a fixed refusal name, never the request's path.
METHOD_LABELS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _method_label(method: str) -> str:
    return method if method in METHOD_LABELS else "other"


LATENCY = Histogram(
    "agentruns_api_request_seconds",
    "HTTP request latency",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)


def _too_large(limit: int) -> ApiError:
    return invalid_input(
        413, "body_too_large", f"invalid_input:body_too_large: request body over {limit} bytes"
    )


async def _body(request: Request, limit: int) -> bytes:
    """The request body, read as it streams in and never past `limit` bytes: a Content-Length
    over it is refused before reading, a chunked body as soon as it grows over it."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "invalid_header", "Content-Length is not a number")
        if int(declared) > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object: UTF-8, nested at most MAX_BODY_DEPTH deep (a deeper one is
    refused without recursing into it)."""
    try:
        value = msgspec.json.decode(raw or b"{}")
    except UnicodeDecodeError:
        raise invalid_input(
            422, "invalid_encoding", "invalid_input:encoding: request body is not UTF-8"
        ) from None
    except RecursionError:
        value = None
        depth = MAX_BODY_DEPTH + 1
    except msgspec.DecodeError as exc:
        raise ApiError(400, "invalid_json", f"request body is not JSON: {exc}") from None
    else:
        depth = json_depth(value, MAX_BODY_DEPTH)
    if depth > MAX_BODY_DEPTH:
        raise invalid_input(
            422, "too_deep", f"invalid_input:json_too_deep: nested deeper than {MAX_BODY_DEPTH}"
        )
    if not isinstance(value, dict):
        raise ApiError(400, "invalid_json", "request body must be a JSON object")
    return value


#: Bytes no header value or query string may hold: a header is one line, and what is read from
#: one becomes ids and trace ids in records.
_CONTROL = (frozenset(range(0x20)) - {0x09}) | {0x7F}  # a tab is whitespace in a header


def _clean(value: bytes) -> bool:
    if _CONTROL.intersection(value):
        return False
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class _Guard:
    """The outermost check of every request: header values and the query string must be UTF-8
    without control characters (400 otherwise). The HTTP server already refuses a header line
    broken by CR or LF; this also covers what it lets through (obs-text, NUL, DEL)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            bad = next((k for k, v in scope["headers"] if not _clean(v)), None)
            if bad is None and not _clean(scope.get("query_string", b"")):
                bad = b"query string"
            if bad is not None:
                what = bad.decode("latin-1")
                response = JSONResponse(
                    {
                        "error": "invalid_header",
                        "detail": f"{what} is not UTF-8 or holds a control character",
                    },
                    status_code=400,
                )
                REQUESTS.labels(_method_label(scope["method"]), "invalid_header", "400").inc()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _console(path: str) -> bool:
    """The console checks its own session cookie (`agentruns.connectors.api.console`)."""
    return path == UI_PREFIX or path.startswith(UI_PREFIX + "/")


#: The ASGI scope key `_Auth` sets to the dispatch a callback's signature was made for (the
#: callback is then refused unless that dispatch is the operation's current one); absent
#: when the callback came with a credential.
CALLBACK_DISPATCH_KEY = "agentruns.callback_dispatch"
_SIGNATURE_HEADER = CALLBACK_SIGNATURE_HEADER.lower().encode()


#: The ASGI scope key `_Auth` sets when the request's credential (or a callback's signature)
#: was checked and valid.
AUTHENTICATED_KEY = "agentruns.authenticated"


def _public(scope: Scope) -> bool:
    """A public path, but DETAILED_WITH_CREDENTIAL with an Authorization header: one that
    answers more to an admin credential (`/healthz`: its checks' error text names hosts, ports
    and user names) has the credential checked, and counted when wrong, like any other."""
    path = scope["path"]
    if path not in PUBLIC_PATHS:
        return False
    return path not in DETAILED_WITH_CREDENTIAL or not any(
        name == b"authorization" for name, _ in scope["headers"]
    )


#: The ASGI scope key `_Auth` sets to the request's `Credential`; absent for a callback
#: authenticated by its signature.
CREDENTIAL_KEY = "agentruns.credential"


def _throttled(wait_s: int, what: str) -> JSONResponse:
    return JSONResponse(
        {
            "error": "too_many_wrong_tokens",
            "detail": f"too many wrong tokens {what}: retry in {wait_s} s",
        },
        status_code=429,
        headers={"Retry-After": str(wait_s)},
    )


class _Auth:
    """Bearer-credential check for every path but PUBLIC_PATHS and the console's
    (`agentruns.connectors.api.credentials`); a callback may instead carry the operation's
    signature header (`keys.verify_callback`: the operation, the dispatch, an expiry;
    `CALLBACK_DISPATCH_KEY`). The credential goes into the scope
    (`CREDENTIAL_KEY`); what it may do there is the route's rule (`ROUTES`, `_endpoint`).

    Every wrong credential counts against the client address in ``limiter`` (the console's
    login limiter) and against its first characters in ``prefixes``: an address or a prefix
    over its budget gets 429 with Retry-After, before its credential is compared. A request
    with no credential at all is refused without counting."""

    def __init__(
        self,
        app: ASGIApp,
        credentials: CredentialStore,
        secret: bytes,
        limiter: LoginLimiter,
        prefixes: LoginLimiter,
        clock: Callable[[], int] = now_ms,
    ) -> None:
        """``secret``: the callback key (`keys.Keys.callback`)."""
        self.app = app
        self._credentials = credentials
        self._secret = secret
        self._clock = clock
        self._limiter = limiter
        self._prefixes = prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _console(scope["path"]) or _public(scope):
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        address = str(client[0]) if client else ""
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        scheme, _, presented = given.partition(b" ")
        prefix = token_prefix(presented)
        wait_s = self._limiter.retry_after(address)
        what = "from this address (or from all addresses)"
        if wait_s is None and presented:
            wait_s, what = self._prefixes.retry_after(prefix), "with this prefix"
        if wait_s is not None:  # refused before the credential is compared, right or wrong
            REQUESTS.labels(_method_label(scope["method"]), "throttled", "429").inc()
            await _throttled(wait_s, what)(scope, receive, send)
            return
        credential = None
        if scheme == b"Bearer":
            credential = await run_in_threadpool(self._credentials.lookup, presented)
        if credential is not None:
            scope[CREDENTIAL_KEY] = credential
        if credential is not None or self._callback_signed(scope):
            scope[AUTHENTICATED_KEY] = True
            await self.app(scope, receive, send)
            return
        if given or _SIGNATURE_HEADER in headers:
            # a guess, not a request without any credential (a browser's /favicon.ico): only
            # guesses spend the budgets
            self._limiter.failed(address)
            if presented:
                self._prefixes.failed(prefix)
        response = JSONResponse(
            {"error": "unauthorized", "detail": "send Authorization: Bearer <credential>"},
            status_code=401,
            headers={"WWW-Authenticate": 'Bearer realm="agentruns"'},
        )
        REQUESTS.labels(_method_label(scope["method"]), "unauthorized", "401").inc()
        await response(scope, receive, send)

    def _callback_signed(self, scope: Scope) -> bool:
        parts = str(scope["path"]).strip("/").split("/")
        if len(parts) != 3 or parts[0] != "operations" or parts[2] != "callback":
            return False
        given = dict(scope["headers"]).get(_SIGNATURE_HEADER)
        if not given:
            return False
        try:
            signature = given.decode("ascii")
            dispatch = verify_callback(self._secret, parts[1], signature, self._clock())
        except (UnicodeDecodeError, CallbackRefused):
            return False
        scope[CALLBACK_DISPATCH_KEY] = dispatch
        return True


class _ScopeError(ApiError):
    """403 for a valid credential without the role a route needs (RFC 6750
    `insufficient_scope`; the scope named is the role)."""

    def __init__(self, role: str) -> None:
        super().__init__(
            403,
            "insufficient_scope",
            f"this action needs a credential with the {role} role",
            scope=role,
        )
        self.role = role

    def response(self) -> JSONResponse:
        response = super().response()
        response.headers["WWW-Authenticate"] = (
            f'Bearer realm="agentruns", error="insufficient_scope", scope="{self.role}"'
        )
        return response


def credential_of(r: Request) -> Credential | None:
    found = r.scope.get(CREDENTIAL_KEY)
    return found if isinstance(found, Credential) else None


def _caller(r: Request) -> Credential:
    """The request's credential (every route with a role has one: `_endpoint` checked it)."""
    credential = credential_of(r)
    assert credential is not None
    return credential


Handler = Callable[[Request], Awaitable[Response]]


def _allowed(rule: str, request: Request) -> None:
    """Refuse a request its route's rule does not let through: a role the credential does
    not hold is a 403. PUBLIC routes and a callback carrying its signature were let through
    by `_Auth`; a callback with a credential instead needs the admin role."""
    credential = credential_of(request)
    if rule == PUBLIC or (rule == CALLBACK and credential is None):
        return
    rule = ADMIN if rule == CALLBACK else rule
    if credential is None or not credential.may(rule):
        raise _ScopeError(rule)


def _endpoint(
    route: str, rule: str, fn: Callable[[ApiService, Request], Awaitable[Response]]
) -> Any:
    def bind(service: ApiService) -> Handler:
        async def handle(request: Request) -> Response:
            started = time.perf_counter()
            try:
                _allowed(rule, request)  # before the body is read: a refusal costs nothing
                response = await fn(service, request)
            except ApiError as exc:
                response = exc.response()
            except AgentrunsError as exc:
                log.warning("%s %s failed: %s", request.method, route, exc)
                response = JSONResponse(
                    {"error": "unavailable", "detail": exc.one_line()}, status_code=503
                )
            REQUESTS.labels(_method_label(request.method), route, str(response.status_code)).inc()
            LATENCY.labels(route).observe(time.perf_counter() - started)
            return response

        return handle

    return bind


async def _submit(s: ApiService, r: Request) -> Response:
    body = _json_object(await _body(r, s.config.max_body_bytes))
    key = r.headers.get("idempotency-key", "")
    traceparent = r.headers.get(tracing.HEADER)
    if traceparent is not None and len(traceparent) > tracing.MAX_CHARS:
        raise ApiError(400, "invalid_header", f"traceparent over {tracing.MAX_CHARS} chars")
    out = await run_in_threadpool(
        s.submit, key, body, r.headers.get("x-trace-id"), traceparent, _caller(r)
    )
    return JSONResponse(
        out,
        status_code=202 if out["created"] else 200,
        headers={"Location": f"/runs/{out['run_id']}"},
    )


async def _list_runs(s: ApiService, r: Request) -> Response:
    f = RunFilter.of_query(dict(r.query_params), _caller(r))
    return JSONResponse(await run_in_threadpool(s.list_runs, f))


async def _get_run(s: ApiService, r: Request) -> Response:
    tenant = _caller(r).tenant_scope
    return JSONResponse(await run_in_threadpool(s.get_run, r.path_params["run_id"], tenant))


def _int_param(r: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = r.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, "invalid_parameter", f"{name} must be an integer") from None
    return max(lo, min(hi, value))


async def _events(s: ApiService, r: Request) -> Response:
    after = _int_param(r, "after_seq", 0, 0, 2**62)
    limit = _int_param(r, "limit", 500, 1, 1000)
    out = await run_in_threadpool(
        s.events, r.path_params["run_id"], after, limit, _caller(r).tenant_scope
    )
    return JSONResponse(out)


async def _reply(s: ApiService, r: Request) -> Response:
    body = _json_object(await _body(r, s.config.max_body_bytes))
    out = await run_in_threadpool(s.reply, r.path_params["run_id"], body, _caller(r).tenant_scope)
    return JSONResponse(out, status_code=202)


async def _cancel(s: ApiService, r: Request) -> Response:
    body = _json_object(await _body(r, s.config.max_body_bytes))
    key = r.headers.get("idempotency-key")
    out = await run_in_threadpool(
        s.cancel, r.path_params["run_id"], body, key, _caller(r).tenant_scope
    )
    return JSONResponse(out, status_code=202)


def _if_match_version(value: str | None) -> int | None:
    """The run version an ``If-Match`` header names (``7`` or the ETag form ``"7"``); a 400
    for anything else."""
    if value is None:
        return None
    text = value.strip().removeprefix("W/").strip('"')
    if not (text.isascii() and text.isdigit()) or len(text) > 18:  # "²" is a digit to Python
        raise ApiError(400, "invalid_header", 'If-Match takes the run\'s version, e.g. "7"')
    return int(text)


def _operator_action(
    action: str,
) -> Callable[[ApiService, Request], Awaitable[Response]]:
    async def handle(s: ApiService, r: Request) -> Response:
        body = _json_object(await _body(r, s.config.max_body_bytes))
        key = r.headers.get("idempotency-key")
        seen = _if_match_version(r.headers.get("if-match"))
        out = await run_in_threadpool(
            s.operator_action, action, r.path_params["run_id"], body, key, _caller(r).actor, seen
        )
        return JSONResponse(out, status_code=202 if out["created"] else 200)

    return handle


def _fork(action: str) -> Callable[[ApiService, Request], Awaitable[Response]]:
    async def handle(s: ApiService, r: Request) -> Response:
        caller = _caller(r)
        body = _json_object(await _body(r, s.config.max_body_bytes))
        key = r.headers.get("idempotency-key")
        out = await run_in_threadpool(
            s.fork, action, r.path_params["run_id"], body, key, caller.actor, caller.tenant_scope
        )
        return JSONResponse(out, status_code=201 if out["created"] else 200)

    return handle


async def _callback(s: ApiService, r: Request) -> Response:
    body = _json_object(await _body(r, s.config.max_body_bytes))
    dispatch = r.scope.get(CALLBACK_DISPATCH_KEY)
    status, out = await run_in_threadpool(s.callback, r.path_params["key"], body, dispatch)
    return JSONResponse(out, status_code=status)


async def _credentials(s: ApiService, r: Request) -> Response:
    return JSONResponse({"credentials": await run_in_threadpool(s.credentials.described)})


async def _health(s: ApiService, r: Request) -> Response:
    """Readiness. Without an admin credential the status and each check's code
    (`health.public_report`): the checks' details (a broker's or Postgres's error text: hosts,
    ports, user names) go to an admin credential, as on every service's health server."""
    ok, body = await run_in_threadpool(s.health)
    credential = credential_of(r)
    if credential is None or not credential.admin:
        body = public_report(body)
    return JSONResponse(body, status_code=200 if ok else 503)


async def _live(s: ApiService, r: Request) -> Response:
    ok, body = s.status.live()
    return JSONResponse(body, status_code=200 if ok else 503)


async def _metrics(s: ApiService, r: Request) -> Response:
    return Response(metrics_text(), media_type=CONTENT_TYPE_LATEST)


async def _openapi(s: ApiService, r: Request) -> Response:
    return JSONResponse(OPENAPI)


#: What a route lets through besides a role: anyone (PUBLIC), or a credential with the admin
#: role or the operation's callback signature (CALLBACK).
PUBLIC, CALLBACK = "public", "callback"
Endpoint = Callable[[ApiService, Request], Awaitable[Response]]

#: (method, path, name, rule, handler). The rule is the role a credential needs (ROLES of
#: `agentruns.connectors.api.credentials`), PUBLIC or CALLBACK. A run of another tenant is a
#: 404 to a credential that is not an admin, whatever the route (its id does not leak).
ROUTES: tuple[tuple[str, str, str, str, Endpoint], ...] = (
    ("POST", "/runs", "submit", SUBMIT, _submit),
    ("GET", "/runs", "list_runs", READ, _list_runs),
    ("GET", "/runs/{run_id}", "get_run", READ, _get_run),
    ("GET", "/runs/{run_id}/events", "events", READ, _events),
    ("POST", "/runs/{run_id}/replies", "reply", REPLY, _reply),
    ("POST", "/runs/{run_id}/cancel", "cancel", CANCEL, _cancel),
    ("POST", "/runs/{run_id}/resolve", "resolve", ADMIN, _operator_action("resolve")),
    ("POST", "/runs/{run_id}/reopen", "reopen", ADMIN, _operator_action("reopen")),
    ("POST", "/runs/{run_id}/redrive", "redrive", ADMIN, _operator_action("redrive")),
    ("POST", "/runs/{run_id}/fork", "fork", SUBMIT, _fork("fork")),
    ("POST", "/runs/{run_id}/resume", "resume", SUBMIT, _fork("resume")),
    ("POST", "/operations/{key}/callback", "callback", CALLBACK, _callback),
    ("GET", "/credentials", "credentials", ADMIN, _credentials),
    ("GET", "/readyz", "readyz", PUBLIC, _health),
    ("GET", "/healthz", "healthz", PUBLIC, _health),
    ("GET", "/livez", "livez", PUBLIC, _live),
    ("GET", "/metrics", "metrics", PUBLIC, _metrics),
    ("GET", "/openapi.json", "openapi", PUBLIC, _openapi),
)


def create_app(config: ApiConfig) -> Starlette:
    """The ASGI app. Connects to Kafka (inbox metadata) at once; Postgres lazily."""
    service = ApiService(config)

    stopping = threading.Event()
    service.status.watch_loop(stopping)  # the app serves until its lifespan ends

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            stopping.set()
            await run_in_threadpool(service.close)

    routes = [
        Route(path, _endpoint(name, rule, fn)(service), methods=[method], name=name)
        for method, path, name, rule, fn in ROUTES
    ]
    console = Console(service)
    routes += console.routes()
    app = Starlette(routes=routes, lifespan=lifespan)
    # One budget of wrong tokens per address, whether they come to the JSON API or to the
    # console's login form: neither door is a way round the other's limit.
    app.add_middleware(
        _Auth,
        credentials=service.credentials,
        secret=config.keys.callback,
        limiter=console.logins,
        prefixes=console.prefixes,
        clock=config.clock,
    )
    app.add_middleware(_Guard)  # added last: runs first
    app.state.service = service
    return app

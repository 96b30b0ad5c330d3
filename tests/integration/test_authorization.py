"""The authorization matrix: every route of the JSON API and every console page, each called
by every role of tenant A, by a credential of tenant B, by an admin, with no credential, with
a wrong one, and (console) with a session logged out, against a run of tenant A; with the
status each must get. The matrix is made from the route tables (`ROUTES`, `CONSOLE_ROUTES`):
a route added without its row here, or with a rule no role stands for, fails it.

What a request that passes authorization gets is the route's own answer; the calls below make
it one that changes nothing (a body each route refuses after its checks, a finished run), so
the matrix can run every cell against the same two runs.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from agentruns.connectors.api.console import CONSOLE_ROUTES, OPEN, SESSION, UI_PREFIX
from agentruns.connectors.api.credentials import ADMIN, ROLES, token_digest
from agentruns.connectors.api.http import CALLBACK, PUBLIC, ROUTES
from agentruns.connectors.health import DETAILED_WITH_CREDENTIAL
from tests.support.api import (
    CREDENTIALS,
    OPERATOR,
    OPERATOR_TOKEN,
    SEARCH,
    TENANT_A,
    TENANT_B,
    Stack,
    anonymous,
    client_address,
)
from tests.support.console import csrf_of, logged_in
from tests.support.waiting import wait_for

#: How each JSON route is called in the matrix: (body or None for no body, headers). Every
#: route of ROUTES has its row; the row of a route that is gone fails the test too.
API_CALLS: dict[str, tuple[dict[str, Any] | None, dict[str, str]]] = {
    "submit": ({"goal": "x"}, {}),  # no Idempotency-Key: 400 once let through
    "list_runs": (None, {}),
    "get_run": (None, {}),
    "events": (None, {}),
    "reply": ({}, {}),  # no resume token: 400
    "cancel": ({}, {}),  # a finished run: 409
    "resolve": ({}, {}),  # no action: 4xx
    "reopen": ({"goal": 5}, {}),
    "redrive": ({}, {}),  # a finished run: 409
    "fork": ({"at": "nowhere"}, {}),
    "resume": ({}, {}),  # a run that did not fail: 409
    "callback": ({"status": "nonsense"}, {}),  # no such operation: 404 operation_not_found
    "credentials": (None, {}),
    "readyz": (None, {}),
    "healthz": (None, {}),
    "livez": (None, {}),
    "metrics": (None, {}),
    "openapi": (None, {}),
}
#: The console's pages and forms by name (all but the open ones need a session; a form's
#: fields besides its CSRF token).
CONSOLE_CALLS: dict[str, dict[str, str]] = {
    "index": {},
    "login_form": {},
    "login": {},
    "logout": {},
    "runs": {},
    "run": {},
    "transcript": {},
    "reply": {"resume_token": "art1.forged.x"},
    "cancel": {},
    "resolve": {},
    "reopen": {},
    "redrive": {},
    "fork": {"at": "nowhere"},
    "resume": {},
    "artifact": {},
    "dead_letters": {},
    "tools": {},
    "script": {},
    "style": {},
}
#: Routes that act on no run of a tenant: other tenants do not apply to them.
UNSCOPED = {
    "submit",
    "list_runs",
    "callback",
    "credentials",
    "runs",
    "dead_letters",
    "tools",
    "artifact",
}
UNSCOPED |= {"logout", "index", "login_form", "login", "script", "style"}


def _token(cid: str) -> str:
    return CREDENTIALS[cid][2]


@contextmanager
def _bearer(stack: Stack, token: str) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {token}", "X-Forwarded-For": client_address()}
    with httpx.Client(base_url=stack.url, headers=headers, timeout=30) as client:
        yield client


@dataclass(frozen=True)
class Runs:
    own: str  # of tenant A
    other: str  # of tenant B
    artifact: str  # the result of `own`


@pytest.fixture(scope="module")
def runs(stack: Stack) -> Runs:
    made = []
    for cid in ("a-submit", "b-all"):
        with _bearer(stack, _token(cid)) as client:
            body = {"goal": "find three documents", "tools": [SEARCH.model_dump()]}
            key = f"authz-{uuid.uuid4().hex}"
            r = client.post("/runs", json=body, headers={"Idempotency-Key": key})
            assert r.status_code == 202, r.text
            made.append(r.json()["run_id"])
    seen: dict[str, dict[str, Any]] = {}
    with _bearer(stack, OPERATOR_TOKEN) as admin:

        def done() -> bool:
            for run_id in made:
                r = admin.get(f"/runs/{run_id}")
                if r.status_code == 200 and r.json()["status"] == "SUCCEEDED":
                    seen[run_id] = r.json()
            return len(seen) == len(made)

        wait_for(done, timeout=60, what="the two tenants' runs to finish", every=0.2)
    own, other = made
    assert (seen[own]["tenant"], seen[other]["tenant"]) == (TENANT_A, TENANT_B)
    return Runs(own, other, seen[own]["result"]["result_ref"])


def _admin(who: str) -> bool:
    return who in ("admin", "revoked") or (
        who in CREDENTIALS and ADMIN in CREDENTIALS[who][1].split(",")
    )


def _path(template: str, run_id: str, runs: Runs) -> str:
    return template.format(run_id=run_id, key="op-that-is-not-there", ref=runs.artifact)


def _api_expected(rule: str, who: str, name: str, template: str) -> str:
    """What a JSON route answers ``who``: 'ok' (let through: the route's own answer),
    '401', '403' or '404' (another tenant's run). A public route that answers more to a
    credential checks one that is given (a wrong one is a 401)."""
    if rule == PUBLIC:
        return "401" if who == "wrong" and template in DETAILED_WITH_CREDENTIAL else "ok"
    if who in ("none", "wrong"):
        return "401"
    holds = ADMIN if who == "admin" else CREDENTIALS[who][1]
    roles = set(ROLES) if holds == ADMIN else set(holds.split(","))
    needed = ADMIN if rule == CALLBACK else rule
    if needed not in roles:
        return "403"
    return "ok"


def test_every_route_has_a_row_and_a_rule_a_role_stands_for() -> None:
    assert {name for _, _, name, _, _ in ROUTES} == set(API_CALLS)
    assert {name for _, _, name, _ in CONSOLE_ROUTES} == set(CONSOLE_CALLS)
    assert {rule for *_, rule, _ in ROUTES} <= {*ROLES, PUBLIC, CALLBACK}
    assert {rule for *_, rule in CONSOLE_ROUTES} <= {*ROLES, OPEN, SESSION}


def _let_through(r: httpx.Response) -> bool:
    refused = r.status_code in (401, 403, 429) or (
        r.status_code == 404 and "run_not_found" in r.text
    )
    return not refused and r.status_code < 500


#: Who calls: each of tenant A's single-role credentials, tenant B's, the admin, nobody, a
#: wrong token.
CALLERS = [*(f"a-{role}" for role in ROLES), "b-all", "admin", "none", "wrong"]


@pytest.mark.parametrize("who", CALLERS)
def test_the_json_api_matrix(stack: Stack, runs: Runs, who: str) -> None:
    token = {"none": None, "wrong": None, "admin": OPERATOR_TOKEN}.get(
        who, _token(who) if who in CREDENTIALS else None
    )
    tenant = TENANT_B if who == "b-all" else TENANT_A
    failures = []
    for method, template, name, rule, _ in ROUTES:
        body, headers = API_CALLS[name]
        # the run this caller owns, then the run of the other tenant
        targets = [("own", runs.own if tenant == TENANT_A else runs.other)]
        if name not in UNSCOPED and "{run_id}" in template:
            targets.append(("other", runs.other if tenant == TENANT_A else runs.own))
        for whose, run_id in targets:
            with anonymous(stack.url) as client:
                sent = dict(headers)
                if who == "wrong":  # a new guess each time: its prefix too
                    sent["Authorization"] = f"Bearer {uuid.uuid4().hex * 2}"
                elif token is not None:
                    sent["Authorization"] = f"Bearer {token}"
                r = client.request(method, _path(template, run_id, runs), json=body, headers=sent)
            expected = _api_expected(rule, who, name, template)
            if expected == "ok" and whose == "other" and not _admin(who) and rule != PUBLIC:
                expected = "404"
            got = "ok" if _let_through(r) else str(r.status_code)
            if expected == "404" and not (r.status_code == 404 and "run_not_found" in r.text):
                got = f"{r.status_code}"
            if got != expected:
                failures.append(
                    f"{method} {template} as {who} on {whose}: {r.status_code} {r.text[:120]}"
                )
    assert not failures, "\n".join(failures)


def test_the_run_list_shows_the_callers_tenant_only(stack: Stack, runs: Runs) -> None:
    with _bearer(stack, _token("a-read")) as reader:
        listed = {r["run_id"]: r["tenant"] for r in reader.get("/runs").json()["runs"]}
        assert runs.own in listed and runs.other not in listed
        assert set(listed.values()) == {TENANT_A}
        asked = reader.get("/runs", params={"tenant": TENANT_B}).json()["runs"]
        assert asked == []  # naming another tenant shows none of its runs
    with _bearer(stack, OPERATOR_TOKEN) as admin:
        listed = {r["run_id"] for r in admin.get("/runs").json()["runs"]}
        assert {runs.own, runs.other} <= listed
        only_b = admin.get("/runs", params={"tenant": TENANT_B}).json()["runs"]
        assert {r["tenant"] for r in only_b} == {TENANT_B}
        metrics = admin.get("/metrics").text
    assert f'agentruns_api_submissions_total{{tenant="{TENANT_A}"}}' in metrics


def _console_expected(rule: str, who: str) -> str:
    if rule == OPEN:
        return "ok"
    if who in ("none", "wrong", "revoked"):
        return "login"
    if rule == SESSION:
        return "ok"
    holds = set(ROLES) if who == "admin" else set(CREDENTIALS[who][1].split(","))
    return "ok" if (ADMIN in holds or rule in holds) else "403"


@contextmanager
def _session(stack: Stack, who: str) -> Iterator[httpx.Client]:
    if who in ("none", "wrong"):
        with httpx.Client(base_url=stack.url, timeout=30) as client:
            if who == "wrong":  # a cookie of the right shape that no key signed
                client.cookies.set("agentruns_console", "9999999999999.x~eA~y.z", path=UI_PREFIX)
            yield client
        return
    token = OPERATOR_TOKEN if who in ("admin", "revoked") else _token(who)
    with logged_in(stack, token) as client:
        if who == "revoked":
            cookie = client.cookies["agentruns_console"]
            page = client.get("/ui/runs")
            out = client.post("/ui/logout", data={"csrf": csrf_of(page.text)})
            assert out.status_code == 303
            client.cookies.set("agentruns_console", cookie, path=UI_PREFIX)  # replayed
        yield client


@pytest.mark.parametrize("who", [*CALLERS, "revoked"])
def test_the_console_matrix(stack: Stack, runs: Runs, who: str) -> None:
    tenant = TENANT_B if who == "b-all" else TENANT_A
    failures = []
    with _session(stack, who) as client:
        csrf = "x"
        if _console_expected(SESSION, who) == "ok":  # every page a session gets carries it
            csrf = csrf_of(client.get("/ui/tools").text)
        for method, path, name, rule in CONSOLE_ROUTES:
            if name == "logout":
                continue  # below, last: it ends the session
            targets = [("own", runs.own if tenant == TENANT_A else runs.other)]
            if name not in UNSCOPED:
                targets.append(("other", runs.other if tenant == TENANT_A else runs.own))
            for whose, run_id in targets:
                url = UI_PREFIX + _path(path, run_id, runs)
                if method == "POST":
                    form = {**CONSOLE_CALLS[name], "csrf": csrf}
                    if name == "login":  # a wrong token, with the login form's own CSRF token
                        form["csrf"] = csrf_of(client.get("/ui/login").text)
                        form["token"] = uuid.uuid4().hex * 2
                    r = client.post(url, data=form, headers={"X-Forwarded-For": client_address()})
                else:
                    r = client.get(url)
                expected = _console_expected(rule, who)
                if expected == "ok" and whose == "other" and not _admin(who):
                    expected = "404"
                got = _console_got(r, name)
                if got != expected:
                    failures.append(f"{method} {url} as {who} on {whose}: {r.status_code}")
        r = client.post("/ui/logout", data={"csrf": csrf})
        expected = _console_expected(SESSION, who)
        if _console_got(r, "logout") != expected:
            failures.append(f"POST /ui/logout as {who}: {r.status_code}")
    assert not failures, "\n".join(failures)


def _console_got(r: httpx.Response, name: str) -> str:
    if name == "login":  # a wrong token: the form again, 401
        return "ok" if r.status_code == 401 else str(r.status_code)
    if r.status_code == 303 and r.headers.get("location", "").endswith("/ui/login"):
        return "ok" if name == "logout" else "login"
    if r.status_code == 401:
        return "login"
    if r.status_code == 403:
        return "403"
    if r.status_code == 404 and "no run" in r.text:
        return "404"
    return "ok" if r.status_code < 500 and r.status_code not in (401, 429) else str(r.status_code)


def test_a_fork_is_of_its_sources_tenant(stack: Stack, runs: Runs) -> None:
    with _bearer(stack, _token("a-submit")) as submitter:
        r = submitter.post(f"/runs/{runs.own}/fork", json={"at": 1})
        assert r.status_code == 201, r.text
        fork = r.json()
    assert fork["actor"] == "operator:a-submit"
    with _bearer(stack, OPERATOR_TOKEN) as admin:

        def projected() -> bool:
            return admin.get(f"/runs/{fork['run_id']}").status_code == 200

        wait_for(projected, timeout=60, what="the fork in the projection", every=0.2)
        assert admin.get(f"/runs/{fork['run_id']}").json()["tenant"] == TENANT_A
    with _bearer(stack, _token("b-all")) as other:
        assert other.get(f"/runs/{fork['run_id']}").status_code == 404


def test_the_console_shows_each_runs_tenant_and_the_callers(stack: Stack, runs: Runs) -> None:
    with logged_in(stack, _token("a-read")) as reader:
        page = reader.get("/ui/runs").text
        assert 'id="caller"' in page and f"tenant <b>{TENANT_A}</b>" in page
        assert "a-read" in page and runs.own in page and runs.other not in page
        assert f'<td class="tenant">{TENANT_A}</td>' in page
        run = reader.get(f"/ui/runs/{runs.own}").text
        assert f'<b class="tenant">{TENANT_A}</b>' in run
    with logged_in(stack, OPERATOR_TOKEN) as admin:
        page = admin.get("/ui/runs").text
        assert "tenant <b>all</b>" in page
        assert runs.own in page and runs.other in page


def test_an_admin_sees_each_credentials_last_use_never_its_hash(stack: Stack, runs: Runs) -> None:
    with _bearer(stack, OPERATOR_TOKEN) as admin:
        listed = {c["id"]: c for c in admin.get("/credentials").json()["credentials"]}
    assert listed["a-submit"]["tenant"] == TENANT_A and listed["a-submit"]["roles"] == ["submit"]
    assert isinstance(listed["a-submit"]["last_used_at"], int)  # it submitted a run
    assert listed[OPERATOR]["source"] == "AGENTRUNS_API_OPERATOR_TOKENS"
    assert "sha256" not in str(listed) and _token("a-submit") not in str(listed)


def test_a_credential_changed_in_the_file_takes_effect_without_a_restart(
    stack: Stack, runs: Runs
) -> None:
    """Removing a credential ends its bearer use and its console sessions; a new one works;
    a role added ends the sessions of the credential that had fewer: no restart."""
    assert stack.api is not None and stack.api.credentials_file is not None
    path = stack.api.credentials_file
    original = path.read_text()
    minted = "agr_minted_" + uuid.uuid4().hex

    def rewrite(text: str, held: str) -> None:
        """Write the file, then wait (asking as an admin: a wrong credential's polls would
        spend its budget) until the API holds credential ``held``."""
        path.write_text(text)
        stat = os.stat(path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        with _bearer(stack, OPERATOR_TOKEN) as admin:

            def read_again() -> bool:
                listed = admin.get("/credentials").json()["credentials"]
                return any(c["id"] == held for c in listed)

            wait_for(read_again, timeout=10, what=f"{held} to be read", every=0.2)

    try:
        with (
            logged_in(stack, _token("a-read")) as reader,
            logged_in(stack, _token("a-reply")) as replier,
        ):
            assert reader.get("/ui/runs").status_code == 200
            assert replier.get("/ui/runs").status_code == 403  # reply only: not read
            kept = [line for line in original.splitlines(keepends=True) if " a-" not in f" {line}"]
            rewrite(
                "".join(kept)
                + f"a-reply {TENANT_A} reply,read {token_digest(_token('a-reply'))}\n"
                + f"minted {TENANT_A} read {token_digest(minted)}\n",
                "minted",
            )
            with _bearer(stack, minted) as fresh:
                assert fresh.get("/runs").status_code == 200
            with _bearer(stack, _token("a-read")) as removed:
                assert removed.get("/runs").status_code == 401
            gone = reader.get("/ui/runs")
            assert gone.status_code == 303 and gone.headers["location"].endswith("/ui/login")
            # a-reply's roles changed (read added): its session ends too
            changed = replier.get("/ui/runs")
            assert changed.status_code == 303 and changed.headers["location"].endswith("/ui/login")
    finally:
        rewrite(original, "a-read")
    with _bearer(stack, _token("a-read")) as back:
        assert back.get("/runs").status_code == 200

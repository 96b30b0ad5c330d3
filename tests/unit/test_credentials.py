"""API credentials: the file's format and its limits, hashed look-up, reading the file again
without a restart, the minimum and maximum token length, the last-used time, and the tenant
a submission and the run list are narrowed to."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from agentruns.connectors.api.credentials import (
    MAX_TOKEN_CHARS,
    ROLES,
    Credential,
    CredentialsError,
    CredentialStore,
    credential_line,
    fixed_credentials,
    parse_credentials,
    token_digest,
)
from agentruns.connectors.api.errors import ApiError
from agentruns.connectors.api.listing import RunFilter
from agentruns.connectors.api.service import _submit_tenant
from agentruns.processors.ids import run_id_for_key
from agentruns.processors.tenants import DEFAULT_TENANT, tenant_key

TOKEN = "agr_" + "s" * 43
OTHER = "agr_" + "o" * 43


def _line(cid: str, tenant: str, roles: str, token: str) -> str:
    return f"{cid} {tenant} {roles} {token_digest(token)}\n"


def _bump(path: Path) -> None:
    """A new modification time, however coarse the file system's clock."""
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def test_the_file_holds_ids_tenants_roles_and_hashes_never_tokens() -> None:
    text = "# comment\n\n" + _line("ci", "billing", "submit,read", TOKEN) + "  # trailing\n"
    (c,) = parse_credentials(text)
    assert (c.id, c.tenant, c.roles) == ("ci", "billing", frozenset({"submit", "read"}))
    assert c.digest.startswith("sha256:") and TOKEN not in text
    assert parse_credentials(credential_line(c)) == [c]


@pytest.mark.parametrize(
    "line",
    [
        "ci billing submit,read",  # no hash
        f"ci billing submit,read {TOKEN}",  # a token, not its hash
        f"ci Billing submit {token_digest(TOKEN)}",  # not a tenant name
        f"ci billing submit,root {token_digest(TOKEN)}",  # an unknown role
        f"ci billing , {token_digest(TOKEN)}",  # no role
        f"c/i billing read {token_digest(TOKEN)}",  # not an id
        f"ci billing read sha256:{'A' * 64}",  # not lower-case hex
    ],
)
def test_a_malformed_line_is_refused_naming_the_line_never_a_token(line: str) -> None:
    with pytest.raises(CredentialsError, match="line 1") as caught:
        parse_credentials(line)
    assert TOKEN not in str(caught.value)


def test_an_id_or_a_token_listed_twice_is_refused() -> None:
    with pytest.raises(CredentialsError, match="twice"):
        parse_credentials(_line("a", "t", "read", TOKEN) + _line("a", "t", "read", OTHER))
    with pytest.raises(CredentialsError, match="twice"):
        parse_credentials(_line("a", "t", "read", TOKEN) + _line("b", "t", "read", TOKEN))
    with pytest.raises(CredentialsError, match="another"):  # the file's and the environment's
        CredentialStore(fixed_credentials(TOKEN, {}), None, lambda: 0)._install(
            parse_credentials(_line("b", "t", "read", TOKEN))
        )


def test_the_api_token_and_operator_tokens_are_admins_of_the_default_tenant() -> None:
    store = CredentialStore(fixed_credentials("short-dev-token", {OTHER: "alice"}), None, lambda: 5)
    api, alice = store.lookup("short-dev-token"), store.lookup(OTHER)
    assert api is not None and api.id == "api" and api.admin and api.tenant == DEFAULT_TENANT
    assert alice is not None and alice.actor == "operator:alice" and alice.tenant_scope is None
    assert store.lookup(TOKEN) is None and store.lookup("") is None


def test_the_file_is_read_again_when_it_changes_and_a_broken_one_keeps_the_last(
    tmp_path: Path,
) -> None:
    path = tmp_path / "credentials"
    path.write_text(_line("ci", "billing", "read", TOKEN))
    now = [0]
    store = CredentialStore([], path, lambda: now[0], check_every_ms=1000)
    assert store.lookup(TOKEN) is not None and store.lookup(OTHER) is None
    path.write_text(_line("ci2", "billing", "read", OTHER))
    _bump(path)
    assert store.lookup(OTHER) is None  # not looked at again within the second
    now[0] = 1000
    assert store.lookup(OTHER) is not None and store.lookup(TOKEN) is None  # rotated
    path.write_text("this is not a credential line\n")
    _bump(path)
    now[0] = 2000
    assert store.lookup(OTHER) is not None  # the broken file is not taken
    path.unlink()
    now[0] = 3000
    assert store.lookup(OTHER) is not None  # nor is a missing one


def test_a_short_token_or_a_huge_one_opens_nothing(tmp_path: Path) -> None:
    short = "agr_short"
    path = tmp_path / "credentials"
    path.write_text(_line("weak", "t", "read", short))
    store = CredentialStore([], path, lambda: 0)
    assert store.lookup(short) is None  # under MIN_TOKEN_CHARS: refused even if listed
    huge = "a" * (1 << 20)
    started = time.perf_counter()
    for _ in range(1000):
        assert store.lookup(huge) is None and store.lookup(huge.encode()) is None
    assert time.perf_counter() - started < 0.5  # refused by length, never hashed
    assert store.lookup("a" * (MAX_TOKEN_CHARS + 1)) is None
    assert store.lookup(b"\xff" * 40) is None  # not UTF-8


def test_the_last_use_is_kept_per_credential(tmp_path: Path) -> None:
    path = tmp_path / "credentials"
    path.write_text(_line("ci", "billing", "read", TOKEN))
    now = [10]
    store = CredentialStore([], path, lambda: now[0])
    assert store.last_used("ci") is None
    store.lookup(TOKEN)
    now[0] = 99
    assert store.last_used("ci") == 10
    store.lookup(TOKEN)
    assert store.last_used("ci") == 99


def test_roles_and_tenants_what_a_credential_sees() -> None:
    reader = Credential("r", "billing", frozenset({"read"}), token_digest(TOKEN))
    admin = Credential("a", "ops", frozenset({"admin"}), token_digest(OTHER))
    assert reader.may("read") and not reader.may("cancel") and not reader.may("admin")
    assert all(admin.may(role) for role in ROLES)
    assert reader.sees("billing") and not reader.sees("ops") and admin.sees("billing")
    assert reader.tenant_scope == "billing" and admin.tenant_scope is None


def test_a_submission_is_for_the_callers_tenant_only_an_admin_names_another() -> None:
    reader = Credential("r", "billing", frozenset({"submit"}), token_digest(TOKEN))
    admin = Credential("a", "ops", frozenset({"admin"}), token_digest(OTHER))
    assert _submit_tenant({}, reader) == "billing"
    assert _submit_tenant({"tenant": "billing"}, reader) == "billing"
    with pytest.raises(ApiError) as caught:
        _submit_tenant({"tenant": "ops"}, reader)
    assert caught.value.status == 422
    assert _submit_tenant({"tenant": "billing"}, admin) == "billing"
    with pytest.raises(ApiError):
        _submit_tenant({"tenant": "Not A Tenant"}, admin)
    # the same idempotency key in two tenants: two runs
    assert run_id_for_key(tenant_key("k", "billing")) != run_id_for_key(tenant_key("k", "ops"))
    assert tenant_key("k", DEFAULT_TENANT) == "k"  # the run ids of before


def test_the_run_list_is_narrowed_to_the_callers_tenant() -> None:
    reader = Credential("r", "billing", frozenset({"read"}), token_digest(TOKEN))
    admin = Credential("a", "ops", frozenset({"admin"}), token_digest(OTHER))
    assert RunFilter.of_query({}, reader).tenant == "billing"
    assert RunFilter.of_query({"tenant": "ops"}, reader).tenant == "-"  # matches no run
    assert RunFilter.of_query({}, admin).tenant is None
    assert RunFilter.of_query({"tenant": "billing"}, admin).tenant == "billing"
    with pytest.raises(ApiError):
        RunFilter.of_query({"tenant": "x y"}, admin)


def test_a_tenant_is_a_metrics_label_only_if_a_credential_names_it(tmp_path: Path) -> None:
    path = tmp_path / "credentials"
    path.write_text(_line("ci", "billing", "read", TOKEN))
    store = CredentialStore(fixed_credentials(OTHER, {}), path, lambda: 0)
    assert store.tenant_label("billing") == "billing"
    assert store.tenant_label(DEFAULT_TENANT) == DEFAULT_TENANT
    assert store.tenant_label("made-up-by-an-admin") == "other"

"""The registry's auth, proxy and TLS settings: read and checked when the registry loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentruns.connectors.executors.base import ExecutorError
from agentruns.connectors.executors.http import (
    Connectivity,
    KeepAliveHTTP,
    Secret,
    environment_proxy,
)
from agentruns.connectors.executors.tool import ToolRegistry

SECRET = "s3cr3t-value-42"


def _load(tmp_path: Path, tool: dict[str, Any], **top: Any) -> ToolRegistry:
    path = tmp_path / "tools.json"
    entry = {"name": "t", "endpoint": "/t", **tool}
    path.write_text(json.dumps({"base_url": "http://127.0.0.1:1", "tools": [entry], **top}))
    return ToolRegistry.load(path)


def test_a_bearer_token_comes_from_the_environment_and_is_masked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("T_TOKEN", f"{SECRET}\n")
    conn = _load(tmp_path, {"auth": {"type": "bearer", "token_env": "T_TOKEN"}}).tools["t"].conn
    assert conn.auth_header is not None
    name, secret = conn.auth_header
    assert (name, secret.reveal()) == ("Authorization", f"Bearer {SECRET}")
    assert SECRET not in repr(conn) and SECRET not in str(secret) and "$T_TOKEN" in repr(secret)
    assert conn.redact(f"echo: Bearer {SECRET}") == "echo: Bearer [redacted]"


def test_an_api_key_comes_from_a_file_into_its_header(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text(SECRET)
    auth = {"type": "api_key", "header": "X-Tool-Key", "key_file": str(key)}
    conn = _load(tmp_path, {"auth": auth}).tools["t"].conn
    assert conn.auth_header is not None
    assert (conn.auth_header[0], conn.auth_header[1].reveal()) == ("X-Tool-Key", SECRET)


@pytest.mark.parametrize(
    ("auth", "says"),
    [
        ({"type": "bearer", "token_env": "T_UNSET_TOKEN"}, "T_UNSET_TOKEN is not set"),
        ({"type": "bearer", "token_file": "/nonexistent/token"}, "/nonexistent/token"),
        ({"type": "bearer"}, "exactly one of token_env and token_file"),
        ({"type": "api_key", "key_env": "A", "key_file": "/b"}, "exactly one of key_env"),
        ({"type": "mtls", "cert_file": "/nonexistent/c.pem", "key_file": "/x"}, "c.pem"),
        ({"type": "basic"}, "bearer, api_key or mtls"),
    ],
)
def test_a_missing_or_malformed_secret_is_one_error_at_load_naming_the_tool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, auth: dict[str, Any], says: str
) -> None:
    monkeypatch.delenv("T_UNSET_TOKEN", raising=False)
    with pytest.raises(ExecutorError) as raised:
        _load(tmp_path, {"auth": auth})
    assert says in str(raised.value) and "tool 't'" in str(raised.value)


def test_an_empty_secret_file_is_refused_and_its_content_never_quoted(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ExecutorError, match="is empty"):
        _load(tmp_path, {"auth": {"type": "bearer", "token_file": str(empty)}})
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff" + SECRET.encode())
    with pytest.raises(ExecutorError, match="not UTF-8") as raised:
        _load(tmp_path, {"auth": {"type": "bearer", "token_file": str(binary)}})
    assert SECRET not in str(raised.value)


def test_registry_tls_and_proxy_are_every_tools_default(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not read until a connection needs it")
    registry = _load(
        tmp_path,
        {"proxy": ""},
        tls={"ca_file": str(ca), "verify": True},
        proxy="http://proxy.internal:3128",
    )
    conn = registry.tools["t"].conn
    assert (conn.ca_file, conn.verify, conn.proxy) == (str(ca), True, "")
    public = _load(tmp_path, {"tls": {"ca_file": None}}, tls={"ca_file": str(ca)})
    assert public.tools["t"].conn.ca_file is None  # the system's CAs for this one
    with pytest.raises(ExecutorError, match="ca_file"):
        _load(tmp_path, {"tls": {"ca_file": str(tmp_path / "missing.pem")}})
    with pytest.raises(ExecutorError, match="http:// or https://"):
        _load(tmp_path, {"proxy": "socks5://p:1080"})


def test_the_environment_proxy_honours_no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    proxies = {"https": "http://proxy:3128", "no": "internal.example,localhost"}
    assert environment_proxy("https://api.example.com/x", proxies) == "http://proxy:3128"
    assert environment_proxy("https://svc.internal.example/x", proxies) is None
    assert environment_proxy("https://localhost:8443/x", proxies) is None
    assert environment_proxy("http://api.example.com/x", proxies) is None  # no http proxy
    monkeypatch.setenv("HTTPS_PROXY", "http://env-proxy:8080")
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    client = KeepAliveHTTP(1.0)
    assert client.proxy_for("https://api.example.com/x", Connectivity()) == "http://env-proxy:8080"
    assert client.proxy_for("https://api.example.com/x", Connectivity(proxy="")) == ""


def test_a_secret_is_masked_wherever_it_is_formatted() -> None:
    secret = Secret(SECRET, "$X")
    assert SECRET not in f"{secret} {secret!r} {[secret]} {Connectivity(secrets=(secret,))}"

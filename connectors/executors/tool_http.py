"""A tool's connection settings in the registry (docs/executors.md, "Auth, proxy and TLS").

- ``auth``: ``{"type": "bearer", "token_env" | "token_file": ...}``, ``{"type": "api_key",
  "header": "X-API-Key", "key_env" | "key_file": ...}`` or ``{"type": "mtls", "cert_file":
  ..., "key_file": ...}``. The secret itself is never in the registry: it is read from the
  environment or a file when the registry is loaded (a missing one is an error then, naming
  the variable or file, never a value), held in a :class:`Secret` whose ``repr`` is masked,
  and scrubbed from every message the executor writes (:meth:`Connectivity.redact`).
- ``proxy``: a proxy URL, or ``""`` for none; without it ``HTTPS_PROXY``/``HTTP_PROXY``/
  ``NO_PROXY`` apply (https goes through the proxy with ``CONNECT``).
- ``tls``: ``{"ca_file": ..., "verify": true}``; verification is on unless ``verify`` is
  false; ``ca_file`` null means the system's CAs. A registry-wide ``tls``/``proxy`` is the
  default of every tool.

The client that carries them is :class:`agentruns.connectors.executors.http.KeepAliveHTTP`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from agentruns.connectors.executors.base import ExecutorError
from agentruns.connectors.executors.http import Answer, Connectivity, Secret


def read_secret(spec: Mapping[str, Any], stem: str, where: str) -> Secret:
    """The secret ``<stem>_env`` or ``<stem>_file`` of ``spec`` names (exactly one)."""
    env, path = spec.get(f"{stem}_env"), spec.get(f"{stem}_file")
    if (env is None) == (path is None):
        raise ExecutorError(f"{where}: give exactly one of {stem}_env and {stem}_file")
    if env is not None:
        value = os.environ.get(str(env), "")
        if not value:
            raise ExecutorError(f"{where}: the environment variable {env} is not set or empty")
        return Secret(value.strip(), f"${env}")
    try:
        value = Path(str(path)).read_text().strip()
    except OSError as exc:
        raise ExecutorError(f"{where}: cannot read {stem}_file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ExecutorError(f"{where}: {stem}_file {path} is not UTF-8 text") from None
    if not value:
        raise ExecutorError(f"{where}: {stem}_file {path} is empty")
    return Secret(value, str(path))


def _readable(path: Any, what: str, where: str) -> str:
    if not isinstance(path, str) or not path:
        raise ExecutorError(f"{where}: {what} must be a file path")
    if not os.access(path, os.R_OK):
        raise ExecutorError(f"{where}: {what} {path} does not exist or is not readable")
    return path


def parse_connectivity(
    spec: Mapping[str, Any], where: str, defaults: Connectivity | None = None
) -> Connectivity:
    """The ``auth``/``tls``/``proxy`` of a registry entry (``defaults``: the registry's)."""
    base = defaults or Connectivity()
    auth, tls = spec.get("auth"), spec.get("tls")
    header: tuple[str, Secret] | None = base.auth_header
    cert_file, key_file = base.cert_file, base.key_file
    secrets = list(base.secrets)
    if auth is not None:
        if not isinstance(auth, Mapping):
            raise ExecutorError(f"{where}: auth must be an object")
        kind = auth.get("type")
        if kind == "bearer":
            secret = read_secret(auth, "token", f"{where} auth")
            header = ("Authorization", Secret(f"Bearer {secret.reveal()}", secret.source))
            secrets.append(secret)
        elif kind == "api_key":
            name = auth.get("header", "X-API-Key")
            if not isinstance(name, str) or not name.isascii() or not name.strip():
                raise ExecutorError(f"{where} auth: header must be a header name")
            secret = read_secret(auth, "key", f"{where} auth")
            header = (name.strip(), secret)
            secrets.append(secret)
        elif kind == "mtls":
            cert_file = _readable(auth.get("cert_file"), "cert_file", f"{where} auth")
            key_file = _readable(auth.get("key_file"), "key_file", f"{where} auth")
        else:
            raise ExecutorError(f"{where} auth: type must be bearer, api_key or mtls, not {kind!r}")
    ca_file, verify = base.ca_file, base.verify
    if tls is not None:
        if not isinstance(tls, Mapping):
            raise ExecutorError(f"{where}: tls must be an object")
        if "ca_file" in tls:  # null: the system's CAs, whatever the registry's default
            ca = tls["ca_file"]
            ca_file = None if ca is None else _readable(ca, "ca_file", f"{where} tls")
        verify = bool(tls.get("verify", True))
    proxy = spec.get("proxy", base.proxy)
    if proxy is not None and not isinstance(proxy, str):
        raise ExecutorError(f"{where}: proxy must be a URL or an empty string")
    if proxy and urlsplit(proxy).scheme not in ("http", "https"):
        raise ExecutorError(f"{where}: proxy must be an http:// or https:// URL")
    return Connectivity(header, cert_file, key_file, ca_file, verify, proxy, tuple(secrets))


def scrub_answer(answer: Answer, conn: Connectivity) -> Answer:
    """``answer`` without any of the backend's secrets, whatever it echoed: its body becomes
    artifacts and messages, its detail action records and logs."""
    if not conn.secrets:
        return answer
    scrubbed = answer.body
    for secret in conn.secrets:
        value = secret.reveal().encode()
        if value in scrubbed:
            scrubbed = scrubbed.replace(value, b"[redacted]")
    return replace(answer, body=scrubbed, detail=conn.redact(answer.detail))


__all__ = ["parse_connectivity", "read_secret", "scrub_answer"]

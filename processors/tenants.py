"""Tenants: the team or upstream system a run belongs to, fixed when it is submitted.

A run's tenant is the ``tenant`` of its submission (RunSubmitted), kept in its state for its
whole life and copied to its forks. UNSET (not written) is DEFAULT_TENANT, so the logs and
snapshots of runs submitted before tenants existed, and of every run of the default tenant,
are the bytes they always were.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

DEFAULT_TENANT = "default"
#: A tenant's name: short, lower-case, safe in a URL, a log line and a metrics label.
TENANT_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
Tenant = Annotated[str, msgspec.Meta(pattern=TENANT_PATTERN)]
_TENANT = re.compile(TENANT_PATTERN)


def valid_tenant(name: str) -> bool:
    return _TENANT.fullmatch(name) is not None


def tenant_of(value: str | msgspec.UnsetType) -> str:
    """The tenant a run's (or a submission's) ``tenant`` field names."""
    return DEFAULT_TENANT if isinstance(value, msgspec.UnsetType) else value


def stored(name: str) -> str | msgspec.UnsetType:
    """What a submission or a state writes for tenant ``name`` (nothing for the default)."""
    return msgspec.UNSET if name == DEFAULT_TENANT else name


def tenant_key(idempotency_key: str, tenant: str) -> str:
    """What a tenant's Idempotency-Key derives its run id from: the key itself for the default
    tenant (the run ids of before), else the key within the tenant, so two tenants that pick
    the same key get two runs and neither learns of the other's."""
    return idempotency_key if tenant == DEFAULT_TENANT else f"{tenant}\x1f{idempotency_key}"

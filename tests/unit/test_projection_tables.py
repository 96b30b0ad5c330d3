"""The sink's staged tables: each names a type for every column it stages, so a column added
to a row (the projection's `*_COLUMNS`) without its type fails here, not in the sink."""

from __future__ import annotations

import pytest

from agentruns.connectors.postgres.bulk import Table
from agentruns.connectors.projection import sql

TABLES = [t for t in vars(sql).values() if isinstance(t, Table)]


def test_every_staged_table_is_found() -> None:
    assert {t.name for t in TABLES} >= {"runs", "events", "operations"}


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_a_table_names_one_type_per_column(table: Table) -> None:
    assert len(table.stage_types) == len(table.columns), table.name
    assert len(set(table.columns)) == len(table.columns), table.name

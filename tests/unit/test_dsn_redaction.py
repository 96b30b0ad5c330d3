"""A Postgres DSN's password never reaches an error message: the one redaction helper, and
the messages of an unreachable or malformed DATABASE_URL (migrate, the endpoint check the
services and the dev stack use, the API's pool)."""

from __future__ import annotations

import pytest

from agentruns.connectors.api.errors import ApiError
from agentruns.connectors.api.pool import ConnectionPool
from agentruns.connectors.endpoints import check_postgres
from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.postgres.dsn import redact_dsn, scrub_dsn
from agentruns.connectors.postgres.migrate import migrate

PASSWORD = "s3cret-Pa55word"


@pytest.mark.parametrize(
    ("dsn", "shown"),
    [
        (
            f"postgresql://alice:{PASSWORD}@db.internal:5432/agentruns",
            "postgresql://alice:***@db.internal:5432/agentruns",
        ),
        (
            f"postgres://alice:{PASSWORD}@h/d?sslmode=require",
            "postgres://alice:***@h/d?sslmode=require",
        ),
        ("postgresql://alice@h/d", "postgresql://alice@h/d"),
        (f"postgresql://:{PASSWORD}@h/d", "postgresql://:***@h/d"),
        (
            f"postgresql://h/d?password={PASSWORD}&sslmode=x",
            "postgresql://h/d?password=***&sslmode=x",
        ),
        (
            f"host=h user=alice password={PASSWORD} dbname=d",
            "host=h user=alice password=*** dbname=d",
        ),
        (f"host=h password = '{PASSWORD} x' dbname=d", "host=h password=*** dbname=d"),
        (f"postgresql://alice:{PASSWORD}@[bad/d", "postgresql://alice:***@[bad/d"),
    ],
)
def test_the_password_is_redacted_in_every_form(dsn: str, shown: str) -> None:
    assert redact_dsn(dsn) == shown
    secret = f"{PASSWORD} x" if f"{PASSWORD} x" in dsn else PASSWORD if PASSWORD in dsn else ""
    scrubbed = scrub_dsn(f'error: "{dsn}" and again {secret}', dsn)
    assert PASSWORD not in scrubbed and redact_dsn(dsn) in scrubbed


UNREACHABLE = [
    f"postgresql://alice:{PASSWORD}@127.0.0.1:1/agentruns?connect_timeout=2",
    f"postgresql://alice:{PASSWORD}@[bad/agentruns",
    f"host=127.0.0.1 port=1 user=alice password={PASSWORD} connect_timeout=2",
]


@pytest.mark.parametrize("dsn", UNREACHABLE)
def test_migrate_and_the_endpoint_check_do_not_repeat_the_password(dsn: str) -> None:
    for attempt in (lambda: migrate(dsn), lambda: check_postgres(dsn, timeout=2)):
        with pytest.raises(AgentrunsError) as caught:
            attempt()
        line = caught.value.one_line()
        assert PASSWORD not in line and PASSWORD not in repr(caught.value), line
        assert "***" in line or "alice" in line


@pytest.mark.parametrize("dsn", UNREACHABLE)
def test_the_api_pool_answers_503_without_the_password(dsn: str) -> None:
    pool = ConnectionPool(dsn, size=1)
    with pytest.raises(ApiError) as caught, pool.connection():
        pass
    assert caught.value.status == 503 and PASSWORD not in str(caught.value)

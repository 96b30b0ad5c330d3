"""Where production commands find Kafka and Postgres: the settings, else what a development
command recorded in the state directory, else one line saying what to set; never started."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentruns.connectors import endpoints
from agentruns.connectors.errors import NotConfiguredError


@pytest.fixture
def bare(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    state = tmp_path / "state"
    monkeypatch.setenv("AGENTRUNS_STATE_DIR", str(state))
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    return state


def test_nothing_configured_is_one_line_naming_what_to_set(bare: Path) -> None:
    with pytest.raises(NotConfiguredError) as caught:
        endpoints.resolve(patience_s=0)
    line = caught.value.one_line()
    assert "\n" not in line
    assert "no Kafka cluster configured" in line and "KAFKA_BOOTSTRAP_SERVERS" in line
    assert not bare.exists()  # nothing created, nothing started


def test_postgres_not_configured_names_database_url(bare: Path) -> None:
    with pytest.raises(NotConfiguredError) as caught:
        endpoints.configured_postgres(required="pass --database-url")
    line = caught.value.one_line()
    assert line.endswith("or set DATABASE_URL, or pass --database-url"), line
    assert endpoints.configured_postgres(required=None) is None


def test_a_record_is_written_read_and_forgotten(bare: Path) -> None:
    endpoints.record(bare, kafka="127.0.0.1:19092", database=None)
    assert endpoints.recorded() == {"kafka": "127.0.0.1:19092"}
    endpoints.forget(bare)
    endpoints.forget(bare)  # forgetting twice is harmless
    assert endpoints.recorded() == {}


@pytest.mark.parametrize(
    "text",
    ["", "{", "[1, 2]", '"x"', '{"kafka": 5, "database": null}', '{"other": "x"}'],
)
def test_an_unreadable_or_foreign_record_is_no_record(bare: Path, text: str) -> None:
    bare.mkdir(parents=True)
    (bare / "endpoints.json").write_text(text)
    assert endpoints.recorded() == {}
    with pytest.raises(NotConfiguredError):
        endpoints.configured_kafka()


def test_a_recorded_broker_that_does_not_answer_is_not_configured(
    bare: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(endpoints, "RECORDED_TIMEOUT_S", 0.5)
    endpoints.record(bare, kafka="127.0.0.1:9", database="postgresql://u@127.0.0.1:9/db")
    with pytest.raises(NotConfiguredError) as caught:
        endpoints.configured_kafka()
    assert "no local broker runs in" in caught.value.one_line()
    with pytest.raises(NotConfiguredError):
        endpoints.configured_postgres(required="")

"""The console's pure parts: session cookies and CSRF tokens, the byte preview, the typing of
a question form, the failed-login limiter, the dead-letter page's cursor and the rows the sink
makes of dead letters."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from agentruns.connectors.api.console import (
    LoginLimiter,
    Sessions,
    _form_response,
    _of_dead_letter_cursor,
    preview,
)
from agentruns.connectors.api.credentials import CredentialStore, fixed_credentials, token_digest
from agentruns.connectors.api.errors import ApiError
from agentruns.connectors.projection.rows import (
    DEAD_LETTER_COLUMNS,
    STORED_BYTES,
    UNDECODABLE,
    dead_letter_values,
    undecodable_dead_letter_values,
)
from agentruns.streams import dlq


def _store(tmp: Path, lines: str, clock: Callable[[], int]) -> CredentialStore:
    path = tmp / "credentials"
    path.write_text(lines)
    return CredentialStore(fixed_credentials("api-token" * 4, {}), path, clock, check_every_ms=0)


def test_a_session_cookie_is_refused_when_forged_expired_or_signed_with_another_key(
    tmp_path: Path,
) -> None:
    now = [1_000_000]
    store = _store(tmp_path, "", lambda: now[0])
    sessions = Sessions(b"k" * 32, lambda: now[0], store)
    cookie = sessions.new(store.lookup("api-token" * 4))  # type: ignore[arg-type]
    session = sessions.valid(cookie)
    assert session is not None
    assert sessions.csrf_ok(session, sessions.csrf(session))
    assert not sessions.csrf_ok(session, sessions.csrf(session + "x"))
    expires, nonce, mac = cookie.split(".")
    assert sessions.valid(f"{int(expires) + 1}.{nonce}.{mac}") is None  # extended by hand
    assert sessions.valid(f"{expires}.{nonce}x.{mac}") is None
    assert Sessions(b"o" * 32, lambda: now[0], store).valid(cookie) is None
    assert sessions.valid("") is None and sessions.valid(None) is None
    assert sessions.valid("x" * 1_000_000) is None  # a 1 MB cookie: refused unread
    now[0] = int(expires)
    assert sessions.valid(cookie) is None


def test_a_session_ends_when_its_credential_is_rotated_removed_or_its_roles_change(
    tmp_path: Path,
) -> None:
    token = "agr_" + "x" * 40
    line = f"alice team-a submit,read {token_digest(token)}\n"
    store = _store(tmp_path, line, lambda: 1_000)
    sessions = Sessions(b"k" * 32, lambda: 1_000, store)
    cookie = sessions.new(store.lookup(token))  # type: ignore[arg-type]
    assert sessions.valid(cookie) is not None
    path = tmp_path / "credentials"
    for changed in (
        line.replace("submit,read", "submit,read,cancel"),  # a role added
        line.replace("team-a", "team-b"),  # moved to another tenant
        f"alice team-a submit,read {token_digest(token + 'x')}\n",  # rotated
        "",  # removed
    ):
        path.write_text(changed)
        os.utime(path, ns=(1, os.stat(path).st_mtime_ns + 1_000_000))
        assert sessions.valid(cookie) is None, changed
        path.write_text(line)
        os.utime(path, ns=(1, os.stat(path).st_mtime_ns + 2_000_000))
        assert sessions.valid(cookie) is not None  # the very same credential again


def test_the_preview_shows_bytes_as_hex_and_printable_text_only() -> None:
    raw = b"<script>\x00\x1b[31m\xff\n" + b"a" * 600
    p = preview(raw)
    assert p["size"] == len(raw) and p["cut"]
    assert p["text"].startswith("<script>..[31m..")
    assert all(c.isprintable() for c in p["text"])
    assert p["hex"].splitlines()[0].startswith("00000000  3c 73 63 72 69 70 74 3e 00 1b")
    assert preview(None) == {"hex": "", "text": "", "size": 0, "cut": False}


def test_a_question_form_is_typed_by_the_response_schema() -> None:
    schema = {
        "type": "object",
        "properties": {
            "approved": {"type": "boolean"},
            "count": {"type": "integer"},
            "comment": {"type": "string"},
            "extra": {"type": "object"},
        },
    }
    form = {
        "field.approved": "true",
        "field.count": "3",
        "field.comment": "<b>ok</b>",
        "field.extra": '{"a": 1}',
        "field.unknown": "dropped",
    }
    assert _form_response(schema, form) == {
        "approved": True,
        "count": 3,
        "comment": "<b>ok</b>",
        "extra": {"a": 1},
    }
    assert _form_response(schema, {"field.approved": "false", "field.count": ""}) == {
        "approved": False
    }
    with pytest.raises(ApiError) as refused:
        _form_response(schema, {"field.count": "three"})
    assert refused.value.status == 422 and refused.value.code == "response_invalid"


def test_the_partial_index_of_live_runs_spells_the_terminal_statuses_of_the_stuck_rule() -> None:
    from agentruns.connectors.postgres.migrate import migration_files
    from agentruns.connectors.projection.stuck import TERMINAL_SQL

    sql = dict(migration_files())["0007_console"]
    assert f"WHERE status NOT IN {TERMINAL_SQL};" in sql


def test_wrong_credentials_from_many_addresses_past_the_global_rate_make_every_address_wait() -> (
    None
):
    """Behind a proxy the API does not trust, or from many addresses, guesses stay under one
    global rate: past it every address waits, until the window has drained."""
    now = [1_000_000]
    limiter = LoginLimiter(lambda: now[0], failures=5, window_ms=60_000, global_failures=10)
    for i in range(9):  # nine addresses, one wrong credential each: nobody waits
        limiter.failed(f"203.0.113.{i}")
    assert limiter.retry_after("198.51.100.7") is None
    now[0] += 10_000
    limiter.failed("203.0.113.99")  # the tenth within the minute
    assert limiter.retry_after("198.51.100.7") == 50  # an address that never failed waits too
    assert limiter.retry_after("203.0.113.1") == 50
    now[0] = 1_000_000 + 60_000  # the first nine leave the window
    assert limiter.retry_after("198.51.100.7") is None


def test_failed_logins_are_limited_per_address_for_a_minute_in_a_bounded_table() -> None:
    now = [1_000_000]
    limiter = LoginLimiter(lambda: now[0], failures=5, window_ms=60_000, capacity=3)
    for _ in range(4):
        limiter.failed("198.51.100.1")
        now[0] += 1000
    assert limiter.retry_after("198.51.100.1") is None  # four failures: still allowed
    limiter.failed("198.51.100.1")
    assert limiter.retry_after("198.51.100.1") == 56  # until the first failure is a minute old
    assert limiter.retry_after("198.51.100.2") is None  # another address is not limited
    now[0] = 1_000_000 + 59_999
    assert limiter.retry_after("198.51.100.1") == 1
    now[0] += 1
    assert limiter.retry_after("198.51.100.1") is None  # the first is a minute old: four left
    limiter.failed("198.51.100.1")
    assert limiter.retry_after("198.51.100.1") == 1  # five again, the oldest 59 s old
    limiter.succeeded("198.51.100.1")
    assert len(limiter) == 0
    for i in range(1000):  # a flood of addresses: the table keeps the newest three
        limiter.failed(f"2001:db8::{i:x}")
    assert len(limiter) == 3


@pytest.mark.parametrize(
    "cursor",
    ["", "%%%", "bm90IGpzb24", "WzEsMl0", "WyJ4IiwgIngiLCAxLCAxXQ", "W251bGwsIG51bGwsIDEsIDFd",
     "WyIyMDI2LTAxLTAxVDAwOjAwOjAwKzAwOjAwIiwgIngiLCAxZTMwMCwgMV0", "A" * 5000],
)  # fmt: skip
def test_a_forged_dead_letter_cursor_is_a_400(cursor: str) -> None:
    with pytest.raises(ApiError) as refused:
        _of_dead_letter_cursor(cursor)
    assert refused.value.status == 400


def test_a_hostile_dead_letter_is_stored_bounded_and_as_postgres_text_can_hold() -> None:
    huge = b"\xff\xfe" + b"<script>alert(1)</script>" * 40_000  # ~1 MB, not UTF-8
    record = dlq.dead_letter(
        "bad \x00 <script>x</script> " + "r" * 5000,
        "NOT\x00A_CLASS" * 20,
        "t" * 400,
        2,
        41,
        b"k" * 10_000,
        huge,
        [("h", b"v")],
        1_700_000_000_000,
        run_id="run-\x00-" + "x" * 1000,
    )
    row = dict(zip(DEAD_LETTER_COLUMNS, dead_letter_values(record, 0, 7), strict=True))
    assert row["original_value"] == huge[:STORED_BYTES] and row["value_bytes"] == len(huge)
    assert row["original_key"] == b"k" * STORED_BYTES and row["key_bytes"] == 10_000
    texts = ("reason", "error_class", "source_topic", "run_id")
    assert all("\x00" not in row[c] for c in texts)
    assert len(row["reason"]) == dlq.MAX_REASON_CHARS and row["reason"].startswith("bad \ufffd <")
    assert len(row["source_topic"]) == 249 and len(row["error_class"]) == 100
    assert (row["source_partition"], row["source_offset"], row["dlq_offset"]) == (2, 41, 7)
    # a value `dlq.fit` cut to fit its topic: the whole size is the one its header names
    cut = dict(record, original_value=huge[:1000])
    values = dead_letter_values(cut, 0, 8, [("original_length", str(len(huge)).encode())])
    assert values[DEAD_LETTER_COLUMNS.index("value_bytes")] == len(huge)
    forged = dead_letter_values(cut, 0, 8, [("original_length", b"9" * 40)])
    assert forged[DEAD_LETTER_COLUMNS.index("value_bytes")] == 1000


def test_a_record_on_the_dlq_that_is_no_dead_letter_is_kept_by_its_own_position() -> None:
    values = undecodable_dead_letter_values(
        "p.dlq", 1, 9, None, b"\x00" * 9000, 5, "not avro\x00", "NOT_AVRO"
    )
    row = dict(zip(DEAD_LETTER_COLUMNS, values, strict=True))
    assert (row["source_topic"], row["source_partition"], row["source_offset"]) == ("p.dlq", 1, 9)
    assert row["reason"].startswith(UNDECODABLE) and "\x00" not in row["reason"]
    assert len(row["original_value"]) == STORED_BYTES and row["value_bytes"] == 9000

"""The console's pure parts: session cookies and CSRF tokens, the byte preview, the typing of
a question form."""

from __future__ import annotations

import pytest
from agentruns.connectors.api.console import Sessions, _form_response, preview
from agentruns.connectors.api.errors import ApiError


def test_a_session_cookie_is_refused_when_forged_expired_or_signed_with_another_key() -> None:
    now = [1_000_000]
    sessions = Sessions(b"k" * 32, lambda: now[0])
    cookie = sessions.new()
    session = sessions.valid(cookie)
    assert session is not None
    assert sessions.csrf_ok(session, sessions.csrf(session))
    assert not sessions.csrf_ok(session, sessions.csrf(session + "x"))
    expires, nonce, mac = cookie.split(".")
    assert sessions.valid(f"{int(expires) + 1}.{nonce}.{mac}") is None  # extended by hand
    assert sessions.valid(f"{expires}.{nonce}x.{mac}") is None
    assert Sessions(b"o" * 32, lambda: now[0]).valid(cookie) is None
    assert sessions.valid("") is None and sessions.valid(None) is None
    now[0] = int(expires)
    assert sessions.valid(cookie) is None


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
    from agentruns.connectors.runtime.scanner import TERMINAL_SQL

    sql = dict(migration_files())["0007_console"]
    assert f"WHERE status NOT IN {TERMINAL_SQL};" in sql

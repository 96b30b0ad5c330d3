"""The API's bearer token (and the operator tokens and the signing secret) have a minimum
length: refused at start with --production, a warning otherwise."""

from __future__ import annotations

import logging

import pytest

from agentruns.connectors.api.config import MIN_TOKEN_CHARS, ApiConfig
from agentruns.connectors.errors import AgentrunsError

LONG = "t" * MIN_TOKEN_CHARS
SHORT = "t" * (MIN_TOKEN_CHARS - 1)


@pytest.mark.parametrize(
    ("variable", "env"),
    [
        ("AGENTRUNS_API_TOKEN", {"AGENTRUNS_API_TOKEN": SHORT, "AGENTRUNS_API_SECRET": LONG}),
        ("AGENTRUNS_API_TOKEN", {"AGENTRUNS_API_TOKEN": "hunter2", "AGENTRUNS_API_SECRET": LONG}),
        ("AGENTRUNS_API_SECRET", {"AGENTRUNS_API_TOKEN": LONG, "AGENTRUNS_API_SECRET": SHORT}),
        (
            "AGENTRUNS_API_OPERATOR_TOKENS",
            {
                "AGENTRUNS_API_TOKEN": LONG,
                "AGENTRUNS_API_SECRET": LONG,
                "AGENTRUNS_API_OPERATOR_TOKENS": "alice:" + "o" * 20,
            },
        ),
    ],
)
def test_a_short_token_is_refused_in_production_and_warned_of_otherwise(
    variable: str, env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(AgentrunsError) as caught:
        ApiConfig.from_env("b", "d", production=True, environ=env)
    line = caught.value.one_line()
    assert variable in line and str(MIN_TOKEN_CHARS) in line
    assert SHORT not in line and "hunter2" not in line
    with caplog.at_level(logging.WARNING, logger="agentruns.api"):
        ApiConfig.from_env("b", "d", environ=env)
    assert any(variable in r.getMessage() and "short" in r.getMessage() for r in caplog.records)


def test_long_tokens_start_in_production() -> None:
    env = {
        "AGENTRUNS_API_TOKEN": LONG,
        "AGENTRUNS_API_SECRET": "s" * MIN_TOKEN_CHARS,
        "AGENTRUNS_API_OPERATOR_TOKENS": "alice:" + "o" * MIN_TOKEN_CHARS,
    }
    config = ApiConfig.from_env("b", "d", production=True, environ=env)
    assert config.api_token == LONG and config.operator_tokens == {"o" * MIN_TOKEN_CHARS: "alice"}

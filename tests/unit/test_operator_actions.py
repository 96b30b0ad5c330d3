"""The operator's door without services: the operator token list and its bounds, the bodies of
resolve, reopen and redrive, what each run status allows, and the operator a console session
carries."""

from __future__ import annotations

from typing import Any

import pytest

from agentruns.connectors.api.config import ApiConfig
from agentruns.connectors.api.console import Sessions
from agentruns.connectors.api.credentials import CredentialStore, fixed_credentials
from agentruns.connectors.api.errors import ApiError
from agentruns.connectors.api.http import _if_match_version
from agentruns.connectors.api.operator import allowed, parse_body, plan
from agentruns.connectors.api.tokens import (
    MAX_OPERATORS,
    OperatorTokensError,
    parse_operator_tokens,
)
from agentruns.connectors.errors import AgentrunsError
from agentruns.processors.events import (
    ModelOutcome,
    ReconcileCompleted,
    ReconcileOutcome,
    RedriveRequested,
    RunReopened,
    RunResolved,
    ToolCallTimedOut,
)
from agentruns.processors.state import RunStatus
from tests.unit._core_support import Driver, search


def now() -> int:
    return 1_000


LONG = "t" * 32


def test_operator_tokens_are_name_token_pairs_within_bounds() -> None:
    tokens = parse_operator_tokens(f" alice:{LONG}a , bob@example.org:{LONG}b ")
    assert tokens == {f"{LONG}a": "alice", f"{LONG}b": "bob@example.org"}
    assert parse_operator_tokens("") == {}


@pytest.mark.parametrize(
    "text",
    [
        "alice",  # no token
        f":{LONG}",  # no name
        f"al ice:{LONG}",
        f"{'a' * 65}:{LONG}",
        "alice:short",
        f"alice:{'x' * 257}",
        f"alice:{LONG} with space",
        f"alice:{LONG}\x00",
        f"alice:{LONG}é",
        f"alice:{LONG},bob:{LONG}",  # one token, two operators
        f"alice:{LONG}a,alice:{LONG}b",
        ",".join(f"op{i}:{LONG}{i}" for i in range(MAX_OPERATORS + 1)),
    ],
)
def test_malformed_operator_tokens_are_refused_without_echoing_a_token(text: str) -> None:
    with pytest.raises(OperatorTokensError) as caught:
        parse_operator_tokens(text)
    assert LONG not in str(caught.value)


def test_the_api_refuses_to_start_with_a_bad_operator_list_or_the_api_token_in_it() -> None:
    env = {"AGENTRUNS_API_TOKEN": LONG, "AGENTRUNS_API_SECRET": "s" * 32}
    with pytest.raises(AgentrunsError, match="OPERATOR_TOKENS"):
        ApiConfig.from_env("b", "d", environ={**env, "AGENTRUNS_API_OPERATOR_TOKENS": "x"})
    with pytest.raises(AgentrunsError, match="own"):
        ApiConfig.from_env(
            "b", "d", environ={**env, "AGENTRUNS_API_OPERATOR_TOKENS": f"alice:{LONG}"}
        )
    prod = ApiConfig.from_env("b", "d", production=True, environ=env)
    assert prod.operator_tokens == {}  # production has no operator unless one is configured
    dev = ApiConfig.from_env("b", "d", environ=env)
    assert list(dev.operator_tokens.values()) == ["dev"]


@pytest.mark.parametrize(
    ("action", "body"),
    [
        ("resolve", {}),
        ("resolve", {"action": "continue", "extra": 1}),
        ("resolve", {"action": "fail", "reason": "r" * 501}),
        ("resolve", {"action": "fail", "reason": ""}),
        ("resolve", {"action": "reconcile", "outcome": "undeterminable"}),
        ("reopen", {"goal": ""}),
        ("reopen", {"resolution": 3}),  # the API derives it from the committed state
        ("redrive", {"version": 3}),
        ("redrive", {"reason": ["x"]}),
    ],
)
def test_malformed_bodies_are_422(action: str, body: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as caught:
        parse_body(action, body)
    assert caught.value.status == 422 and caught.value.code == "invalid_body"


def _ids() -> dict[str, Any]:
    return {"run_id": "run-t", "event_id": "operator:run-t:v1", "at": 10**12, "trace_id": "t"}


def _plan(action: str, d: Driver, body: dict[str, Any]) -> Any:
    return plan(action, d.s, parse_body(action, body), ids=_ids(), actor="operator:alice")


def _paused_on_tool_call() -> Driver:
    d = Driver(run_id="run-t")
    d.submit()
    d.calls(search())
    d.op_event(ToolCallTimedOut)
    d.op_event(ReconcileCompleted, outcome=ReconcileOutcome.UNDETERMINABLE)
    assert d.s.status is RunStatus.PAUSED
    return d


def test_a_run_paused_on_a_tool_call_takes_a_verdict_or_an_end() -> None:
    d = _paused_on_tool_call()
    can = allowed(d.s)
    assert can["resolve"] == ["reconcile", "fail", "succeed"]
    assert can["unknown_operations"] == [d.s.ops[0].key]
    assert not can["reopen"] and not can["redrive"]
    verdict = _plan("resolve", d, {"action": "reconcile", "outcome": "not_executed"}).event
    assert isinstance(verdict, ReconcileCompleted) and verdict.actor == "operator:alice"
    assert verdict.operation_key == d.s.ops[0].key and verdict.dispatch == d.s.ops[0].dispatch
    with pytest.raises(ApiError) as caught:
        _plan("resolve", d, {"action": "continue"})
    assert caught.value.status == 409 and caught.value.extra["run_status"] == "PAUSED"
    with pytest.raises(ApiError) as caught:
        _plan("resolve", d, {"action": "reconcile"})  # no outcome
    assert caught.value.status == 422
    with pytest.raises(ApiError) as caught:
        _plan("resolve", d, {"action": "reconcile", "outcome": "found_succeeded", "result": 1})
    assert caught.value.status == 422  # a result needs somewhere to be stored
    with pytest.raises(ApiError) as caught:
        _plan(
            "resolve",
            d,
            {"action": "reconcile", "outcome": "not_executed", "operation_key": "nope"},
        )
    assert caught.value.status == 409
    ended = _plan("resolve", d, {"action": "fail", "reason": "gave up"}).event
    assert isinstance(ended, RunResolved) and ended.status is RunStatus.FAILED
    assert ended.resolution == d.s.resolution and ended.actor == "operator:alice"
    # the core applies what the API built
    assert d.send(ended).state is not None and d.s.status is RunStatus.FAILED


def test_an_ended_run_is_reopened_or_its_status_corrected_never_redriven() -> None:
    d = Driver(run_id="run-t")
    d.submit()
    d.final()
    can = allowed(d.s)
    assert can == {
        "resolve": ["fail"],
        "unknown_operations": [],
        "reopen": True,
        "redrive": False,
        "fork": True,
        "resume": False,  # it succeeded: forked, never resumed
    }
    reopened = _plan("reopen", d, {"reason": "again", "goal": "new goal"}).event
    assert isinstance(reopened, RunReopened) and reopened.goal == "new goal"
    with pytest.raises(ApiError) as caught:
        _plan("redrive", d, {})
    assert caught.value.extra["run_status"] == "SUCCEEDED"
    with pytest.raises(ApiError):
        _plan("resolve", d, {"action": "succeed"})


def test_a_waiting_run_is_redriven_only_without_a_driving_timer() -> None:
    d = Driver(run_id="run-t")
    d.submit()
    assert allowed(d.s)["redrive"]
    event = _plan("redrive", d, {"reason": "lost"}).event
    assert isinstance(event, RedriveRequested) and event.version == d.s.version
    d.model(ModelOutcome.RATE_LIMITED, retry_after_ms=5_000)
    assert d.s.timers and not allowed(d.s)["redrive"]
    with pytest.raises(ApiError) as caught:
        _plan("redrive", d, {})
    assert caught.value.status == 409 and caught.value.extra["timers"] == ["MODEL_BACKOFF"]


def test_a_console_session_carries_its_credential_inside_the_signature() -> None:
    store = CredentialStore(fixed_credentials("a" * 32, {"b" * 32: "bob@example.org"}), None, now)
    sessions = Sessions(b"k" * 32, now, store)
    plain = sessions.valid(sessions.new(store.lookup("a" * 32)))  # type: ignore[arg-type]
    assert plain is not None and sessions.credential(plain).id == "api"  # type: ignore[union-attr]
    cookie = sessions.new(store.lookup("b" * 32))  # type: ignore[arg-type]
    session = sessions.valid(cookie)
    assert session is not None
    assert sessions.credential(session).actor == "operator:bob@example.org"  # type: ignore[union-attr]
    expires, nonce, mac = cookie.split(".")
    forged = f"{expires}.{nonce.split('~')[0]}~YXBp~{nonce.split('~')[2]}.{mac}"
    assert sessions.valid(forged) is None


@pytest.mark.parametrize(("value", "version"), [(None, None), ("7", 7), ('"7"', 7), ('W/"12"', 12)])
def test_if_match_names_the_version_the_operator_saw(
    value: str | None, version: int | None
) -> None:
    assert _if_match_version(value) == version


@pytest.mark.parametrize("value", ["", "abc", "-1", "7.0", "\u00b2", "\u0661\u0662", "9" * 19, "*"])
def test_an_if_match_that_is_no_version_is_a_400(value: str) -> None:
    with pytest.raises(ApiError) as refused:
        _if_match_version(value)
    assert refused.value.status == 400 and refused.value.code == "invalid_header"

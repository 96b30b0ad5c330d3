"""The API's test stack: `agentruns api` on uvicorn (a free port, a thread) in front of the
in-process processor, the sink and a scripted executor double, on one topic prefix."""

from __future__ import annotations

import random
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from agentruns.connectors.api.config import ApiConfig
from agentruns.connectors.api.credentials import ROLES, token_digest
from agentruns.connectors.api.serve import serving
from agentruns.connectors.keys import Keys, sign_callback
from agentruns.processors.catalog import Catalog
from agentruns.processors.effects import CallModel, CallTool, CancelTool, Reconcile
from agentruns.processors.events import (
    CancelConfirmed,
    Candidate,
    Event,
    ModelCallCompleted,
    ModelOutcome,
    ReconcileCompleted,
    ReconcileOutcome,
    ToolCallAccepted,
    ToolCallRequest,
    ToolCallSucceeded,
    ToolCallTimedOut,
)
from agentruns.processors.state import ToolSpec
from agentruns.streams.admin import ensure_topics
from agentruns.streams.processor import Processor, ProcessorConfig
from tests.support.pipeline import (
    SEARCH,
    ExecutorDouble,
    model_answer,
    now_ms,
    running_processor,
)
from tests.support.runlog import running_sink
from tests.support.waiting import wait_for

PARTITIONS = 3
TOKEN = "test-bearer-" + uuid.uuid4().hex
TENANT_A, TENANT_B = "team-a", "team-b"


def _minted(name: str) -> str:
    return f"agr_{name}_{uuid.uuid4().hex}"


#: The credentials file of the test stack: id -> (tenant, roles, token). The stack's own
#: client sends TOKEN: every role but admin, in the default tenant (the API's own token is an
#: admin; OPERATOR_TOKEN is one too). Tenant A has one credential per role, tenant B one with
#: every role but admin.
CREDENTIALS: dict[str, tuple[str, str, str]] = {
    "stack": ("default", "submit,read,reply,cancel", TOKEN),
    **{f"a-{role}": (TENANT_A, role, _minted(f"a-{role}")) for role in ROLES},
    "b-all": (TENANT_B, "submit,read,reply,cancel", _minted("b-all")),
}


def write_credentials(path: Path, credentials: dict[str, tuple[str, str, str]]) -> Path:
    path.write_text(
        "".join(
            f"{cid} {t} {roles} {token_digest(tok)}\n"
            for cid, (t, roles, tok) in credentials.items()
        )
    )
    return path


SECRET = b"test-secret-" + uuid.uuid4().hex.encode()
OPERATOR = "alice"
OPERATOR_TOKEN = "test-operator-" + uuid.uuid4().hex
REPORT = ToolSpec(
    name="long_report",
    parameters={"type": "object", "properties": {"report": {"type": "string"}}},
    is_async=True,
    cancellable=True,
)
GUARDED = SEARCH.model_copy(update={"permission": "write"})


class ScriptedDouble(ExecutorDouble):
    """The executor double, plus: runs listed in `async_runs` call `long_report`, which the
    backend only accepts (202); a CancelTool is confirmed. For the operator's cases: the tool
    calls of `undeterminable_runs` time out and no look-up can tell their outcome (the run
    pauses); the first model call of `silent_runs` and every tool call of `silent_tool_runs`
    is never answered (a look-up finds it succeeded); `stalled_runs` call a tool at every
    step and never finish (each result is the same, so no step makes progress)."""

    def __init__(
        self, bootstrap: str, prefix: str, kinds: tuple[str, ...] = ("model", "tool")
    ) -> None:
        super().__init__(bootstrap, prefix, PARTITIONS, steps=2, kinds=kinds)
        self.async_runs: set[str] = set()
        self.undeterminable_runs: set[str] = set()
        self.silent_runs: set[str] = set()
        self.silent_tool_runs: set[str] = set()
        self.stalled_runs: set[str] = set()

    def answer(self, effect: Any) -> Iterable[Event]:
        key = effect.idempotency_key
        ids = {"run_id": effect.run_id, "event_id": f"{key}:result", "trace_id": effect.trace_id}
        run = effect.run_id
        first_call = isinstance(effect, CallModel) and (effect.step, effect.attempt) == (1, 1)
        if first_call and run in self.silent_runs:
            return
        if isinstance(effect, CallTool) and run in self.silent_tool_runs:
            return
        if isinstance(effect, CallTool) and run in self.undeterminable_runs:
            op = effect.operation
            yield ToolCallTimedOut(
                **ids, at=now_ms(), step=effect.step, operation_key=op.key, dispatch=op.dispatch
            )
            return
        if isinstance(effect, Reconcile):
            undeterminable = run in self.undeterminable_runs
            yield ReconcileCompleted(
                **ids,
                at=now_ms(),
                step=effect.step,
                operation_key=effect.operation_key,
                dispatch=effect.dispatch,
                outcome=ReconcileOutcome.UNDETERMINABLE
                if undeterminable
                else ReconcileOutcome.FOUND_SUCCEEDED,
                result_ref=None if undeterminable else "sha256:" + "d" * 64,
            )
            return
        if isinstance(effect, CallModel) and run in self.stalled_runs:
            yield model_answer(effect, ids, final=False, call_id="s")
            return
        if isinstance(effect, CallTool) and run in self.stalled_runs:
            yield ToolCallSucceeded(
                **ids,
                at=now_ms(),
                step=effect.step,
                operation_key=effect.operation.key,
                dispatch=effect.operation.dispatch,
                result_ref="sha256:" + "e" * 64,
            )
            return
        if isinstance(effect, CallModel) and effect.run_id in self.async_runs and effect.step == 1:
            call = ToolCallRequest(id="c1", name="long_report", arguments_json='{"report":"q3"}')
            yield ModelCallCompleted(
                **ids,
                at=now_ms(),
                step=effect.step,
                attempt=effect.attempt,
                outcome=ModelOutcome.FINISHED,
                candidate_ref="sha256:" + "c" * 64,
                candidate=Candidate(tool_calls=(call,)),
            )
        elif isinstance(effect, CallTool) and effect.operation.tool == "long_report":
            yield ToolCallAccepted(
                **ids,
                at=now_ms(),
                step=effect.step,
                operation_key=effect.operation.key,
                dispatch=effect.operation.dispatch,
            )
        elif isinstance(effect, CancelTool):
            yield CancelConfirmed(
                **ids,
                at=now_ms(),
                step=effect.step,
                operation_key=effect.operation_key,
                dispatch=effect.dispatch,
            )
        else:
            yield from super().answer(effect)


def client_address() -> str:
    """A client address of its own: uvicorn takes X-Forwarded-For from 127.0.0.1 (its default
    trusted proxy), so a test's wrong tokens count against this address, not against every
    other request of the module (the API throttles wrong tokens per address)."""
    return f"198.18.{random.randrange(256)}.{random.randrange(1, 255)}"


def anonymous(url: str) -> httpx.Client:
    """A client without the bearer token whose every request comes from an address of its own
    (`client_address`)."""

    def spread(request: httpx.Request) -> None:
        request.headers.setdefault("X-Forwarded-For", client_address())

    return httpx.Client(base_url=url, timeout=30, event_hooks={"request": [spread]})


@dataclass
class Stack:
    bootstrap: str
    database_url: str
    prefix: str
    url: str
    double: ScriptedDouble
    http: httpx.Client
    processor: Processor | None = None
    api: ApiConfig | None = None

    def set_catalog(self, catalog: Catalog) -> None:
        """Hold new tasks to ``catalog`` from now on, at the API and the processor (what a
        `CatalogRefresher` hands them)."""
        assert self.processor is not None and self.api is not None
        self.processor.set_catalog(catalog)
        self.api.set_catalog(catalog)

    @contextmanager
    def client(self, token: str) -> Iterator[httpx.Client]:
        """A client of the API that sends ``token`` (OPERATOR_TOKEN: an admin's)."""
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=30) as http:
            yield http

    def submit(self, key: str, **task: Any) -> str:
        body = {"goal": "find three documents", "tools": [SEARCH.model_dump()], **task}
        r = self.http.post("/runs", json=body, headers={"Idempotency-Key": key})
        assert r.status_code in (200, 202), r.text
        return str(r.json()["run_id"])

    def run(self, run_id: str) -> dict[str, Any]:
        r = self.http.get(f"/runs/{run_id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def wait_status(self, run_id: str, *statuses: str, timeout: float = 40) -> dict[str, Any]:
        seen: dict[str, Any] = {}

        def reached() -> bool:
            r = self.http.get(f"/runs/{run_id}")
            if r.status_code == 404:  # submitted straight to Kafka, not projected yet
                return False
            assert r.status_code == 200, r.text
            seen.update(r.json())
            return seen["status"] in statuses

        wait_for(reached, timeout=timeout, what=f"{run_id} to reach {statuses}", every=0.1)
        return seen


@contextmanager
def pipeline(
    bootstrap: str,
    database_url: str,
    *,
    catalog: Catalog | None = None,
    make_double: Callable[[str, str], ScriptedDouble] = ScriptedDouble,
    processor_options: Mapping[str, Any] | None = None,
) -> Iterator[Stack]:
    """Processor + sink + executor double + API for one topic prefix; with `catalog`, the
    processor and the API hold tasks to it. `make_double(bootstrap, prefix)`: the double;
    `processor_options`: more of the processor's `ProcessorConfig`."""
    prefix = f"t-api-{uuid.uuid4().hex[:10]}"
    ensure_topics(bootstrap, prefix=prefix, partitions=PARTITIONS)
    config = ProcessorConfig(
        bootstrap=bootstrap,
        prefix=prefix,
        group_id=f"{prefix}-proc",
        catalog=catalog,
        **(processor_options or {}),
    )
    double = make_double(bootstrap, prefix)
    api = ApiConfig(
        bootstrap=bootstrap,
        database_url=database_url,
        api_token="",
        secret=SECRET,
        prefix=prefix,
        operator_tokens={OPERATOR_TOKEN: OPERATOR},
        catalog=catalog,
        credentials_file=write_credentials(
            Path(tempfile.mkdtemp(prefix="agentruns-credentials-")) / "credentials", CREDENTIALS
        ),
    )
    with running_processor(config, database_url) as processor:
        double.start()
        try:
            with running_sink(bootstrap, database_url, prefix), serving(api) as url:
                headers = {"Authorization": f"Bearer {TOKEN}"}
                with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
                    yield Stack(bootstrap, database_url, prefix, url, double, http, processor, api)
        finally:
            double.close()


def signed_callback(
    url: str, op: dict[str, Any], *, dispatch: int | None = None, expires_ms: int | None = None
) -> tuple[str, dict[str, str]]:
    """What a tool backend posts a callback with: the operation's callback URL (no signature
    in it) and the X-Callback-Signature header the executor gave it, signed with the callback
    key of SECRET for ``dispatch`` (default the operation's) until ``expires_ms`` (default in
    an hour)."""
    expires = expires_ms if expires_ms is not None else int(time.time() * 1000) + 3_600_000
    signature = sign_callback(
        Keys.derive(SECRET).callback,
        op["op_key"],
        op["dispatch"] if dispatch is None else dispatch,
        expires,
    )
    target = f"{url}/operations/{op['op_key']}/callback"
    return target, {"X-Callback-Signature": signature}

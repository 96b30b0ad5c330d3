"""The API's logic: `ApiService`, blocking (Postgres, Kafka), called from the HTTP threadpool.

Reads come only from committed data: the Postgres projection (`runs`, `events`, `operations`,
written by `agentruns sink` from read_committed Kafka transactions) and the artifact store. So a
run is shown SUCCEEDED only after its terminal state and result are committed (R20); nothing is
kept in memory between requests.

Writes are inputs produced to `<prefix>.inbox` (key run_id, explicit partition from
`partition_for`), each carrying a trace_id. Every input is first recorded in `api_inputs`
(migration 0005) with its exact bytes, so a repeated request returns the same outcome and a
retry after a lost Kafka acknowledgement re-produces a byte-identical record, which the
processor drops as an exact duplicate.

Replies are checked here synchronously against the projection (signature, run, expiry, the
run's open question, single use, response schema) and then produced; the core re-checks them
and stays the final judge (R15, R30).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec
from prometheus_client import Counter

from agentruns.connectors.api import forks, queries
from agentruns.connectors.api.config import ApiConfig
from agentruns.connectors.api.credential_use import CredentialUse
from agentruns.connectors.api.credentials import Credential, CredentialStore, fixed_credentials
from agentruns.connectors.api.errors import ApiError, invalid_input
from agentruns.connectors.api.inbox import Inbox
from agentruns.connectors.api.inputs import (
    MAX_KEY_CHARS,
    InvalidInputError,
    encoded_input,
    submitted_task,
)
from agentruns.connectors.api.listing import RunFilter, list_runs
from agentruns.connectors.api.operator import parse_body, plan
from agentruns.connectors.api.pool import Conn, ConnectionPool
from agentruns.connectors.api.tokens import ResumeToken, TokenError, sign_token, verify_token
from agentruns.connectors.health import Health
from agentruns.connectors.keys import tenant_kafka_key
from agentruns.connectors.postgres.artifacts import StoredArtifact
from agentruns.processors import tool_results
from agentruns.processors.events import (
    CancelConfirmed,
    CancelRequested,
    Event,
    ToolCallFailed,
    UserReplied,
)
from agentruns.processors.ids import (
    canonical_json,
    request_hash,
    run_id_for_key,
    submit_event_id,
    trace_id_for,
)
from agentruns.processors.limits import MAX_DURATION_MS, MAX_JSON_DEPTH, json_depth
from agentruns.processors.state import SETTLED, TERMINAL, ErrorClass, RunState, RunStatus
from agentruns.processors.tenants import DEFAULT_TENANT, stored, tenant_key, valid_tenant
from agentruns.processors.validation import schema_problem
from agentruns.streams import tracing
from agentruns.streams.clock import ms_of
from agentruns.streams.codec import decode
from agentruns.streams.records import input_record, parse_state
from agentruns.streams.tenant_headers import signed_headers

API_PRODUCER_ID = "api"
#: The most forks of a run its view lists.
MAX_FORKS_SHOWN = 100
# A run page's tree of child runs: at most this many runs, this many levels down.
MAX_CHILDREN_SHOWN = 100
MAX_CHILD_LEVELS = 10


CALLBACK_MEDIA_TYPE = "application/vnd.agentruns.tool-result+json"


INPUTS = Counter("agentruns_api_inputs_total", "Inputs produced to the inbox", ["kind"])
SUBMISSIONS = Counter(
    "agentruns_api_submissions_total",
    "Tasks submitted through the API, by tenant (a tenant no credential names: other)",
    ["tenant"],
)
REPLIES_REJECTED = Counter(
    "agentruns_api_replies_rejected_total", "Replies refused before reaching the core", ["error"]
)


def _tool_result(op_key: str, tool: str, output: Any, *, via: str) -> StoredArtifact:
    """The result artifact of a tool call that succeeded, as reported `via` a callback or an
    operator's verdict."""
    return StoredArtifact.of(
        canonical_json(
            {
                "type": "tool_result",
                "operation_key": op_key,
                "tool": tool,
                "status": "succeeded",
                "via": via,
                "output": output,
            }
        ),
        CALLBACK_MEDIA_TYPE,
    )


def _state_of(run: dict[str, Any]) -> RunState:
    raw = run["state"]
    state = parse_state(raw if isinstance(raw, str) else json.dumps(raw))
    assert state is not None
    return state


def _waiting_for(status: RunStatus) -> str:
    """Whose time a resting status spends (the same split as the core's TimeAccount)."""
    if status in (RunStatus.WAITING_USER, RunStatus.PAUSED):
        return "user"
    if status in (RunStatus.TOOL_RUNNING, RunStatus.WAITING_TOOL):
        return "tool"
    return "system"


def _submitted_record(conn: Conn, run_id: str) -> dict[str, Any] | None:
    """The RunSubmitted input this API produced for `run_id`, if any."""
    record = queries.submitted_input(conn, run_id)
    return None if record is None else decode(record, "Input").record


#: The dead letters of a run a view of a run not yet projected shows at most, newest first.
MAX_RUN_DEAD_LETTERS = 10


def _tenant_of_input(record: dict[str, Any]) -> str:
    """The tenant a submission input (`_submitted_record`) names."""
    try:
        named = json.loads(record["body"]).get("tenant")
    except (ValueError, AttributeError):
        named = None
    return named if isinstance(named, str) else DEFAULT_TENANT


def _submit_tenant(body: dict[str, Any], caller: Credential | None) -> str:
    """The tenant a submission is for: the caller's; an admin may name another in the body's
    ``tenant``, anyone else only its own."""
    own = DEFAULT_TENANT if caller is None else caller.tenant
    named = body.get("tenant")
    if named is None:
        return own
    if not isinstance(named, str) or not valid_tenant(named):
        raise invalid_input(422, "invalid_task", "invalid_input:tenant: not a tenant name")
    if named != own and caller is not None and not caller.admin:
        raise invalid_input(
            422,
            "invalid_task",
            f"invalid_input:tenant: a credential of tenant {own} submits to {own} only",
        )
    return named


def _dead_letters_of(conn: Conn, run_id: str) -> list[dict[str, Any]]:
    """The refused inputs of `run_id` the sink projected (newest first, at most
    MAX_RUN_DEAD_LETTERS): why a run that was submitted has not started."""
    rows = queries.run_dead_letters(conn, run_id, MAX_RUN_DEAD_LETTERS)
    return [dict(row, at=ms_of(row["at"])) for row in rows]


def _result(conn: Conn, run: dict[str, Any]) -> dict[str, Any]:
    row = queries.latest_result(conn, run["run_id"])
    ref = run["result_ref"]
    return {
        "status": run["status"],
        "resolution": run["resolution"],
        "result_ref": ref,
        "summary": None if row is None else row[3],
        "content": None if ref is None else _artifact_json(conn, ref),
    }


def _artifact_json(conn: Conn, ref: str) -> Any:
    content = queries.artifact_content(conn, ref)
    if content is None:
        return None
    text = content.decode()
    try:
        return json.loads(text)
    except ValueError:
        return text


class ApiService:
    """The endpoints' logic: blocking (Postgres, Kafka), called from the threadpool."""

    def __init__(self, config: ApiConfig) -> None:
        self.config = config
        self.clock = config.clock
        self.db = ConnectionPool(config.database_url, config.db_pool_size)
        self.inbox = Inbox(config)
        self.status = Health("api", bootstrap=config.bootstrap, database_url=config.database_url)
        self.uses = CredentialUse(config.database_url, config.clock)
        self.credentials = CredentialStore(
            fixed_credentials(config.api_token, config.operator_tokens),
            config.credentials_file,
            config.clock,
            uses=self.uses,
        )
        self.uses.start()

    def close(self) -> None:
        self.uses.close()
        self.inbox.close()
        self.db.close()

    # ------------------------------------------------------------------ produce once

    def _encoded(self, record: dict[str, Any]) -> bytes:
        """The record's bytes; one the broker would refuse on every retry is never stored."""
        try:
            return encoded_input(record, self.config.max_record_bytes)
        except InvalidInputError as exc:
            if exc.reason.startswith("invalid_input:record_too_large"):
                raise invalid_input(413, "record_too_large", exc.reason) from None
            raise invalid_input(422, "invalid_encoding", exc.reason) from None

    def _produce_once(
        self,
        input_id: str,
        run_id: str,
        kind: str,
        req_hash: str,
        value: bytes,
        *,
        conflict: ApiError | None = None,
        single_use: bool = False,
        claim: Callable[[Conn], None] | None = None,
        traceparent: str | None = None,
        tenant: str | None = None,
    ) -> bool:
        """Produce the input `input_id` once; True if THIS call produced it.

        1. The row with the exact record (and `claim`, in the same transaction) is committed
           before anything reaches Kafka, so a crash later leaves a record to re-produce.
        2. Under the row's lock: produce the stored bytes unless already produced, then mark
           it. Concurrent requests for one input serialize here; exactly one produces.

        A request whose hash differs from the stored one raises `conflict` (422 by default),
        as does any repeat of a `single_use` input (a resume token) once it was produced. A
        repeat of an input that never reached Kafka re-produces the byte-identical record,
        which the processor drops as an exact duplicate if it did arrive after all.

        A submission for a ``tenant`` the body names carries that tenant's signed header
        (`agentruns.streams.tenant_headers`), so a processor that takes signed tenant headers
        only believes the API's tenant as it believes any producer's.
        """
        conflict = conflict or ApiError(
            422, "idempotency_key_reused", "this idempotency key was used with another request"
        )
        with self.db.connection() as conn:
            with conn.transaction():
                inserted = queries.insert_input(conn, input_id, run_id, kind, req_hash, value)
                if inserted and claim is not None:
                    claim(conn)
            with conn.transaction():
                stored = queries.lock_input(conn, input_id)
                assert stored is not None
                if stored[0] != req_hash or (stored[2] and single_use):
                    raise conflict
                if stored[2]:
                    return False
                headers = tracing.headers_of(traceparent)
                if tenant is not None:
                    key = tenant_kafka_key(self.config.keys.tenant_headers, tenant)
                    headers += signed_headers(key, tenant, run_id.encode(), stored[1])
                self.inbox.produce(run_id, stored[1], headers)
                queries.mark_produced(conn, input_id)
        INPUTS.labels(kind).inc()
        return True

    # ------------------------------------------------------------------ runs

    def submit(
        self,
        key: str,
        body: dict[str, Any],
        trace_header: str | None,
        traceparent: str | None = None,
        caller: Credential | None = None,
    ) -> dict[str, Any]:
        """Submit a task for ``caller``'s tenant (None: the default tenant's); `traceparent`
        (W3C, the caller's span) is the parent of the run's trace, else it starts one (a
        malformed one is ignored: a new trace)."""
        context = tracing.parse(traceparent)
        tenant = _submit_tenant(body, caller)
        if not tracing.enabled():
            return self._submit(key, body, trace_header, context, tenant)
        span = tracing.start(
            "submit",
            context or self._run_context(tenant_key(key, tenant), body, trace_header),
            tracing.sent(self.inbox.topic),
            kind="PRODUCER",
        )
        try:
            out = self._submit(key, body, trace_header, tracing.traceparent_of(span), tenant)
        except BaseException as exc:
            tracing.end(span, f"{type(exc).__name__}: {exc}")
            raise
        span.set_attribute("agentruns.run_id", out["run_id"])
        tracing.end(span)
        return out

    def _run_context(self, key: str, body: dict[str, Any], trace_header: str | None) -> str:
        """The context of the run's span (streams/tracing.py) for a submission with none."""
        run_id = run_id_for_key(key)
        trace_id = trace_header or body.get("trace_id")
        return tracing.run_context(run_id, trace_id if isinstance(trace_id, str) else None, None)

    def _submit(
        self,
        key: str,
        body: dict[str, Any],
        trace_header: str | None,
        traceparent: str | None,
        tenant: str,
    ) -> dict[str, Any]:
        if not key or len(key) > MAX_KEY_CHARS:
            raise ApiError(400, "idempotency_key_required", "send an Idempotency-Key header")
        run_id = run_id_for_key(tenant_key(key, tenant))
        # a trace_id that is not a string is refused below, as the task schema says
        trace_id = trace_header or body.get("trace_id") or trace_id_for(run_id)
        fields = {k: v for k, v in body.items() if k not in ("trace_id", "tenant")}
        named = stored(tenant)
        at = self.clock()
        try:
            event = submitted_task(
                fields,
                catalog=self.config.catalog,
                run_id=run_id,
                event_id=submit_event_id(run_id),
                at=at,
                trace_id=trace_id,
                **({} if isinstance(named, msgspec.UnsetType) else {"tenant": named}),
            )
        except InvalidInputError as exc:
            extra = {"errors": exc.errors} if exc.errors else {}
            raise invalid_input(422, "invalid_task", exc.reason, **extra) from None
        record = input_record(
            event, input_id=submit_event_id(run_id), producer_id=API_PRODUCER_ID, producer_seq=1
        )
        created = self._produce_once(
            record["input_id"],
            run_id,
            event.type,
            request_hash(body),
            self._encoded(record),
            traceparent=traceparent,
            tenant=None if isinstance(named, msgspec.UnsetType) else named,
        )
        if created:
            SUBMISSIONS.labels(self.credentials.tenant_label(tenant)).inc()
        run = self.run_row(run_id)
        return {
            "run_id": run_id,
            "trace_id": trace_id if run is None else run["trace_id"],
            "created": created,
            "status": "PENDING" if run is None else run["status"],
        }

    def list_runs(self, f: RunFilter) -> dict[str, Any]:
        """A page of the run list (`agentruns.connectors.api.listing`), in one snapshot."""
        with self.db.connection() as conn, conn.transaction():
            queries.read_only_snapshot(conn)
            return list_runs(conn, f, self.clock())

    def run_row(self, run_id: str) -> dict[str, Any] | None:
        with self.db.connection() as conn:
            return queries.run_row(conn, run_id)

    def check_tenant(self, conn: Conn, run_id: str, tenant: str | None) -> None:
        """Refuse (404, as for a run that does not exist: its id does not leak) a run of
        another tenant than ``tenant``; None: every tenant's runs are the caller's."""
        if tenant is None:
            return
        found = queries.run_tenant(conn, run_id)
        if found is None:
            submitted = _submitted_record(conn, run_id)
            found = None if submitted is None else _tenant_of_input(submitted)
        if found != tenant:
            raise ApiError(404, "run_not_found", f"no run {run_id}")

    def get_run(self, run_id: str, tenant: str | None = None) -> dict[str, Any]:
        """The run as committed (of ``tenant``: `check_tenant`). All of it is read in ONE
        snapshot: the sink commits a run's rows (runs, operations, results) together, so they
        agree with each other."""
        with self.db.connection() as conn, conn.transaction():
            queries.read_only_snapshot(conn)
            self.check_tenant(conn, run_id, tenant)
            run = queries.run_row(conn, run_id)
            if run is None:
                # Submitted through this API, or refused with its run named (the submission
                # of a producer on Kafka too), and not in the committed projection: PENDING,
                # with the refusals. A submission still on its way from another producer is
                # known to no table yet: 404.
                dead = _dead_letters_of(conn, run_id)
                submitted = _submitted_record(conn, run_id)
                if not dead and submitted is None:
                    raise ApiError(404, "run_not_found", f"no run {run_id}")
                return {
                    "run_id": run_id,
                    "tenant": None if submitted is None else _tenant_of_input(submitted),
                    "status": "PENDING",
                    "terminal": False,
                    "operations": [],
                    "question": None,
                    "result": None,
                    "dead_letters": dead,
                }
            return self._run_view(conn, run)

    def _run_view(self, conn: Conn, run: dict[str, Any]) -> dict[str, Any]:
        run_id = run["run_id"]
        state = _state_of(run)
        status = RunStatus(run["status"])
        terminal = status in TERMINAL
        waits: dict[str, Any] = {
            "system_ms": run["system_ms"],
            "tool_wait_ms": run["tool_wait_ms"],
            "user_wait_ms": run["user_wait_ms"],
        }
        if not terminal:
            # R16: the wait in progress, not yet folded into the totals above.
            waits["current"] = {
                "waiting_for": _waiting_for(status),
                "since": state.time.last_at,
                "ms": max(0, self.clock() - state.time.last_at),
            }
        out: dict[str, Any] = {
            "run_id": run_id,
            "tenant": run["tenant"],
            "status": status.value,
            "terminal": terminal,
            "trace_id": run["trace_id"],
            "goal": run["goal"],
            "step": run["step"],
            "attempt": run["attempt"],
            "version": run["version"],
            "resolution": run["resolution"],
            "last_seq": run["last_seq"],
            "started_at": ms_of(run["started_at"]),
            "last_event_at": ms_of(run["last_event_at"]),
            "ended_at": ms_of(run["ended_at"]),
            "waits": waits,
            "usage": {
                "input_tokens": run["input_tokens"],
                "output_tokens": run["output_tokens"],
                "cost_micros": run["cost_micros"],
                "tool_calls": run["tool_calls"],
            },
            "cancel_requested": state.cancel_requested,
            "warnings": list(state.warnings),
            # the operator's tool catalog the task was checked against (None: no catalog)
            "catalog_version": None
            if isinstance(state.catalog_version, msgspec.UnsetType)
            else state.catalog_version,
            "operations": queries.run_operations(conn, run_id),
            # the run it was forked from, and the runs forked from it (agentruns fork, resume)
            "forked_from": None
            if isinstance(state.forked_from, msgspec.UnsetType)
            else state.forked_from.model_dump(),
            "forks": queries.forks_of(conn, run_id, MAX_FORKS_SHOWN),
            # the run whose call started it, and the tree of the runs its calls started
            "parent": None
            if isinstance(state.parent, msgspec.UnsetType)
            else state.parent.model_dump(),
            "children": children_tree(conn, run_id),
            "question": None,
            "result": None,
        }
        if status is RunStatus.WAITING_USER and state.question is not None:
            out["question"] = self._question(conn, state)
        if terminal:
            out["outcome"] = run["outcome"]
            out["result"] = _result(conn, run)
        return out

    def _question(self, conn: Conn, state: RunState) -> dict[str, Any]:
        q = state.question
        assert q is not None
        token = ResumeToken(state.run_id, q.question_id, q.token_id, q.version, q.expires_at)
        return {
            "question_id": q.question_id,
            "kind": q.kind,
            "artifact_ref": q.artifact_ref,
            "content": _artifact_json(conn, q.artifact_ref),
            "response_schema": q.response_schema,
            "expires_at": q.expires_at,
            "state_version": q.version,
            "token_id": q.token_id,
            "resume_token": sign_token(self.config.keys.resume, token),
        }

    def events(
        self, run_id: str, after_seq: int, limit: int, tenant: str | None = None
    ) -> dict[str, Any]:
        with self.db.connection() as conn:
            self.check_tenant(conn, run_id, tenant)
            rows = queries.events_after(conn, run_id, after_seq, limit)
            if not rows and after_seq == 0 and not queries.run_exists(conn, run_id):
                raise ApiError(404, "run_not_found", f"no events for run {run_id}")
        for r in rows:
            r["at"] = ms_of(r["at"])
        next_after = rows[-1]["seq"] if rows else after_seq
        return {"run_id": run_id, "events": rows, "next_after_seq": next_after}

    # ------------------------------------------------------------------ replies

    def reply(self, run_id: str, body: dict[str, Any], tenant: str | None = None) -> dict[str, Any]:
        try:
            with self.db.connection() as conn:
                self.check_tenant(conn, run_id, tenant)
            return self._reply(run_id, body)
        except ApiError as exc:
            REPLIES_REJECTED.labels(exc.code).inc()
            raise

    def _reply(self, run_id: str, body: dict[str, Any]) -> dict[str, Any]:
        text = body.get("resume_token")
        response = body.get("response")
        if not isinstance(text, str) or not isinstance(response, dict):
            raise ApiError(400, "invalid_reply", "send {resume_token: string, response: object}")
        if json_depth(response) > MAX_JSON_DEPTH:
            raise invalid_input(
                422,
                "response_invalid",
                f"invalid_input:response_too_deep: nested deeper than {MAX_JSON_DEPTH}",
            )
        token = verify_token(self.config.keys.resume, text)
        if token.run_id != run_id:
            raise TokenError("token_forged", "resume token was issued for another run")
        now = self.clock()
        if now >= token.expires_at:
            raise TokenError("token_expired", "the question expired; the reply is too late")
        input_id = f"reply:{token.token_id}"
        req_hash = request_hash({"token_id": token.token_id, "response": response})
        with self.db.connection() as conn:
            applied = queries.reply_applied(conn, run_id, token.token_id)
            used = queries.token_use(conn, token.token_id)
        # A used token is refused, except the retry of the very same reply whose input never
        # reached Kafka (then the stored record is produced again, below).
        if applied or (used is not None and (used[0] or used[1] != req_hash)):
            raise TokenError("token_used", "this resume token was already used")
        run = self.run_row(run_id)
        if run is None:
            raise ApiError(404, "run_not_found", f"no run {run_id}")
        state = _state_of(run)
        q = state.question
        if (
            state.status is not RunStatus.WAITING_USER
            or q is None
            or q.question_id != token.question_id
            or q.token_id != token.token_id
            or q.version != token.state_version
        ):
            raise TokenError(
                "token_stale",
                f"the run is {state.status.value} and no longer waits for this question",
            )
        problem = schema_problem(q.response_schema, response)
        if problem is not None:
            raise ApiError(
                422,
                "response_invalid",
                f"response does not match the expected schema: {problem}",
                response_schema=q.response_schema,
            )
        event = UserReplied(
            run_id=run_id,
            event_id=input_id,
            at=now,
            trace_id=state.trace_id,
            question_id=q.question_id,
            token_id=q.token_id,
            state_version=q.version,
            response=response,
        )
        record = input_record(event, input_id=input_id)

        def claim(conn: Conn) -> None:
            queries.claim_token(conn, q.token_id, run_id, q.question_id, input_id)

        self._produce_once(
            input_id,
            run_id,
            event.type,
            req_hash,
            self._encoded(record),
            conflict=TokenError("token_used", "this resume token was already used"),
            single_use=True,
            claim=claim,
        )
        return {"run_id": run_id, "question_id": q.question_id, "accepted": True}

    # ------------------------------------------------------------------ cancel, callbacks

    def cancel(
        self, run_id: str, body: dict[str, Any], key: str | None, tenant: str | None = None
    ) -> dict[str, Any]:
        """CancelRequested for the run (R24: the core handles it at the next transition), of
        ``tenant`` (`check_tenant`).

        Without an Idempotency-Key, one cancel per run resolution: a repeat is answered as
        already requested (the core would record it as a DUPLICATE anyway)."""
        if key is not None and len(key) > MAX_KEY_CHARS:
            raise ApiError(400, "invalid_header", f"Idempotency-Key over {MAX_KEY_CHARS} chars")
        with self.db.connection() as conn:
            self.check_tenant(conn, run_id, tenant)
            run = queries.run_row(conn, run_id)
            submitted = _submitted_record(conn, run_id) if run is None else None
        if run is None and submitted is None:
            raise ApiError(404, "run_not_found", f"no run {run_id}")
        if run is not None and run["status"] in {s.value for s in TERMINAL}:
            raise ApiError(409, "run_terminal", f"the run is already {run['status']}")
        source = run if run is not None else submitted
        assert source is not None
        trace_id = str(source["trace_id"])
        reason = str(body.get("reason") or "requested")[:200]
        resolution = 0 if run is None else run["resolution"]
        input_id = f"cancel:{run_id}:" + (f"key:{key}" if key else str(resolution))
        event = CancelRequested(
            run_id=run_id, event_id=input_id, at=self.clock(), trace_id=trace_id, reason=reason
        )
        record = input_record(event, input_id=input_id)
        req_hash = request_hash({"reason": reason} if key else {"cancel": run_id})
        created = self._produce_once(input_id, run_id, event.type, req_hash, self._encoded(record))
        return {"run_id": run_id, "cancel_requested": True, "created": created}

    # ------------------------------------------------------------------ operator actions

    def operator_action(
        self,
        action: str,
        run_id: str,
        body: dict[str, Any],
        key: str | None,
        actor: str,
        seen_version: int | None = None,
    ) -> dict[str, Any]:
        """Resolve, reopen or re-drive the run (`agentruns.connectors.api.operator`), as
        ``actor``, who is recorded in the input and so in the run's log.

        Produced once per Idempotency-Key; without one, once per run state the operator saw
        (its version): a repeat gets the first outcome, another action on the same state a
        409 ``action_conflict``, and the core refuses anything that arrives after the state
        moved on (compare-and-set). ``seen_version`` (``If-Match``) is the version the operator
        acted on: a run projected at another one is a 412 ``version_mismatch``."""
        if key is not None and (not key or len(key) > MAX_KEY_CHARS):
            raise ApiError(400, "invalid_header", f"Idempotency-Key over {MAX_KEY_CHARS} chars")
        parsed = parse_body(action, body)
        req_hash = request_hash({"action": action, "body": body, "actor": actor})
        with self.db.connection() as conn:
            run = queries.run_row(conn, run_id)
            submitted = _submitted_record(conn, run_id) if run is None else None
        if run is None:
            if submitted is None:
                raise ApiError(404, "run_not_found", f"no run {run_id}")
            raise ApiError(
                409, "action_not_allowed", "the run is not projected yet", run_status="PENDING"
            )
        state = _state_of(run)
        version = state.version if seen_version is None else seen_version
        if key is not None:
            input_id = f"operator:{run_id}:key:{key}"
            conflict = None
        else:
            input_id = f"operator:{run_id}:v{version}"
            conflict = ApiError(
                409,
                "action_conflict",
                f"another operator action was sent for this run at version {version}",
                run_status=state.status.value,
            )
        with self.db.connection() as conn:
            stored = queries.input_kind(conn, input_id)
        if stored is not None:
            # a repeat: the first outcome, whatever the state is now (nothing new is built)
            created = self._produce_once(input_id, run_id, stored, req_hash, b"", conflict=conflict)
            return self._acted(action, run_id, input_id, created, actor, state)
        if version != state.version:
            raise ApiError(
                412,
                "version_mismatch",
                f"the run is at version {state.version}, not {version}",
                run_status=state.status.value,
                version=state.version,
            )
        ids = {
            "run_id": run_id,
            "event_id": input_id,
            "at": self.clock(),
            "trace_id": state.trace_id,
        }
        made = plan(
            action, state, parsed, ids=ids, actor=actor, result_artifact=self._verdict_result
        )
        if made.artifact is not None:
            ref, content = made.artifact
            self._store_artifact(StoredArtifact(ref, CALLBACK_MEDIA_TYPE, content))
        record = input_record(made.event, input_id=input_id)
        created = self._produce_once(
            input_id, run_id, made.event.type, req_hash, self._encoded(record), conflict=conflict
        )
        return self._acted(action, run_id, input_id, created, actor, state)

    def fork(
        self,
        action: str,
        run_id: str,
        body: dict[str, Any],
        key: str | None,
        actor: str,
        tenant: str | None = None,
    ) -> dict[str, Any]:
        """Fork the run (``action`` ``fork``: at the seq the body names, with its edits) or
        resume it (``resume``: a fork before the failure that ended it), as ``actor``. The
        fork is produced once per idempotency key (without one: the key `agentruns fork`
        derives from the source and the seq), as input 1 of the API for the fork's run."""
        if key is not None and (not key or len(key) > MAX_KEY_CHARS):
            raise ApiError(400, "invalid_header", f"Idempotency-Key over {MAX_KEY_CHARS} chars")
        with self.db.connection() as conn:
            self.check_tenant(conn, run_id, tenant)  # the fork is of the source's tenant
        parsed = forks.parse(action, body)
        with self.db.connection() as conn:
            records = queries.run_log(conn, run_id, forks.MAX_SOURCE_RECORDS)
        if not records:
            raise ApiError(404, "run_not_found", f"no run {run_id}")
        fork = forks.planned(
            action, forks.source_log(records), parsed, key=key, actor=actor, at=self.clock()
        )
        event = fork.record
        req_hash = request_hash(
            {"source": run_id, "seq": event.source_seq, "edits": event.edits.model_dump()}
        )
        record = input_record(
            event, input_id=event.event_id, producer_id=API_PRODUCER_ID, producer_seq=1
        )
        created = self._produce_once(
            event.event_id, event.run_id, event.type, req_hash, self._encoded(record)
        )
        return {**fork.as_json(), "action": action, "created": created, "actor": actor}

    @staticmethod
    def _acted(
        action: str, run_id: str, input_id: str, created: bool, actor: str, state: RunState
    ) -> dict[str, Any]:
        return {
            "run_id": run_id,
            "action": action,
            "input_id": input_id,
            "created": created,
            "actor": actor,
            "status": state.status.value,
            "version": state.version,
        }

    @staticmethod
    def _verdict_result(op_key: str, tool: str, output: Any) -> tuple[str, str]:
        artifact = _tool_result(op_key, tool, output, via="operator")
        return artifact.ref, artifact.content

    def _store_artifact(self, artifact: StoredArtifact) -> None:
        """Durable before the input that references it (R2)."""
        with self.db.connection() as conn:
            queries.store_artifact(
                conn, artifact.ref, artifact.media_type, artifact.content.encode()
            )

    def callback(
        self, op_key: str, body: dict[str, Any], signed_dispatch: int | None = None
    ) -> tuple[int, dict[str, Any]]:
        """A tool backend's report of an operation's outcome. ``signed_dispatch``: the dispatch
        the callback's signature was made for (None: the bearer token); a signature of
        another dispatch than the operation's current one is refused (a replay)."""
        with self.db.connection() as conn:
            row = queries.callback_operation(conn, op_key)
        if row is None:
            raise ApiError(404, "operation_not_found", f"no operation {op_key}")
        run_id, step, dispatch, op_status, tool, trace_id = row
        if signed_dispatch is not None and signed_dispatch != dispatch:
            raise ApiError(
                403,
                "callback_other_dispatch",
                f"the signature is for dispatch {signed_dispatch} of this operation, "
                f"not its current dispatch",
            )
        status = str(body.get("status", ""))
        if op_status in {s.value for s in SETTLED}:
            return 200, {"operation_key": op_key, "accepted": False, "reason": op_status}
        if status in ("running", "accepted"):
            return 200, {"operation_key": op_key, "accepted": False, "reason": "still running"}
        input_id = f"{op_key}:{dispatch}:callback"
        ids: dict[str, Any] = {
            "run_id": run_id,
            "event_id": input_id,
            "at": self.clock(),
            "trace_id": trace_id,
            "step": step,
            "operation_key": op_key,
            "dispatch": dispatch,
        }
        event: Event
        artifact: StoredArtifact | None = None
        if status == "succeeded":
            output = body.get("result")
            artifact = _tool_result(op_key, tool, output, via="callback")
            event = tool_results.succeeded(ids, output, artifact.ref)
        elif status == "failed":
            result = body.get("result")
            code = body.get("error_code") or (
                result.get("error") if isinstance(result, dict) else None
            )
            try:
                error_class = ErrorClass(str(body.get("error_class") or "UNKNOWN"))
            except ValueError:
                error_class = ErrorClass.UNKNOWN
            retry = body.get("retry_after_ms")
            if retry is not None and not (
                isinstance(retry, int)
                and not isinstance(retry, bool)
                and 0 <= retry <= MAX_DURATION_MS
            ):
                raise invalid_input(
                    422,
                    "invalid_callback",
                    f"invalid_input:retry_after_ms: {str(retry)[:40]} is not an integer"
                    f" from 0 to {MAX_DURATION_MS}",
                )
            event = ToolCallFailed(
                **ids,
                error_class=error_class,
                error_code=str(code or "failed")[:200],
                message=str(body.get("message") or "")[:1000],
                retry_after_ms=retry,
            )
        elif status == "cancelled":
            event = CancelConfirmed(**ids)
        else:
            raise ApiError(
                422,
                "invalid_callback",
                "status must be one of succeeded, failed, cancelled, running, accepted",
            )
        if artifact is not None:
            self._store_artifact(artifact)
        record = input_record(event, input_id=input_id)
        self._produce_once(
            input_id,
            run_id,
            event.type,
            request_hash({"status": status, "body": body}),
            self._encoded(record),
            conflict=ApiError(409, "callback_conflict", "another outcome was already reported"),
        )
        return 202, {"operation_key": op_key, "run_id": run_id, "accepted": True}

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Readiness (`/healthz`): Kafka and Postgres answer (the checks every service uses)."""
        ok, body = self.status.ready()
        return ok, {**body, "inbox": self.inbox.topic, "partitions": self.inbox.partitions}


def children_tree(conn: Conn, run_id: str) -> list[dict[str, Any]]:
    """The child runs of ``run_id``, each with its own children (``run_id``, ``status``,
    ``goal``, ``children``), a level at a time: at most MAX_CHILDREN_SHOWN runs and
    MAX_CHILD_LEVELS levels."""
    nodes: dict[str, dict[str, Any]] = {}
    roots: list[dict[str, Any]] = []
    level = [run_id]
    for _ in range(MAX_CHILD_LEVELS):
        left = MAX_CHILDREN_SHOWN - len(nodes)
        if not level or left <= 0:
            break
        rows = [r for r in queries.children_of(conn, level, left) if r["run_id"] not in nodes]
        for row in rows:
            node = {
                "run_id": row["run_id"],
                "status": row["status"],
                "goal": (row["goal"] or "")[:200],
                "children": [],
            }
            nodes[row["run_id"]] = node
            above = nodes.get(row["parent_run_id"])
            (roots if above is None else above["children"]).append(node)
        level = [r["run_id"] for r in rows]
    return roots

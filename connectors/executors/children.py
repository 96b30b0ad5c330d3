"""Child runs in the tool executor: the calls of a tool of kind ``run`` (docs/tools.md,
"Child runs"; the pure rules in :mod:`agentruns.processors.children`).

- ``CallTool``: the child's submission (:func:`agentruns.processors.children.
  child_submission`) is produced to the inbox, acknowledged by the broker, before the call is
  answered ``ToolCallAccepted`` (the caller waits in ``WAITING_TOOL``). A refusal (limits,
  arguments, budget) is the call's ``ToolCallFailed`` (``UNKNOWN``: the caller's model reads it,
  nothing retries it). The submission is the same bytes on every resend and after a restart
  (its run id, event id and time derive from the call), so the processor takes it once: a
  second copy is an exact duplicate, and a run id once used stays taken.
- ``NotifyParent`` (the child's core writes it with the child's end, in the same transaction):
  the caller's operation answered with the child's answer (``ToolCallSucceeded``) or its
  failure (``ToolCallFailed`` ``UNKNOWN`` ``child_<status>``). Its answer is recorded like any
  effect's, so a redelivery sends the same bytes, which the caller's processor drops.
- ``CancelTool`` (the caller was cancelled or ended): the child is asked to cancel
  (``CancelRequested``), and the call is answered ``CancelConfirmed``.
- ``PollTool``: the child is still running as far as the caller knows (its end comes as
  ``NotifyParent``); ``Reconcile`` cannot tell (the call is never answered ``ToolCallTimedOut``,
  so it does not come).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Mapping
from typing import Any

import msgspec
from confluent_kafka import Producer

from agentruns.connectors.executors.base import ExecutorError, Outcome, event_identity
from agentruns.connectors.executors.config import ExecutorConfig
from agentruns.connectors.postgres.artifacts import PostgresArtifactStore, StoredArtifact
from agentruns.processors import tool_results
from agentruns.processors.children import ChildTemplate, child_submission
from agentruns.processors.effects import CallTool, CancelTool, Effect, NotifyParent, PollTool
from agentruns.processors.events import (
    CancelConfirmed,
    CancelRequested,
    Event,
    ModelUsage,
    ToolCallAccepted,
    ToolCallFailed,
    ToolStatusReported,
)
from agentruns.processors.ids import canonical_json, derive_key
from agentruns.processors.state import ErrorClass, RunStatus
from agentruns.processors.transition import load_candidate
from agentruns.streams import records
from agentruns.streams.acked import NotAcknowledgedError, produce_acked
from agentruns.streams.codec import encode
from agentruns.streams.kafka_defaults import NO_DELAY, client_settings, partition_count, release
from agentruns.streams.partitioning import partition_for, run_key
from agentruns.streams.topics import INBOX, topic_name

#: The media type of the tool result a child's answer becomes in its caller's run.
RESULT_MEDIA_TYPE = "application/vnd.agentruns.tool-result+json"
# A caller polls its child this rarely: the child's end comes to it as NotifyParent; a poll only
# says it still runs.
POLL_AFTER_MS = 10 * 60 * 1000
# How long the broker may take to acknowledge a child's submission or cancel.
PRODUCE_TIMEOUT_S = 30.0


class ChildRuns:
    """The tool executor's part of child runs: a producer to the inbox (idempotent, each record
    acknowledged before the call is answered) and the artifact store (a child's answer)."""

    def __init__(self, config: ExecutorConfig) -> None:
        self.topic = topic_name(INBOX, config.prefix)
        self._settings = {
            "bootstrap.servers": config.bootstrap,
            **client_settings(),
            "enable.idempotence": True,
            "linger.ms": 1,
            **NO_DELAY,
            "log_level": 3,
            **config.extra_producer,
        }
        # made with the first child: an executor whose registry has no tool of kind run has
        # no producer of its own
        self._producer: Producer | None = None
        self._partitions: int | None = None
        self._store = PostgresArtifactStore(config.database_url)
        self._lock = threading.Lock()
        self._store_lock = threading.Lock()  # the store's connection: one thread at a time
        # children being submitted, by run id: a cancel of one waits for its submission (a
        # call and its cancel are effects of one partition, so of this executor, and run at
        # once: the cancel must not reach the inbox before the run it cancels)
        self._starting: dict[str, asyncio.Event] = {}

    def close(self) -> None:
        if self._producer is not None:
            release(self._producer, 5)
        self._store.close()

    # ------------------------------------------------------------------ I/O (worker threads)

    def _produce(self, event: Event, input_id: str) -> None:
        """``event`` on the inbox partition of its run, acknowledged (ExecutorError: not in
        time or refused; the handler's guard answers the call with its failure)."""
        with self._lock:
            if self._producer is None:
                self._producer = Producer(self._settings)
            if self._partitions is None:
                self._partitions = partition_count(self._producer, self.topic)
            producer, partitions = self._producer, self._partitions
        record = records.input_record(event, input_id=input_id)
        try:
            failure = produce_acked(
                producer,
                self.topic,
                key=run_key(event.run_id),
                value=encode("Input", record),
                partition=partition_for(event.run_id, partitions),
                headers=[("trace_id", event.trace_id.encode()), ("run_id", event.run_id.encode())],
                timeout_s=PRODUCE_TIMEOUT_S,
            )
        except NotAcknowledgedError as exc:  # the broker is away: carried out again later
            raise ExecutorError(str(exc), retryable=True) from None
        if failure is not None:
            raise ExecutorError(f"producing to {self.topic}: {failure}")

    def _answer_text(self, ref: str | None) -> str | None:
        """The text of a child's final answer (its candidate's content), or None."""
        if ref is None:
            return None
        with self._store_lock:
            content = self._store.get(ref)
        if content is None:
            return None
        try:
            return load_candidate(content).content
        except msgspec.DecodeError:  # not a candidate: the document as it is
            return content

    # ------------------------------------------------------------------ effects

    async def call(self, effect: CallTool, template: ChildTemplate) -> Outcome:
        op = effect.operation
        ids = _ids(effect, op.key, op.dispatch)
        try:
            arguments = json.loads(op.arguments_json)
        except ValueError:
            arguments = None
        submission = child_submission(effect, arguments, template)
        if isinstance(submission, str):
            code, _, message = submission.partition(": ")
            event: Event = ToolCallFailed(
                **ids, error_class=ErrorClass.UNKNOWN, error_code=code, message=message
            )
            return Outcome(event, detail=f"child refused: {submission}"[:300])
        started = self._starting.setdefault(submission.run_id, asyncio.Event())
        try:
            await asyncio.to_thread(self._produce, submission, submission.event_id)
        finally:
            started.set()
            self._starting.pop(submission.run_id, None)
        accepted = ToolCallAccepted(**ids, poll_after_ms=POLL_AFTER_MS)
        return Outcome(accepted, detail=f"child run {submission.run_id}")

    async def poll(self, effect: PollTool) -> Outcome:
        event = ToolStatusReported(
            **_ids(effect, effect.operation_key, effect.dispatch),
            status="running",
            poll=effect.poll,
        )
        return Outcome(event, detail="child run: its end answers the call")

    async def cancel(self, effect: CancelTool, child_run_id: str) -> Outcome:
        """Ask the child to cancel (its own cancel then reaches its children) and confirm."""
        ids = _ids(effect, effect.operation_key, effect.dispatch)
        starting = self._starting.get(child_run_id)
        if starting is not None:
            await asyncio.wait_for(starting.wait(), PRODUCE_TIMEOUT_S)
        request = CancelRequested(
            run_id=child_run_id,
            event_id="cancel-" + derive_key("cancel_child", effect.idempotency_key)[:32],
            at=ids["at"],
            trace_id=effect.trace_id,
            reason=f"the run that started it was cancelled ({effect.run_id})"[:300],
        )
        # another time on a resend after a crash: another input id, so it is no conflicting
        # duplicate; the child's core takes one cancel (the same event id) and drops the rest
        await asyncio.to_thread(self._produce, request, f"{request.event_id}:{request.at}")
        return Outcome(CancelConfirmed(**ids), detail=f"child run {child_run_id} cancelled")

    async def notify(self, effect: NotifyParent) -> Outcome:
        """The caller's operation answered with the child's end."""
        spent = effect.usage
        ids = {
            **_ids(effect, effect.operation_key, effect.dispatch),
            "child_usage": ModelUsage(
                input_tokens=spent.input_tokens,
                output_tokens=spent.output_tokens,
                cost_micros=spent.cost_micros,
            ),
        }
        if effect.status is not RunStatus.SUCCEEDED:
            event: Event = ToolCallFailed(
                **ids,
                error_class=ErrorClass.UNKNOWN,
                error_code=f"child_{effect.status.value.lower()}",
                message=f"child run {effect.child_run_id} ended {effect.status.value}: "
                f"{effect.reason}"[:1000],
            )
            return Outcome(event, detail=f"child {effect.status.value}")
        answer = await asyncio.to_thread(self._answer_text, effect.answer_ref)
        output = {
            "run_id": effect.child_run_id,
            "status": effect.status.value,
            "answer": answer if answer is not None else effect.reason,
            "result_ref": effect.result_ref,
        }
        artifact = StoredArtifact.of(
            canonical_json(
                {
                    "type": "tool_result",
                    "operation_key": effect.operation_key,
                    "tool": effect.tool,
                    "status": "succeeded",
                    "child_run_id": effect.child_run_id,
                    "output": output,
                }
            ),
            RESULT_MEDIA_TYPE,
        )
        succeeded = tool_results.succeeded(ids, output, artifact.ref)
        return Outcome(succeeded, (artifact,), detail=f"child {effect.child_run_id} succeeded")


def _ids(effect: Effect, op_key: str, dispatch: int) -> dict[str, Any]:
    return {
        **event_identity(effect),
        "step": effect.step,
        "operation_key": op_key,
        "dispatch": dispatch,
    }


def template_of(entry: Mapping[str, Any], where: str) -> ChildTemplate:
    """The ``run`` object of a registry entry of kind run (ValueError: not one that can be)."""
    raw = entry.get("run", {})
    if not isinstance(raw, dict):
        raise ValueError(f"run of {where} is not an object")
    unknown = sorted(set(raw) - {"model_route", "tools", "max_depth", "max_children"})
    if unknown:
        raise ValueError(f"run of {where} has unknown fields {unknown}")
    route, tools = raw.get("model_route"), raw.get("tools")
    if route is not None and not isinstance(route, str):
        raise ValueError(f"run.model_route of {where} is not a text")
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, str) for t in tools)
    ):
        raise ValueError(f"run.tools of {where} is not a list of tool names")
    limits = {}
    for name in ("max_depth", "max_children"):
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1000:
            raise ValueError(f"run.{name} of {where} is not an integer from 0 to 1000")
        limits[name] = value
    return ChildTemplate(model_route=route, tools=None if tools is None else tuple(tools), **limits)

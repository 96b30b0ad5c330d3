"""The processor's assignment: the inbox partitions it owns, what the consumer's rebalance
callbacks do with them, and which of them are paused.

- assigned: wait until no transaction of a previous owner is still open, then restore the
  partitions' run state (`Owner.restore`) before any of their inputs is applied;
- revoked: commit what was applied so far (the next owner starts from those offsets and
  snapshots), then drop the partitions' state; once fenced, only drop it;
- lost: the group moved on without us, so nothing may be committed: the open batch and the
  transaction are dropped with the partitions' state;
- paused: an inbox partition whose processing stopped (`InputPath.stopped`) is paused, its
  inputs left unconsumed for a build that can apply them, and resumed once restored.

The callbacks run on the loop thread, inside the consumer's poll.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Protocol

from confluent_kafka import Consumer, KafkaException, TopicPartition

from agentruns.streams import metrics
from agentruns.streams.eviction import Evictor
from agentruns.streams.inputs import InputPath
from agentruns.streams.membership import Membership
from agentruns.streams.transaction import committed_offsets

log = logging.getLogger("agentruns.processor")


class Owner(Protocol):
    """What the rebalance callbacks ask of the loop that owns the partitions."""

    @property
    def stopping(self) -> threading.Event | None:
        """Set when the loop is asked to stop: long waits end early."""
        ...

    def restore(self, partitions: set[int]) -> int:
        """Reload the run state of `partitions`; how many runs are held."""
        ...

    def commit_pending(self) -> None:
        """Seal what was applied and wait until it committed; raises a KafkaException if a
        transaction failed."""
        ...

    def recover(self, exc: KafkaException, rewind: set[int]) -> None:
        """After a failed transaction: abort, and rewind `partitions` to what was committed."""
        ...

    def wait_in_flight(self) -> None:
        """Wait for the transaction in flight; raise its error."""
        ...

    def discard_open(self) -> None:
        """Drop the open batch and abort the open transaction."""
        ...

    def forget(self, partition: int) -> None:
        """Drop what the loop itself keeps of `partition`."""
        ...


class Rebalancer:
    """The inbox partitions assigned and paused, kept by the rebalance callbacks."""

    def __init__(
        self,
        consumer: Consumer,
        inbox: str,
        path: InputPath,
        evictor: Evictor,
        owner: Owner,
        membership: Membership,
        *,
        transaction_timeout_ms: int,
    ) -> None:
        self._consumer = consumer
        self.inbox = inbox
        self._path = path
        self._evictor = evictor
        self._owner = owner
        self.membership = membership  # what /healthz reports
        self._transaction_timeout_ms = transaction_timeout_ms
        self.assigned: set[int] = set()
        # Inbox partitions paused because their processing stopped (`sync_stopped`).
        self.paused: set[int] = set()
        # Set when the consumer was fenced: from then on nothing applied is committed, and the
        # rebalance callbacks that closing the consumer runs only drop state.
        self.fenced = False

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        mine = {tp.partition for tp in partitions}
        began = time.monotonic()
        self.await_stable_offsets(consumer, partitions)
        restored = self._owner.restore(mine)
        self.assigned |= mine
        self.membership.assigned(partitions)  # ready once restored
        gc.freeze()  # the restored slots live long: out of the collector's way
        log.info(
            "assigned partitions %s: restored %d runs in %.2fs",
            sorted(mine),
            restored,
            time.monotonic() - began,
        )

    def await_stable_offsets(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Wait until no transaction of a previous owner of `partitions` is still open.

        Its snapshots and its input offsets become visible (or are aborted) together, but a
        restore reads the snapshots only up to the open transaction, while the consumer's own
        offset fetch later waits for it: restored from before a transaction that then commits,
        the run states would miss inputs the consumer never delivers again (the chaos run that
        found it: a fenced processor committed seq 9 of a run while its successor, restored
        without it, wrote another seq 9). A read_committed consumer's `committed()` waits while
        offsets of an open transaction are pending (KIP-447 `require_stable`); one of a dead
        owner is aborted by the coordinator within its transaction timeout."""
        if not partitions:
            return
        committed_offsets(
            consumer,
            self.inbox,
            [tp.partition for tp in partitions],
            patience_s=max(60.0, 2 * self._transaction_timeout_ms / 1000),
            stop=self._owner.stopping,
            hint="a transaction of the previous owner is still open; see "
            "kafka-transactions.sh --describe",
        )

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.membership.revoked()
        revoked = {tp.partition for tp in partitions}
        if self.fenced:  # nothing of ours may be committed any more
            self.drop(revoked)
            return
        # Commit what was applied so far: the next owner starts from these offsets and state.
        try:
            self._owner.commit_pending()
        except KafkaException as exc:
            log.warning("commit on revoke failed, aborting: %s", exc)
            self._owner.recover(exc, self.assigned - revoked)
        self.drop(revoked)

    def on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # The group moved on without us (a session that expired while the process stood still):
        # our offsets are refused now, so a transaction still in flight fails; drop everything.
        self.membership.revoked()
        lost = sorted(tp.partition for tp in partitions)
        try:
            self._owner.wait_in_flight()
        except KafkaException as exc:
            log.warning("partitions %s lost; the transaction in flight failed: %s", lost, exc)
        else:
            log.warning("partitions %s lost; dropping their state and the open batch", lost)
        self._owner.discard_open()
        self.drop({tp.partition for tp in partitions})

    def sync_stopped(self) -> None:
        """Pause the inbox partitions whose processing stopped (their inputs wait unconsumed,
        `InputPath.stopped`), resume the ones restored since; report them to /healthz and
        /metrics."""
        stopped = self._path.stopped
        pause = [p for p in stopped if p not in self.paused and p in self.assigned]
        resume = [p for p in self.paused if p not in stopped and p in self.assigned]
        if pause:
            self._consumer.pause([TopicPartition(self.inbox, p) for p in pause])
        if resume:
            self._consumer.resume([TopicPartition(self.inbox, p) for p in resume])
        for p in self.paused - stopped.keys():
            metrics.partition_resumed(p)
        for p in stopped.keys() - self.paused:
            metrics.partition_stopped(p)
        self.paused = set(stopped)
        self.membership.stopped(stopped)

    def drop(self, partitions: set[int]) -> None:
        """`partitions` are no longer ours: their runs and everything kept of them go."""
        path = self._path
        for p in partitions:
            if path.stopped.pop(p, None) is not None:
                self.paused.discard(p)
                metrics.partition_resumed(p)
                self.membership.stopped(path.stopped)
            path.slots.pop(p, None)
            path.parked.pop(p, None)
            path.ended.pop(p, None)
            self._evictor.drop(p)
            self._owner.forget(p)
            self.assigned.discard(p)


__all__ = ["Owner", "Rebalancer"]
